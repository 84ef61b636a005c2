"""The README as a new user reads it: its snippets run, its commands' flags
exist, every record it cites is in the repository, its generated tables are
their records', and the main job's seed-0 row reproduces."""

import glob
import itertools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from launch import benchlib, reproduce_readme
from tests import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
# The guides moved out of the README (docs/guides/): their records and
# commands are checked with the README's.
GUIDES = "\n".join(open(p, encoding="utf-8").read() for p in sorted(
    glob.glob(os.path.join(ROOT, "docs", "guides", "*.md"))))


def _blocks(language, text=README):
  return [m.group(1) for m in re.finditer(rf"```{language}\n(.*?)```",
                                          text, re.S)]


def _expand_braces(pattern):
  """``a{b,c}d`` -> ``[abd, acd]`` (the shell's brace expansion)."""
  parts = re.split(r"\{([^{}]*)\}", pattern)
  choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*choices)]


# --- records ------------------------------------------------------------------

RECORD = re.compile(r"[\w{},*.\-]+-(?:[0-9a-f]{12}|\{[0-9a-f,]+\})\.json")


def test_every_record_the_readme_cites_exists():
  cited = set(RECORD.findall(README + GUIDES))
  assert len(cited) > 10, cited  # the pattern finds the README's records
  missing = []
  for name in sorted(cited):
    for pattern in _expand_braces(name):
      if not glob.glob(os.path.join(ROOT, "benchmarks", "results", pattern)):
        missing.append(pattern)
  assert not missing, missing


def test_brace_expansion_of_record_names():
  assert _expand_braces("{a,b}_seed{0,1}-x.json") == [
      "a_seed0-x.json", "a_seed1-x.json", "b_seed0-x.json", "b_seed1-x.json"]


def test_generated_tables_are_their_records():
  """Each ``<!-- reproduce:NAME -->`` block is exactly what
  ``launch.reproduce_readme --tables_only --commit=<its commit>`` writes."""
  names = re.findall(r"<!-- reproduce:(\w+) -->", README + GUIDES)
  assert {"main", "ppo", "lora", "demos"} <= set(names)
  for name in names:
    block = reproduce_readme.block_pattern(name).search(
        README + GUIDES).group(2)
    commit = re.search(r"--jobs=\w+` at ([0-9a-f]{12})", block).group(1)
    assert block == reproduce_readme.render(reproduce_readme.JOBS[name],
                                            commit), name


def _readme_row(name, seed):
  block = reproduce_readme.block_pattern(name).search(README).group(2)
  for line in block.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] == str(seed):
      return cells
  raise AssertionError(f"no seed {seed} row in the {name} table")


def _cpus_that_gave_the_seed_0_row():
  """The CPUs (``benchlib.cpu``) of the main job's seed-0 records whose
  accuracies, greedy ones included, are the README's seed-0 row: the CPUs on
  which the row is known to come out to the digit."""
  _, before, after, _, greedy, _ = _readme_row("main", 0)
  cpus = []
  for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results",
                                            "train_seed0-*.json"))):
    with open(path) as f:
      record = json.load(f)
    cpu = record.get("machine", {}).get("cpu")
    cells = reproduce_readme.row_cells(record["figures"])
    if (cpu and cpu not in cpus and (cells["before"], cells["after"],
                                     cells.get("greedy")) == (before, after,
                                                              greedy)):
      cpus.append(cpu)
  return cpus


def test_the_seed_0_row_names_the_cpu_of_its_table():
  """The main table's own record is among the CPUs the seed-0 check runs on
  (its record names its CPU, and its figures are the row)."""
  block = reproduce_readme.block_pattern("main").search(README).group(2)
  commit = re.search(r"train_seed\*-([0-9a-f]{12})\.json", block).group(1)
  with open(os.path.join(ROOT, "benchmarks", "results",
                         f"train_seed0-{commit}.json")) as f:
    measured_on = json.load(f)["machine"]["cpu"]
  assert measured_on in _cpus_that_gave_the_seed_0_row()


