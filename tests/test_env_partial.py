"""Partial rollouts of multi-turn episodes (``rollout.episode_carry``).

The reference is the static batch of the same episodes with the same
params: an episode stopped at the end of one step and carried to the next
goes on with its own draws from where it stopped (its history prefilled
again, never re-sampled), so once it ends it is the static batch's row,
token for token, with the same observations, rewards and environment
states.
"""

import jax
import numpy as np
import pytest

from rljax import envs, models
from rljax.rollout import episode_carry
from rljax.rollout import multi_turn as mt
from tests import env_fixtures
from tests.test_envs import G, MC, O, SC, TOK

TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=O)
FIRST = {"prompt": ["ab+c", "xyz"]}
MORE = {"prompt": ["q+r", "mn"]}
FILLER = [{"prompt": ["k", "lm"]}, {"prompt": ["u+v", "w"]},
          {"prompt": ["e", "fg"]}, {"prompt": ["hi", "j+j"]}]


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def static(params):
  """The four examples of the first step and its extra batch, each with
  its own row from the start (no slots, nothing carried)."""
  runner = envs.EnvRunner(env_fixtures.Graded(), num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8, 16))
    both = {"prompt": FIRST["prompt"] + MORE["prompt"]}
    return jax.device_get(sampler.run(params, both, jax.random.key(3)))
  finally:
    runner.close()


def _sampler(runner, carry):
  return mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8, 16), slots=4,
                             refill_rows=1, carry=carry)


def _steps(params, sampler, steps):
  """Runs ``steps`` partial steps (the first with the extra batch, the others
  on fillers); returns each step's episodes."""
  out = []
  for i in range(steps):
    examples = FIRST if i == 0 else FILLER[i - 1]
    more = (lambda: MORE) if i == 0 else None
    key = jax.random.key(3 if i == 0 else 10 + i)
    out.append(jax.device_get(sampler.run(params, examples, key, version=i,
                                          more=more)))
  return out


def _by_prompt(runs):
  """Every trained group of ``runs``: prompt -> (run, group index)."""
  return {ex["prompt"]: (k, i) for k, run in enumerate(runs)
          for i, ex in enumerate(run.examples)}


def test_a_carried_episode_ends_as_its_static_row(params, static):
  runner = envs.EnvRunner(env_fixtures.Graded(), num_workers=0)
  carry = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
  try:
    runs = _steps(params, _sampler(runner, carry), 4)
  finally:
    runner.close()
  first = runs[0]
  # The first step trains B = 2 groups of the 4 it started and carries the
  # others, with their histories.
  assert len(first.examples) == 2
  assert first.metrics["rollout/carried_groups"] >= 1
  assert first.rollout.completion_tokens.shape[0] == 2 * G
  where = _by_prompt(runs)
  originals = FIRST["prompt"] + MORE["prompt"]
  assert set(originals) <= set(where)
  carried = [p for p in originals if where[p][0] > 0]
  assert carried, "nothing was carried past the first step"
  mixed = 0
  for i, prompt in enumerate(originals):
    k, j = where[prompt]
    got, want = runs[k].rollout, static.rollout
    a, b = slice(j * G, (j + 1) * G), slice(i * G, (i + 1) * G)
    for field in ("completion_tokens", "completion_mask", "observation_mask",
                  "lengths", "finished", "turn_rewards", "prompt_tokens"):
      np.testing.assert_array_equal(getattr(got, field)[a],
                                    getattr(want, field)[b],
                                    err_msg=f"{prompt}: {field}")
    np.testing.assert_allclose(got.sampler_logprobs[a],
                               want.sampler_logprobs[b], atol=2e-5)
    np.testing.assert_array_equal(runs[k].env_reward[a], static.env_reward[b])
    assert runs[k].turn_tokens[a] == static.turn_tokens[b]
    versions = runs[k].token_versions[a]
    mask = got.completion_mask[a]
    assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
    assert versions[mask].max() == k  # its last token: the step it ended
    for row, m in zip(versions, mask):  # each token's version, in order
      assert (np.diff(row[m]) >= 0).all()
    mixed += int(versions[mask].min() < k)
  assert mixed, "no trained group holds tokens of two versions"


def test_the_carry_saved_and_loaded_plays_the_same_next_step(params):
  """A checkpoint's carried episodes (``arrays``/``load_arrays``): the next
  step from the loaded carry is the step from the live one."""
  runner = envs.EnvRunner(env_fixtures.Graded(), num_workers=0)
  try:
    live = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
    sampler = _sampler(runner, live)
    _steps(params, sampler, 1)
    saved = {k: np.array(v) for k, v in live.arrays().items()}
    assert "episodes" in saved
    loaded = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
    loaded.load_arrays(saved, group_size=G, max_new_tokens=SC.max_new_tokens,
                       policy_logp=True, blocks=1)
    key = jax.random.key(11)
    a = jax.device_get(sampler.run(params, FILLER[0], key, version=1))
    b = jax.device_get(_sampler(runner, loaded).run(params, FILLER[0], key,
                                                    version=1))
  finally:
    runner.close()
  assert a.examples == b.examples
  for x, y in zip(jax.tree.leaves(a.rollout), jax.tree.leaves(b.rollout)):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(a.token_versions, b.token_versions)
  assert [gr.prompt for gr in live.groups] == [gr.prompt for gr in
                                               loaded.groups]


