"""Run directories that can't be damaged, and bad data refused before work.

Reproduces the failures found by probing the tiny config: a second writer, a
changed model on resume, a corrupt newest checkpoint, duplicate metric rows
after a resume, a full disk, failing rewards for many steps, a second SIGINT
during compilation, and data files without answers, with too few held-out
rows, or not there at all.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rljax import metrics, train
from rljax.train import rundir
from tests.test_loop import loop_config

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _steps(workdir):
  return [r["step"] for r in metrics.read_jsonl(os.path.join(workdir,
                                                             "metrics.jsonl"))]


def test_a_second_run_on_a_locked_workdir_is_refused(tmp_path):
  with rundir.WorkdirLock(str(tmp_path)):
    with pytest.raises(RuntimeError, match=rf"in use by another run \(pid "
                       rf"{os.getpid()} on host"):
      train.run(loop_config(), str(tmp_path))
  assert not os.path.exists(tmp_path / "config.json")
  # Released: the lock can be taken again.
  rundir.WorkdirLock(str(tmp_path)).release()


def test_lock_file_names_the_holder(tmp_path):
  lock = rundir.WorkdirLock(str(tmp_path))
  try:
    text = (tmp_path / rundir.LOCK_FILE).read_text()
    assert f"pid {os.getpid()}" in text
  finally:
    lock.release()


def test_check_resumable_names_every_differing_field():
  saved = {"seed": 0, "model": {"preset": "tiny", "overrides": {}},
           "rl": {"group_size": 4, "kl_coef": 0.0, "num_steps": 3},
           "optimizer": {"name": "adamw"}, "critic": {"max_grad_norm": 1.0}}
  new = json.loads(json.dumps(saved))
  new["critic"]["max_grad_norm"] = 0.5  # same presence: same optimizer state
  new["rl"]["num_steps"] = 10           # allowed: train longer
  new["rl"]["kl_coef"] = 0.0            # same presence
  rundir.check_resumable(saved, new, "/w")
  new["model"]["preset"] = "small"
  new["rl"]["group_size"] = 8
  new["rl"]["kl_coef"] = 0.1            # a reference model appears
  new["critic"]["max_grad_norm"] = None  # the critic's clip state goes
  with pytest.raises(ValueError) as e:
    rundir.check_resumable(saved, new, "/w")
  message = str(e.value)
  for field in ("model: ", "rl.group_size: 4 -> 8", "rl.kl_coef: 0.0 -> 0.1",
                "critic.max_grad_norm: 1.0 -> None", "another --workdir"):
    assert field in message, message


def test_trim_metrics_keeps_rows_up_to_the_restored_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "x": float(s)} for s in (-2, 0, 1, 2, 3, 4)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5')
  assert rundir.trim_metrics(str(path), 2) == 3
  assert [r["step"] for r in metrics.read_jsonl(path)] == [-2, 0, 1, 2]


def test_disk_full_is_found_in_the_chain_of_causes():
  inner = OSError(errno.ENOSPC, "No space left on device", "/w/f")
  try:
    try:
      raise inner
    except OSError as e:
      raise RuntimeError("orbax failed") from e
  except RuntimeError as outer:
    assert rundir.disk_full(outer) is inner
  assert rundir.disk_full(ValueError("x")) is None


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A finished 2-step run with checkpoints at steps 1 and 2."""
  workdir = str(tmp_path_factory.mktemp("run"))
  config = loop_config()
  config.checkpoint.every = 1
  train.run(config, workdir)
  return workdir, config


@pytest.mark.slow
def test_a_different_model_is_refused_and_config_json_is_unchanged(
    finished_run):
  workdir, config = finished_run
  before = open(os.path.join(workdir, "config.json"), "rb").read()
  changed = loop_config()
  changed.checkpoint.every = 1
  changed.model.preset = "small"
  with pytest.raises(ValueError, match=r"model: .*'tiny'.*-> .*'small'"):
    train.run(changed, workdir)
  assert open(os.path.join(workdir, "config.json"), "rb").read() == before


@pytest.mark.slow
def test_corrupt_newest_checkpoint_is_moved_aside_and_the_rerun_completes(
    tmp_path):
  config = loop_config()
  config.checkpoint.every = 1
  workdir = str(tmp_path)
  train.run(config, workdir)
  newest = os.path.join(workdir, "checkpoints", "2")
  damaged = 0
  for root, _, files in os.walk(newest):
    for name in files:
      path = os.path.join(root, name)
      if os.path.getsize(path) > 64 and "metadata" not in name:
        with open(path, "r+b") as f:
          f.truncate(8)
        damaged += 1
  assert damaged
  config.rl.num_steps = 3
  train.run(config, workdir)
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                if s.isdigit()) == [2, 3]
  aside = os.listdir(os.path.join(workdir, "checkpoints.corrupt"))
  assert len(aside) == 1 and aside[0].startswith("2-")
  rl_steps = [s for s in _steps(workdir) if s > 0]
  assert rl_steps == [1, 2, 3]  # each step once: rows after step 1 dropped


