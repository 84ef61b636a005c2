"""Episodes on slots (continuous batching of multi-turn episodes).

The reference is the static batch of the same episodes: every episode gets
its own row there from the start, so an episode played in a refilled slot
must be the same episode, token for token (its draws are its row's), with
the same observations, rewards and failures.
"""

import jax
import numpy as np
import pytest

from rljax import envs, models
from rljax.rollout import episodes as episodes_lib
from rljax.rollout import multi_turn as mt
from tests import env_fixtures
from tests.test_envs import EXAMPLES, MC, O, SC, TOK

TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=O)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _run(params, env, *, slots=None, refill_rows=1, examples=EXAMPLES,
         config=SC, turns=TURNS, workers=0, key=3):
  runner = envs.EnvRunner(env, num_workers=workers, timeout_s=3.0)
  try:
    sampler = mt.MultiTurnSampler(MC, config, turns, runner, TOK, (8, 16),
                                  slots=slots, refill_rows=refill_rows)
    return jax.device_get(sampler.run(params, examples, jax.random.key(key)))
  finally:
    runner.close()


@pytest.fixture(scope="module")
def static(params):
  return _run(params, env_fixtures.Graded((1.0, -0.25, 2.0)))


@pytest.mark.parametrize("slots,refill_rows", [(2, 1), (4, 2), (5, 1), (2, 5)])
def test_each_episode_on_slots_is_its_static_row(params, static, slots,
                                                 refill_rows):
  got = _run(params, env_fixtures.Graded((1.0, -0.25, 2.0)), slots=slots,
             refill_rows=refill_rows)
  a, b = static.rollout, got.rollout
  for field in ("prompt_tokens", "prompt_mask", "completion_tokens",
                "completion_mask", "observation_mask", "lengths", "finished",
                "turn_rewards"):
    np.testing.assert_array_equal(getattr(b, field), getattr(a, field),
                                  err_msg=field)
  np.testing.assert_allclose(b.sampler_logprobs, a.sampler_logprobs,
                             atol=2e-5)
  np.testing.assert_allclose(b.policy_logprobs, a.policy_logprobs, atol=2e-5)
  assert got.turn_tokens == static.turn_tokens
  np.testing.assert_array_equal(got.env_reward, static.env_reward)
  n = len(static.env_reward)
  m = got.metrics
  assert m["rollout/slots"] == slots and m["rollout/prefills"] == n
  # The first fill prefills each of its examples' prompts once.
  assert 1 <= m["rollout/prefilled_rows"] < n + slots
  assert 0 < m["rollout/slot_utilization"] <= 1
  model_tokens = (a.completion_mask & ~a.observation_mask).sum()
  # Fewer slots than episodes: more decode steps than the static batch's
  # longest episode, each with at most `slots` tokens.
  assert m["rollout/decode_steps"] * slots >= model_tokens
  for k, v in static.metrics.items():
    if k != "time/env":
      assert m[k] == v, k


def test_a_prompt_starting_several_rows_is_prefilled_once_by_hand():
  """Rows 2 k and 2 k + 1 play example k (G = 2): each example's prompt
  once, padded to a power of two with the last, and each row's index."""
  tokens = np.arange(10)[:, None] * np.ones((1, 3), np.int32)
  mask = np.ones((10, 3), bool)
  lead, lead_mask, source = episodes_lib.distinct_prompts(
      np.array([0, 1, 2, 3, 5, 9]), 2, tokens, mask)
  np.testing.assert_array_equal(lead[:, 0], [0, 2, 4, 8])
  np.testing.assert_array_equal(source, [0, 0, 1, 1, 2, 3])
  assert lead_mask.shape == (4, 3)
  lead, _, source = episodes_lib.distinct_prompts(np.array([4, 0, 2]), 2, tokens, mask)
  np.testing.assert_array_equal(lead[:, 0], [0, 2, 4, 4])  # 3 -> 4 rows
  np.testing.assert_array_equal(source, [2, 0, 1])
  lead, _, source = episodes_lib.distinct_prompts(np.array([7, 6]), 2, tokens, mask)
  np.testing.assert_array_equal(lead[:, 0], [6])
  np.testing.assert_array_equal(source, [0, 0])


