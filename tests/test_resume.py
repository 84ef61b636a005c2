"""Fault tolerance of the training loop: SIGKILL + resume, SIGTERM, bad steps.

The kill tests run ``launch.train`` in real subprocesses.
"""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import checkpoint, metrics, models, optim, train
from tests.test_steps import _fresh_state as _state
from tests.test_steps import _random_batch as _batch
from tests.test_train import tiny_config
from tests import subprocess_env

ROOT = os.path.join(os.path.dirname(__file__), "..")
NUM_STEPS = 6
FLAGS = ["--config=configs/arithmetic_grpo.py:tiny",
         f"--config.rl.num_steps={NUM_STEPS}", "--config.checkpoint.every=1",
         "--config.eval.every=3"]


def _launch(workdir, *extra):
  env = subprocess_env.one_device_env()
  return subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--workdir={workdir}", *FLAGS,
       *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


def _wait_for_step(workdir, step, proc, timeout=300):
  """Waits until metrics for ``step`` are written and its checkpoint is complete."""
  path = os.path.join(workdir, "metrics.jsonl")
  ckpt = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()
    if os.path.exists(path) and any(
        r["step"] == step for r in metrics.read_jsonl(path)) and os.path.isdir(
            ckpt):
      return
    time.sleep(0.05)
  raise TimeoutError(f"step {step} not reached")


def _by_step(workdir):
  """Last logged metrics of each RL step, without wall-clock figures."""
  out = {}
  for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")):
    if r["step"] > 0:
      out[r["step"]] = {k: v for k, v in r.items() if not k.startswith(
          ("time/", "tokens_per_s/", "reward/eval_seconds"))}
  return out


def _final_params(workdir):
  return train.load_policy(workdir).params


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  proc = _launch(workdir)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  return workdir


@pytest.mark.slow
def test_sigkill_then_resume_continues_exactly(uninterrupted, tmp_path):
  workdir = str(tmp_path)
  proc = _launch(workdir)
  _wait_for_step(workdir, 3, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = _launch(workdir)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  assert "resumed from step" in out
  full, again = _by_step(uninterrupted), _by_step(workdir)
  assert sorted(again) == list(range(1, NUM_STEPS + 1))
  for step in range(4, NUM_STEPS + 1):
    assert again[step] == full[step], step
  for a, b in zip(jax.tree.leaves(_final_params(uninterrupted)),
                  jax.tree.leaves(_final_params(workdir))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("sig,resume", [(signal.SIGTERM, True),
                                        (signal.SIGINT, False)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_at_a_step_boundary_and_exits_cleanly(
    uninterrupted, tmp_path, sig, resume):
  """Either signal saves a checkpoint at the next step boundary and exits 0;
  the run resumed from it continues exactly (checked once: both signals
  set the same flag)."""
  workdir = str(tmp_path)
  proc = _launch(workdir, "--config.checkpoint.every=100")
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while not (os.path.exists(path) and any(r["step"] >= 2 for r in metrics.read_jsonl(path))):
    assert time.time() < deadline and proc.poll() is None
    time.sleep(0.05)
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  assert "preempted" in out
  steps = checkpoint.CheckpointManager(os.path.join(workdir, "checkpoints")).all_steps()
  assert len(steps) == 1 and 2 <= steps[0] < NUM_STEPS
  if not resume:
    return
  resumed = _launch(workdir, "--config.checkpoint.every=100")
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  full, again = _by_step(uninterrupted), _by_step(workdir)
  for step in range(steps[0] + 1, NUM_STEPS + 1):
    assert again[step] == full[step], step


@pytest.mark.slow
def test_nonfinite_gradient_step_is_skipped_and_counted():
  mc = models.get_preset("tiny")
  params = models.init_params(mc, jax.random.key(4))
  optimizer = optim.make_optimizer("adamw", 1e-2, max_consecutive_nonfinite=3)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  step = jax.jit(train.make_rl_step(mc, train.RLStepConfig(), optimizer, coef_tx))
  state = _state(optimizer, coef_tx, params)
  good = _batch(seed=1)
  bad = good._replace(advantages_NxL=np.where(
      np.arange(len(good.advantages_NxL)) == 0, np.nan,
      good.advantages_NxL).astype(np.float32))
  state, m = step(state, bad)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(m["nonfinite_skipped_total"]) == 1 and int(m["nonfinite_consecutive"]) == 1
  state, m = step(state, good)
  assert int(m["nonfinite_consecutive"]) == 0
  changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(params))]
  assert any(changed)


@pytest.mark.slow
def test_consecutive_bad_steps_stop_the_run(tmp_path, monkeypatch):
  from rljax import rollout
  original = rollout.Collector.collect

  def poisoned(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    return out._replace(batch=out.batch._replace(
        advantages_NxL=out.batch.advantages_NxL * jnp.nan))

  monkeypatch.setattr(rollout.Collector, "collect", poisoned)
  config = tiny_config()
  config.rl.num_steps = 5
  config.optimizer.max_consecutive_nonfinite = 2
  config.rl.num_minibatches = 1  # one optimizer update per RL step
  with pytest.raises(FloatingPointError,
                     match=r"optimizer.max_consecutive_nonfinite=2"):
    train.run(config, str(tmp_path))
  rows = [r for r in metrics.read_jsonl(tmp_path / "metrics.jsonl") if r["step"] > 0]
  assert [r["nonfinite_skipped_total"] for r in rows] == [1, 2]