@pytest.mark.slow
def test_the_main_job_seed_0_row_reproduces(tmp_path):
  """``python -m launch.train`` (the README's command, seed 0) gives the
  README's seed-0 row to the digit: held-out accuracy before and after RL,
  sampled and greedy. It runs on every CPU whose seed-0 record in
  ``benchmarks/results`` gave that row (the table's own and those the
  README's note names); on another CPU float results differ and the row
  cannot reproduce to the digit: skipped, saying so (``benchlib.cpu``)."""
  cpus = _cpus_that_gave_the_seed_0_row()
  if benchlib.cpu() not in cpus:
    pytest.skip(f"the README's seed-0 row was measured on {cpus}; this "
                f"machine's CPU is {benchlib.cpu()}: XLA:CPU's float "
                "results differ between CPUs, so sampled runs do too")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, as the README's runs
  proc = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path / 'run'}",
       f"--record_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [record] = glob.glob(str(tmp_path / "train_seed0-*.json"))
  with open(record) as f:
    figures = json.load(f)["figures"]
  b, a = figures["before"], figures["after"]
  _, before, after, _, greedy, _ = _readme_row("main", 0)

  def pct(x):
    return f"{100 * x:.1f}%"
  assert (pct(b["eval/accuracy"]), pct(a["eval/accuracy"])) == (before, after)
  assert (f"{pct(b['eval/greedy_accuracy'])} -> "
          f"{pct(a['eval/greedy_accuracy'])}") == greedy


# --- snippets -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_snippets_run_as_pasted(tmp_path, index):
  """Each python block runs in a fresh interpreter outside the repository
  (except those reading the run of the README's commands, ``/tmp/demo``:
  ``tests/test_launchers.py`` loads such an export in transformers)."""
  code = _blocks("python")[index]
  if "/tmp/demo" in code:
    pytest.skip("reads the finished run of the README's commands")
  proc = subprocess_env.run_as_pasted(code, tmp_path)
  assert proc.returncode == 0, code + "\n" + proc.stderr[-3000:]


def _commands():
  """``(module, [tokens])`` of every ``python -m launch.*`` in bash blocks."""
  out = []
  for block in _blocks("bash", README + GUIDES):
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
      line = line.split(" #")[0].strip()
      m = re.match(r"(?:.*?\s)?python -m (launch\.\w+)(.*)", line)
      if m and not line.startswith("#"):
        tokens = shlex.split(m.group(2).replace("$", "_").replace("\"", ""))
        if "--" in tokens:  # local_cluster: what follows is launch.train's
          out.append(("launch.train", tokens[tokens.index("--") + 1:]))
          tokens = tokens[:tokens.index("--")]
        out.append((m.group(1), tokens))
  return out


def test_the_readme_has_launcher_commands():
  modules = {m for m, _ in _commands()}
  assert {"launch.train", "launch.evaluate", "launch.sample"} <= modules


def _config(tokens):
  """The config a ``launch.train`` command reads, its overrides applied
  by name only (the check is that each field exists)."""
  sys.path.insert(0, ROOT)
  import configs  # pylint: disable=import-outside-toplevel
  path, arg = configs.path("arithmetic_grpo"), None
  for t in tokens:
    if t.startswith("--config="):
      file, _, arg = t.removeprefix("--config=").partition(":")
      path = os.path.join(ROOT, file)
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("readme_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg or None)


@pytest.mark.parametrize("index", range(len(_commands())))
def test_every_config_field_a_readme_command_sets_exists(index):
  module, tokens = _commands()[index]
  if module != "launch.train" or any("..." in t for t in tokens):
    pytest.skip("not a launch.train command with a concrete config")
  config = _config(tokens)
  for t in tokens:
    if t.startswith("--config."):
      node = config
      for part in t.removeprefix("--config.").split("=")[0].split("."):
        assert part in node, (t, sorted(node.keys()))
        node = node[part]


@pytest.mark.slow
def test_every_launcher_flag_a_readme_command_uses_exists():
  by_module = {}
  for module, tokens in _commands():
    names = {t.removeprefix("--").split("=")[0] for t in tokens
             if t.startswith("--") and not t.startswith("--config.")}
    by_module.setdefault(module, set()).update(names - {""})
  for module, names in by_module.items():
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}; from absl import flags; "
         "print('\\n'.join(flags.FLAGS))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    defined = set(proc.stdout.split())
    assert names <= defined, (module, names - defined)


