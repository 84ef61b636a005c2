"""Executes every notebook in colabs/ (code cells in order, one namespace).

Runs in CI without Jupyter: the cells are plain Python. Lines starting with
``!`` or ``%`` (shell/magics for Colab) are skipped.
"""

import glob
import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.chdir(ROOT)
  with open(path) as f:
    nb = json.load(f)
  namespace = {"__name__": "__main__"}
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
      continue
    lines = [l for l in "".join(cell["source"]).splitlines()
             if not l.lstrip().startswith(("!", "%"))]
    exec(compile("\n".join(lines), f"{os.path.basename(path)}[cell {i}]", "exec"),
         namespace)