def test_slot_settings_are_checked():
  runner = envs.EnvRunner(env_fixtures.Scripted(), num_workers=0)
  for kwargs, match in (({"slots": 0}, "rl.rollout_slots=0"),
                        ({"slots": 2, "refill_rows": 0},
                         "rl.rollout_refill_rows=0")):
    with pytest.raises(ValueError, match=match):
      mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8,), **kwargs)


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_failing_environments_on_slots_fail_their_episodes_only(params,
                                                                workers):
  """A step that raises, answers garbage or a NaN reward, a failed reset,
  and with a worker a step that hangs or kills its worker, each in a slot
  that is then given to the next episode: the same failures as the static
  batch, and every other episode plays."""
  ways = ["raise", "fine", "not_a_step", "nan_reward", "fine",
          "not_json_state", "bad_reset", "long_prompt", "fine"]
  if workers:
    ways += ["hang", "fine", "exit", "fine"]
  examples = {"prompt": ways}
  config = SC.replace(num_samples=1)
  turns = mt.TurnConfig(max_turns=2, max_turn_tokens=3)
  env = env_fixtures.Misbehaves()
  want = _run(params, env, examples=examples, config=config, turns=turns,
              workers=workers, key=1)
  got = _run(params, env, slots=3, examples=examples, config=config,
             turns=turns, workers=workers, key=1)
  assert got.failed.tolist() == [w != "fine" for w in ways]
  np.testing.assert_array_equal(got.failed, want.failed)
  np.testing.assert_array_equal(got.env_reward, want.env_reward)
  np.testing.assert_array_equal(got.rollout.completion_tokens,
                                want.rollout.completion_tokens)
  for k in ("env/failed_episodes", "env/errors", "env/timeouts"):
    assert got.metrics[k] == want.metrics[k], k
  if workers:
    assert got.metrics["env/timeouts"] == 1


class _Stop(Exception):
  pass


def test_async_episodes_decode_a_copy_and_hand_the_run_the_dispatch(params):
  """Under an asynchronous schedule on one mesh, the episodes decode with a
  copy of the params (the update donates them: equal values, other
  buffers), and the collector hands ``on_dispatch`` (which dispatches the
  update) to the episodes' run, which calls it once their first decode is
  dispatched (the next test)."""
  from rljax import rollout, rewards  # pylint: disable=import-outside-toplevel
  events = []

  class Episodes:
    def run(self, p, examples, key, *, on_dispatch=None, **_):
      same = jax.tree.leaves(jax.tree.map(lambda a, b: a is b, p, params))
      events.append("episodes on " + (
          "the params" if all(same) else "a copy" if not any(same) else "?"))
      jax.tree.map(np.testing.assert_array_equal, p, params)
      if on_dispatch is not None:
        on_dispatch()
      raise _Stop

  class Postprocess:
    extra_samples, failed_rewards = 0, "zero"

  evaluator = rewards.RewardEvaluator(
      [rewards.RewardSpec("env", lambda *a, **k: 0.0)], num_workers=0)
  collector = rollout.Collector(
      sampler=None, tokenizer=TOK, evaluator=evaluator,
      postprocess=Postprocess(), group_size=2, buckets=(8,), eos_ids=(2,),
      correctness="env", episodes=Episodes())
  with pytest.raises(_Stop):
    collector.collect(params, EXAMPLES, jax.random.key(0), None,
                      on_dispatch=lambda: events.append("update"))
  assert events == ["episodes on a copy", "update"]
  events.clear()
  with pytest.raises(_Stop):  # synchronous: no update to overlap
    collector.collect(params, EXAMPLES, jax.random.key(0), None)
  assert events == ["episodes on the params"]


