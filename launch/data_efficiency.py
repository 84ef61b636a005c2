"""The curves, summary and plot of ``launch/bench_data_efficiency.py``.

No absl flags here, so tests and notebooks import it beside any launcher.
"""

from __future__ import annotations

import json
import os

import numpy as np


def curve(workdir: str) -> dict[str, list[float]]:
  """A run's held-out accuracy after 0, k, 2k, ... steps, with the sampled
  tokens and RL seconds (``time/step``) spent by then."""
  rows = [json.loads(line) for line in open(
      os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  by_step: dict[int, dict] = {}
  for r in rows:
    by_step.setdefault(int(r["step"]), {}).update(r)
  steps, acc, tokens, seconds = [], [], [], []
  spent_tokens = spent_seconds = 0.0
  for step in sorted(by_step):
    r = by_step[step]
    if step > 0:
      spent_tokens += r["num_generated_tokens"]
      spent_seconds += r["time/step"]
    if "eval/accuracy" in r:
      steps.append(step)
      acc.append(float(r["eval/accuracy"]))
      tokens.append(spent_tokens)
      seconds.append(spent_seconds)
  return {"steps": steps, "accuracy": acc, "tokens": tokens,
          "seconds": seconds}


def summarize(curves: dict[str, list[dict]], target: float) -> dict:
  """Per method: mean and sample std over seeds at each evaluated step, and
  the tokens and seconds to first reach ``target``."""
  out = {}
  for method, runs in curves.items():
    ddof = 1 if len(runs) > 1 else 0  # the sample std over seeds
    steps = runs[0]["steps"]
    if any(r["steps"] != steps for r in runs):
      raise ValueError(f"{method}: the seeds evaluated at different steps.")
    stat = {}
    for key in ("accuracy", "tokens", "seconds"):
      values = np.asarray([r[key] for r in runs], np.float64)
      stat[key] = {"mean": values.mean(0).tolist(),
                   "std": values.std(0, ddof=ddof).tolist()}
    reached = []
    for r in runs:
      hit = [i for i, a in enumerate(r["accuracy"]) if a >= target and
             r["steps"][i] > 0]
      reached.append(None if not hit else {
          "step": r["steps"][hit[0]], "tokens": r["tokens"][hit[0]],
          "seconds": r["seconds"][hit[0]]})
    hits = [x for x in reached if x is not None]
    gains = [r["accuracy"][-1] - r["accuracy"][0] for r in runs]
    out[method] = {
        "steps": steps, **stat, "to_target": reached,
        "seeds_reaching_target": len(hits),
        "tokens_to_target_mean": (float(np.mean([x["tokens"] for x in hits]))
                                  if hits else None),
        "seconds_to_target_mean": (float(np.mean([x["seconds"] for x in hits]))
                                   if hits else None),
        "final_accuracy_mean": float(np.mean([r["accuracy"][-1]
                                              for r in runs])),
        "final_accuracy_std": float(np.std([r["accuracy"][-1]
                                            for r in runs], ddof=ddof)),
        "gain_mean": float(np.mean(gains)),
        "gain_std": float(np.std(gains, ddof=ddof)),
        "tokens_total_mean": float(np.mean([r["tokens"][-1] for r in runs])),
        "seconds_total_mean": float(np.mean([r["seconds"][-1]
                                             for r in runs])),
    }
  return out


def plot(summary: dict, path: str, target: float,
         overrides: tuple[str, ...] = ()) -> None:
  """Accuracy vs sampled tokens and vs RL seconds, mean +- std bands; the
  title names the config ``overrides`` of every run."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for method, s in summary.items():
    acc = np.asarray(s["accuracy"]["mean"])
    std = np.asarray(s["accuracy"]["std"])
    for ax, key, scale in ((axes[0], "tokens", 1e6), (axes[1], "seconds", 1)):
      x = np.asarray(s[key]["mean"]) / scale
      label = "GRPO (baseline)" if method == "none" else method
      ax.plot(x, acc, marker="o", ms=3, label=label)
      ax.fill_between(x, acc - std, acc + std, alpha=0.2)
  for ax, xlabel in ((axes[0], "sampled tokens (millions)"),
                     (axes[1], "RL wall clock (s)")):
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy (sampled)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
  job = "the main job" + (f" with {', '.join(overrides)}" if overrides else "")
  fig.suptitle(f"Prompt selection on {job}: mean +- std over seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


SELECTIONS = ("none", "dapo", "greso", "dots")
ALLOCATIONS = ("vigor", "pilot_commit", "sgpo")


def method_flags(method: str, replay_fraction: float) -> list[str]:
  """``dapo``, ``greso+replay``, ``replay``, ``vigor``, ``vigor+dapo``, ...
  as config flags."""
  parts = method.split("+")
  names = [p for p in parts if p != "replay"]
  selections = [n for n in names if n in SELECTIONS]
  allocations = [n for n in names if n in ALLOCATIONS]
  if (len(selections) > 1 or len(allocations) > 1
      or len(selections) + len(allocations) != len(names)
      or parts.count("replay") > 1):
    raise ValueError(
        f"--methods: {method!r} is not a selection name {SELECTIONS}, an "
        f"allocation name {ALLOCATIONS}, or one of each joined with '+', "
        "optionally with '+replay'.")
  flags_ = [f"--config.rl.selection.name="
            f"{selections[0] if selections else 'none'}"]
  if allocations:
    flags_.append(f"--config.rl.allocation.name={allocations[0]}")
  if "replay" in parts:
    flags_.append(f"--config.rl.replay.fraction={replay_fraction}")
  return flags_


__all__ = ["ALLOCATIONS", "SELECTIONS", "curve", "method_flags", "plot",
           "summarize"]
