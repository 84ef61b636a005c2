r"""What writing metrics costs a run at its start: the first metrics row.

  python -m launch.bench_metrics --baseline=<git revision>
  python -m launch.bench_metrics --baseline=<git revision> --launch

Each figure is the median of ``--repeats`` fresh processes, measured for
this checkout and, with ``--baseline``, for another revision (checked out
into a temporary git worktree, measured in the same run, alternating with
this one), and printed with their ratio.

* The writer alone: a process imports ``rljax.metrics``, opens a
  ``MetricWriter`` (JSONL and TensorBoard), waits ``--setup_s`` seconds
  (as ``launch.train`` compiles its programs, which XLA does without the
  GIL, between opening the writer and its first row; 0 times the writer
  alone) and
  writes its first row of 40 scalars; it times the import and the first
  write. The TensorBoard file each wrote is read back with TensorBoard's
  loader.
* ``--launch``: ``python -m launch.train`` on the tiny arithmetic config
  (``configs/arithmetic_grpo.py:tiny``), from the process's start until its
  first row is in ``metrics.jsonl`` (the process is then stopped).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from tensorboard.backend.event_processing import event_file_loader

from launch import benchlib

_REPEATS = flags.DEFINE_integer("repeats", 7, "processes per checkout")
_BASELINE = flags.DEFINE_string(
    "baseline", "", "a git revision to compare with (its own worktree)")
_SETUP_S = flags.DEFINE_float(
    "setup_s", 1.0, "seconds of work between opening the writer and its "
    "first row (the writer alone)")
_LAUNCH = flags.DEFINE_bool(
    "launch", False, "time launch.train's first metrics row instead")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "", "where the JSON record goes (benchmarks/results to "
    "keep it); default: none")

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from rljax import metrics
t1 = time.perf_counter()
w = metrics.MetricWriter(sys.argv[1])
time.sleep(float(sys.argv[2]))  # the set-up: XLA compiles without the GIL
t1b = time.perf_counter()
w.write(1, {f"metric/{i}": i / 7 for i in range(40)})
t2 = time.perf_counter()
w.close()
print(json.dumps({"import_s": t1 - t0, "first_row_s": t2 - t1b,
                  "total_s": (t1 - t0) + (t2 - t1b)}))
"""


def _once(root: str) -> dict[str, float]:
  with tempfile.TemporaryDirectory() as workdir:
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _CHILD, workdir,
                          str(_SETUP_S.value)], cwd=root,
                         env=env, capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    logdir = os.path.join(workdir, "tensorboard")
    [events] = [f for f in os.listdir(logdir)
                if f.startswith("events.out.tfevents.")]
    read = [v for e in event_file_loader.EventFileLoader(
        os.path.join(logdir, events)).Load() for v in e.summary.value]
    if len(read) != 40:
      raise SystemExit(f"{root}: {len(read)} scalars read back, not 40")
    return figures


def _launch_once(root: str) -> dict[str, float]:
  """Seconds from ``launch.train``'s start to its first metrics row."""
  with tempfile.TemporaryDirectory() as workdir:
    env = dict(os.environ, PYTHONPATH=root)
    path = os.path.join(workdir, "metrics.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train",
         "--config=configs/arithmetic_grpo.py:tiny", f"--workdir={workdir}"],
        cwd=root, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
      while not (os.path.exists(path) and os.path.getsize(path)):
        if proc.poll() is not None:
          raise SystemExit(f"{root}: launch.train exited ({proc.returncode}) "
                           "before its first metrics row")
        time.sleep(0.005)
      return {"total_s": time.perf_counter() - t0}
    finally:
      proc.kill()
      proc.wait()


def main(argv):
  del argv
  roots = {"this": _ROOT}
  worktree = None
  if _BASELINE.value:
    worktree = tempfile.mkdtemp(prefix="rljax-bench-metrics-")
    subprocess.run(["git", "worktree", "add", "--detach", worktree,
                    _BASELINE.value], cwd=_ROOT, check=True,
                   capture_output=True)
    roots["baseline"] = worktree
  try:
    runs = {name: [] for name in roots}
    for _ in range(_REPEATS.value):  # alternating: the same machine state
      for name, root in roots.items():
        runs[name].append(_launch_once(root) if _LAUNCH.value
                          else _once(root))
  finally:
    if worktree:
      subprocess.run(["git", "worktree", "remove", "--force", worktree],
                     cwd=_ROOT, check=False, capture_output=True)
  figures = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for name, rs in runs.items()}
  for name, f in figures.items():
    if _LAUNCH.value:
      print(f"{name:<9} launch.train's first metrics row after "
            f"{f['total_s']:.2f} s (median of {_REPEATS.value})")
      continue
    print(f"{name:<9} import {f['import_s'] * 1e3:7.1f} ms, first row "
          f"{f['first_row_s'] * 1e3:7.1f} ms, together "
          f"{f['total_s'] * 1e3:7.1f} ms (median of {_REPEATS.value})")
  if "baseline" in figures:
    ratio = figures["this"]["total_s"] / figures["baseline"]["total_s"]
    figures["ratio_total"] = ratio
    figures["baseline_revision"] = benchlib.git("rev-parse", _BASELINE.value)
    extra = figures["this"]["total_s"] - figures["baseline"]["total_s"]
    print(f"this / baseline ({_BASELINE.value}): {ratio:.2f}x "
          f"({extra * 1e3:+.1f} ms)")
  if _RECORD_DIR.value:
    print("record:", benchlib.write_record(
        "bench_metrics_launch" if _LAUNCH.value else "bench_metrics",
        figures, _RECORD_DIR.value,
        {"repeats": _REPEATS.value, "baseline": _BASELINE.value,
         "setup_s": _SETUP_S.value, "launch": _LAUNCH.value}))


if __name__ == "__main__":
  app.run(main)
