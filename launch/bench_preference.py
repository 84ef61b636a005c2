r"""The DPO family on the main job's task: held-out accuracy before and after.

  python -m launch.bench_preference --record_dir=benchmarks/results
  python -m launch.bench_preference --quick     # 1 seed, tiny config

For each seed and each loss of ``PREFERENCE_LOSSES``, one after the other in
subprocesses (one CPU device): ``launch.train`` on
``configs/arithmetic_dpo.py`` with ``preference.loss`` set (the main job's
SFT warm-up, then ``rl.num_steps`` preference steps on pairs built from the
task; SimPO with ``preference.beta=2``, its paper's range, and robust DPO
with ``preference.label_smoothing=0.1``). It prints and
records, per loss, the held-out accuracy (the verifier's, sampled at the
training temperature) before and after and the gain, mean +- std over the
seeds, and the held-out pair accuracy after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from launch import benchlib, local_cluster
from rljax.train.preference_losses import PREFERENCE_LOSSES

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
_LOSSES = flags.DEFINE_list("losses", list(PREFERENCE_LOSSES),
                            "preference.loss names")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed of the tiny config, 2 "
                           "steps (the tests' smoke run)")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the runs go (default: "
                               "a new temporary directory)")
_RECORD_DIR = flags.DEFINE_string("record_dir", "", "where the JSON record "
                                  "goes (default: the workdir)")

_ROOT = os.path.join(os.path.dirname(__file__), "..")
# Per-loss settings: SimPO's beta from its paper (2 to 2.5); robust DPO
# assumes 10% flipped labels (with 0 it is DPO).
_LOSS_FLAGS = {"simpo": ["--config.preference.beta=2.0"],
               "robust_dpo": ["--config.preference.label_smoothing=0.1"]}


def _quick_flags(quick: bool) -> list[str]:
  return (["--config.rl.num_steps=2", "--config.sft.num_steps=4",
           "--config.eval.every=2", "--config.preference.num_pairs=64",
           "--config.preference.num_heldout=16",
           "--config.preference.batch_size=8"] if quick else [])


def accuracy(workdir: str) -> dict[str, float]:
  """Held-out accuracy at step 0 and at the last step, and the pair
  accuracy at the last step, from ``metrics.jsonl``."""
  rows = [json.loads(line) for line in open(
      os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  acc = [(r["step"], r["eval/accuracy"]) for r in rows
         if "eval/accuracy" in r and r["step"] >= 0]
  pairs = [r["eval/pair_accuracy"] for r in rows
           if "eval/pair_accuracy" in r and r["step"] > 0]
  return {"before": acc[0][1], "after": acc[-1][1],
          "gain": acc[-1][1] - acc[0][1], "pair_accuracy": pairs[-1]}


def _stats(values: list[float]) -> dict[str, float]:
  ddof = 1 if len(values) > 1 else 0
  return {"mean": float(np.mean(values)),
          "std": float(np.std(values, ddof=ddof))}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  quick = _QUICK.value
  seeds = [0] if quick else [int(s) for s in _SEEDS.value]
  losses = list(_LOSSES.value)
  unknown = sorted(set(losses) - set(PREFERENCE_LOSSES))
  if unknown:
    raise app.UsageError(f"--losses: unknown {unknown}; accepted "
                         f"{list(PREFERENCE_LOSSES)}.")
  base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-pref-")
  env = local_cluster.child_env(1, platform="")
  config = "configs/arithmetic_dpo.py" + (":tiny" if quick else "")
  runs: dict[str, list[dict]] = {name: [] for name in losses}
  for seed in seeds:
    for name in losses:
      workdir = os.path.join(base, f"{name}_seed{seed}")
      args = [f"--config={config}", f"--config.seed={seed}",
              f"--config.preference.loss={name}", f"--workdir={workdir}",
              *_LOSS_FLAGS.get(name, []), *_quick_flags(quick)]
      start = time.time()
      result = subprocess.run([sys.executable, "-m", "launch.train", *args],
                              cwd=_ROOT, env=env, capture_output=True,
                              text=True)
      if result.returncode:
        print(result.stdout[-3000:], result.stderr[-3000:])
        raise SystemExit(f"launch.train {' '.join(args)} failed (exit "
                         f"{result.returncode}).")
      figures = dict(accuracy(workdir), seed=seed,
                     seconds=time.time() - start)
      runs[name].append(figures)
      print(f"seed {seed} {name:>10}: held-out {figures['before']:.3f} -> "
            f"{figures['after']:.3f}, pair accuracy "
            f"{figures['pair_accuracy']:.3f} ({figures['seconds']:.0f} s)",
            flush=True)
  summary = {}
  for name in losses:
    for what in ("before", "after", "gain", "pair_accuracy"):
      summary[f"{name}_{what}"] = _stats([r[what] for r in runs[name]])
    s = summary
    print(f"{name:>10}: held-out {s[f'{name}_before']['mean']:.3f} -> "
          f"{s[f'{name}_after']['mean']:.3f} +- "
          f"{s[f'{name}_after']['std']:.3f}, gain "
          f"{s[f'{name}_gain']['mean'] * 100:+.1f} +- "
          f"{s[f'{name}_gain']['std'] * 100:.1f} points; pair accuracy "
          f"{s[f'{name}_pair_accuracy']['mean']:.3f}")
  out_dir = _RECORD_DIR.value or base
  path = benchlib.write_record(
      "bench_preference" + ("_quick" if quick else ""),
      {"summary": summary, "runs": runs, "seeds": seeds},
      out_dir, config={"config": config, "losses": losses,
                       "loss_flags": _LOSS_FLAGS})
  print(f"record: {path}")


if __name__ == "__main__":
  app.run(main)