@pytest.mark.parametrize("slots", [None, 2])
def test_the_update_is_dispatched_after_the_first_decode(params, static,
                                                         slots):
  """``run(on_dispatch=...)``: called once, right after the first decode is
  dispatched (on one device the update then runs while the host waits for
  the first environment steps), on the static batch and on slots; the
  episodes are those of a run without it."""
  events = []
  runner = envs.EnvRunner(env_fixtures.Graded((1.0, -0.25, 2.0)),
                          num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8, 16),
                                  slots=slots)
    decode = sampler._decode  # pylint: disable=protected-access

    def traced(*args, **kw):
      events.append("decode")
      return decode(*args, **kw)

    sampler._decode = traced  # pylint: disable=protected-access
    got = jax.device_get(sampler.run(
        params, EXAMPLES, jax.random.key(3),
        on_dispatch=lambda: events.append("update")))
  finally:
    runner.close()
  assert events[:2] == ["decode", "update"] and events.count("update") == 1
  assert events.count("decode") > 1
  np.testing.assert_array_equal(got.rollout.completion_tokens,
                                static.rollout.completion_tokens)


@pytest.mark.parametrize("slots,step_rows", [(4, None), (None, 2)])
def test_steps_in_flight_give_the_same_episodes(params, static, slots,
                                                step_rows):
  """With worker processes a round's steps are started without waiting and
  taken back as they end (``EnvRunner.submit_steps`` / ``poll_steps``), in
  whatever order their latencies give: on slots and on the static batch in
  rounds, the episodes are those the in-process environment gives."""
  turns = mt.TurnConfig(max_turns=4, max_observation_tokens=O,
                        step_rows=step_rows)
  got = _run(params, env_fixtures.Jittery((1.0, -0.25, 2.0)), slots=slots,
             refill_rows=2, turns=turns, workers=3)
  np.testing.assert_array_equal(got.rollout.completion_tokens,
                                static.rollout.completion_tokens)
  np.testing.assert_array_equal(got.rollout.observation_mask,
                                static.rollout.observation_mask)
  np.testing.assert_array_equal(got.env_reward, static.env_reward)
  np.testing.assert_array_equal(got.rollout.turn_rewards,
                                static.rollout.turn_rewards)
  assert got.turn_tokens == static.turn_tokens
  assert not got.failed.any()


@pytest.mark.parametrize("smallest,step_rows", [(1, None), (2, 2)])
def test_a_shrinking_static_batch_plays_the_same_episodes(params, static,
                                                          smallest,
                                                          step_rows):
  """``sampler.shrink_batch_to``: each round decodes only the rows playing
  their turn, in the smallest batch of ``shrink_levels`` that holds them;
  the episodes are the whole batch's, and fewer row-steps are decoded."""
  turns = mt.TurnConfig(max_turns=4, max_observation_tokens=O,
                        step_rows=step_rows)
  got = _run(params, env_fixtures.Graded((1.0, -0.25, 2.0)), turns=turns,
             config=SC.replace(shrink_batch_to=smallest))
  a, b = static.rollout, got.rollout
  for field in ("completion_tokens", "completion_mask", "observation_mask",
                "lengths", "finished", "turn_rewards"):
    np.testing.assert_array_equal(getattr(b, field), getattr(a, field),
                                  err_msg=field)
  np.testing.assert_allclose(b.sampler_logprobs, a.sampler_logprobs,
                             atol=2e-5)
  np.testing.assert_allclose(b.policy_logprobs, a.policy_logprobs, atol=2e-5)
  assert got.turn_tokens == static.turn_tokens
  np.testing.assert_array_equal(got.env_reward, static.env_reward)
  m, n = got.metrics, len(static.env_reward)
  # Episodes end at different turns (lengths 18 to 24 of T=24), so some
  # rounds decode fewer than the N rows, never fewer than the level.
  assert smallest <= m["rollout/decode_rows"] < n
  model_tokens = int((a.completion_mask & ~a.observation_mask).sum())
  assert m["rollout/decode_utilization"] == pytest.approx(
      model_tokens / (m["rollout/decode_rows"] * m["rollout/decode_steps"]))
  # Every row-step of the whole batch that kept a token is still decoded.
  assert m["rollout/decode_rows"] * m["rollout/decode_steps"] >= model_tokens


def test_slots_refuse_a_batch_to_shrink(params):
  with pytest.raises(ValueError, match="sampler.shrink_batch_to=2 with "
                     "rl.rollout_slots=3"):
    mt.MultiTurnSampler(MC, SC.replace(shrink_batch_to=2), TURNS,
                        envs.EnvRunner(env_fixtures.Graded(), num_workers=0),
                        TOK, (8,), slots=3)
