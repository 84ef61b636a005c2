"""Environments from the config through the training loop: every accepted
``env.name`` trains, a stopped run resumes to the same rows, and bad
settings are refused before anything is compiled."""

import os

import numpy as np
import pytest

from rljax import train
from rljax.train import build
from tests.test_loop import assert_stop_and_resume_matches, rl_rows
from tests.test_train import load_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def env_config(name="calculator", **overrides):
  file = {"calculator": "calculator_grpo.py", "python": "calculator_grpo.py",
          "guess_number": "guess_number_grpo.py"}[name]
  c = load_config(os.path.join(CONFIGS, file), "tiny")
  c.env.name = name
  if name == "python":  # the sandboxed tool, in a worker process
    c.env.num_workers = 1
    c.env.timeout_s = 20.0
  c.rl.num_steps = 2
  c.eval.every = 2
  # The environment's reward and a reward function with variance in every
  # group (the transcript's length parity): [N, 2], and a gradient.
  c.rewards.names = ("env", "tests.reward_fixtures:parity")
  c.rewards.weights = (1.0, 0.5)
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


# What a loop test that checks the RL steps does not need: the warm-up,
# greedy and long held-out evaluations.
QUICK = {"sft.num_steps": 0, "eval.greedy": False, "eval.num_examples": 8}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["calculator", "guess_number", "python"])
def test_every_environment_trains_from_the_config(name, tmp_path):
  summary = train.run(env_config(name, **QUICK), str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["env/failed_episodes"] == 0
    assert r["env/turns/mean"] >= 1
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0
    assert "reward/env/mean" in r and "reward/parity/mean" in r
  assert "eval/accuracy" in summary["after"]
  if name == "calculator":  # launch.evaluate runs the run's episodes
    import json  # pylint: disable=g-import-not-at-top
    from tests.test_launchers import _run  # pylint: disable=g-import-not-at-top
    _run("launch.evaluate", f"--workdir={tmp_path}", "--num_samples=2",
         f"--output={tmp_path / 'eval.json'}")
    with open(tmp_path / "eval.json") as f:
      results = json.load(f)
    assert 0.0 <= results["eval/accuracy"] <= 1.0
    # Episodes: a tool call's observation is part of the completion.
    assert results["eval/completion_length"] > 0


@pytest.mark.slow
def test_rounds_and_turn_caps_train_from_the_config(tmp_path):
  """env.step_rows (environments stepped as rows wait) and
  env.max_turn_tokens from the config, through the loop."""
  config = env_config("guess_number", **QUICK, **{"env.step_rows": 4,
                                         "env.max_turn_tokens": 3,
                                         "eval.every": 0})
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["grad_norm"] > 0 and r["env/failed_episodes"] == 0
             for r in rows)
  # A turn of at most 3 tokens: 5 turns of 3 plus observations fit T=20.
  assert all(r["completion_length/max"] <= 15 for r in rows)


@pytest.mark.slow
def test_failing_environments_are_counted_and_training_goes_on(tmp_path):
  """Steps that raise, hang past the timeout or answer garbage, in flight in
  two workers while other slots decode, on continuous slots sampled one
  update ahead (the static batch's episodes fail the same way:
  tests/test_envs.py, tests/test_env_slots.py)."""
  config = env_config("guess_number", **QUICK, **{
      "env.name": "tests.env_fixtures:FlakyGuess", "env.num_workers": 2,
      "env.timeout_s": 0.5, "eval.every": 0, "rl.max_staleness": 1,
      "rl.rollout": "continuous"})
  summary = train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  failed = sum(r["env/failed_episodes"] for r in rows)
  assert failed > 0
  assert failed == sum(r["env/errors"] + r["env/timeouts"] for r in rows)
  assert sum(r["reward/env/none"] for r in rows) == failed
  assert all(r["grad_norm"] > 0 for r in rows)
  assert not summary["preempted"]


