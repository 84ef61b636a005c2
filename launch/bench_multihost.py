r"""What running as several processes costs: 1 x 8 devices vs 2 x 4 devices.

  python -m launch.bench_multihost
  python -m launch.bench_multihost --schedules=async
  python -m launch.bench_multihost --steps=10 -- --config.rl.prompts_per_step=32

For each schedule (``--schedules``: sync, and async, ``rl.max_staleness=1``)
runs the same config twice, one after the other on this machine: one
process simulating 8 CPU devices (``launch.train``), then two processes of 4
(``launch.local_cluster``, ``jax.distributed`` over loopback), on the same
mesh ``data=2 x fsdp=4``. It prints each run's steps per second and, per RL
step (the median over the steps after the first, which compiles), the step
time and its phases, the ratio 2 x 4 / 1 x 8, and each process's host-side collectives (``ProcessGroup``:
prompt-bucket agreement, reward and metric gathers) per step.

On one machine both processes share its cores, so this measures the
coordination overhead of the multi-process path, not a speed-up: on real
hosts each process has its own cores and accelerators.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

from launch import benchlib, local_cluster

_STEPS = flags.DEFINE_integer("steps", 8, "RL steps per run (>= 3)")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "", "where the JSON record goes (benchmarks/results to "
    "keep it); default: none")

_SCHEDULE_FLAG = flags.DEFINE_list(
    "schedules", ["sync", "async"], "which schedules to run: sync (sample, "
    "then train) and async (rl.max_staleness=1: the next step's rollout "
    "sampled while this one trains)")

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_SCHEDULES = {"sync": (), "async": ("--config.rl.max_staleness=1",)}
_PHASES = ("step", "sample", "reward", "advantage", "train")


def _args(workdir: str, steps: int, extra: list[str]) -> list[str]:
  return ["--config=configs/arithmetic_grpo.py:tiny", f"--workdir={workdir}",
          f"--config.rl.num_steps={steps}", "--config.rl.prompts_per_step=16",
          "--config.mesh.data=2", "--config.mesh.fsdp=4",
          "--config.sft.num_steps=0", "--config.eval.every=1000",
          "--config.eval.greedy=False", "--config.eval.num_examples=8",
          "--config.checkpoint.every=1000", *extra]


def _step_times(workdir: str) -> dict[str, float]:
  """Median seconds per phase over the RL steps after the first."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if r["step"] >= 2 and "time/step" in r]
  return {p: statistics.median(r[f"time/{p}"] for r in rows) for p in _PHASES
          if all(f"time/{p}" in r for r in rows)}


def _process_lines(output: str) -> list[dict]:
  out = []
  for line in output.splitlines():
    _, sep, rest = line.partition("process summary: ")
    if sep:
      out.append(json.loads(rest))
  return sorted(out, key=lambda d: d["index"])


def _schedule(name: str, base: str, steps: int, extra: list[str]) -> dict:
  """One schedule's 1 x 8 and 2 x 4 runs: their phase medians and each
  process's summary."""
  flags = list(_SCHEDULES[name]) + extra
  one, two = os.path.join(base, name, "one"), os.path.join(base, name, "two")
  print(f"{name}: 1 process x 8 devices ({steps} steps) ...", flush=True)
  subprocess.run([sys.executable, "-m", "launch.train",
                  *_args(one, steps, flags)], cwd=_ROOT,
                 env=local_cluster.child_env(8), check=True,
                 capture_output=True)
  print(f"{name}: 2 processes x 4 devices ({steps} steps) ...", flush=True)
  result = subprocess.run(
      [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
       "--devices_per_process=4", "--", *_args(two, steps, flags)],
      cwd=_ROOT, capture_output=True, text=True)
  if result.returncode:
    print(result.stdout[-4000:], result.stderr[-2000:])
    raise SystemExit(result.returncode)
  a, b = _step_times(one), _step_times(two)
  processes = _process_lines(result.stdout)
  print(f"\n{name}: per RL step, median of steps 2..{steps} (seconds)")
  print(f"{'phase':<10} {'1 x 8':>8} {'2 x 4':>8} {'ratio':>6} {'extra':>8}")
  for p in a:
    print(f"{p:<10} {a[p]:8.3f} {b[p]:8.3f} {b[p] / a[p]:6.2f} "
          f"{b[p] - a[p]:+8.3f}")
  for d in processes:
    c = d["collectives"]
    print(f"process {d['index']}: {c['count'] / steps:.1f} host "
          f"collectives per step (all phases, incl. evaluation), "
          f"{c['seconds'] / steps * 1e3:.1f} ms per step; wall "
          f"{d['seconds']:.1f} s; by phase " + ", ".join(
              f"{k} {v:.1f}" for k, v in d["seconds_by_phase"].items()))
  figures = {"one_by_eight": a, "two_by_four": b,
             "steps_per_s": {"one_by_eight": 1 / a["step"],
                             "two_by_four": 1 / b["step"]},
             "ratio_step": b["step"] / a["step"],
             "overhead_s_per_step": b["step"] - a["step"],
             "processes": processes, "flags": flags}
  print(f"{name}: {1 / a['step']:.2f} vs {1 / b['step']:.2f} steps/s; "
        f"2 x 4 / 1 x 8 step time {figures['ratio_step']:.2f}x "
        f"({figures['overhead_s_per_step'] * 1e3:+.0f} ms per step)\n")
  return figures


def main(argv):
  extra = list(argv[1:])
  steps = _STEPS.value
  if steps < 3:
    raise app.UsageError(f"--steps={steps}: at least 3 (the first compiles).")
  unknown = [n for n in _SCHEDULE_FLAG.value if n not in _SCHEDULES]
  if unknown or not _SCHEDULE_FLAG.value:
    raise app.UsageError(f"--schedules={','.join(_SCHEDULE_FLAG.value)}: "
                         f"one or more of {', '.join(_SCHEDULES)}.")
  base = tempfile.mkdtemp(prefix="rljax-bench-multihost-")
  figures = {name: _schedule(name, base, steps, extra)
             for name in _SCHEDULE_FLAG.value}
  figures["steps"] = steps
  for name in _SCHEDULE_FLAG.value:
    f = figures[name]
    print(f"{name:<6} 1 x 8 {f['steps_per_s']['one_by_eight']:.2f} steps/s, "
          f"2 x 4 {f['steps_per_s']['two_by_four']:.2f} steps/s "
          f"({f['ratio_step']:.2f}x the step time, "
          f"{f['overhead_s_per_step'] * 1e3:+.0f} ms)")
  if _RECORD_DIR.value:
    print("record:", benchlib.write_record(
        "bench_multihost", figures, _RECORD_DIR.value, {"args": _args(
            "<workdir>", steps, extra)}))


if __name__ == "__main__":
  app.run(main)
