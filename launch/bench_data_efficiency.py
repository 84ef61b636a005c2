r"""Does prompt selection spend rollouts better? Baseline GRPO vs DAPO's
dynamic sampling vs GRESO (and replay, VIGOR, Pilot-Commit), several seeds,
on the main job.

  python -m launch.bench_data_efficiency --record_dir=benchmarks/results
  python -m launch.bench_data_efficiency --methods=replay,dapo+replay
  python -m launch.bench_data_efficiency --methods=none,vigor,pilot_commit
  python -m launch.bench_data_efficiency --quick      # 1 seed, tiny config
  python -m launch.bench_data_efficiency --override=task.kwargs.max_digits=3

``--override`` (repeatable) sets a config field of every run: with
``task.kwargs.max_digits=3`` the warmed-up policy has easy, medium and
unsolved prompts (3-digit sums with carries), so methods that skip or
re-weight prompts have room to differ.

Each (method, seed) is the README's main job (``configs/arithmetic_grpo.py``:
SFT warm-up, then 400 GRPO steps on 1-2 digit arithmetic, where the warmed-up
policy solves most prompts and a quarter to three quarters of the groups
have zero reward variance) with ``rl.selection.name`` set and held-out
accuracy measured every ``--eval_every`` steps. Runs go one after the other
in subprocesses (``python -m launch.train``, one CPU device, the user's XLA
flags). It writes:

* per method, held-out accuracy (sampled, 512 problems) against cumulative
  sampled tokens (every round's, the dropped groups' too) and against the
  RL phase's wall clock, mean +- std over seeds;
* ``<record_dir>/bench_data_efficiency-<commit>.png`` (or the workdir's):
  accuracy vs tokens and vs seconds, one curve per method;
* the sampled tokens each method needed to first reach ``--target``
  accuracy (seeds that never reach it are counted apart).

Methods are compared at the same number of updates (``rl.num_steps``), so a
method that samples more per update shows it on the token and clock axes.
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags

from launch import benchlib, local_cluster
from launch.data_efficiency import curve, method_flags, plot, summarize

_METHODS = flags.DEFINE_list(
    "methods", ["none", "dapo", "greso"], "rl.selection.name values (dots too) ('none': "
    "baseline), rl.allocation.name values (vigor, pilot_commit, sgpo), or "
    "an allocation joined with a selection ('vigor+dapo'), each optionally "
    "joined with '+replay' ('replay' alone: the baseline with rollout "
    "replay)")
_REPLAY = flags.DEFINE_float("replay_fraction", 0.25, "rl.replay.fraction of "
                             "the methods with '+replay'")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds per method")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "held-out evaluation "
                                   "every this many RL steps")
_TARGET = flags.DEFINE_float("target", 0.88, "the accuracy the tokens-to-"
                             "target table reads")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "FIELD=VALUE: --config.FIELD=VALUE for every run, e.g. "
    "task.kwargs.max_digits=3 (repeatable)")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed of the tiny config, 6 "
                           "steps (the tests' smoke run)")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the runs go (default: "
                               "a new temporary directory)")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "", "where the JSON record and the PNG go "
    "(benchmarks/results to keep them); default: the workdir")



def _args(method: str, seed: int, workdir: str, quick: bool,
          eval_every: int) -> list[str]:
  config = "configs/arithmetic_grpo.py" + (":tiny" if quick else "")
  args = [f"--config={config}", f"--workdir={workdir}",
          f"--config.seed={seed}", *method_flags(method, _REPLAY.value),
          f"--config.eval.every={eval_every}"]
  if quick:
    args += ["--config.rl.num_steps=6", "--config.sft.num_steps=20"]
  return args + [f"--config.{o}" for o in _OVERRIDES.value]


def check_overrides(overrides: list[str]) -> None:
  """``FIELD=VALUE`` each, the field not already set by the bench."""
  for o in overrides:
    field, eq, _ = o.partition("=")
    if not eq or not field or field.startswith("-"):
      raise app.UsageError(f"--override={o!r}: FIELD=VALUE is accepted, "
                           "e.g. task.kwargs.max_digits=3 (no '--config.').")
    if field in ("seed", "eval.every") or field.startswith(
        ("rl.selection.name", "rl.allocation.name", "rl.replay.fraction")):
      raise app.UsageError(f"--override={o!r}: {field} is set by the bench "
                           "(--seeds, --eval_every, --methods, "
                           "--replay_fraction).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  check_overrides(_OVERRIDES.value)
  for method in _METHODS.value:  # refused before any run
    try:
      method_flags(method, _REPLAY.value)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  quick = _QUICK.value
  seeds = [0] if quick else [int(s) for s in _SEEDS.value]
  eval_every = 2 if quick else _EVAL_EVERY.value
  base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-data-")
  # One CPU device, as the user's main job; the caller's other XLA flags
  # are kept (the tests' fast code generation reaches the runs).
  env = local_cluster.child_env(1, platform="")
  curves: dict[str, list[dict]] = {}
  for method in _METHODS.value:
    for seed in seeds:
      workdir = os.path.join(base, f"{method}_seed{seed}")
      args = _args(method, seed, workdir, quick, eval_every)
      print(f"{method} seed {seed} ...", flush=True)
      start = time.time()
      benchlib.run_train(args, env, f"{method} seed {seed}")
      c = curve(workdir)
      c["wall_s"] = time.time() - start
      curves.setdefault(method, []).append(c)
      print(f"  {c['accuracy'][0]:.3f} -> {c['accuracy'][-1]:.3f} held-out, "
            f"{c['tokens'][-1] / 1e6:.2f} M sampled tokens, RL "
            f"{c['seconds'][-1]:.0f} s (run {c['wall_s']:.0f} s)", flush=True)
  target = _TARGET.value
  summary = summarize(curves, target)
  print(f"\n{'method':<8} {'before':>7} {'after':>13} {'gain':>13} "
        f"{'tokens (M)':>10} {'RL s':>6} {'to ' + format(target, '.0%'):>18}")
  for method, s in summary.items():
    acc = s["accuracy"]["mean"]
    to = (f"{s['tokens_to_target_mean'] / 1e6:.2f} M ({s['seeds_reaching_target']}"
          f"/{len(seeds)})" if s["tokens_to_target_mean"] is not None
          else f"never (0/{len(seeds)})")
    print(f"{method:<8} {acc[0]:7.3f} {s['final_accuracy_mean']:7.3f}+-"
          f"{s['final_accuracy_std']:.3f} {s['gain_mean'] * 100:+7.1f}+-"
          f"{s['gain_std'] * 100:.1f} {s['tokens_total_mean'] / 1e6:10.2f} "
          f"{s['seconds_total_mean']:6.0f} {to:>18}")
  out_dir = _RECORD_DIR.value or base
  os.makedirs(out_dir, exist_ok=True)
  commit = benchlib.git("rev-parse", "HEAD")[:12] or "unknown"
  png = os.path.join(out_dir, f"bench_data_efficiency-{commit}.png")
  plot(summary, png, target, tuple(_OVERRIDES.value))
  print("plot:", png)
  figures = {"summary": summary, "curves": curves, "target": target,
             "quick": quick, "seeds": seeds}
  print("record:", benchlib.write_record(
      "bench_data_efficiency" + ("_quick" if quick else ""), figures,
      out_dir, {"methods": _METHODS.value, "eval_every": eval_every,
                "replay_fraction": _REPLAY.value,
                "overrides": _OVERRIDES.value,
                "args": _args("none", 0, "<workdir>", quick, eval_every)}))


if __name__ == "__main__":
  app.run(main)