# Each run composes several features, each seen to act through its own
# metric: one 2-step run per case keeps the pairs cheap.
COMPOSE = {
    # Dynamic sampling refills zero-variance groups with more episodes,
    # each example's a tree that forks after turn 1 (docs/environments.md);
    # every turn rewarded (tests.env_fixtures.Graded), REINFORCE++ with a
    # discount reads the per-token rewards.
    "tree-dapo-turn-rewards-reinforce_pp": {
        "rl.rollout": "tree",
        "rl.selection.name": "dapo", "rl.selection.max_rounds": 2,
        "env.name": "tests.env_fixtures:Graded", "env.kwargs": {},
        "rl.advantage": "whiten_by_tokens", "rl.gamma": 0.9,
        # The static batch decodes only the episodes still playing.
        "sampler.shrink_batch_to": 2},
    # GRESO's filter and replayed groups of episodes, sampled one update
    # ahead on a split mesh; a critic's GAE reads the per-token rewards.
    "greso-replay-async-split-turn-rewards-gae": {
        "rl.selection.name": "greso", "rl.replay.fraction": 0.25,
        "rl.max_staleness": 1, "rl.sampler_devices": 4, "rl.num_steps": 3,
        "env.name": "tests.env_fixtures:Graded", "env.kwargs": {},
        "rl.advantage": "gae", "critic.gamma": 0.9, "critic.lam": 0.95},
}
# Episodes on continuous slots with async sampling, split devices, DAPO,
# a critic, LoRA, a reward model and distillation: tests/test_pairs.py.


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPOSE))
def test_episodes_compose_with_schedules_feeders_and_estimators(case,
                                                               tmp_path):
  """Episodes under the other schedules, prompt feeders and discounted
  estimators."""
  overrides = COMPOSE[case]
  config = env_config("guess_number", **QUICK, **{"eval.every": 0})
  for key, value in overrides.items():
    *sections, field = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[field] = value
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == list(range(1, config.rl.num_steps + 1))
  for r in rows:
    assert r["env/turns/mean"] >= 1 and r["env/failed_episodes"] == 0
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0
  if "rl.sampler_devices" in overrides:
    # Step 2 is a checkpoint (checkpoint.every): nothing is sampled across.
    assert [r["rollout/sampler_lag"] for r in rows] == [0, 1, 0]
    assert all(r["rollout/sampler_devices"] == 4 for r in rows)
    assert max(r["replay/fraction"] for r in rows) == 0.25
  if overrides.get("rl.selection.name") == "dapo":
    assert all(r["select/rounds"] >= 1 for r in rows)
    assert "select/zero_variance_after" in rows[0]
  if overrides.get("rl.selection.name") == "greso":
    assert all(r["select/prompt_draws"] >= 1 for r in rows)
    assert "select/zero_variance_before" in rows[-1]
  if "env.kwargs" in overrides:  # every turn rewarded
    assert all(r["reward/env/mean"] != 0 for r in rows)
  if "rl.rollout" in overrides:  # the forks copied turns decoded once
    assert all(r["rollout/tree_token_saving"] > 0 for r in rows)
  if "sampler.shrink_batch_to" in overrides:
    n = config.rl.prompts_per_step * config.rl.group_size
    assert all(2 <= r["rollout/decode_rows"] < n for r in rows)
    assert all(0 < r["rollout/decode_utilization"] <= 1 for r in rows)
  if overrides.get("rl.advantage") == "gae":
    assert all(np.isfinite(r["critic/value_loss"]) for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["static", "tree", "latr"])
def test_a_stopped_environment_run_resumes_to_the_same_rows(rollout,
                                                            tmp_path):
  """The static batch, and tree and LATR episodes (their forks and
  branches within a step: nothing crosses a step but the checkpoint)."""
  config = env_config("guess_number", **QUICK, **{"rl.num_steps": 3,
                                         "checkpoint.every": 1,
                                         "eval.every": 0,
                                         "rl.rollout": rollout})
  # Thresholds every token of an untrained model crosses.
  config.rl.latr.abs_threshold = config.rl.latr.rel_threshold = 0.0
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  if rollout == "tree":
    assert all(r["rollout/tree_token_saving"] > 0 for r in rows)
  if rollout == "latr":
    assert all(r["latr/branches"] > 0 for r in rows)
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 1)


def test_tree_episodes_need_a_turn_after_their_last_fork():
  """Group size 4 as 2 roots x 2^1 (one fork, after turn 1): two turns
  are enough, one is refused before compiling, naming the fields."""
  config = env_config("calculator", **{"rl.rollout": "tree",
                                       "rl.group_size": 4,
                                       "env.max_turns": 2})
  config.rl.tree.roots = config.rl.tree.branch = 2
  build.validate(config)
  config.env.max_turns = 1
  with pytest.raises(ValueError, match=r"env.max_turns=1 leaves no turn"):
    build.validate(config)


