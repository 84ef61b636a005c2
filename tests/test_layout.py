"""The repository's own rules, checked on its source (docs/architecture.md):
no import cycle in ``rljax/``, config defaults in one place, a short loop,
code that cites only files inside the repository."""

import ast
import os
import pathlib
import re

import pytest

from rljax.train import schema

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rljax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, modules) -> set[str]:
  """The rljax modules ``path`` imports (any depth: a cycle through a
  function-level import is still a cycle)."""
  out = set()
  package = _module_name(path) if path.name == "__init__.py" else (
      _module_name(path).rpartition(".")[0])
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
               for a in node.names]
    else:
      continue
    out.update(n for n in names if n in modules)
  return out


def _cycle(graph):
  """One import cycle of ``graph`` (a list of modules), or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_rljax_has_no_import_cycle():
  modules = _modules()
  # A package's __init__ re-exports its modules; a module importing its own
  # package's __init__ would close a cycle, and is counted.
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def _reach(graph, start):
  """Every module ``start`` imports, directly or through others."""
  seen, todo = set(), [start]
  while todo:
    for nxt in graph[todo.pop()] - seen:
      seen.add(nxt)
      todo.append(nxt)
  return seen


def _third_party(path: pathlib.Path) -> set[str]:
  """The top-level names of the modules outside rljax that ``path`` imports
  (at any depth of the file)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split(".")[0])
  return out - {"rljax"}


def test_the_rollout_engine_is_below_the_trainer_and_envs_free_of_jax():
  """``rljax.rollout`` imports nothing of ``rljax.train``, directly or
  through another module (the trainer hands it what it needs), and
  ``rljax.envs``, which environment workers import, reaches no module that
  imports JAX (docs/architecture.md, Layers)."""
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  rollout = [m for m in modules if m.split(".")[:2] == ["rljax", "rollout"]]
  assert len(rollout) >= 8, rollout
  for m in rollout:
    up = sorted(n for n in _reach(graph, m) if n.startswith("rljax.train"))
    assert not up, (m, up)
  for m in [m for m in modules if m.split(".")[:2] == ["rljax", "envs"]]:
    with_jax = sorted(n for n in _reach(graph, m) | {m}
                      if {"jax", "flax", "optax"} & _third_party(modules[n]))
    assert not with_jax, (m, with_jax)


def test_the_reach_finds_an_import_two_steps_away():
  assert _reach({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}


# Receivers that hold a config or one of its sections.
SECTION = re.compile(r"\b(config|rl|opt|optimizer|sampler|critic|teacher|task|"
                     r"tokenizer|model|rewards|eval|checkpoint|sft|mesh)\b")


def _field_gets(path: pathlib.Path):
  """``x.get("<name>", default)`` calls whose name is a config field's."""
  names = {k.rpartition(".")[2] for k in schema.fields()}
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get" and node.args
        and SECTION.search(ast.unparse(node.func.value))
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in names and len(node.args) == 2):
      yield f"{path.relative_to(ROOT)}:{node.lineno} .get({node.args[0].value!r}, ...)"


def test_no_config_default_is_restated_outside_the_schema():
  found = [hit for p in (PACKAGE / "train").glob("*.py")
           for hit in _field_gets(p)]
  assert not found, found


def test_the_default_finder_finds_a_restated_default(tmp_path):
  path = ROOT / "tests" / "_layout_probe.py"
  path.write_text("x = rl.get('max_log_ratio', 20.0)\n")
  try:
    assert len(list(_field_gets(path))) == 1
  finally:
    path.unlink()


def test_the_loop_is_short():
  lines = (PACKAGE / "train" / "loop.py").read_text().count("\n")
  assert lines <= 250, lines


CITED = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w.-]+\.(?:md|py|ipynb))\b")


@pytest.mark.parametrize("path", sorted(
    str(p.relative_to(ROOT)) for p in list(PACKAGE.rglob("*.py"))
    + list((ROOT / "launch").glob("*.py")) + list((ROOT / "configs").glob("*.py"))))
def test_code_cites_only_files_inside_the_repository(path):
  text = (ROOT / path).read_text()
  assert "shared/" not in text and "DESIGN.md" not in text, path
  for cited in set(CITED.findall(text)):
    if "/" not in cited:
      continue  # a bare module name (``steps.py``) refers to its package
    if cited.startswith(("http", "www.")) or "://" in cited:
      continue
    exists = (ROOT / cited).exists() or any(
        (ROOT / d / cited).exists() for d in ("rljax", "rljax/train"))
    if not exists and os.path.isabs(cited):
      continue
    assert exists or not cited.startswith(("docs/", "rljax/", "tests/",
                                           "launch/", "configs/", "colabs/",
                                           "research/")), (path, cited)


def _missing_test_imports(paths, root=ROOT) -> list[str]:
  """``from tests.x import name`` statements (at any depth, so a
  function-level import counts) whose name ``tests/x.py`` does not define
  at its top level: a renamed helper breaks only the tests that import it,
  which a subset run does not catch."""
  defined = {}
  missing = []
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(node, ast.ImportFrom) and node.module
              and node.module.startswith("tests.")):
        continue
      source = root / (node.module.replace(".", "/") + ".py")
      if source not in defined:
        names = set()
        for top in ast.parse(source.read_text()).body if source.exists() else ():
          if isinstance(top, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(top.name)
          elif isinstance(top, (ast.Assign, ast.AnnAssign)):
            targets = top.targets if isinstance(top, ast.Assign) else [top.target]
            names |= {n.id for t in targets for n in ast.walk(t)
                      if isinstance(n, ast.Name)}
          elif isinstance(top, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in top.names}
        defined[source] = names
      missing += [f"{path.relative_to(root)}:{node.lineno} {node.module}."
                  f"{a.name}" for a in node.names
                  if a.name not in defined[source]]
  return missing


def test_every_helper_a_test_imports_from_another_exists():
  assert _missing_test_imports(sorted((ROOT / "tests").rglob("*.py"))) == []


def test_the_test_import_checker_finds_a_renamed_helper(tmp_path):
  (tmp_path / "tests").mkdir()
  (tmp_path / "tests" / "test_a.py").write_text(
      "T = 3\ndef decode_loops():\n  pass\n")
  user = tmp_path / "tests" / "test_b.py"
  user.write_text("def test():\n  from tests.test_a import T, _decode_loops\n")
  assert _missing_test_imports([user], tmp_path) == [
      "tests/test_b.py:2 tests.test_a._decode_loops"]