@pytest.mark.slow
def test_resume_writes_each_step_once(finished_run, tmp_path):
  workdir, config = finished_run
  resumed = loop_config()
  resumed.checkpoint.every = 1
  resumed.rl.num_steps = 3
  # Rows of a step that was trained but never checkpointed (a kill after the
  # metrics write) must not survive the resume.
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 3, "stale": 1.0}) + "\n")
  train.run(resumed, workdir)
  steps = [s for s in _steps(workdir) if s > 0]
  assert steps == [1, 2, 3]
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert all("stale" not in r for r in rows)


def test_a_full_disk_gives_one_error_naming_the_path(tmp_path, monkeypatch):
  def write(self, step, values, histograms=None):
    raise OSError(errno.ENOSPC, "No space left on device",
                  str(tmp_path / "metrics.jsonl"))

  monkeypatch.setattr(metrics.MetricWriter, "write", write)
  config = loop_config()
  config.rl.num_steps = 1
  with pytest.raises(OSError) as e:
    train.run(config, str(tmp_path))
  assert e.value.errno == errno.ENOSPC
  assert str(tmp_path / "metrics.jsonl") in str(e.value)
  assert e.value.__suppress_context__ and e.value.__cause__ is None


@pytest.mark.slow
def test_rewards_failing_for_many_steps_stop_the_run(tmp_path):
  config = loop_config()
  config.rl.num_steps = 5
  config.rewards.names = ("tests.reward_fixtures:returns_none",)
  config.rewards.weights = (1.0,)
  config.rewards.failure_patience = 2
  with pytest.raises(RuntimeError, match=r"reward/failure_fraction > "
                     r"rewards.max_failure_fraction=0.99 for 2 RL steps"):
    train.run(config, str(tmp_path))
  assert [s for s in _steps(tmp_path) if s > 0] == [1, 2]


