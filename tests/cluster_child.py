"""A stand-in for ``launch.train`` in tests/test_local_cluster.py (no JAX).

  python -m tests.cluster_child --process_id=0 --num_processes=2 \
      --coordinator_address=127.0.0.1:1234 --distributed --sleep_s=60

Prints what it was given (its pid, XLA_FLAGS, JAX_PLATFORMS, its flags), marks
itself ready in ``--ready_dir`` once its SIGTERM handler is set, then exits
with ``--fail_code`` if it is ``--fail_process`` (after every process is
ready, so none is still starting when the launcher sends SIGTERM), else sleeps
``--sleep_s`` and exits 0. On SIGTERM it prints "got SIGTERM" and exits 0,
unless ``--ignore_sigterm``. ``--chatter`` also prints lines as Gloo and
XLA print them (``CHATTER``) and an XLA error line (``ERROR``).
"""

import argparse
import os
import signal
import sys
import time


CHATTER = [
    "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of "
    "connected peer ranks is : 7",
    "W1205 09:15:06.502495   19960 spmd_partitioner.cc:656] [SPMD] "
    "Involuntary full rematerialization.",
    "I0000 00:00:1733390106.502495   19960 cpu_client.cc:12] started",
    # Two of Gloo's threads writing at once.
    "[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected "
    "number of connected peer ranks is : 3",
    "1 is connected to 3 peer ranks. Expected number of connected peer ranks "
    "is : 3",
]
ERROR = ("E1205 09:15:07.000001   19960 coordination_service.cc:1] a task "
         "stopped sending heartbeats")


def _on_sigterm(signum, frame):
  del signum, frame
  print("got SIGTERM", flush=True)
  sys.exit(0)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--coordinator_address", required=True)
  parser.add_argument("--distributed", action="store_true")
  parser.add_argument("--fail_process", type=int, default=-1)
  parser.add_argument("--fail_code", type=int, default=1)
  parser.add_argument("--sleep_s", type=float, default=0.0)
  parser.add_argument("--ignore_sigterm", action="store_true")
  parser.add_argument("--ready_dir", default="")
  parser.add_argument("--chatter", action="store_true")
  args, rest = parser.parse_known_args()
  signal.signal(signal.SIGTERM,
                signal.SIG_IGN if args.ignore_sigterm else _on_sigterm)
  print(f"pid={os.getpid()}")
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
  print(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')}")
  print(f"process_id={args.process_id} num_processes={args.num_processes} "
        f"coordinator_address={args.coordinator_address} "
        f"distributed={args.distributed} rest={rest}")
  print("to stderr", file=sys.stderr)
  if args.chatter:  # what Gloo and XLA print, and an XLA error
    for line in CHATTER + [ERROR]:
      print(line, file=sys.stderr)
  if args.ready_dir:
    open(os.path.join(args.ready_dir, f"ready_{args.process_id}"), "w").close()
  if args.process_id == args.fail_process:
    while args.ready_dir and len(os.listdir(args.ready_dir)) < args.num_processes:
      time.sleep(0.02)
    print(f"failing with code {args.fail_code}", flush=True)
    sys.exit(args.fail_code)
  time.sleep(args.sleep_s)
  print("done", flush=True)


if __name__ == "__main__":
  main()
