"""Per-turn rewards of a multi-turn environment become per-token rewards,
and GAE, REINFORCE++ and ReMax read them with a discount.

The references are hand placements (each step's reward on the last model
token of the turn it answered, the other rewards on the row's last model
token) fed to numpy transcriptions of verl's estimators
(``tests/test_advantages_new_peers.py``: ``compute_gae_advantage_return``,
``compute_reinforce_plus_plus_outcome_advantage``,
``compute_remax_outcome_advantage``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import envs, models, train
from rljax.train import batch_layout, build, critic as critic_lib, steps
from rljax.rollout import multi_turn as mt
from tests import env_fixtures
from tests.test_advantages_new_peers import (_verl_gae,
                                             _verl_reinforce_plus_plus,
                                             _verl_rpp_returns)
from tests.test_envs import EXAMPLES, MC, O, SC, TOK
from tests.test_train import tiny_config

GRADES = (1.0, -0.25, 2.0)
WEIGHTS = (1.0, 0.5)  # the env reward's, the other reward's


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _episodes(params, env, key=3, max_turns=4):
  sampler = mt.MultiTurnSampler(
      MC, SC, mt.TurnConfig(max_turns=max_turns, max_observation_tokens=O),
      envs.EnvRunner(env, num_workers=0), TOK, (8,))
  return jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(key)))


@pytest.fixture(scope="module")
def graded(params):
  return _episodes(params, env_fixtures.Graded(GRADES))


def _steps_taken(total):
  """How many steps gave ``total`` (GRADES' prefix sums are distinct)."""
  sums = np.concatenate([[0.0], np.cumsum(GRADES)])
  (k,) = np.flatnonzero(np.isclose(sums, total))
  return int(k)


def _hand_turn_rewards(ep):
  """Each step's reward on the last token of the k-th model turn."""
  out = np.zeros(ep.rollout.completion_tokens.shape, np.float32)
  for row, spans in enumerate(ep.turn_tokens):
    model = [(s, e) for s, e, kind in spans if kind == "model"]
    for k in range(_steps_taken(ep.env_reward[row])):
      out[row, model[k][1] - 1] += GRADES[k]
  return out


def _other_rewards(n):
  return (np.arange(n) % 3).astype(np.float32)


def _hand_token_rewards(ep):
  """verl's ``token_level_rewards``: the env's turns, weighted, and the
  other reward, weighted, on the last model token."""
  sampled = ep.rollout.completion_mask & ~ep.rollout.observation_mask
  last = sampled.shape[1] - 1 - np.argmax(sampled[:, ::-1], 1)
  out = WEIGHTS[0] * _hand_turn_rewards(ep)
  out[np.arange(len(last)), last] += WEIGHTS[1] * _other_rewards(len(last))
  return out, sampled


def _postprocess(ep, advantage, group_size, **rl):
  config = tiny_config()
  config.rl.advantage = advantage
  for k, v in rl.items():
    config.rl[k] = v
  alg = build.algorithm(config)
  r = jax.tree.map(jnp.asarray, ep.rollout)
  n = r.lengths.shape[0]
  rewards = jnp.asarray(np.stack([ep.env_reward, _other_rewards(n)], 1),
                        jnp.float32)
  return batch_layout.postprocess(
      r, rewards, jnp.ones(n, bool), jnp.asarray(WEIGHTS),
      alg.advantage.init(rewards), algorithm=alg, group_size=group_size,
      env_column=0)


def test_each_step_reward_sits_on_the_last_token_of_its_turn(graded):
  steps_per_row = [_steps_taken(t) for t in graded.env_reward]
  assert max(steps_per_row) >= 2 and min(steps_per_row) < 3  # varied
  np.testing.assert_array_equal(graded.rollout.turn_rewards,
                                _hand_turn_rewards(graded))
  np.testing.assert_allclose(graded.rollout.turn_rewards.sum(1),
                             graded.env_reward, rtol=1e-6)


def test_token_rewards_move_the_env_reward_onto_its_turns(graded):
  want, sampled = _hand_token_rewards(graded)
  n = len(graded.env_reward)
  total = WEIGHTS[0] * graded.env_reward + WEIGHTS[1] * _other_rewards(n)
  got = batch_layout.token_rewards(
      jnp.asarray(total, jnp.float32), graded.rollout.turn_rewards,
      jnp.asarray(graded.env_reward), WEIGHTS[0], jnp.asarray(sampled))
  np.testing.assert_allclose(got, want, atol=1e-6)
  # Without the env reward among the rewards, its turns do not count.
  got = batch_layout.token_rewards(
      jnp.asarray(total, jnp.float32), graded.rollout.turn_rewards,
      jnp.zeros(n), 0.0, jnp.asarray(sampled))
  last = sampled.shape[1] - 1 - np.argmax(sampled[:, ::-1], 1)
  want = np.zeros(sampled.shape, np.float32)
  want[np.arange(n), last] = total
  np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_reads_the_turn_rewards_as_verl_does(graded, gamma):
  batch, _, _ = _postprocess(graded, "whiten_by_tokens", 3, gamma=gamma)
  want_rewards, sampled = _hand_token_rewards(graded)
  want = _verl_reinforce_plus_plus(want_rewards.astype(np.float64),
                                   sampled.astype(np.float64), gamma)
  p = graded.rollout.prompt_tokens.shape[1]
  np.testing.assert_allclose(np.where(sampled, batch.advantages_NxL[:, p:], 0),
                             want, atol=2e-5)


def test_remax_reads_the_turn_rewards_with_a_discount(graded):
  # Groups of 3 episodes: 2 trained, the last the baseline row.
  gamma = 0.9
  batch, _, _ = _postprocess(graded, "remax", 2, gamma=gamma)
  rewards, sampled = _hand_token_rewards(graded)
  returns = _verl_rpp_returns(rewards.astype(np.float64),
                              sampled.astype(np.float64), gamma)
  baseline = np.repeat(rewards.sum(1)[2::3], 3)  # verl: rm_scores.sum(-1)
  want = np.where(sampled, returns - baseline[:, None], 0.0)
  kept = np.arange(len(rewards)) % 3 != 2  # the greedy rows are dropped
  p = graded.rollout.prompt_tokens.shape[1]
  np.testing.assert_allclose(
      np.where(sampled[kept], batch.advantages_NxL[:, p:], 0), want[kept],
      atol=2e-5)


@pytest.mark.parametrize("completion_only", [False, True])
def test_gae_in_the_step_reads_the_turn_rewards_as_verl_does(
    params, graded, completion_only):
  gamma, lam = 0.9, 0.95
  batch, _, _ = _postprocess(graded, "gae", 3)
  rewards, sampled = _hand_token_rewards(graded)
  p = graded.rollout.prompt_tokens.shape[1]
  np.testing.assert_allclose(batch.token_rewards_NxL[:, p:], rewards,
                             atol=1e-6)
  np.testing.assert_array_equal(batch.token_rewards_NxL[:, :p], 0)
  t = rewards.shape[1]
  cfg = train.RLStepConfig(
      critic=critic_lib.CriticConfig(gamma=gamma, lam=lam, whiten=False),
      completion_length=t if completion_only else None)
  critic_params = critic_lib.init_params(params, MC)
  # A critic whose values are not 0, so GAE's values matter.
  critic_params = jax.tree.map(lambda x: x + 0.05, critic_params)
  opt = optax.sgd(0.1)
  state = train.TrainState(
      params, opt.init(params), optax.EmptyState(), optax.EmptyState(),
      jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)),
      critic_lib.CriticState(critic_params, opt.init(critic_params)))
  inputs, _, _ = steps.prepare_inputs(cfg, MC, state, batch)
  values = np.asarray(inputs.old_values_NxT, np.float64)
  mask = np.asarray(inputs.loss_mask_NxT, np.float64)
  assert np.abs(values[mask > 0]).max() > 1e-3
  full = np.concatenate([np.zeros((len(rewards), p)), rewards], 1)
  full = full[:, -values.shape[1]:]  # the scored columns
  assert values.shape[1] == (t if completion_only else p + t)
  want, want_returns = _verl_gae(full, values, mask, gamma, lam)
  np.testing.assert_allclose(np.asarray(inputs.advantages_NxT) * mask,
                             want * mask, atol=2e-5)
  np.testing.assert_allclose(np.asarray(inputs.returns_NxT) * mask,
                             want_returns * mask, atol=2e-5)


def test_a_nan_turn_reward_fails_its_episode_only(params):
  env = env_fixtures.Graded((1.0, float("nan"), 2.0))
  ep = _episodes(params, env)
  twice = np.array([_steps_taken(t) if np.isfinite(t) else -1
                    for t in ep.env_reward])
  # Every episode that reached its second step failed there, counted; the
  # others kept their first step's reward on its turn.
  assert ep.failed.any() and ep.metrics["env/failed_episodes"] == \
      ep.failed.sum() == ep.metrics["env/errors"]
  assert np.all(np.isnan(ep.env_reward[ep.failed]))
  np.testing.assert_array_equal(ep.rollout.turn_rewards[ep.failed], 0)
  assert set(twice[~ep.failed]) <= {0, 1}
