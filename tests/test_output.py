"""What a user sees: the launchers' console output, run in subprocesses."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
# absl's format: level letter, MMDD, time, thread id, file:line]
ABSL_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]",
                       re.MULTILINE)


def _launch(module, *flags, returncode=0, cwd=ROOT):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=cwd,
                        env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=600,
                        check=False)
  assert proc.returncode == returncode, proc.stdout
  return proc.stdout


TRAIN = ("launch.train", "--config=configs/arithmetic_grpo.py:tiny",
         "--config.checkpoint.every=1")


@pytest.fixture(scope="module")
def finished(finished_tiny_run):
  """``(workdir, output)`` of the session's finished tiny main-job run
  (tests/conftest.py: ``TRAIN``'s command)."""
  return finished_tiny_run


def _files(workdir):
  """Every file under ``workdir`` but the lock: path -> (bytes, mtime)."""
  out = {}
  for root, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(root, name)
      if name != ".lock":
        with open(path, "rb") as f:
          out[os.path.relpath(path, workdir)] = (f.read(),
                                                 os.stat(path).st_mtime_ns)
  return out


@pytest.mark.slow
def test_train_prints_rljax_lines_in_order_and_no_third_party_info(finished):
  workdir, out = finished
  info = [m.group(0) for m in ABSL_LINE.finditer(out) if m.group(0)[0] in "DI"]
  assert not info, out
  for noise in ("async_checkpointer", "checkpoint_manager", "orbax",
                "Unable to initialize backend"):
    assert noise not in out, out
  assert "\r" not in out
  # What is built, before JAX loads: the first line.
  assert re.match(r"^\d\d:\d\d:\d\d rljax ", out), out
  expected = ["launch.train with ", "loading JAX and the config",
              "building a fresh 'tiny' model on 'arithmetic': SFT 4 steps, "
              "RL 3 steps x 8 prompts x 4 samples", "model:",
              "task arithmetic", "sft: 4 warm-up steps x 8 rows; compiling",
              "sft: step 1 compiled and ran in", "sft step",
              "held-out evaluation before RL (compiles",
              "held-out evaluation took", "held-out before RL",
              "RL step 1: compiling the sampler and the update",
              "RL step 1 took", "RL step 3/3", "held-out after RL",
              "run summary:", "held-out accuracy (T=", "wall clock",
              "first RL step (compiles", "tokens/s after the first step: "
              "sampling",
              f"files in {workdir}", "metrics.jsonl", "tensorboard/",
              "checkpoints/"]
  positions = [out.find(text) for text in expected]
  assert -1 not in positions, (expected[positions.index(-1)], out)
  assert positions == sorted(positions), out


def test_the_main_jobs_first_line_comes_within_two_seconds(tmp_path):
  """``python -m launch.train`` (the main job, as the README runs it) says
  what it builds before it loads JAX; the process is stopped there."""
  import time  # pylint: disable=import-outside-toplevel
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  start = time.monotonic()
  proc = subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}/run"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  try:
    line = proc.stdout.readline()
    elapsed = time.monotonic() - start
  finally:
    proc.kill()
    proc.wait()
  assert elapsed < 2.0, (elapsed, line)
  assert re.match(r"^\d\d:\d\d:\d\d rljax [\d.]+: launch.train with "
                  r"configs/arithmetic_grpo.py in " + re.escape(
                      f"{tmp_path}/run") + "; loading JAX", line), line


@pytest.mark.slow
def test_verbosity_flag_brings_third_party_logs_back():
  flags = ["--preset=tiny", "--prompt=1+1=", "--max_new_tokens=2"]
  assert not ABSL_LINE.search(_launch("launch.sample", *flags))
  assert ABSL_LINE.search(_launch("launch.sample", *flags, "--verbosity=1"))


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_says_so_and_touches_nothing(finished):
  """The same command again reports the finished run's figures and leaves
  its record, metrics, TensorBoard files, plot and checkpoints as they were
  (it used to rewrite the record with an empty "after")."""
  workdir, first = finished
  before = _files(workdir)
  assert any(name.startswith("train_seed0-") for name in before), sorted(before)
  out = _launch(*TRAIN, f"--workdir={workdir}")
  assert "already finished" in out, out
  assert "RL step 1: compiling" not in out, out
  after = _files(workdir)
  # config.json and the tokenizer are rewritten with the same bytes.
  for name in ("config.json", "tokenizer.model"):
    assert after.pop(name)[0] == before.pop(name)[0]
  assert after == before
  # The figures it reports are the finished run's.
  def accuracy_line(text):
    return [line for line in text.splitlines()
            if "held-out accuracy (T=" in line]
  assert accuracy_line(out) == accuracy_line(first) != []


@pytest.mark.slow
@pytest.mark.parametrize("cwd", [ROOT, "/"])
def test_an_error_is_one_line_without_a_traceback(tmp_path, cwd):
  """A bad field prints ``error: ...`` naming it, no traceback; from any
  working directory (the default config is found next to the launcher)."""
  out = _launch("launch.train", f"--workdir={tmp_path / 'run'}",
                "--config.rl.training_temperature=0.0", returncode=1, cwd=cwd)
  assert "Traceback" not in out, out
  errors = [line for line in out.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and "rl.training_temperature" in errors[0], out
  assert "--verbosity=1 shows the traceback" in out


@pytest.mark.slow
def test_verbosity_brings_the_traceback_back(tmp_path):
  out = _launch("launch.train", f"--workdir={tmp_path / 'run'}",
                "--config.rl.training_temperature=0.0", "--verbosity=0",
                returncode=1)
  assert "Traceback" in out and "rl.training_temperature" in out, out
