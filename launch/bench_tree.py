r"""Tree rollouts against independent rows on the main job.

Each (method, seed) is the README's main job (``configs/arithmetic_grpo.py``:
SFT warm-up, then 400 RL steps on 1-2 digit arithmetic, ``G = 8`` rows per
prompt, 6 new tokens) with:

* ``grpo``: independent rows (``rl.rollout=static``), the README's job;
* ``tree``: the rows as a tree (``rl.rollout=tree``: 2 roots per prompt,
  forks after 2 and 4 tokens, each doubling the rows, new rows by
  uncertainty), GRPO's advantage;
* ``treepo``: the same trees with TreePO's subtree advantage
  (``rl.advantage=treepo``);
* ``latr``: LATR's lookahead trees (``rl.rollout=latr``: half of each
  group in the tree, the middle of the authors' mix-ratio schedule, the
  other half sampled; branching where the second candidate has p2 > 0.15
  and p1 - p2 > 0.25, the authors' scripts' thresholds; pruning branches
  that kept within 40% edits of their parent 2 and 4 tokens after their
  birth, the authors' 30 and 50 scaled to 6-token completions), GRPO's
  advantage.

``--task=calculator`` runs the same methods on the calculator demo
(``configs/calculator_grpo.py``: multi-turn episodes with a tool, 120 RL
steps, ``G = 8``): its trees fork between turns (``tree``, ``treepo``:
``rljax/rollout/episode_tree.py``; ``segment_tokens`` is not used) and
LATR's branches grow inside turns (``latr``:
``rljax/rollout/episode_latr.py``, the authors' lookahead of 30 and 50
tokens scaled to the same 2 and 4). Held-out success is the demo's
(sampled, 128 problems).

Runs go one after the other in subprocesses (``python -m launch.train``,
one CPU device). It prints, per method and over the seeds, held-out accuracy
before and after RL (sampled, 512 problems), the tokens the sampler decoded
(``num_generated_tokens``: a tree's shared segments once), the distinct
completions among the sampled rows (``rollout/distinct_completions``, per
group) and their ratio, the sampled tokens per distinct completion, and the
RL seconds; ``--record_dir`` keeps the record.

  python -m launch.bench_tree --record_dir=benchmarks/results
  python -m launch.bench_tree --quick        # 1 seed of the tiny config
  python -m launch.bench_tree --task=calculator --record_dir=benchmarks/results
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags
import numpy as np

from launch import benchlib, local_cluster

METHODS = {
    "grpo": [],
    "tree": ["--config.rl.rollout=tree", "--config.rl.tree.segment_tokens=2"],
    "treepo": ["--config.rl.rollout=tree", "--config.rl.tree.segment_tokens=2",
               "--config.rl.advantage=treepo"],
    "latr": ["--config.rl.rollout=latr", "--config.rl.latr.lookahead=(2, 4)",
             "--config.rl.latr.mix_ratio=0.5"],
}

TASKS = {"arithmetic": "configs/arithmetic_grpo.py",
         "calculator": "configs/calculator_grpo.py"}

_METHODS = flags.DEFINE_list("methods", list(METHODS), f"of {list(METHODS)}")
_TASK = flags.DEFINE_enum("task", "arithmetic", list(TASKS), "the main job "
                          "(arithmetic) or the calculator demo's episodes")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds per method")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", None, "held-out "
                                   "evaluation every this many RL steps "
                                   "(default: 100 arithmetic, 40 calculator)")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed of the tiny config, 4 "
                           "steps")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the runs go (default: "
                               "a new temporary directory)")
_RECORD_DIR = flags.DEFINE_string("record_dir", "", "where the JSON record "
                                  "goes (default: the workdir)")



def run_figures(workdir: str) -> dict:
  """A run's held-out accuracy before and after RL, and its RL phase's
  sampled tokens, distinct completions, rows and seconds."""
  rows = [json.loads(line) for line in open(
      os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  evals = [(r["step"], r["eval/accuracy"]) for r in rows
           if "eval/accuracy" in r]
  rl = [r for r in rows if r["step"] > 0 and "num_generated_tokens" in r]
  tokens = float(sum(r["num_generated_tokens"] for r in rl))
  distinct = float(sum(r["rollout/distinct_completions"] for r in rl))
  return {"before": evals[0][1], "after": evals[-1][1],
          "curve": evals, "tokens": tokens, "distinct": distinct,
          "tokens_per_distinct": tokens / max(distinct, 1.0),
          "tree_token_saving": float(np.mean(
              [r.get("rollout/tree_token_saving", 0.0) for r in rl])),
          # LATR's branches and the slots left to copies, per step.
          "latr_branches": float(np.mean(
              [r.get("latr/branches", 0.0) for r in rl])),
          "latr_copies": float(np.mean(
              [r.get("latr/copies", 0.0) for r in rl])),
          "rl_seconds": float(sum(r["time/step"] for r in rl))}


def summarize(runs: dict[str, list[dict]]) -> dict:
  """Mean and sample std over seeds of each figure, per method."""
  out = {}
  for method, figures in runs.items():
    ddof = 1 if len(figures) > 1 else 0
    out[method] = {k: {"mean": float(np.mean([f[k] for f in figures])),
                       "std": float(np.std([f[k] for f in figures],
                                           ddof=ddof))}
                   for k in ("before", "after", "tokens", "distinct",
                             "tokens_per_distinct", "tree_token_saving",
                             "latr_branches", "latr_copies",
                             "rl_seconds")}
    out[method]["after_by_seed"] = [f["after"] for f in figures]
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = [m for m in _METHODS.value if m not in METHODS]
  if unknown:
    raise app.UsageError(f"--methods: {unknown} unknown; accepted "
                         f"{list(METHODS)}.")
  quick = _QUICK.value
  seeds = [0] if quick else [int(s) for s in _SEEDS.value]
  base = _WORKDIR.value or tempfile.mkdtemp(prefix="rljax-bench-tree-")
  env = local_cluster.child_env(1, platform="")
  runs: dict[str, list[dict]] = {}
  eval_every = _EVAL_EVERY.value or (100 if _TASK.value == "arithmetic"
                                     else 40)
  for method in _METHODS.value:
    for seed in seeds:
      workdir = os.path.join(base, f"{method}_seed{seed}")
      args = [f"--config={TASKS[_TASK.value]}" + (":tiny" if quick else ""),
              f"--workdir={workdir}", f"--config.seed={seed}",
              f"--config.eval.every={2 if quick else eval_every}",
              *METHODS[method]]
      if quick:
        args += ["--config.rl.num_steps=4", "--config.sft.num_steps=20",
                 "--config.rl.tree.segment_tokens=2"]
      print(f"{method} seed {seed} ...", flush=True)
      start = time.time()
      benchlib.run_train(args, env, f"{method} seed {seed}")
      f = run_figures(workdir)
      f["wall_s"] = time.time() - start
      runs.setdefault(method, []).append(f)
      print(f"  {f['before']:.3f} -> {f['after']:.3f} held-out; "
            f"{f['tokens'] / 1e6:.3f} M sampled tokens, "
            f"{f['distinct'] / 1e3:.1f} k distinct completions, "
            f"{f['tokens_per_distinct']:.2f} tokens each; RL "
            f"{f['rl_seconds']:.0f} s", flush=True)
  summary = summarize(runs)
  base_m = summary.get("grpo")
  print(f"\n{'method':<7} {'before':>7} {'after':>14} {'tokens (M)':>11} "
        f"{'distinct (k)':>13} {'tok/distinct':>13} {'RL s':>6}")
  for method, s in summary.items():
    ratio = ("" if base_m is None or method == "grpo" else
             f"  ({s['tokens_per_distinct']['mean'] / base_m['tokens_per_distinct']['mean']:.2f}x grpo)")
    print(f"{method:<7} {s['before']['mean']:7.3f} "
          f"{s['after']['mean']:7.3f}+-{s['after']['std']:.3f} "
          f"{s['tokens']['mean'] / 1e6:11.3f} "
          f"{s['distinct']['mean'] / 1e3:13.1f} "
          f"{s['tokens_per_distinct']['mean']:13.2f} "
          f"{s['rl_seconds']['mean']:6.0f}{ratio}")
  out_dir = _RECORD_DIR.value or base
  os.makedirs(out_dir, exist_ok=True)
  name = "bench_tree" + ("" if _TASK.value == "arithmetic"
                         else f"_{_TASK.value}")
  print("record:", benchlib.write_record(
      name + ("_quick" if quick else ""),
      {"summary": summary, "runs": runs, "seeds": seeds, "quick": quick},
      out_dir, {"methods": _METHODS.value, "flags": METHODS,
                "task": _TASK.value, "eval_every": eval_every}))


if __name__ == "__main__":
  app.run(main)
