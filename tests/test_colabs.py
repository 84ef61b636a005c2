"""Runs every notebook in colabs/ as a notebook: nbclient and a real kernel.

Each notebook asserts its own results, so a notebook that runs to the end
passes. The kernel is ``python3``, the kernelspec that ipykernel (test
extra) installs into the environment; jupyter_client starts it with the
interpreter running the tests (``test_python3_kernel_is_this_interpreter``).
Its working directory is an empty temporary directory, outside the
repository: a notebook finds rljax and ``configs`` as installed packages,
wherever it is opened. Its environment is the user's: without the 8
simulated devices that ``conftest.py`` gives the test process.
"""

import glob
import os
import re
import sys

import jupyter_client
import nbclient
import nbformat
import pytest
from tests import subprocess_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colabs", "*.ipynb")))
KERNEL = "python3"
TIME_LIMIT_S = 300  # per notebook; each takes about a minute on a 2-core CPU
# The quickstart trains until accuracy rises: ~3 minutes on a 2-core CPU.
TIME_LIMITS_S = {"quickstart.ipynb": 900, "rlhf_with_a_reward_model.ipynb": 900}
COLAB_GUARD = 'IN_COLAB = "google.colab" in sys.modules'


def _read(path):
  return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
  assert NOTEBOOKS, os.path.join(ROOT, "colabs")


def test_python3_kernel_is_this_interpreter():
  km, kc = jupyter_client.manager.start_new_kernel(kernel_name=KERNEL)
  try:
    out = []
    kc.execute_interactive(
        "import sys; print(sys.executable)", timeout=60,
        output_hook=lambda m: out.append(m["content"].get("text", "")))
  finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
  assert os.path.realpath("".join(out).strip()) == os.path.realpath(
      sys.executable), (out, sys.executable)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_clean(path):
  nb = _read(path)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == KERNEL
  code = [c for c in nb.cells if c.cell_type == "code"]
  for i, cell in enumerate(code):
    assert not cell.outputs and cell.execution_count is None, (
        f"code cell {i} has outputs: clear them before committing")
  # The first code cell installs rljax in Colab and does nothing elsewhere.
  assert COLAB_GUARD in code[0].source and "if IN_COLAB:" in code[0].source
  assert any("assert " in c.source for c in code), "the notebook checks nothing"
  # No path into the repository: the notebook runs from any directory.
  for i, cell in enumerate(code):
    assert not re.search(r"[\"'](\.\./|configs/|colabs/|launch/)", cell.source), (
        f"code cell {i} reads a path relative to the repository")
  # What it writes goes under `runs` (RUNS_DIR, or a temporary directory
  # that the last cell removes): no other temporary directory.
  writes = [c for c in code if "mkdtemp" in c.source or "run_dir(" in c.source]
  if writes:
    assert code[1].source.count("mkdtemp") == 1 and "RUNS_DIR" in code[1].source
    assert not [c for c in code[2:] if "mkdtemp" in c.source]
    assert "shutil.rmtree(runs)" in code[-1].source


# Notebooks that train the main job for hundreds of steps: their kernels
# get XLA's default (optimised) code generation, faster for them overall.
TRAIN_THE_MAIN_JOB = ("quickstart.ipynb", "rlhf_with_a_reward_model.ipynb",
                      "dpo_on_preference_pairs.ipynb")


@pytest.mark.slow
@pytest.mark.timeout(max(TIME_LIMITS_S.values()) + 60)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
  """Runs to the end, and leaves nothing in the temporary directory."""
  nb = _read(path)
  cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
  cwd.mkdir()
  tmp.mkdir()
  client = nbclient.NotebookClient(
      nb, kernel_name=KERNEL,
      timeout=TIME_LIMITS_S.get(os.path.basename(path), TIME_LIMIT_S),
      resources={"metadata": {"path": str(cwd)}})
  env = subprocess_env.one_device_env(
      fast_codegen=os.path.basename(path) not in TRAIN_THE_MAIN_JOB)
  # torch keeps its compiler cache in the temporary directory (not the
  # notebook's doing): elsewhere.
  client.execute(env={**env, "TMPDIR": str(tmp),
                      "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")})
  assert not os.listdir(tmp), os.listdir(tmp)
  assert_stated_figures_are_computed(nb)


FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?%)")


def assert_stated_figures_are_computed(nb):
  """Every percentage the prose states (markdown cells) appears, as written,
  in the executed cells' output: the prose states only what they compute."""
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      out.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
  out = "\n".join(out)
  for cell in nb.cells:
    if cell.cell_type == "markdown":
      for figure in FIGURE.findall(cell.source):
        assert figure in out, (figure, cell.source)


def test_a_stated_figure_that_no_cell_prints_fails_the_check():
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_markdown_cell("accuracy goes from 50.4% to 62.1%"),
      nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
          "stream", name="stdout", text="before RL 50.4%, after RL 62.1%\n")])])
  assert_stated_figures_are_computed(nb)
  nb.cells[0].source = "accuracy goes from about 54% to about 68%"
  with pytest.raises(AssertionError, match="54%"):
    assert_stated_figures_are_computed(nb)