def test_a_carry_of_another_shape_is_refused_naming_the_field(params):
  runner = envs.EnvRunner(env_fixtures.Graded(), num_workers=0)
  try:
    live = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
    _steps(params, _sampler(runner, live), 1)
  finally:
    runner.close()
  saved = live.arrays()
  fresh = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
  with pytest.raises(ValueError, match="tokens has shape .* expected"):
    fresh.load_arrays(saved, group_size=G, max_new_tokens=SC.max_new_tokens + 1,
                      policy_logp=True, blocks=1)
  with pytest.raises(ValueError, match="group_size"):
    fresh.load_arrays(saved, group_size=G + 1,
                      max_new_tokens=SC.max_new_tokens, policy_logp=True,
                      blocks=1)
  cut = dict(saved, episodes=saved["episodes"][:-5])  # a half-written blob
  with pytest.raises(ValueError, match="carried episodes"):
    fresh.load_arrays(cut, group_size=G, max_new_tokens=SC.max_new_tokens,
                      policy_logp=True, blocks=1)


def test_the_carry_caps_by_age_count_and_slots_on_both_sides():
  """``keep``: a started group is kept at age ``max_age`` and dropped at
  ``max_age + 1``; at most ``max_carried`` started groups; their unfinished
  episodes with a history fit the slots; waiting groups are all kept."""
  def group(born, history):
    rows = {"over": np.zeros(G, bool), "mask": np.zeros((G, 4), bool)}
    rows["mask"][:history, 0] = True
    return episode_carry.CarriedGroup({}, "p", 0, born, rows, [None] * G,
                                      [[]] * G, [[]] * G)

  carry = episode_carry.EpisodeCarry(slots=4, max_age=2, max_carried=2)
  carry.keep([group(3, 1), group(2, 1)], next_version=5)  # ages 2 and 3
  assert [gr.born for gr in carry.groups] == [3] and carry.dropped == 1
  carry = episode_carry.EpisodeCarry(slots=4, max_age=9, max_carried=2)
  carry.keep([group(1, 1), group(2, 1), group(3, 1), group(None, 0)], 5)
  assert [gr.born for gr in carry.groups] == [1, 2, None]
  assert carry.dropped == 1
  carry = episode_carry.EpisodeCarry(slots=4, max_age=9, max_carried=5)
  carry.keep([group(1, 3), group(2, 1), group(3, 1)], 5)  # 3 + 1 = 4 slots
  assert [gr.born for gr in carry.groups] == [1, 2] and carry.dropped == 1


def test_failing_environments_end_their_episodes_and_the_steps_go_on(params):
  """Partial steps over an environment that kills its worker, hangs past
  the timeout (a step the carry waits for) or refuses a reset: each such
  episode ends as failed, counted in the metrics, wherever it stops; the
  other episodes train."""
  runner = envs.EnvRunner(env_fixtures.Misbehaves(), num_workers=1,
                          timeout_s=1.0)
  carry = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
  sampler = _sampler(runner, carry)
  bad = ["exit", "nan_reward", "hang", "bad_reset"]
  runs = []
  try:
    for i in range(4):
      examples = {"prompt": bad[:2]} if i == 0 else {"prompt": ["k", "lm"]}
      runs.append(jax.device_get(sampler.run(
          params, examples, jax.random.key(i), version=i,
          more=(lambda: {"prompt": bad[2:]}) if i == 0 else None)))
  finally:
    runner.close()
  seen = set()
  t = SC.max_new_tokens
  for run in runs:
    prompts = [ex["prompt"] for ex in run.examples]
    bad_rows = np.repeat([p in bad for p in prompts], G)
    # A row of a bad prompt fails, unless its one turn ran to the budget
    # (then no step was asked of the environment).
    budget = np.array([bool(spans) and spans[-1][1] == t
                       for spans in run.turn_tokens])
    np.testing.assert_array_equal(run.failed, bad_rows & ~budget)
    assert np.isnan(run.env_reward[run.failed]).all()
    assert np.isfinite(run.env_reward[~run.failed]).all()
    assert run.metrics["env/failed_episodes"] == run.failed.sum()
    seen |= {p for i, p in enumerate(prompts)
             if run.failed[i * G:(i + 1) * G].any()}
  # A killed worker, a hang and a failed reset each failed an episode (the
  # NaN prompt's rows run to the budget here: no step asked).
  assert seen >= {"exit", "hang", "bad_reset"}
  assert sum(r.metrics["env/timeouts"] for r in runs) >= 1
  assert sum(r.metrics["env/worker_restarts"] for r in runs) >= 1


def test_a_nan_turn_reward_fails_its_episode_carried_or_not(params):
  runner = envs.EnvRunner(env_fixtures.Graded((1.0, float("nan"), 2.0)),
                          num_workers=0)
  carry = episode_carry.EpisodeCarry(slots=4, max_age=10, max_carried=2)
  try:
    runs = _steps(params, _sampler(runner, carry), 4)
  finally:
    runner.close()
  failed_carried = 0
  for k, run in enumerate(runs):
    assert run.metrics["env/failed_episodes"] == run.failed.sum()
    assert np.isnan(run.env_reward[run.failed]).all()
    np.testing.assert_array_equal(run.rollout.turn_rewards[run.failed], 0)
    # The others had one step at most (reward 1) or none (0).
    assert set(run.env_reward[~run.failed]) <= {0.0, 1.0}
    for i, ex in enumerate(run.examples):
      if k and ex["prompt"] in FIRST["prompt"] + MORE["prompt"]:
        failed_carried += int(run.failed[i * G:(i + 1) * G].sum())
  assert sum(r.failed.sum() for r in runs) > 0
  assert failed_carried > 0  # a carried episode failed after its carry
