r"""RLHF on a built-in task: a learned reward model against the verifier.

  python -m launch.bench_rlhf --record_dir=benchmarks/results
  python -m launch.bench_rlhf --quick          # 1 seed, tiny config

For each seed, one after the other in subprocesses (one CPU device):

1. ``launch.train_reward_model``, twice: the main job's SFT warm-up, then a
   reward model (the SFT model with a score head) trained with the
   Bradley–Terry loss on preference pairs built from the arithmetic task,
   the right answer over a near miss (``reward_model.negatives=near``) or
   over a mix of near misses, random integers and digit edits (``mixed``);
   their held-out pair accuracy.
2. ``launch.train`` with each reward model as the only reward
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

Iterated RLHF (``--iterated_rounds=K``; Bai et al. 2022, "Training a
Helpful and Harmless Assistant with Reinforcement Learning from Human
Feedback", https://arxiv.org/abs/2204.05862, section 4.5): one policy run
on the first ``--rms`` reward model for ``--round_steps`` steps; then, K - 1
times, the reward model is trained on (``reward_model.init_path``: from
where it was) for ``--retrain_steps`` more steps on its pairs plus pairs of
the policy's own samples on ``--policy_prompts`` prompts, labelled by the
verifier (``reward_model.policy_path``, ``reward_model.labeller``), and the
policy run resumes for ``--round_steps`` more steps on it (the run's reward
directory ``rm_current_seed<s>`` holds the newest model: same config, so
the run resumes).

The over-optimisation curve (Gao et al. 2022, "Scaling Laws for Reward
Model Overoptimization", https://arxiv.org/abs/2210.10760): every policy
run logs its KL to the SFT policy with no penalty (``rl.log_kl``: the
estimator ``rl.kl_estimator``, averaged over the run's tokens, the same
training as without it), and at each held-out evaluation the record keeps
the KL and the proxy reward (each the mean over the steps since the
evaluation before). A PNG of the record's name, beside it, plots held-out
verifier accuracy and the reward model's score against that KL, one line
per method and seed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from launch import benchlib, local_cluster
from launch.data_efficiency import curve

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed of the tiny config, a few "
                           "steps (the tests' smoke run)")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the runs go (default: "
                               "a new temporary directory)")
_RECORD_DIR = flags.DEFINE_string("record_dir", "", "where the JSON record "
                                  "goes (default: the workdir)")

_RMS = flags.DEFINE_list(
    "rms", ["near", "mixed"], "the reward models: 'near' and 'mixed' "
    "(reward_model.negatives), 'policy' (mixed, plus pairs of the SFT "
    "model's samples on --policy_prompts prompts)")
_POLICY_PROMPTS = flags.DEFINE_integer("policy_prompts", 2000,
                                       "reward_model.policy_prompts of 'policy'")
_VERIFIER = flags.DEFINE_bool("verifier", True, "also train on the verifier "
                              "reward (the baseline)")
_HACKED = flags.DEFINE_bool("hacked", True, "train a policy on each --rms "
                            "reward model alone")
_ITERATED = flags.DEFINE_integer("iterated_rounds", 0, "rounds of iterated "
                                 "RLHF (0: none)")
_ROUND_STEPS = flags.DEFINE_integer("round_steps", 100, "RL steps per round "
                                    "of iterated RLHF")
_RETRAIN_STEPS = flags.DEFINE_integer("retrain_steps", 300, "reward-model "
                                      "steps per retraining")
_ITER_PROMPTS = flags.DEFINE_integer("iterated_prompts", 500, "prompts whose "
                                     "policy samples are labelled each round")
_RECIPE = flags.DEFINE_bool(
    "recipe", False, "instead: configs/arithmetic_rlhf.py, online DPO on a "
    "worst-case ensemble of the 'mixed' and 'policy' reward models, per seed")
_RECIPE_RM_STEPS = flags.DEFINE_integer(
    "recipe_rm_steps", 3000, "--recipe: each reward model's optimizer steps "
    "(the recipe's gain follows their held-out pair accuracy)")
_RECIPE_RM_INIT = flags.DEFINE_enum(
    "recipe_rm_init", "sft", ["sft", "policy_sft"], "--recipe: each reward "
    "model's reward_model.init ('policy_sft': the policy's own warm-up, so "
    "the 'policy' model's pairs are the recipe policy's SFT samples)")

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_RM_FLAGS = {"near": ["--config.reward_model.negatives=near"],
             "mixed": ["--config.reward_model.negatives=mixed"],
             "policy": ["--config.reward_model.negatives=mixed"]}
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


def iterated(seed: int, base: str, common: list[str], rm_dir: str,
             rm_flags: list[str], env: dict[str, str], quick: bool
             ) -> tuple[str, str, dict]:
  """Iterated RLHF (the module docstring) from the reward model of the run
  ``rm_dir`` (trained with ``rm_flags``: its pairs, kept). Returns ``(policy workdir, the reward column's label, the
  reward models' held-out pair accuracy and new pairs per round)``."""
  rounds, steps = _ITERATED.value, 2 if quick else _ROUND_STEPS.value
  current = os.path.join(base, f"rm_current_seed{seed}")
  shutil.copytree(os.path.join(rm_dir, "reward_model"), current,
                  dirs_exist_ok=True)
  workdir = os.path.join(base, f"policy_iterated_seed{seed}")
  reward = [f'--config.rewards.names=("model:{current}","numeric_match")',
            "--config.rewards.weights=(1.0,0.0)",
            "--config.eval.reward=numeric_match",
            f"--config.checkpoint.every={steps}", "--config.rl.log_kl=True"]
  with open(os.path.join(rm_dir, "summary.json")) as f:
    info = {"rm_accuracy": [json.load(f)["heldout_accuracy"]],
            "policy_pairs": [0]}
  previous = rm_dir
  for i in range(1, rounds + 1):
    print(f"seed {seed}: iterated round {i}: policy to step {i * steps} ...",
          flush=True)
    _run("launch.train", [*common, f"--workdir={workdir}", *reward,
                          f"--config.rl.num_steps={i * steps}"], env)
    if i == rounds:
      break
    retrained = os.path.join(base, f"rm_iterated_seed{seed}_round{i}")
    _run("launch.train_reward_model", [
        *common, f"--workdir={retrained}", *rm_flags,
        f"--config.reward_model.init_path={previous}",
        f"--config.reward_model.policy_path={workdir}",
        f"--config.reward_model.policy_prompts="
        f"{8 if quick else _ITER_PROMPTS.value}",
        f"--config.reward_model.num_steps="
        f"{20 if quick else _RETRAIN_STEPS.value}"], env)
    with open(os.path.join(retrained, "summary.json")) as f:
      accuracy = json.load(f)["heldout_accuracy"]
    rows = [json.loads(line) for line in open(
        os.path.join(retrained, "metrics.jsonl")) if line.strip()]
    pairs = [r["rm/policy_pairs"] for r in rows if "rm/policy_pairs" in r]
    info["rm_accuracy"].append(accuracy)
    info["policy_pairs"].append(pairs[0] if pairs else 0.0)
    print(f"  reward model retrained on {info['policy_pairs'][-1]:.0f} pairs "
          f"of the policy's samples: held-out pair accuracy {accuracy:.3f}",
          flush=True)
    shutil.copytree(os.path.join(retrained, "reward_model"), current,
                    dirs_exist_ok=True)
    previous = retrained
  return workdir, os.path.basename(current), info


def kl_curve(workdir: str, proxy: str | None) -> dict[str, list[float]]:
  """At each held-out evaluation (``data_efficiency.curve``'s steps): the
  mean ``kl`` (``rl.log_kl``) and, with ``proxy`` (a reward column), its
  mean over the RL steps since the evaluation before (step 0: KL 0, the
  proxy of the first step)."""
  rows = [json.loads(line) for line in open(
      os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  rl = [r for r in rows if r["step"] > 0 and "kl" in r]
  steps = curve(workdir)["steps"]
  out: dict[str, list[float]] = {"kl": [], "proxy": []}
  for i, step in enumerate(steps):
    lo = steps[i - 1] if i else 0
    window = [r for r in rl if lo < r["step"] <= step] or rl[:1]
    out["kl"].append(float(np.mean([r["kl"] for r in window]))
                     if step else 0.0)
    if proxy is not None:
      out["proxy"].append(float(np.mean(
          [r[f"reward/{proxy}/mean"] for r in window])))
  return out


def plot_overoptimization(runs: list[dict], kinds: tuple[str, ...],
                          path: str) -> None:
  """Held-out accuracy and the proxy reward against KL(pi || pi_SFT), one
  line per method and seed (Gao et al. 2022, figure 1's axes)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for run in runs:
    for kind in kinds:
      r = run[kind]
      label = {"verifier": "verifier (the true reward)",
               "iterated": "iterated RLHF"}.get(kind, f"{kind} reward model")
      label = label if run is runs[0] else None
      left.plot(r["kl"], r["accuracy"], marker="o", ms=3,
                color=colors[kind], label=label)
      if r.get("proxy"):
        right.plot(r["kl"], r["proxy"], marker="o", ms=3,
                   color=colors[kind], label=label)
  left.set_ylabel("held-out accuracy (the verifier)")
  left.set_ylim(0, 1)
  right.set_ylabel("reward model score (the proxy)")
  for ax in (left, right):
    ax.set_xlabel("KL(policy || SFT policy), per token")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle("Over-optimisation on the main job: one line per seed")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _stats(values: list[float]) -> dict[str, float]:
  ddof = 1 if len(values) > 1 else 0
  return {"mean": float(np.mean(values)),
          "std": float(np.std(values, ddof=ddof))}


def recipe(seeds: list[int], base: str, env: dict[str, str], quick: bool
           ) -> None:
  """``--recipe``: per seed, the 'mixed' and 'policy' reward models, then
  ``configs/arithmetic_rlhf.py`` on their worst-case ensemble; held-out
  accuracy (the verifier's) before and after, and the record."""
  runs = []
  for seed in seeds:
    common = [f"--config.seed={seed}", *_quick_flags(quick)]
    rm_dirs = []
    for kind in ("mixed", "policy"):
      rm_dir = os.path.join(base, f"rm_{kind}_seed{seed}")
      flags_ = [f"--config={_config(quick)}", *common, f"--workdir={rm_dir}",
                "--config.reward_model.negatives=mixed",
                f"--config.reward_model.init={_RECIPE_RM_INIT.value}"]
      if not quick:
        flags_.append("--config.reward_model.num_steps="
                      f"{_RECIPE_RM_STEPS.value}")
      if kind == "policy":  # sampled sides: up to a bucket + 6 new tokens
        flags_ += ["--config.reward_model.policy_prompts="
                   f"{8 if quick else _POLICY_PROMPTS.value}",
                   "--config.reward_model.max_length=22"]
      print(f"seed {seed}: reward model {kind} ...", flush=True)
      _run("launch.train_reward_model", flags_, env)
      rm_dirs.append(rm_dir)
    workdir = os.path.join(base, f"recipe_seed{seed}")
    config = "configs/arithmetic_rlhf.py" + (":tiny" if quick else "")
    names = f'("ensemble:{",".join(rm_dirs)}","numeric_match")'
    extra = (["--config.preference.max_length=22",
              "--config.preference.num_pairs=64",
              "--config.preference.num_heldout=16"] if quick else [])
    seconds = _run("launch.train", [f"--config={config}", *common, *extra,
                                    f"--workdir={workdir}",
                                    f"--config.rewards.names={names}"], env)
    c = curve(workdir)
    runs.append({"seed": seed, "accuracy": c["accuracy"], "steps": c["steps"],
                 "before": c["accuracy"][0], "after": c["accuracy"][-1],
                 "gain": c["accuracy"][-1] - c["accuracy"][0],
                 "seconds": seconds})
    print(f"  held-out {c['accuracy'][0]:.3f} -> {c['accuracy'][-1]:.3f} "
          f"({seconds:.0f} s)", flush=True)
  summary = {w: _stats([r[w] for r in runs])
             for w in ("before", "after", "gain")}
  print(f"recipe: held-out {summary['before']['mean']:.3f} -> "
        f"{summary['after']['mean']:.3f}, gain "
        f"{summary['gain']['mean'] * 100:+.1f} +- "
        f"{summary['gain']['std'] * 100:.1f} points; every seed "
        f"{min(r['gain'] for r in runs) * 100:+.1f} or more")
  out_dir = _RECORD_DIR.value or base
  print("record:", benchlib.write_record(
      "bench_rlhf_recipe" + ("_quick" if quick else ""),
      {"summary": summary, "runs": runs, "seeds": seeds, "quick": quick},
      out_dir, {"config": "configs/arithmetic_rlhf.py",
                "policy_prompts": _POLICY_PROMPTS.value,
                "rm_steps": None if quick else _RECIPE_RM_STEPS.value,
                "rm_init": _RECIPE_RM_INIT.value}))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  quick = _QUICK.value
  if _RECIPE.value:
    seeds = [0] if quick else [int(s) for s in _SEEDS.value]
    base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-rlhf-")
    recipe(seeds, base, local_cluster.child_env(1, platform=""), quick)
    return
  seeds = [0] if quick else [int(s) for s in _SEEDS.value]
  base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-rlhf-")
  # One CPU device, as the user's main job; the caller's other XLA flags
  # are kept (the tests' fast code generation reaches the runs).
  env = local_cluster.child_env(1, platform="")
  config, extra = _config(quick), _quick_flags(quick)
  rms = tuple(_RMS.value)
  unknown = sorted(set(rms) - set(_RM_FLAGS))
  if unknown:
    raise app.UsageError(f"--rms: unknown {unknown}; accepted "
                         f"{sorted(_RM_FLAGS)}.")
  if _ITERATED.value < 0 or (_ITERATED.value and not rms):
    raise app.UsageError(f"--iterated_rounds={_ITERATED.value}: a number of "
                         "rounds >= 0, from the first --rms reward model.")
  kinds = ((rms if _HACKED.value else ())
           + (("verifier",) if _VERIFIER.value else ())
           + (("iterated",) if _ITERATED.value else ()))
  runs = []
  for seed in seeds:
    common = [f"--config={config}", f"--config.seed={seed}", *extra]
    result = {"seed": seed}
    for negatives in rms:
      rm_dir = os.path.join(base, f"rm_{negatives}_seed{seed}")
      print(f"seed {seed}: reward model {negatives} ...", flush=True)
      rm_flags = list(_RM_FLAGS[negatives])
      if negatives == "policy":
        rm_flags.append("--config.reward_model.policy_prompts="
                        f"{8 if quick else _POLICY_PROMPTS.value}")
      seconds = _run("launch.train_reward_model",
                     [*common, f"--workdir={rm_dir}", *rm_flags], env)
      with open(os.path.join(rm_dir, "summary.json")) as f:
        result[f"rm_{negatives}"] = dict(json.load(f), seconds=seconds)
      print(f"  pair accuracy {result[f'rm_{negatives}']['heldout_accuracy']:.3f}"
            f" ({seconds:.0f} s)", flush=True)
    for kind in kinds:
      flags_, label = [], None
      if kind not in ("verifier", "iterated"):
        rm_dir = os.path.join(base, f"rm_{kind}_seed{seed}")
        label = os.path.basename(rm_dir)
        flags_ = [f'--config.rewards.names=("model:{rm_dir}","numeric_match")',
                  "--config.rewards.weights=(1.0,0.0)",
                  "--config.eval.reward=numeric_match"]
      workdir = os.path.join(base, f"policy_{kind}_seed{seed}")
      if kind == "iterated":
        start = time.time()
        workdir, label, rounds_info = iterated(
            seed, base, common, os.path.join(base, f"rm_{rms[0]}_seed{seed}"),
            list(_RM_FLAGS[rms[0]]), env, quick)
        seconds = time.time() - start
      else:
        print(f"seed {seed}: policy on the {kind} reward ...", flush=True)
        seconds = _run("launch.train", [*common, f"--workdir={workdir}",
                                        "--config.rl.log_kl=True", *flags_],
                       env)
      c = curve(workdir)
      k = kl_curve(workdir, label)
      result[kind] = {"accuracy": c["accuracy"], "steps": c["steps"],
                      "before": c["accuracy"][0], "after": c["accuracy"][-1],
                      "gain": c["accuracy"][-1] - c["accuracy"][0],
                      "seconds": seconds, "kl": k["kl"],
                      "proxy": k["proxy"]}
      if kind == "iterated":
        result[kind].update(rounds_info)
      if label is not None:
        result[kind]["rewards"] = reward_columns(workdir,
                                                 (label, "numeric_match"))
        result[kind]["rewards"]["proxy"] = result[kind]["rewards"].pop(label)
      print(f"  held-out {c['accuracy'][0]:.3f} -> {c['accuracy'][-1]:.3f} "
            f"({seconds:.0f} s)", flush=True)
    runs.append(result)
  summary = {f"rm_{n}_pair_accuracy": _stats(
      [r[f"rm_{n}"]["heldout_accuracy"] for r in runs]) for n in rms}
  for kind in kinds:
    for what in ("before", "after", "gain"):
      summary[f"{kind}_{what}"] = _stats([r[kind][what] for r in runs])
    if kind != "verifier":
      for column in ("proxy", "numeric_match"):
        for w in ("first", "last"):
          summary[f"{kind}_{column}_{w}"] = _stats(
              [r[kind]["rewards"][column][w] for r in runs])
  s = summary
  for n in rms:
    print(f"reward model {n}: held-out pair accuracy "
          f"{s[f'rm_{n}_pair_accuracy']['mean']:.3f} +- "
          f"{s[f'rm_{n}_pair_accuracy']['std']:.3f}")
  for kind in kinds:
    line = (f"{kind:>8} reward: held-out {s[f'{kind}_before']['mean']:.3f} -> "
            f"{s[f'{kind}_after']['mean']:.3f} +- "
            f"{s[f'{kind}_after']['std']:.3f}, gain "
            f"{s[f'{kind}_gain']['mean'] * 100:+.1f} +- "
            f"{s[f'{kind}_gain']['std'] * 100:.1f} points")
    if kind != "verifier":
      line += (f"; first/last {_WINDOW} steps: proxy "
               f"{s[f'{kind}_proxy_first']['mean']:.2f} -> "
               f"{s[f'{kind}_proxy_last']['mean']:.2f}, true "
               f"{s[f'{kind}_numeric_match_first']['mean']:.3f} -> "
               f"{s[f'{kind}_numeric_match_last']['mean']:.3f}")
    print(line)
  out_dir = _RECORD_DIR.value or base
  os.makedirs(out_dir, exist_ok=True)
  for kind in kinds:
    print(f"{kind:>8} reward: KL to the SFT policy at the last evaluation "
          f"{np.mean([r[kind]['kl'][-1] for r in runs]):.3f} per token")
  record = benchlib.write_record(
      "bench_rlhf" + ("_quick" if quick else ""),
      {"summary": summary, "runs": runs, "seeds": seeds, "quick": quick},
      out_dir, {"config": config, "flags": extra, "rms": rms,
                "policy_prompts": _POLICY_PROMPTS.value, "kinds": kinds,
                "iterated_rounds": _ITERATED.value,
                "round_steps": _ROUND_STEPS.value,
                "retrain_steps": _RETRAIN_STEPS.value,
                "iterated_prompts": _ITER_PROMPTS.value})
  png = os.path.splitext(record)[0] + ".png"  # the record's name
  plot_overoptimization(runs, kinds, png)
  print("record:", record)
  print("plot:", png)


if __name__ == "__main__":
  app.run(main)
