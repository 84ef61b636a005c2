"""The documentation site (mkdocs.yml, docs/): it builds with warnings as
errors, its API reference comes from the docstrings, every page is in its
navigation, and its python blocks run as pasted."""

import glob
import os
import re
import subprocess
import sys

import pytest

from tests import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                         recursive=True))


def _python_blocks():
  out = []
  for path in PAGES:
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
      indent = len(m.group(1))
      code = "\n".join(line[indent:] for line in m.group(2).splitlines())
      out.append((os.path.relpath(path, ROOT), code))
  return out


def test_the_site_builds_with_warnings_as_errors(tmp_path):
  pytest.importorskip("mkdocstrings")
  site = tmp_path / "site"
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
       str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  api = (site / "api" / "advantages" / "index.html").read_text()
  # The reference is the docstrings': a function and a sentence of its doc.
  assert "scale_by_group_mad" in api and "median absolute deviation" in api
  assert (site / "metrics" / "index.html").exists()


def test_every_page_is_in_the_navigation():
  nav = open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8").read()
  for path in PAGES:
    page = os.path.relpath(path, os.path.join(ROOT, "docs"))
    assert f": {page}" in nav, f"{page} is not in mkdocs.yml's nav"


def _blocks_marked():
  """A block that trains a run (``train.run``) is a whole loop: ``slow``."""
  return [pytest.param(page, code, id=page, marks=(
      (pytest.mark.slow,) if "train.run(" in code else ()))
          for page, code in _python_blocks()]


@pytest.mark.parametrize("page, code", _blocks_marked())
def test_python_blocks_run_as_pasted(tmp_path, page, code):
  """Each runs in a fresh interpreter outside the repository (except those
  reading the run of the README's commands, ``/tmp/demo``)."""
  if "/tmp/demo" in code:
    pytest.skip("reads the finished run of the README's commands")
  proc = subprocess_env.run_as_pasted(code, tmp_path)
  assert proc.returncode == 0, f"{page}:\n{code}\n{proc.stderr[-3000:]}"


def test_there_are_python_blocks():
  assert len(_python_blocks()) >= 2
