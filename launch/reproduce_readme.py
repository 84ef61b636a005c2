r"""Re-runs the README's CPU figures and rewrites its tables from the records.

  python -m launch.reproduce_readme --jobs=main          # 3 seeds, ~15 min
  python -m launch.reproduce_readme --jobs=main,ppo,demos,schedules
  python -m launch.reproduce_readme --tables_only        # this commit's records
  python -m launch.reproduce_readme --tables_only --commit=ee6075d27abb
  python -m launch.reproduce_readme --list               # the jobs, commands
  python -m launch.reproduce_readme --jobs=benches       # the bench_*.py records

Each job runs its launcher commands one after another (never in parallel:
they are timed), each writing a record to ``benchmarks/results/`` named
after the config, the seed and the commit. Its table in README.md lies
between ``<!-- reproduce:NAME -->`` and ``<!-- /reproduce:NAME -->``; the
script rewrites that block from the records of one commit (HEAD's unless
``--commit``), with the command and the record names under the table.
Run it on a clean checkout (a dirty tree is refused: its records would
name a commit that did not make them) and on a quiet machine. The
``benches`` job runs the ``launch/bench_*.py`` scripts of the README's
Benchmarks table, whose rows are prose around the figures: they are updated
by hand from the new records. ``tests/test_readme.py`` checks that every
record the README cites exists, that each block equals its records and that
the seed-0 row of the main job reproduces.
"""

from __future__ import annotations

import dataclasses
import json
import glob
import os
import re
import shutil
import subprocess
import sys

from absl import app, flags

from launch import benchlib, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join("benchmarks", "results")
SEEDS = (0, 1, 2)

_JOBS = flags.DEFINE_list("jobs", ["main"], "the jobs to run (see --list)")
_TABLES_ONLY = flags.DEFINE_bool(
    "tables_only", False, "rewrite the tables from existing records only")
_COMMIT = flags.DEFINE_string(
    "commit", None, "the records' commit (12 hex digits; default HEAD)")
_LIST = flags.DEFINE_bool("list", False, "list the jobs and their commands")
_README = flags.DEFINE_string("readme", README, "the README to rewrite")


@dataclasses.dataclass(frozen=True)
class Run:
  """One launcher command and the record stem it writes.

  Attributes:
    label: the row's name in the table (``seed 0``, ``calculator``, ...).
    stem: the record's name before ``-<commit>.json``.
    flags: ``launch.train`` flags (``--record_dir`` is added).
  """

  label: str
  stem: str
  flags: tuple[str, ...]
  module: str = "launch.train"

  @property
  def command(self) -> str:
    return " ".join((f"python -m {self.module}",) + self.flags)


@dataclasses.dataclass(frozen=True)
class Job:
  """A README table: its runs and how a table is drawn from their records."""

  name: str
  runs: tuple[Run, ...]
  render: str  # "seeds" (one row per seed), "grid" (row x seed) or "" (none)
  what: str
  row_header: str = ""  # the first column's name in a grid


def _seed_runs(stem: str, *flags_: str) -> tuple[Run, ...]:
  return tuple(Run(f"{s}", f"{stem}_seed{s}", flags_ + (f"--config.seed={s}",))
               for s in SEEDS)


# The main job with rank-16 adapters on every projection: LoRA takes a
# larger step than full fine-tuning (1.5e-4).
LORA_FLAGS = ("--config.model.lora.rank=16", "--config.model.lora.alpha=32",
              "--config.optimizer.learning_rate=1e-3")

