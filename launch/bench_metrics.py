r"""What writing metrics costs a run at its start: the first metrics row.

  python -m launch.bench_metrics
  python -m launch.bench_metrics --baseline=<git revision>

A fresh Python process (as ``launch.train`` is) imports ``rljax.metrics``,
opens a ``MetricWriter`` (JSONL and TensorBoard) and writes its first row of
40 scalars; the process times the import and the first write. Each is the
median of ``--repeats`` processes, measured for this checkout and, with
``--baseline``, for another revision (checked out into a temporary git
worktree, measured in the same run, alternating with this one), and
printed with their ratio. The TensorBoard file each wrote is read back with
TensorBoard's loader.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags
from tensorboard.backend.event_processing import event_file_loader

from launch import benchlib

_REPEATS = flags.DEFINE_integer("repeats", 7, "processes per checkout")
_BASELINE = flags.DEFINE_string(
    "baseline", "", "a git revision to compare with (its own worktree)")
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
w.write(1, {f"metric/{i}": i / 7 for i in range(40)})
t2 = time.perf_counter()
w.close()
print(json.dumps({"import_s": t1 - t0, "first_row_s": t2 - t1,
                  "total_s": t2 - t0}))
"""


def _once(root: str) -> dict[str, float]:
  with tempfile.TemporaryDirectory() as workdir:
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _CHILD, workdir], cwd=root,
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
        runs[name].append(_once(root))
  finally:
    if worktree:
      subprocess.run(["git", "worktree", "remove", "--force", worktree],
                     cwd=_ROOT, check=False, capture_output=True)
  figures = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
             for name, rs in runs.items()}
  for name, f in figures.items():
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
        "bench_metrics", figures, _RECORD_DIR.value,
        {"repeats": _REPEATS.value, "baseline": _BASELINE.value}))


if __name__ == "__main__":
  app.run(main)
