r"""Trains a policy with RL as an ml_collections config says.

  python -m launch.train --config=configs/arithmetic_grpo.py --workdir=/tmp/rljax_demo
  python -m launch.train --config=configs/arithmetic_grpo.py --config.rl.group_size=16

Runs the embedded default (``configs/arithmetic_grpo.py``) when ``--config``
is not given.

Several hosts (one process each, one global mesh; docs/multihost.md):

  python -m launch.train --distributed ...        # TPU pod, SLURM, Open MPI
  python -m launch.train --distributed --coordinator_address=10.0.0.1:1234 \
      --num_processes=2 --process_id=0 ...        # elsewhere, on every host
  python -m launch.local_cluster --num_processes=2 --devices_per_process=4 \
      -- --config=configs/arithmetic_grpo.py:tiny  # one machine, for tests
"""

import json
import logging
import os
import sys
import time
import traceback

from absl import app, flags
from ml_collections import config_flags

from launch import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "configs",
                        "arithmetic_grpo.py")
if __name__ == "__main__":  # run as a launcher, not imported
  cli.first_line("launch.train", _DEFAULT, "/tmp/rljax_run")
_CONFIG = cli.define_config_file("config", _DEFAULT,
                                 "ml_collections config file")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/rljax_run",
                               "where metrics, plots and checkpoints go")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "", "where the run's JSON record (figures, config, commit, "
    "machine) goes; default the workdir (benchmarks/results to keep it)")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "run as one process of several (jax.distributed): "
    "the cluster is detected on TPU pods, SLURM and Open MPI; elsewhere give "
    "--coordinator_address, --num_processes and --process_id")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (with --distributed)")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "processes in the run (with --distributed)")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "this process's id (with --distributed)")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 60, "with --distributed: a process silent this "
    "long is declared dead, and the others stop with an error naming it")


def _record_stem() -> str:
  """``train`` for the main job's config, else the config file's stem (so
  records of different configs at one commit do not overwrite each other)."""
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  stem = os.path.splitext(os.path.basename(path.split(":")[0]))[0]
  stem = "train" if stem == "arithmetic_grpo" else stem
  rl = _CONFIG.value.rl  # rollout schedules get records of their own
  if rl.get("rollout", "static") != "static":
    stem += f"_{rl.rollout}"
  if rl.get("max_staleness", 0):
    stem += f"_async{rl.max_staleness}"
  lora = _CONFIG.value.model.get("lora", {})
  if lora.get("rank", 0):  # LoRA runs too
    stem += f"_lora{lora.rank}"
    if lora.get("quantize_base", "none") != "none":
      stem += f"_{lora.quantize_base}"
  return stem


def _lost_peer(error: BaseException) -> bool:
  """Whether ``error`` is a collective that lost its peer (a dead process)."""
  text = str(error)
  return "Gloo" in text or "Connection reset by peer" in text or (
      "Connection closed by peer" in text)


def main(argv):
  del argv
  cli.setup_logging()
  explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if not _DISTRIBUTED.value and any(v is not None for v in explicit):
    raise app.UsageError(
        "--coordinator_address, --num_processes and --process_id need "
        "--distributed.")
  if _DISTRIBUTED.value:
    from rljax import distributed  # pylint: disable=import-outside-toplevel
    distributed.initialize(*explicit, heartbeat_timeout_s=_HEARTBEAT.value)
  import jax  # pylint: disable=import-outside-toplevel
  primary = jax.process_index() == 0
  if not primary:  # process 0 reports; the others only warn
    logging.getLogger("rljax").setLevel(logging.WARNING)
  from rljax import train  # pylint: disable=import-outside-toplevel
  try:
    summary = train.run(_CONFIG.value, _WORKDIR.value)
  except BaseException as e:  # pylint: disable=broad-exception-caught
    if jax.process_count() == 1:
      raise
    traceback.print_exc()
    if _lost_peer(e):  # let jax.distributed name the process that is gone
      print(f"rljax: a collective failed, another process is probably gone; "
            f"waiting up to {_HEARTBEAT.value} s for jax.distributed to name "
            "it.", file=sys.stderr, flush=True)
      time.sleep(_HEARTBEAT.value + 10)
    # Leave at once otherwise: the others stop on the lost heartbeat instead
    # of waiting for this process at a collective or the shutdown barrier.
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access
  if jax.process_count() > 1:  # every process's own clock, one line each
    print("process summary:", json.dumps({
        **summary["process"], "seconds": summary["seconds"],
        "seconds_by_phase": summary["seconds_by_phase"]}), flush=True)
  if not primary:
    return
  if summary["preempted"]:
    print(f"preempted: checkpoint saved in {summary['checkpoints']}; rerun the "
          f"same command to resume.")
  print(cli.run_summary(summary))
  # A rerun of a finished run keeps the record its real run wrote.
  if not (summary["preempted"] or summary["already_finished"]):
    from launch.benchlib import write_record  # pylint: disable=import-outside-toplevel
    figures = {k: summary.get(k) for k in (
        "before", "after", "seconds", "seconds_by_phase", "tokens_per_s")}
    print("record:", write_record(
        f"{_record_stem()}_seed{_CONFIG.value.seed}", figures,
        _RECORD_DIR.value or _WORKDIR.value, _CONFIG.value.to_dict()))


if __name__ == "__main__":
  cli.run(main)
