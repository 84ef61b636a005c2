r"""RLHF on a built-in task: a learned reward model against the verifier.

  python -m launch.bench_rlhf --record_dir=benchmarks/results
  python -m launch.bench_rlhf --quick          # 1 seed, tiny config

For each seed, one after the other in subprocesses (one CPU device):

1. ``launch.train_reward_model``: the main job's SFT warm-up, then a reward
   model (the SFT model with a score head) trained with the Bradley–Terry
   loss on preference pairs built from the arithmetic task (the right
   answer over a near miss); its held-out pair accuracy.
2. ``launch.train`` with that reward model as the only reward
   (``rewards.names=("model:<rm>", "numeric_match")``, weights ``(1, 0)``:
   the verifier is computed and logged, never trained on), held-out
   accuracy measured by the verifier.
3. ``launch.train`` as the README's main job (the verifier's reward), the
   baseline, in the same run.

It prints and records per seed and as mean +- std: the reward model's pair
accuracy, each policy's held-out accuracy before and after RL and the gain,
and, for the reward-model runs, the proxy reward (the reward model's score)
and the true reward (the verifier's, on the training rollouts) over the
first and last 50 steps: a proxy that rises while the true reward falls is
reward hacking.
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

from launch import benchlib
from launch.data_efficiency import curve

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed of the tiny config, a few "
                           "steps (the tests' smoke run)")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the runs go (default: "
                               "a new temporary directory)")
_RECORD_DIR = flags.DEFINE_string("record_dir", "", "where the JSON record "
                                  "goes (default: the workdir)")

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_WINDOW = 50


def _config(quick: bool) -> str:
  return "configs/arithmetic_grpo.py" + (":tiny" if quick else "")


def _quick_flags(quick: bool) -> list[str]:
  return (["--config.rl.num_steps=4", "--config.sft.num_steps=20",
           "--config.eval.every=2", "--config.reward_model.num_steps=20",
           "--config.reward_model.eval_every=10",
           "--config.reward_model.num_pairs=256"] if quick else [])


def _run(module: str, args: list[str], env: dict[str, str]) -> float:
  start = time.time()
  result = subprocess.run([sys.executable, "-m", module, *args], cwd=_ROOT,
                          env=env, capture_output=True, text=True)
  if result.returncode:
    print(result.stdout[-3000:], result.stderr[-3000:])
    raise SystemExit(f"{module} {' '.join(args)} failed "
                     f"(exit {result.returncode}).")
  if module == "launch.train" and "model:" in " ".join(args):
    if "reads the policy's tokens" not in result.stderr + result.stdout:
      raise SystemExit("the reward model did not read the policy's tokens "
                       "(a different tokenizer?)")
  return time.time() - start


def reward_columns(workdir: str, names: tuple[str, ...]) -> dict[str, dict]:
  """Per reward column: its mean over the first and the last ``_WINDOW`` RL
  steps."""
  rows = [json.loads(line) for line in open(
      os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  rows = [r for r in rows if r["step"] > 0 and "reward/total/mean" in r]
  out = {}
  for name in names:
    values = [r[f"reward/{name}/mean"] for r in rows]
    out[name] = {"first": float(np.mean(values[:_WINDOW])),
                 "last": float(np.mean(values[-_WINDOW:]))}
  return out


def _stats(values: list[float]) -> dict[str, float]:
  ddof = 1 if len(values) > 1 else 0
  return {"mean": float(np.mean(values)),
          "std": float(np.std(values, ddof=ddof))}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  quick = _QUICK.value
  seeds = [0] if quick else [int(s) for s in _SEEDS.value]
  base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-rlhf-")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  config, extra = _config(quick), _quick_flags(quick)
  runs = []
  for seed in seeds:
    rm_dir = os.path.join(base, f"rm_seed{seed}")
    common = [f"--config={config}", f"--config.seed={seed}", *extra]
    print(f"seed {seed}: reward model ...", flush=True)
    rm_s = _run("launch.train_reward_model",
                [*common, f"--workdir={rm_dir}"], env)
    with open(os.path.join(rm_dir, "summary.json")) as f:
      rm_summary = json.load(f)
    label = os.path.basename(rm_dir)
    print(f"  pair accuracy {rm_summary['heldout_accuracy_before']:.3f} -> "
          f"{rm_summary['heldout_accuracy']:.3f} ({rm_s:.0f} s)", flush=True)
    result = {"seed": seed, "rm": rm_summary, "rm_seconds": rm_s}
    for kind, flags_ in (
        ("learned", [f'--config.rewards.names=("model:{rm_dir}",'
                     '"numeric_match")', "--config.rewards.weights=(1.0,0.0)",
                     "--config.eval.reward=numeric_match"]),
        ("verifier", [])):
      workdir = os.path.join(base, f"{kind}_seed{seed}")
      print(f"seed {seed}: policy on the {kind} reward ...", flush=True)
      seconds = _run("launch.train", [*common, f"--workdir={workdir}",
                                      *flags_], env)
      c = curve(workdir)
      result[kind] = {"accuracy": c["accuracy"], "steps": c["steps"],
                      "before": c["accuracy"][0], "after": c["accuracy"][-1],
                      "gain": c["accuracy"][-1] - c["accuracy"][0],
                      "seconds": seconds}
      if kind == "learned":
        result[kind]["rewards"] = reward_columns(workdir,
                                                 (label, "numeric_match"))
      print(f"  held-out {c['accuracy'][0]:.3f} -> {c['accuracy'][-1]:.3f} "
            f"({seconds:.0f} s)", flush=True)
    runs.append(result)
  summary = {
      "pair_accuracy": _stats([r["rm"]["heldout_accuracy"] for r in runs]),
      **{f"{kind}_{what}": _stats([r[kind][what] for r in runs])
         for kind in ("learned", "verifier")
         for what in ("before", "after", "gain")},
      "proxy_reward": {w: _stats([r["learned"]["rewards"][
          f"rm_seed{r['seed']}"][w] for r in runs]) for w in ("first", "last")},
      "true_reward": {w: _stats([r["learned"]["rewards"]["numeric_match"][w]
                                 for r in runs]) for w in ("first", "last")},
  }
  s = summary
  print(f"\nreward model held-out pair accuracy: "
        f"{s['pair_accuracy']['mean']:.3f} +- {s['pair_accuracy']['std']:.3f}")
  for kind in ("learned", "verifier"):
    print(f"{kind:>8} reward: held-out {s[f'{kind}_before']['mean']:.3f} -> "
          f"{s[f'{kind}_after']['mean']:.3f} +- "
          f"{s[f'{kind}_after']['std']:.3f}, gain "
          f"{s[f'{kind}_gain']['mean'] * 100:+.1f} +- "
          f"{s[f'{kind}_gain']['std'] * 100:.1f} points")
  print(f"learned-reward runs, first/last {_WINDOW} steps: proxy (reward "
        f"model) {s['proxy_reward']['first']['mean']:.3f} -> "
        f"{s['proxy_reward']['last']['mean']:.3f}; true (verifier) "
        f"{s['true_reward']['first']['mean']:.3f} -> "
        f"{s['true_reward']['last']['mean']:.3f}")
  out_dir = _RECORD_DIR.value or base
  os.makedirs(out_dir, exist_ok=True)
  print("record:", benchlib.write_record(
      "bench_rlhf" + ("_quick" if quick else ""),
      {"summary": summary, "runs": runs, "seeds": seeds, "quick": quick},
      out_dir, {"config": config, "flags": extra}))


if __name__ == "__main__":
  app.run(main)
