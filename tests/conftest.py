"""Test session set-up: simulate an 8-device CPU mesh before JAX starts (with
fast, unoptimised code generation), and
share compiled programs between tests through JAX's persistent compilation
cache (a fresh directory per session: identical programs built by different
tests, e.g. the same sampler in several loop runs, compile once)."""

import os
import shutil
import tempfile

# Unoptimised XLA:CPU code generation: test programs are tiny, so compiling
# them dominates, and these flags compile ~25% faster (launch.train's
# tiny run: 68 s vs 89 s on 2 cores). XLA:CPU's older (non-MLIR) fusion
# emitters halve the rest: a 2-step loop run compiles in 2.8-3.3 s instead
# of 5.1-5.2 s, the failing-environments loop test takes 46.5 s instead of
# 54.7 s. (An XLA flag: jax's pin in pyproject.toml keeps it known.)
# Processes the tests start inherit them.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# glibc's malloc on transparent huge pages in every process the session
# starts (the pytest-xdist workers, the notebook kernels, the launchers),
# as the launchers set it for users (``launch/__init__.py``): fewer page
# faults on XLA's fresh buffers. The quickstart notebook's test: 6.8 s of
# system time instead of 15.4 s. glibc reads it only when a process starts,
# so the process that imports this file keeps its own.
import launch  # noqa: E402  pylint: disable=wrong-import-position

_USER_GLIBC_TUNABLES = os.environ.get("GLIBC_TUNABLES")
os.environ.update(launch.huge_pages_env(os.environ) or {})

import jax  # noqa: E402  pylint: disable=wrong-import-position

# One cache for the session: pytest-xdist's workers inherit the variable
# from the controller, and launchers that tests start with
# ``tests/subprocess_env.one_device_env()`` read it too (a killed run's
# resumed process then loads the programs its first process compiled).
_OWNS_CACHE = "RLJAX_TEST_JAX_CACHE" not in os.environ
if _OWNS_CACHE:
  os.environ["RLJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(
      prefix="rljax-test-jax-cache-")
CACHE_DIR = os.environ["RLJAX_TEST_JAX_CACHE"]
# Likewise one directory of finished warm-ups (rljax/train/sft_cache.py) for
# the launchers and notebooks the session starts (``one_device_env()``): the
# quickstart, DPO and RLHF notebooks train the same 450-step warm-up, once.
_OWNS_SFT_CACHE = "RLJAX_TEST_SFT_CACHE" not in os.environ
if _OWNS_SFT_CACHE:
  os.environ["RLJAX_TEST_SFT_CACHE"] = tempfile.mkdtemp(
      prefix="rljax-test-sft-cache-")
SFT_CACHE_DIR = os.environ["RLJAX_TEST_SFT_CACHE"]
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


import logging  # noqa: E402  pylint: disable=wrong-import-position