@pytest.mark.slow
def test_partial_episodes_carried_across_steps_resume_exactly(tmp_path):
  """Partial rollouts of calculator episodes, sampled one update ahead:
  unfinished episodes are carried with their environment state and saved
  with the checkpoint; stop after step 2, resume, and steps 3-4 train the
  same rows as the uninterrupted run."""
  config = env_config("calculator", **QUICK, **{
      "rl.num_steps": 4, "checkpoint.every": 2, "eval.every": 0,
      "rl.rollout": "partial", "rl.rollout_slots": 8,
      "rl.partial_max_carried": 1.0, "rl.max_staleness": 1})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  assert any(r["rollout/carried_groups"] > 0 for r in rows[:2])
  assert max(r["rollout/version_spread"] for r in rows) > 0  # mixed rows
  for r in rows:
    assert r["env/turns/mean"] >= 1 and np.isfinite(r["pg_loss"])
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)


@pytest.mark.parametrize("field,value,match", [
    ("env.name", "nope", "env.name='nope'"),
    ("env.name", "tests.env_fixtures:Missing", "cannot be imported"),
    ("env.max_turns", 0, "env.max_turns"),
    ("env.observation_role", "", "env.observation_role"),
])
def test_bad_environment_settings_are_refused_before_compiling(field, value,
                                                               match):
  config = env_config("calculator", **{field: value})
  with pytest.raises(ValueError, match=match):
    build.validate(config)


def test_the_env_reward_needs_an_environment():
  config = env_config("calculator", **{"env.name": ""})
  with pytest.raises(ValueError, match="rewards.names contains 'env'"):
    build.validate(config)


def test_a_stop_string_the_tokenizer_splits_unevenly_is_refused():
  class Tok:  # encodes "</calc>" mid-sequence to ids that decode otherwise
    def encode(self, text):
      return [ord(c) % 7 for c in text]

    def decode(self, ids):
      return "".join("?" for _ in ids)

  with pytest.raises(ValueError, match="stop string '</calc>'"):
    build.turn_config(env_config("calculator"), Tok(), ("</calc>",))




@pytest.mark.slow
def test_calculator_on_slots_async_killed_mid_run_resumes_exactly(tmp_path):
  """The calculator on continuous slots, sampled one update ahead: SIGKILL
  after step 2's checkpoint, resume, and steps 3-4 and the final params
  equal the uninterrupted run's."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from tests import subprocess_env, test_resume  # pylint: disable=g-import-not-at-top
  flags = ["--config=configs/calculator_grpo.py:tiny",
           "--config.rl.num_steps=4", "--config.eval.every=0",
           "--config.checkpoint.every=2", "--config.sft.num_steps=0",
           "--config.eval.greedy=False", "--config.eval.num_examples=8",
           "--config.rl.rollout=continuous", "--config.rl.rollout_slots=16",
           "--config.rl.max_staleness=1",
           "--config.rewards.names=('env', 'tests.reward_fixtures:parity')",
           "--config.rewards.weights=(1.0, 0.5)"]

  def launch(workdir):
    return subprocess.Popen(
        [sys.executable, "-m", "launch.train", f"--workdir={workdir}",
         *flags], cwd=os.path.join(CONFIGS, ".."),
        env=subprocess_env.one_device_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)

  full = str(tmp_path / "full")
  proc = launch(full)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  killed = str(tmp_path / "killed")
  proc = launch(killed)
  test_resume._wait_for_step(killed, 2, proc)  # pylint: disable=protected-access
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = launch(killed)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0 and "resumed from step" in out, out
  a = test_resume._by_step(full)  # pylint: disable=protected-access
  b = test_resume._by_step(killed)  # pylint: disable=protected-access
  assert sorted(b) == [1, 2, 3, 4]
  assert all(a[s]["rollout/slots"] == 16 for s in a)
  assert a[4]["rollout/sampler_lag"] == 1  # step 4's batch drawn at step 3
  for step in (3, 4):
    assert b[step] == a[step], step
  for x, y in zip(
      jax.tree.leaves(test_resume._final_params(full)),  # pylint: disable=protected-access
      jax.tree.leaves(test_resume._final_params(killed))):  # pylint: disable=protected-access
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
