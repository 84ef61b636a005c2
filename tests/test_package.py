"""The built package (tests/conftest.py's ``installed_wheel``): what the
wheel and sdist hold, and that the installed wheel imports and trains from
an empty directory without the checkout."""

import email
import os
import subprocess
import tarfile
import zipfile

import pytest

import rljax
from rljax import metrics


@pytest.fixture(scope="module")
def dist(installed_wheel):
  return installed_wheel[2]


def _one(directory, suffix):
  [name] = [n for n in os.listdir(directory) if n.endswith(suffix)]
  return os.path.join(directory, name)


@pytest.mark.slow
def test_the_wheel_holds_the_packages_types_license_and_metadata(dist):
  with zipfile.ZipFile(_one(dist, ".whl")) as z:
    names = z.namelist()
    info = f"rljax-{rljax.__version__}.dist-info"
    meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
  tops = {n.split("/")[0] for n in names}
  assert tops == {"rljax", "launch", "configs", info}, tops
  for path in ("rljax/py.typed", "rljax/train/loop.py", "launch/train.py",
               "configs/arithmetic_grpo.py", f"{info}/licenses/LICENSE"):
    assert path in names, path
  assert not [n for n in names if n.startswith("tests/")]
  assert meta["Name"] == "rljax" and meta["Version"] == rljax.__version__
  assert meta["License-Expression"] == "Apache-2.0"
  classifiers = meta.get_all("Classifier")
  assert "Typing :: Typed" in classifiers
  assert any(c.startswith("Development Status") for c in classifiers)
  extras = set(meta.get_all("Provides-Extra"))
  assert {"hf", "wandb", "mlflow", "test"} <= extras


@pytest.mark.slow
def test_the_sdist_holds_the_sources_readme_license_and_tests(dist):
  with tarfile.open(_one(dist, ".tar.gz")) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for path in ("pyproject.toml", "README.md", "LICENSE", "rljax/py.typed",
               "launch/cli.py", "configs/common.py", "tests/conftest.py",
               "CHANGELOG.md"):
    assert path in names, path


@pytest.mark.slow
def test_the_installed_wheel_imports_from_itself(installed_wheel, tmp_path):
  python, site, _ = installed_wheel
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = subprocess.run(
      [python, "-c", "import rljax, launch, configs, rljax.train; "
       "print(rljax.__version__); "
       "print('\\n'.join(m.__file__ for m in (rljax, launch, configs)))"],
      cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
      timeout=120)
  version, *files = out.stdout.split()
  assert version == rljax.__version__
  assert all(f.startswith(site) for f in files), files


@pytest.mark.slow
def test_launch_train_runs_from_the_wheel_in_an_empty_directory(
    finished_tiny_run):
  """The session's tiny main-job run is the installed wheel's
  ``python -m launch.train`` started in an empty directory."""
  workdir, _ = finished_tiny_run
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "3"
