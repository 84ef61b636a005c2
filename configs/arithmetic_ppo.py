r"""PPO with a value model on the main job: SFT warm-up, then PPO whose
token-level advantages come from GAE over a critic (``rl.advantage="gae"``).

The critic is a separate copy of the policy's decoder with a linear value
head (``rljax.train.critic``), trained by its own Adam in the same jitted
step; GAE (``critic.gamma``, ``critic.lam``) turns the reward at the last
token and the critic's values into per-token advantages, whitened over the
batch as verl does, and verl's clipped value loss (``critic.value_clip``)
trains the critic. Everything else is the GRPO main job's
(``configs/arithmetic_grpo.py``).

  python -m launch.train --config=configs/arithmetic_ppo.py --workdir=/tmp/rljax_ppo

`--config=configs/arithmetic_ppo.py:tiny` shrinks everything for smoke tests.
"""

import ml_collections

from configs import arithmetic_grpo
from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = arithmetic_grpo.get_config()
  c.rl.advantage = "gae"
  # A critic is a per-token baseline: no group is needed for the advantage,
  # so the step's rows spread over more prompts.
  c.rl.group_size = 2
  c.rl.prompts_per_step = 64

  c.critic.gamma = 1.0
  c.critic.lam = 0.95
  c.critic.value_clip = 0.5
  c.critic.whiten = True
  # The value head starts at zero and must catch up with the policy quickly.
  c.critic.learning_rate = 1e-3
  c.critic.max_grad_norm = 1.0
  return common.apply_arg(c, arg)
