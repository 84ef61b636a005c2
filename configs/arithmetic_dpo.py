r"""The main job's model and task, trained with DPO instead of RL.

The SFT warm-up of ``configs/arithmetic_grpo.py``, then direct preference
optimisation on pairs built from the task (the reference answer preferred
over a wrong integer: a near miss, a random integer or a digit edit); the
reference model is the policy after the warm-up. Held-out accuracy (the
verifier's, sampled at the training temperature) is printed before and
after, with the held-out pairs' implicit-reward accuracy.

  python -m launch.train --config=configs/arithmetic_dpo.py --workdir=/tmp/rljax_dpo

Any loss of the DPO family: ``--config.preference.loss=ipo`` (``dpo``,
``robust_dpo``, ``ipo``, ``simpo``, ``orpo``, ``kto``; docs/preference.md).
`--config=configs/arithmetic_dpo.py:tiny` shrinks everything for smoke tests.
"""

import ml_collections

from configs import arithmetic_grpo
from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = arithmetic_grpo.get_config()
  c.preference.loss = "dpo"
  c.preference.beta = 0.1
  c.preference.batch_size = 32
  c.preference.num_pairs = 4000
  c.preference.num_heldout = 256
  c.rl.num_steps = 150
  c.optimizer.learning_rate = 1e-4
  c.eval.every = 50
  c.checkpoint.every = 50
  return common.apply_arg(c, arg)
