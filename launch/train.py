r"""Trains a policy with RL as an ml_collections config says.

  python -m launch.train --config=configs/arithmetic_grpo.py --workdir=/tmp/rljax_demo
  python -m launch.train --config=configs/arithmetic_grpo.py --config.rl.group_size=16

Runs the embedded default (``configs/arithmetic_grpo.py``) when ``--config``
is not given.
"""

import os

from absl import app, flags
from ml_collections import config_flags

from launch import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs",
                        "arithmetic_grpo.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT,
                                          "ml_collections config file")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rljax_run",
                               "where metrics, plots and checkpoints go")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "", "where the run's JSON record (figures, config, commit, "
    "machine) goes; default the workdir (benchmarks/results to keep it)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "call jax.distributed.initialize() first")


def _record_stem() -> str:
  """``train`` for the main job's config, else the config file's stem (so
  records of different configs at one commit do not overwrite each other)."""
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  stem = os.path.splitext(os.path.basename(path.split(":")[0]))[0]
  return "train" if stem == "arithmetic_grpo" else stem


def main(argv):
  del argv
  cli.setup_logging()
  if _DISTRIBUTED.value:
    import jax
    jax.distributed.initialize()
  from rljax import train
  summary = train.run(_CONFIG.value, _WORKDIR.value)
  if summary["preempted"]:
    print(f"preempted: checkpoint saved in {summary['checkpoints']}; rerun the "
          f"same command to resume.")
  print(cli.run_summary(summary))
  if not summary["preempted"]:
    from launch.benchlib import write_record  # pylint: disable=import-outside-toplevel
    figures = {k: summary.get(k) for k in (
        "before", "after", "seconds", "seconds_by_phase", "tokens_per_s")}
    print("record:", write_record(
        f"{_record_stem()}_seed{_CONFIG.value.seed}", figures,
        _RECORD_DIR.value or _WORKDIR.value, _CONFIG.value.to_dict()))


if __name__ == "__main__":
  app.run(main)