import pytest  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _restore_rljax_logger():
  """A launcher run in-process (``launch.cli.setup_logging``) gives the
  ``rljax`` logger its own handler and stops propagation; later tests that
  read log records through ``caplog`` need them to propagate again."""
  log = logging.getLogger("rljax")
  saved = (log.propagate, log.level, list(log.handlers))
  yield
  log.propagate, level, handlers = saved
  log.setLevel(level)
  log.handlers[:] = handlers


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def once_per_session(tmp_path_factory, name, make):
  """``make(directory)``'s result (JSON), computed once per test session
  whichever pytest-xdist worker asks first: the others wait on a lock in
  the session's shared temporary directory and read it. A ``make`` that
  raises leaves no result, so the next worker to ask tries again."""
  import fcntl  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # <session>/popen-gwN
    base = base.parent
  out, done = base / name, base / f"{name}.json"
  with open(base / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      out.mkdir(exist_ok=True)
      done.write_text(json.dumps(make(out)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
  """``(python, site_packages, dist)``: rljax's wheel and sdist built from
  this checkout (``python -m build`` into ``dist``) and the wheel installed
  into a fresh virtual environment, once per session (every worker uses
  it, read only). Its dependencies are this
  environment's (a ``.pth`` line; no network): the venv imports rljax,
  launch and configs from the wheel alone."""
  return tuple(once_per_session(tmp_path_factory, "wheel", _build_wheel))


def _build_wheel(base):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import sysconfig  # pylint: disable=import-outside-toplevel
  dist, venv = base / "dist", base / "venv"
  subprocess.run([sys.executable, "-m", "build", "--no-isolation",
                  "--outdir", str(dist), ROOT], check=True,
                 capture_output=True, timeout=600)
  [wheel] = dist.glob("rljax-*.whl")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                 check=True, timeout=120)
  python = venv / "bin" / "python"
  site = subprocess.run(
      [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
       "['purelib'])"], check=True, capture_output=True, text=True,
      timeout=60).stdout.strip()
  subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                  "--no-index", "--quiet", "--target", site, str(wheel)],
                 check=True, timeout=300)
  ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  with open(os.path.join(site, "zz_test_dependencies.pth"), "w") as f:
    f.write("\n".join(sorted(ours)) + "\n")
  return str(python), site, str(dist)


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, installed_wheel):
  """``(workdir, output)`` of ``python -m launch.train`` on the main job's
  ``tiny`` config (3 RL steps, a checkpoint at each), run once per session
  in a subprocess as a user types it: from the installed wheel
  (``installed_wheel``), in an empty directory, on one CPU device with the
  user's XLA flags; its console output has stdout and stderr merged. Each
  worker gets its own copy of the run directory (files and times as
  written), and the output names the copy where it named the run. Tests
  that read it (launchers, console output) must not change what it
  trained."""
  run, output = once_per_session(
      tmp_path_factory, "finished",
      lambda base: _finished_run(base, installed_wheel))
  workdir = tmp_path_factory.mktemp("finished") / "run"
  shutil.copytree(run, workdir)
  return str(workdir), output.replace(run, str(workdir))


def _finished_run(base, installed_wheel):
  import subprocess  # pylint: disable=import-outside-toplevel
  python, site, _ = installed_wheel
  workdir = str(base / "run")
  empty = base / "empty"
  empty.mkdir()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  # The user's malloc tunables: the launcher re-executes itself on huge
  # pages (tests/test_launchers.py checks its record).
  env.pop("GLIBC_TUNABLES", None)
  if _USER_GLIBC_TUNABLES is not None:
    env["GLIBC_TUNABLES"] = _USER_GLIBC_TUNABLES
  env.pop("PYTHONPATH", None)
  proc = subprocess.run(
      [python, "-m", "launch.train",
       f"--config={site}/configs/arithmetic_grpo.py:tiny",
       "--config.checkpoint.every=1", f"--workdir={workdir}"],
      cwd=empty, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout
  return workdir, proc.stdout


# The files that take longest in a full run (``--durations=0`` summed per
# file, 2 workers), heaviest first. pytest-xdist's ``--dist loadfile`` hands
# files out in collection order once its own reordering (by number of tests)
# is off: a few long files started first finish together with the many short
# ones behind them, where sorted by test count test_multihost (few tests,
# ~12 minutes) started late and ran alone on one worker at the end.
HEAVIEST_FIRST = (
    "test_multihost.py", "test_colabs.py", "test_loop.py", "test_pairs.py",
    "test_schedules.py", "test_env_loop.py", "test_allocation.py",
    "test_preference.py", "test_reward_training.py", "test_launchers.py",
    "test_steps.py", "test_tree.py", "test_lora.py")


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's option
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """The files of ``HEAVIEST_FIRST`` first, in that order; then the rest
  as collected (a stable sort keeps each file's tests in order)."""
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session):
  """The process that made the session's caches (the xdist controller, or
  the one process) removes them: a session leaves no cache behind in the
  temporary directory."""
  if hasattr(session.config, "workerinput"):
    return
  if _OWNS_CACHE:
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
  if _OWNS_SFT_CACHE:
    shutil.rmtree(SFT_CACHE_DIR, ignore_errors=True)