JOBS = {
    "main": Job("main", _seed_runs("train"), "seeds",
                "the main job, configs/arithmetic_grpo.py"),
    "lora": Job("lora", _seed_runs("train_lora16", *LORA_FLAGS), "seeds",
                "the main job training LoRA adapters of rank 16"),
    "ppo": Job("ppo", _seed_runs("arithmetic_ppo",
                                 "--config=configs/arithmetic_ppo.py"),
               "seeds", "PPO with a critic, configs/arithmetic_ppo.py"),
    "schedules": Job(
        "schedules",
        tuple(Run(f"{label}|{s}", f"{stem}_seed{s}", extra +
                  (f"--config.seed={s}",))
              for label, stem, extra in (
                  ("synchronous", "train", ()),
                  ("`max_staleness=1`", "train_async1",
                   ("--config.rl.max_staleness=1",)),
                  ("`rollout=partial`", "train_partial",
                   ("--config.rl.rollout=partial",)))
              for s in SEEDS), "grid",
        "the main job with each rollout schedule", "schedule"),
    "demos": Job(
        "demos",
        tuple(Run(f"{label}|{s}", f"{demo}_seed{s}",
                  (f"--config=configs/{demo}.py", f"--config.seed={s}"))
              for label, demo in (("calculator", "calculator_grpo"),
                                  ("guess the number", "guess_number_grpo"))
              for s in SEEDS), "grid",
        "the multi-turn environment demos", "demo"),
    # The benchmark scripts write their records; their README rows are
    # prose around the figures, rewritten by hand from the new records.
    "benches": Job(
        "benches",
        tuple(Run(module.removeprefix("launch."), module, flags_, module)
              for module, flags_ in (
                  ("launch.bench_sampler", ("--repeats=2",
                                            "--no_cache_baseline=false")),
                  ("launch.bench_train_step", ("--compare_torch",
                                               "--remat_sweep",
                                               "--padding_free")),
                  ("launch.bench_rl_step", ("--compare_trl",)),
                  ("launch.bench_model", ()),
                  ("launch.bench_memory", ()),
                  ("launch.bench_envs", ()),
                  ("launch.bench_rollout", ()))), "",
        "the benchmark scripts of the README's Benchmarks table"),
}


def head_commit() -> str:
  return benchlib.git("rev-parse", "HEAD")[:12]


def dirty() -> bool:
  return bool(benchlib.git("status", "--porcelain", "--untracked-files=no"))


def record_path(run: Run, commit: str, root: str = ROOT) -> str:
  return os.path.join(root, RESULTS, f"{run.stem}-{commit}.json")


def load_figures(run: Run, commit: str, root: str = ROOT) -> dict:
  path = record_path(run, commit, root)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"no record {os.path.relpath(path, root)}: run `python -m "
        f"launch.reproduce_readme --jobs=...` at commit {commit} first.")
  try:
    with open(path) as f:
      return json.load(f)["figures"]
  except (ValueError, KeyError) as e:  # half-written, or not a record
    raise ValueError(f"{os.path.relpath(path, root)} is not a complete "
                     f"record ({type(e).__name__}: {e}): re-run its job.") from e


def percent(x: float) -> str:
  return f"{100 * x:.1f}%"


def row_cells(figures: dict) -> dict[str, str]:
  """A run's figures as the README prints them."""
  b, a = figures["before"], figures["after"]
  cells = {"before": percent(b["eval/accuracy"]),
           "after": percent(a["eval/accuracy"]),
           "gain": f"{100 * (a['eval/accuracy'] - b['eval/accuracy']):+.1f} points",
           "seconds": f"{figures['seconds']:.0f} s"}
  if "eval/greedy_accuracy" in b and "eval/greedy_accuracy" in a:
    cells["greedy"] = (f"{percent(b['eval/greedy_accuracy'])} -> "
                       f"{percent(a['eval/greedy_accuracy'])}")
  return cells


def render(job: Job, commit: str, root: str = ROOT) -> str:
  """The markdown block of ``job`` from its records at ``commit``."""
  lines = []
  if job.render == "seeds":
    lines += ["| seed | before RL | after RL | gain | greedy, before -> after "
              "| wall clock (incl. compiles) |",
              "|---|---|---|---|---|---|"]
    for run in job.runs:
      c = row_cells(load_figures(run, commit, root))
      lines.append(f"| {run.label} | {c['before']} | {c['after']} | "
                   f"{c['gain']} | {c.get('greedy', '-')} | {c['seconds']} |")
  else:
    rows: dict[str, list[tuple[dict, dict]]] = {}
    for run in job.runs:
      label = run.label.split("|")[0]
      figures = load_figures(run, commit, root)
      rows.setdefault(label, []).append((row_cells(figures), figures))
    lines += [f"| {job.row_header} | seed 0 | seed 1 | seed 2 | gain: mean "
              "(range) |", "|---|---|---|---|---|"]
    greedy = []
    for label, cells in rows.items():
      gains = [100 * (f["after"]["eval/accuracy"]
                      - f["before"]["eval/accuracy"]) for _, f in cells]
      seeds = " | ".join(f"{c['before']} -> {c['after']}" for c, _ in cells)
      lines.append(f"| {label} | {seeds} | **{sum(gains) / len(gains):+.1f}** "
                   f"({min(gains):+.1f} to {max(gains):+.1f}) points |")
      if all("greedy" in c for c, _ in cells):
        before = "/".join(c["greedy"].split(" -> ")[0].rstrip("%")
                          for c, _ in cells)
        after = "/".join(c["greedy"].split(" -> ")[1].rstrip("%")
                         for c, _ in cells)
        greedy.append(f"{label} {before}% -> {after}%")
    if greedy:
      lines += ["", f"Greedy, seeds 0/1/2: {'; '.join(greedy)}."]
  stems = sorted({re.sub(r"_seed\d+$", "_seed*", r.stem) for r in job.runs})
  lines += ["", f"(`python -m launch.reproduce_readme --jobs={job.name}` at "
            f"{commit}: {job.what}, `python -m launch.train [flags] "
            f"--config.seed=N --record_dir={RESULTS}` for each row; records "
            + ", ".join(f"`{RESULTS}/{s}-{commit}.json`" for s in stems)
            + ".)"]
  return "\n".join(lines)