# --- the reproduction script ---------------------------------------------------

def _record(root, stem, commit, before, after, seconds=100.0):
  path = os.path.join(root, "benchmarks", "results", f"{stem}-{commit}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"figures": {
        "before": {"eval/accuracy": before[0], "eval/greedy_accuracy": before[1]},
        "after": {"eval/accuracy": after[0], "eval/greedy_accuracy": after[1]},
        "seconds": seconds}}, f)


def test_tables_render_from_hand_written_records(tmp_path):
  commit = "0123456789ab"
  for seed, (b, a) in enumerate([(0.5, 0.75), (0.25, 0.5), (0.125, 0.25)]):
    _record(str(tmp_path), f"train_seed{seed}", commit, (b, 0.9), (a, 0.95),
            seconds=300.4)
    _record(str(tmp_path), f"calculator_grpo_seed{seed}", commit, (b, 0.5),
            (a, 1.0))
    _record(str(tmp_path), f"guess_number_grpo_seed{seed}", commit, (b, 0.5),
            (b, 0.5))
  main = reproduce_readme.render(reproduce_readme.JOBS["main"], commit,
                                 str(tmp_path)).splitlines()
  assert main[2] == ("| 0 | 50.0% | 75.0% | +25.0 points | 90.0% -> 95.0% | "
                     "300 s |")
  assert main[4].startswith("| 2 | 12.5% | 25.0% | +12.5 points |")
  demos = reproduce_readme.render(reproduce_readme.JOBS["demos"], commit,
                                  str(tmp_path)).splitlines()
  assert demos[0].startswith("| demo | seed 0 |")
  # gains +25, +25, +12.5: mean 20.8; guess: no gain at all.
  assert demos[2] == ("| calculator | 50.0% -> 75.0% | 25.0% -> 50.0% | "
                      "12.5% -> 25.0% | **+20.8** (+12.5 to +25.0) points |")
  assert demos[3].endswith("| **+0.0** (+0.0 to +0.0) points |")
  assert "calculator 50.0/50.0/50.0% -> 100.0/100.0/100.0%" in demos[5]


def test_a_missing_record_or_block_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"train_seed0-0123456789ab"):
    reproduce_readme.render(reproduce_readme.JOBS["main"], "0123456789ab",
                            str(tmp_path))
  with pytest.raises(ValueError, match=r"reproduce:ppo"):
    reproduce_readme.rewrite("<!-- reproduce:main -->\nx\n"
                             "<!-- /reproduce:main -->", "ppo", "y")
  text = "a\n<!-- reproduce:main -->\nold\n<!-- /reproduce:main -->\nb"
  assert reproduce_readme.rewrite(text, "main", "new") == (
      "a\n<!-- reproduce:main -->\nnew\n<!-- /reproduce:main -->\nb")


def test_a_half_written_record_is_named(tmp_path):
  _record(str(tmp_path), "train_seed0", "0123456789ab", (0.5, 0.9), (0.75, 0.95))
  path = tmp_path / "benchmarks" / "results" / "train_seed0-0123456789ab.json"
  path.write_text(path.read_text()[:40])
  with pytest.raises(ValueError, match=r"train_seed0-0123456789ab.json is not "
                     r"a complete record"):
    reproduce_readme.render(reproduce_readme.JOBS["main"], "0123456789ab",
                            str(tmp_path))
