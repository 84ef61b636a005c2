"""Rollout schedules in the loop: asynchronous off-policy training, partial
rollouts and continuous batching from the config, resume and signals."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rljax import checkpoint, metrics, train
from rljax import rollout
from rljax.rollout import schedules
from rljax.train import build
from tests.test_loop import assert_stop_and_resume_matches, loop_config, rl_rows
from tests import subprocess_env

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _params(workdir):
  return jax.tree.leaves(train.load_policy(str(workdir)).params)


def _assert_same_params(a, b):
  for x, y in zip(_params(a), _params(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_off_policy_that_never_samples_ahead_is_the_synchronous_loop(
    tmp_path):
  """With a checkpoint after every update nothing is sampled ahead (no batch
  crosses a checkpoint), so OffPolicy must train bitwise as Synchronous."""
  config = loop_config()
  config.rl.num_steps = 4
  config.checkpoint.every = 1
  train.run(config, str(tmp_path / "sync"))
  config.rl.max_staleness = 1
  train.run(config, str(tmp_path / "async"))
  _assert_same_params(tmp_path / "sync", tmp_path / "async")
  rows = rl_rows(tmp_path / "async")
  assert [r["rollout/sampler_lag"] for r in rows] == [0, 0, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["static", "partial"])
def test_async_sampler_is_at_most_k_versions_behind(tmp_path, rollout):
  """max_staleness=1: every trained token was drawn by the params of this
  update or the one before (from the logged versions); after the first
  step, batches are drawn one update ahead; and a run stopped at its
  checkpoint and resumed continues exactly as the uninterrupted one."""
  config = loop_config(**{"rl.rollout": rollout})
  config.rl.num_steps = 4
  config.rl.max_staleness = 1
  config.checkpoint.every = 2
  full = tmp_path / "full"
  train.run(config, str(full))
  rows = rl_rows(full)
  # Steps 1 and 3 follow a checkpoint (or the start): drawn with their own
  # params; steps 2 and 4 were drawn one update ahead.
  assert [r["rollout/sampler_lag"] for r in rows] == [0, 1, 0, 1]
  # Per token: the sampler's lag, plus a carried row's age with partial
  # rollouts (at most rl.partial_max_age).
  extra = config.rl.partial_max_age if rollout == "partial" else 0
  assert max(r["rollout/staleness/max"] for r in rows) <= 1 + extra
  assert rows[1]["rollout/staleness/max"] >= 1
  if rollout == "partial":
    assert any(r["rollout/carried_groups"] > 0 for r in rows)
  split = tmp_path / "split"
  assert_stop_and_resume_matches(config, rows, split, 2)
  _assert_same_params(full, split)


@pytest.mark.slow
def test_partial_rollouts_resume_exactly_with_their_carried_rows(tmp_path):
  """Carried groups are in the checkpoint: stop after step 2, resume, and
  steps 3-4 train the same rows (and params) as the uninterrupted run."""
  config = loop_config(**{"rl.rollout": "partial", "rl.rollout_slots": 8,
                          "rl.partial_max_carried": 1.0})
  config.rl.num_steps = 4
  config.checkpoint.every = 2
  full = tmp_path / "full"
  train.run(config, str(full))
  rows = rl_rows(full)
  assert rows[1]["rollout/carried_groups"] > 0  # something is carried at 2
  assert max(r["rollout/version_spread"] for r in rows) > 0  # mixed rows
  split = tmp_path / "split"
  assert_stop_and_resume_matches(config, rows, split, 2)
  _assert_same_params(full, split)


@pytest.mark.slow
def test_split_mesh_samples_on_its_own_devices_at_most_one_version_behind(
    tmp_path):
  """8 devices, 4 sample and 4 train; params published after each update."""
  config = loop_config(**{"rl.sampler_devices": 4, "rl.max_staleness": 1,
                          "rl.rollout": "partial"})
  config.rl.num_steps = 4
  c = build.build(config)
  try:
    assert set(c.sample_mesh.devices.flat) == set(jax.devices()[4:])
    assert set(c.mesh.devices.flat) == set(jax.devices()[:4])
    params = c.init_params(jax.random.key(0))
    published = c.publish(params)
    for leaf in jax.tree.leaves(published):
      assert leaf.sharding.device_set == set(jax.devices()[4:])
  finally:
    c.evaluator.close()
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["rollout/sampler_lag"] for r in rows] == [0, 1, 1, 1]
  assert all(r["grad_norm"] > 0 for r in rows)


def test_rollout_settings_are_checked_before_compiling():
  cases = [
      ({"rl.rollout_slots": 8}, "rl.rollout_slots=8 with rl.rollout='static'"),
      ({"rl.rollout": "partial", "rl.rollout_slots": 2,
        "rl.rollout_refill_rows": 3}, "rl.rollout_refill_rows=3 is more"),
      ({"rl.rollout": "sliding"}, "rl.rollout='sliding'"),
      ({"rl.max_staleness": -1}, "rl.max_staleness=-1"),
      ({"rl.partial_max_carried": 1.5}, "rl.partial_max_carried=1.5"),
      ({"rl.sampler_devices": jax.device_count()},
       f"rl.sampler_devices={jax.device_count()} with"),
  ]
  for overrides, message in cases:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(
        "[", r"\[")):
      build.validate(loop_config(**overrides))


def test_staleness_metrics_by_hand():
  versions = np.array([[3, 3, 4, -1], [4, 4, -1, -1]], np.int32)
  collected = rollout.Collected(None, None, {}, [], np.zeros((2, 1)), versions)
  m = schedules.staleness_metrics(collected, 4, 5)
  assert m["rollout/sampler_lag"] == 1
  stale = np.array([2, 2, 1, 1, 1], np.float64)
  assert m["rollout/staleness/mean"] == pytest.approx(stale.mean())
  assert m["rollout/staleness/max"] == 2
  assert m["rollout/version_spread"] == pytest.approx(0.5)  # (1 + 0) / 2


@pytest.mark.slow
def test_sigterm_during_async_partial_run_exits_cleanly_and_resumes(tmp_path):
  workdir = str(tmp_path)
  env = subprocess_env.one_device_env()
  args = [sys.executable, "-m", "launch.train",
          "--config=configs/arithmetic_grpo.py:tiny", f"--workdir={workdir}",
          "--config.rl.num_steps=6", "--config.checkpoint.every=100",
          "--config.eval.every=0", "--config.rl.max_staleness=1",
          "--config.rl.rollout=partial"]
  proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while not (os.path.exists(path) and any(
      r["step"] >= 2 for r in metrics.read_jsonl(path))):
    assert time.time() < deadline and proc.poll() is None
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  assert "preempted" in out
  steps = checkpoint.CheckpointManager(
      os.path.join(workdir, "checkpoints")).all_steps()
  assert len(steps) == 1 and 2 <= steps[0] < 6
  resumed = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert [r["step"] for r in rl_rows(workdir)] == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["continuous", "partial", "static-split"])
def test_spec_rl_drafts_verified_from_the_previous_epoch(tmp_path, rollout):
  """One epoch per step: from step 2 every prompt has a draft, verified in
  the slots or by the static speculative sampler, here on 4 sampler devices
  of their own (``static-split``); the draft store is checkpointed, so a run
  stopped after step 1 and resumed trains exactly as the uninterrupted
  one."""
  if rollout == "static-split":
    config = loop_config(**{"sampler.speculative": True,
                            "rl.sampler_devices": 4})
  else:
    config = loop_config(**{"sampler.speculative": True,
                            "rl.rollout": rollout, "rl.rollout_slots": 8})
  config.task.num_train = config.rl.prompts_per_step
  config.rl.num_steps = 3
  config.checkpoint.every = 1
  full = tmp_path / "full"
  train.run(config, str(full))
  rows = rl_rows(full)
  assert rows[0]["spec/drafted_rows"] == 0
  assert all(r["spec/drafted_rows"] > 0 for r in rows[1:])
  assert 0 < rows[1]["spec/accept_rate"] <= 1
  assert all(r["grad_norm"] > 0 for r in rows)
  if rollout == "static-split":
    assert all(r["rollout/sampler_devices"] == 4 for r in rows)
  split = tmp_path / "split"
  assert_stop_and_resume_matches(config, rows, split, 1)


@pytest.mark.slow
def test_selection_and_replay_on_partial_slots_train_one_update_ahead(
    tmp_path):
  """DAPO's dynamic sampling and replay on partial rollouts, sampled one
  update ahead: each selection round is decoded on the slots (carried
  groups included), replayed groups join the batch, and every trained token
  is at most the sampler lag plus the carried and replayed ages old."""
  config = loop_config(**{
      "rl.rollout": "partial", "rl.selection.name": "dapo",
      "rl.selection.max_rounds": 2, "rl.replay.fraction": 0.25,
      "rl.max_staleness": 1, "rl.num_steps": 4})
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(r["select/rounds"] >= 1 for r in rows), rows
  assert any(r["replay/fraction"] > 0 for r in rows), rows
  assert "rollout/carried_groups" in rows[0]
  bound = 1 + config.rl.partial_max_age + config.rl.replay.max_age
  for r in rows:
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0, r
    assert 0 <= r["rollout/staleness/max"] <= bound, r