@pytest.mark.slow
def test_non_finite_stop_names_a_complete_checkpoint(tmp_path, monkeypatch):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from rljax import rollout  # pylint: disable=import-outside-toplevel
  original = rollout.Collector.collect
  calls = []

  def poisoned(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == 1:
      return out
    return out._replace(batch=out.batch._replace(
        advantages_NxL=out.batch.advantages_NxL * jnp.nan))

  monkeypatch.setattr(rollout.Collector, "collect", poisoned)
  config = loop_config()
  config.rl.num_steps = 5
  config.rl.num_minibatches = 1
  config.checkpoint.every = 1
  config.optimizer.max_consecutive_nonfinite = 2
  with pytest.raises(FloatingPointError) as e:
    train.run(config, str(tmp_path))
  message = str(e.value)
  path = message.split(" in ")[-1].rstrip(".")
  assert "newest complete checkpoint is step 2" in message, message
  assert os.path.isdir(path), path
  leftovers = [d for d in os.listdir(tmp_path / "checkpoints") if "tmp" in d]
  assert not leftovers


# --- data ---------------------------------------------------------------------

def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_a_jsonl_task_without_answers_is_refused_or_warned(tmp_path, caplog):
  config = loop_config()
  config.task.path = _jsonl(tmp_path / "t.jsonl",
                            [{"prompt": f"{i}+1=", "answer": ""}
                             for i in range(40)])
  config.sft.num_steps = 0
  with pytest.raises(ValueError, match=r"no training example of .*t.jsonl has "
                     r"a non-empty 'answer'"):
    train.build.build(config)
  config.task.on_data_problem = "warn"
  c = train.build.build(config)
  c.evaluator.close()
  assert "DATA PROBLEM" in caplog.text


def test_too_few_held_out_examples_are_refused(tmp_path):
  config = loop_config()
  config.sft.num_steps = 0
  config.task.path = _jsonl(tmp_path / "t.jsonl", [
      {"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)])
  config.task.heldout_path = _jsonl(tmp_path / "h.jsonl", [
      {"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(8)])
  config.eval.num_examples = 16
  with pytest.raises(ValueError, match=r"eval.num_examples=16 but .*h.jsonl "
                     r"holds only 8 held-out examples"):
    train.build.build(config)


def test_held_out_rows_that_do_not_split_over_the_mesh_fail_before_compile(
    tmp_path):
  config = loop_config()
  config.sft.num_steps = 0
  config.task.on_data_problem = "warn"
  config.task.path = _jsonl(tmp_path / "t.jsonl", [
      {"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(12)])
  config.eval.num_examples = 16  # the head of the file: 12 rows
  with pytest.raises(ValueError, match=r"number of held-out examples loaded"):
    train.build.build(config)


# --- signals ------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_sigint_during_compilation_exits_promptly(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}",
       "--config=configs/arithmetic_grpo.py:tiny", "--config.rl.num_steps=50"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  time.sleep(8)  # imports done; building, SFT or compiling
  proc.send_signal(signal.SIGINT)
  time.sleep(0.3)
  proc.send_signal(signal.SIGINT)
  start = time.time()
  try:
    out, _ = proc.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    pytest.fail("the run did not exit within 60 s of the second SIGINT")
  assert proc.returncode not in (139, -signal.SIGSEGV), out[-2000:]
  assert proc.returncode in (-signal.SIGINT, 130, 0, 1), (proc.returncode,
                                                          out[-2000:])
  assert time.time() - start < 60


def test_a_jsonl_line_without_answer_names_file_line_and_field(tmp_path):
  config = loop_config()
  config.sft.num_steps = 0
  rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
  del rows[6]["answer"]
  config.task.path = _jsonl(tmp_path / "t.jsonl", rows)
  with pytest.raises(ValueError, match=r"t.jsonl:7: required field 'answer'"):
    train.build.build(config)


def test_tokenizer_ids_beyond_the_model_vocab_are_refused_before_compile():
  config = loop_config()
  config.model.overrides.vocab_size = 8  # the trained tokenizer has 32 ids
  with pytest.raises(ValueError, match=r"model.preset='tiny'.*largest id is "
                     r"\d+.*vocab_size=8"):
    train.build.build(config)


# --- issue 25: refused starts through the launcher ----------------------------


def _snapshot(directory):
  """Every file under ``directory``: its bytes and mode (what a refused start
  must leave as it was). The lock file is left out: it names the last process
  that took the lock, and a start refused after taking it (at build) rewrites
  that line."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, directory)
      if rel == rundir.LOCK_FILE:
        continue
      out[rel] = (os.stat(path).st_mode, open(path, "rb").read()
                  if os.path.isfile(path) else None)
  return out


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
  """A teacher run directory whose tokenizer is not the student's."""
  from tests.test_distill import _teacher_run  # pylint: disable=g-import-not-at-top
  directory = str(tmp_path_factory.mktemp("teacher") / "run")
  _teacher_run(directory, steps=(1,))
  return directory


@pytest.mark.slow
@pytest.mark.parametrize("flags,match", [
    (["--config.rl.rank_weights=nonsense"], r"rl.rank_weights preset="
     r"'nonsense'"),
    (["--config.rl.advantage=grpo++"], r"empty link at position 1"),
    (["--config.rl.training_temperature=0.0"], r"rl.training_temperature"),
    (["--config.sampler.temperature=-1.0"], r"sampler.temperature"),
    # Checked at build (it needs the student's tokenizer): a directory
    # without checkpoints, so that no resume check comes first.
    (["--config.rl.distill_coef=1.0", "--config.teacher.path={teacher}"],
     r"teacher.path=.*tokenizer"),
])
def test_a_refused_start_through_the_launcher_leaves_the_run_directory(
    tmp_path, other_teacher, flags, match):
  """``python -m launch.train`` with a bad field exits non-zero with an
  error naming it (not a difference from the saved run), and the run
  directory it was pointed at (one holding an earlier run's files) is
  byte-for-byte as it was."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text('{"seed": 0}')
  (workdir / "metrics.jsonl").write_text('{"step": 3}\n')
  if "teacher" not in match:
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    (workdir / "checkpoints" / "3" / "state").write_bytes(b"\x00" * 64)
  before = _snapshot(workdir)
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={workdir}",
       "--config=configs/arithmetic_grpo.py:tiny"]
      + [f.format(teacher=other_teacher) for f in flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out[-3000:]
  import re  # pylint: disable=g-import-not-at-top
  assert re.search(match, out), out[-3000:]
  assert "Traceback" not in out or "ValueError" in out, out[-3000:]
  assert _snapshot(workdir) == before


def test_gsm8k_without_its_data_file_stops_at_once_through_the_launcher(
    tmp_path):
  """The documented GSM8K command with a data file that is not there exits
  non-zero within seconds (no tokenizer trained, nothing compiled), with
  one message naming the field, the path and how to make the file, and
  leaves no run directory behind."""
  missing = tmp_path / "data" / "gsm8k" / "train.jsonl"
  workdir = tmp_path / "run"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  start = time.time()
  proc = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={workdir}",
       "--config=configs/gsm8k_grpo.py", f"--config.task.path={missing}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=False)
  seconds = time.time() - start
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out[-3000:]
  assert seconds < 30, (seconds, out[-3000:])
  assert f"task.path='{missing}': the file does not exist" in proc.stderr, out
  assert "python -m launch.prepare_data" in proc.stderr, out
  assert "Traceback" not in out, out[-3000:]
  assert not workdir.exists()
