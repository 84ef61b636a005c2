r"""Trains a reward model on preference pairs (Bradley–Terry) and exports it.

  python -m launch.train_reward_model --config=configs/arithmetic_grpo.py \
      --workdir=/tmp/rljax_rm

Uses the config's task, tokenizer, ``model.*`` and SFT warm-up, and its
``reward_model.*`` section (``rljax/train/reward_training.py``): pairs from
``reward_model.pairs_path`` (JSONL ``prompt``, ``chosen``, ``rejected``,
optional ``margin``) or built from the task (the reference answer over a
near miss). Prints the held-out pair accuracy before and after; writes
``metrics.jsonl``, checkpoints (a rerun resumes), ``summary.json`` and
``<workdir>/reward_model`` (a Hugging Face ``*ForSequenceClassification``
checkpoint with the tokenizer). Train a policy against it with
``python -m launch.train --config=configs/arithmetic_grpo.py
--config.rewards.names='("model:/tmp/rljax_rm","numeric_match")'
--config.rewards.weights='(1.0,0.0)'`` (the verifier watched at weight 0).
"""

import json
import os

from absl import flags

from launch import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs",
                        "arithmetic_grpo.py")
if __name__ == "__main__":  # run as a launcher, not imported
  cli.first_line("launch.train_reward_model", _DEFAULT, "/tmp/rljax_rm")
from rljax.train import reward_training  # noqa: E402  (after the first line)
_CONFIG = cli.define_config_file("config", _DEFAULT, "an RL config file")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rljax_rm", "the run directory")


def main(argv):
  del argv
  cli.setup_logging()
  summary = reward_training.run(_CONFIG.value, _WORKDIR.value)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  cli.run(main)