def guides() -> list[str]:
  """The guides (``docs/guides/*.md``), which hold tables moved out of the
  README."""
  return sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))


def block_pattern(name: str) -> re.Pattern:
  return re.compile(rf"(<!-- reproduce:{re.escape(name)} -->\n)(.*?)"
                    rf"(\n?<!-- /reproduce:{re.escape(name)} -->)", re.S)


def rewrite(text: str, name: str, block: str) -> str:
  """``text`` with the ``name`` block replaced by ``block``.

  Raises:
    ValueError: the README has no such block.
  """
  pattern = block_pattern(name)
  if not pattern.search(text):
    raise ValueError(f"README.md has no <!-- reproduce:{name} --> ... "
                     f"<!-- /reproduce:{name} --> block.")
  return pattern.sub(lambda m: m.group(1) + block + m.group(3), text, count=1)


def run_job(job: Job) -> None:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
  for run in job.runs:
    command = [sys.executable, "-m", run.module, *run.flags,
               f"--record_dir={RESULTS}"]
    if run.module == "launch.train":
      workdir = os.path.join("/tmp", "rljax_reproduce", run.stem)
      shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume
      command.append(f"--workdir={workdir}")
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def main(argv):
  del argv
  if _LIST.value:
    for job in JOBS.values():
      print(f"{job.name}: {job.what}")
      for run in job.runs:
        print(f"  {run.command}")
    return
  unknown = [j for j in _JOBS.value if j not in JOBS]
  if unknown:
    raise app.UsageError(f"--jobs={','.join(_JOBS.value)}: unknown "
                         f"{unknown}; accepted {sorted(JOBS)}.")
  commit = _COMMIT.value or head_commit()
  if not commit:
    raise app.UsageError("no commit: run it in a git checkout or give --commit.")
  tables = [name for name in _JOBS.value if JOBS[name].render]
  texts = {}  # every block exists before any run, in the README or a guide
  for path in [_README.value] + guides():
    with open(path) as f:
      texts[path] = f.read()
  where = {}
  for name in tables:
    found = [p for p, t in texts.items() if block_pattern(name).search(t)]
    if not found:
      raise ValueError(f"{_README.value} and docs/guides/ have no "
                       f"<!-- reproduce:{name} --> ... <!-- /reproduce:{name}"
                       " --> block to rewrite.")
    where[name] = found[0]
  if not _TABLES_ONLY.value:
    if dirty():
      raise app.UsageError("the working tree has uncommitted changes: "
                           "commit them (records name HEAD's commit).")
    for name in _JOBS.value:
      run_job(JOBS[name])
  for name in tables:
    texts[where[name]] = rewrite(texts[where[name]], name,
                                 render(JOBS[name], commit))
  for path in sorted(set(where.values())):
    with open(path, "w") as f:
      f.write(texts[path])
  for name in tables:
    print(f"rewrote {name} in {where[name]} from the records at {commit}")
  for name in set(_JOBS.value) - set(tables):
    print(f"{name}: records in {RESULTS}/; update the README rows that cite "
          "them by hand")


if __name__ == "__main__":
  cli.run(main)
