r"""What running as several processes costs: 1 x 8 devices vs 2 x 4 devices.

  python -m launch.bench_multihost
  python -m launch.bench_multihost --steps=10 -- --config.rl.prompts_per_step=32

Runs the same config twice, one after the other on this machine: one
process simulating 8 CPU devices (``launch.train``), then two processes of 4
(``launch.local_cluster``, ``jax.distributed`` over loopback), on the same
mesh ``data=2 x fsdp=4``. It prints, per RL step (the median over the steps
after the first, which compiles), the step time and its phases, the ratio
2 x 4 / 1 x 8, and each process's host-side collectives (``ProcessGroup``:
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

_ROOT = os.path.join(os.path.dirname(__file__), "..")
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
  return {p: statistics.median(r[f"time/{p}"] for r in rows) for p in _PHASES}


def _process_lines(output: str) -> list[dict]:
  out = []
  for line in output.splitlines():
    _, sep, rest = line.partition("process summary: ")
    if sep:
      out.append(json.loads(rest))
  return sorted(out, key=lambda d: d["index"])


def main(argv):
  extra = list(argv[1:])
  steps = _STEPS.value
  if steps < 3:
    raise app.UsageError(f"--steps={steps}: at least 3 (the first compiles).")
  base = tempfile.mkdtemp(prefix="rljax-bench-multihost-")
  one, two = os.path.join(base, "one"), os.path.join(base, "two")
  env = local_cluster.child_env(8)
  print(f"1 process x 8 devices ({steps} steps) ...", flush=True)
  subprocess.run([sys.executable, "-m", "launch.train",
                  *_args(one, steps, extra)], cwd=_ROOT, env=env, check=True,
                 capture_output=True)
  print(f"2 processes x 4 devices ({steps} steps) ...", flush=True)
  result = subprocess.run(
      [sys.executable, "-m", "launch.local_cluster", "--num_processes=2",
       "--devices_per_process=4", "--", *_args(two, steps, extra)],
      cwd=_ROOT, capture_output=True, text=True)
  if result.returncode:
    print(result.stdout[-4000:], result.stderr[-2000:])
    raise SystemExit(result.returncode)
  a, b = _step_times(one), _step_times(two)
  processes = _process_lines(result.stdout)
  rl_steps = steps
  print(f"\nper RL step, median of steps 2..{steps} (seconds)")
  print(f"{'phase':<10} {'1 x 8':>8} {'2 x 4':>8} {'ratio':>6} {'extra':>8}")
  for p in _PHASES:
    print(f"{p:<10} {a[p]:8.3f} {b[p]:8.3f} {b[p] / a[p]:6.2f} "
          f"{b[p] - a[p]:+8.3f}")
  for d in processes:
    c = d["collectives"]
    print(f"process {d['index']}: {c['count'] / rl_steps:.1f} host "
          f"collectives per step (all phases, incl. evaluation), "
          f"{c['seconds'] / rl_steps * 1e3:.1f} ms per step; wall "
          f"{d['seconds']:.1f} s; by phase " + ", ".join(
              f"{k} {v:.1f}" for k, v in d["seconds_by_phase"].items()))
  figures = {"one_by_eight": a, "two_by_four": b,
             "ratio_step": b["step"] / a["step"],
             "overhead_s_per_step": b["step"] - a["step"],
             "processes": processes, "steps": steps}
  print(f"\n2 x 4 / 1 x 8 step time: {figures['ratio_step']:.2f}x "
        f"({figures['overhead_s_per_step'] * 1e3:+.0f} ms per step)")
  if _RECORD_DIR.value:
    print("record:", benchlib.write_record(
        "bench_multihost", figures, _RECORD_DIR.value, {"args": _args(
            "<workdir>", steps, extra)}))


if __name__ == "__main__":
  app.run(main)
