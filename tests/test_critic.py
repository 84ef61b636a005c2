"""PPO with a value model: GAE, the clipped value loss, the critic trained in
the same jitted step, the loop and the config checks.

References are independent of the code under test: a numpy backward
recursion written per row over its masked tokens, the hand-derived gradient
of the clipped value loss, and the plain (critic-free) step on the same batch.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import checkpoint as ckpt_lib
from rljax import models, train
from rljax import objectives as obj
from rljax.advantages import gae as gae_lib
from rljax.train import critic as critic_lib
from tests.test_loop import loop_config, rl_rows
from tests.test_train import load_config


# --- GAE ---------------------------------------------------------------------


def _numpy_gae(rewards, values, mask, gamma, lam):
  """Per row: walk its masked tokens backward; the reward at the last one."""
  n, t = values.shape
  adv = np.zeros((n, t))
  ret = np.zeros((n, t))
  for i in range(n):
    idx = np.flatnonzero(mask[i])
    next_value, next_adv = 0.0, 0.0
    for j, k in enumerate(idx[::-1]):
      r = rewards[i] if j == 0 else 0.0
      delta = r + gamma * next_value - values[i, k]
      next_adv = delta + gamma * lam * next_adv
      next_value = values[i, k]
      adv[i, k] = next_adv
      ret[i, k] = next_adv + values[i, k]
  return adv, ret


def _gae_batch():
  """Prompt columns 0-2 (row 1 left-padded), ragged completions, a hole in
  row 3 and a row with no completion token."""
  rng = np.random.RandomState(0)
  n, t = 5, 9
  mask = np.zeros((n, t), bool)
  mask[0, 3:9] = True
  mask[1, 3:6] = True
  mask[2, 3:4] = True
  mask[3, 3:9] = True
  mask[3, 5] = False
  values = rng.randn(n, t).astype(np.float32)
  rewards = np.array([1.0, -0.5, 2.0, 0.3, 7.0], np.float32)
  return rewards, values, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_gae_equals_numpy_backward_recursion(gamma, lam):
  rewards, values, mask = _gae_batch()
  adv, ret = jax.jit(gae_lib.gae_advantages, static_argnums=(3, 4))(
      rewards, values, mask, gamma, lam)
  want_adv, want_ret = _numpy_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(adv)[~mask] == 0) and np.all(np.asarray(adv)[4] == 0)


def test_gae_with_gamma_lam_one_is_reward_minus_value():
  rewards, values, mask = _gae_batch()
  adv, ret = gae_lib.gae_advantages(rewards, values, mask)
  np.testing.assert_allclose(adv, np.where(mask, rewards[:, None] - values, 0),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, np.where(mask, rewards[:, None], 0),
                             rtol=1e-6)


def test_whitened_advantages_equal_numpy():
  rewards, values, mask = _gae_batch()
  adv, _ = gae_lib.gae_advantages(rewards, values, mask, 0.9, 0.8)
  a = np.asarray(adv)[mask].astype(np.float64)
  want = (a - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8)
  got = np.asarray(gae_lib.whiten_advantages(adv, mask))
  np.testing.assert_allclose(got[mask], want, rtol=1e-5, atol=1e-5)
  assert np.all(got[~mask] == 0)


def test_gae_rejects_bad_shapes():
  rewards, values, mask = _gae_batch()
  with pytest.raises(ValueError, match="values_NxT"):
    gae_lib.gae_advantages(rewards, values[:3], mask[:3])
  with pytest.raises(ValueError, match="mask_NxT"):
    gae_lib.gae_advantages(rewards, values, mask[:, :4])


# --- the clipped value loss ------------------------------------------------


def test_clipped_value_loss_and_gradient_equal_hand_derivation():
  rng = np.random.RandomState(3)
  shape = (4, 7)
  old = rng.randn(*shape).astype(np.float32)
  v = (old + rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
  ret = rng.randn(*shape).astype(np.float32)
  mask = rng.rand(*shape) > 0.3
  c = 0.4

  def loss(v):
    per_token, _ = critic_lib.clipped_value_loss(v, old, ret, c)
    return obj.aggregate_loss(per_token, mask, "token_mean")

  # By hand: V_clip = clip(V, old - c, old + c); the larger branch wins; its
  # derivative is (V - R), or (V_clip - R) times 1[|V - old| < c].
  v64, old64, ret64 = (x.astype(np.float64) for x in (v, old, ret))
  v_clip = np.clip(v64, old64 - c, old64 + c)
  a, b = (v64 - ret64) ** 2, (v_clip - ret64) ** 2
  assert (b > a)[mask].any() and (b < a)[mask].any()  # both branches occur
  n = mask.sum()
  want_loss = (0.5 * np.maximum(a, b))[mask].sum() / n
  inside = np.abs(v64 - old64) < c
  want_grad = np.where(b > a, (v_clip - ret64) * inside, v64 - ret64)
  want_grad = np.where(mask, want_grad, 0.0) / n
  value, grad = jax.value_and_grad(loss)(jnp.asarray(v))
  np.testing.assert_allclose(value, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)

  def surrogate(v):
    """verl's compute_value_loss, written independently (token mean)."""
    v_clip = jnp.where(v > old + c, old + c, jnp.where(v < old - c, old - c, v))
    per_token = 0.5 * jnp.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / n

  np.testing.assert_allclose(grad, jax.grad(surrogate)(jnp.asarray(v)),
                             rtol=1e-5, atol=1e-7)
  _, clipped = critic_lib.clipped_value_loss(v, old, ret, c)
  np.testing.assert_array_equal(np.asarray(clipped) > 0, b > a)


def test_value_loss_without_clip_is_half_squared_error():
  v, ret = jnp.array([[1.0, 2.0]]), jnp.array([[0.0, 5.0]])
  loss, clipped = critic_lib.clipped_value_loss(v, v + 10.0, ret, None)
  np.testing.assert_allclose(loss, [[0.5, 4.5]])
  assert not np.any(clipped)


# --- the critic in the jitted step -------------------------------------------

MC = models.get_preset("tiny")


@pytest.fixture(scope="module")
def batch():
  rng = np.random.RandomState(1)
  n, length = 8, 10
  tokens = rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32)
  input_mask = np.ones((n, length), bool)
  input_mask[1, :2] = False  # left-padded prompt
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 5:] = True
  loss_mask[2, 8:] = False
  input_mask[2, 8:] = False
  rewards = rng.randn(n).astype(np.float32)
  # The plain step reads the rewards as advantages, the critic's step as
  # GAE's rewards.
  return train.RLBatch(tokens, input_mask, loss_mask, rewards,
                       np.zeros((n, length), np.float32), rewards_N=rewards)


def test_values_at_t_do_not_see_token_t(batch):
  params = critic_lib.init_params(models.init_params(MC, jax.random.key(0)), MC)
  params["head"]["kernel"] = jax.random.normal(jax.random.key(1), (MC.d_model,))
  tokens = np.array(batch.tokens_NxL)
  values = jax.jit(critic_lib.values, static_argnums=1)
  v = values(params, MC, tokens, batch.input_mask_NxL)
  # A new array, not an in-place edit: on CPU, jit may read a numpy argument
  # without copying it, after the call has returned.
  changed = tokens.copy()
  changed[:, 6] = (changed[:, 6] + 1) % MC.vocab_size
  v2 = values(params, MC, changed, batch.input_mask_NxL)
  np.testing.assert_allclose(v[:, :7], v2[:, :7], rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(v[:, 7]) - np.asarray(v2[:, 7])).max() > 1e-4
  assert np.all(np.asarray(v[:, 0]) == 0)


def _state(params, optimizer, coef_tx, critic_opt=None, critic_params=None):
  critic = None
  if critic_opt is not None:
    critic = critic_lib.CriticState(critic_params,
                                    critic_opt.init(critic_params))
  return train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                          coef_tx.init(jnp.zeros((1, 1))),
                          jnp.zeros((), jnp.int32),
                          jax.random.key_data(jax.random.key(0)), critic)


SGD_LR = 0.5


@pytest.fixture(scope="module")
def critic_step():
  """One compiled step with a critic (gamma = lam = 1, no whitening), shared."""
  critic_opt = critic_lib.make_optimizer(3e-3)
  cfg = train.RLStepConfig(critic=critic_lib.CriticConfig(
      gamma=1.0, lam=1.0, value_clip=0.5, whiten=False))
  step = jax.jit(train.make_rl_step(MC, cfg, optax.sgd(SGD_LR),
                                    obj.ppo_clip(0.2),
                                    critic_optimizer=critic_opt))
  return step, critic_opt


@pytest.mark.slow
def test_zero_critic_policy_update_equals_the_plain_step_on_rewards(
    batch, critic_step):
  """V = 0, gamma = lam = 1, no whitening: every token's advantage is the
  row's reward, so the policy moves exactly as the critic-free step with
  advantages = rewards."""
  params = models.init_params(MC, jax.random.key(0))
  coef_tx = obj.ppo_clip(0.2)
  sgd = optax.sgd(SGD_LR)
  step, critic_opt = critic_step
  plain = jax.jit(train.make_rl_step(MC, train.RLStepConfig(), sgd, coef_tx))
  critic_params = critic_lib.init_params(params, MC)
  a, out = step(_state(params, sgd, coef_tx, critic_opt, critic_params), batch)
  b, _ = plain(_state(params, sgd, coef_tx), batch)
  moved = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(
      jax.tree.leaves(a.params), jax.tree.leaves(params)))
  assert moved > 1e-4
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  # The critic's first loss: V = 0 against returns R on every loss token.
  m = batch.loss_mask_NxL
  want = 0.5 * (np.broadcast_to(batch.advantages_NxL[:, None], m.shape)[m] ** 2
                ).mean()
  np.testing.assert_allclose(out["critic/value_loss"], want, rtol=1e-5)
  assert out["critic/grad_norm"] > 0


@pytest.mark.slow
def test_the_critic_learns_the_returns_over_steps(batch, critic_step):
  params = models.init_params(MC, jax.random.key(0))
  coef_tx = obj.ppo_clip(0.2)
  step, critic_opt = critic_step
  state = _state(params, optax.sgd(SGD_LR), coef_tx, critic_opt,
                 critic_lib.init_params(params, MC))
  losses = []
  for _ in range(12):
    state, out = step(state, batch)
    losses.append(float(out["critic/value_loss"]))
    assert all(math.isfinite(float(v)) for v in jax.tree.leaves(out))
  assert losses[-1] < 0.3 * losses[0], losses
  assert int(state.step) == 12


def test_make_rl_step_needs_the_critic_optimizer():
  with pytest.raises(ValueError, match="critic_optimizer"):
    train.make_rl_step(MC, train.RLStepConfig(
        critic=critic_lib.CriticConfig()), optax.sgd(1.0), obj.ppo_clip(0.2))


# --- the loop and the config ---------------------------------------------------


@pytest.mark.slow
def test_ppo_with_a_critic_trains_in_the_loop_and_resumes(tmp_path):
  """One sample per prompt; the run stops after step 1 and resumes (the
  critic's params and optimizer state are in the checkpoint)."""
  overrides = {"rl.advantage": "gae", "rl.group_size": 1,
               "rl.prompts_per_step": 16, "critic.learning_rate": 1e-3}
  train.run(loop_config(**overrides, **{"rl.num_steps": 1}), str(tmp_path))
  train.run(loop_config(**overrides), str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert math.isfinite(r["critic/value_loss"]) and r["critic/grad_norm"] > 0
    assert r["grad_norm"] > 0
  manager = ckpt_lib.CheckpointManager(tmp_path / "checkpoints",
                                       async_save=False)
  heads = [manager.restore(step, None)[0]["state"]["critic"]["params"]["head"]
           for step in (1, 2)]
  manager.close()
  assert np.abs(heads[0]["kernel"]).max() > 0  # trained from zero
  assert np.abs(heads[1]["kernel"] - heads[0]["kernel"]).max() > 0
  # The run directory still loads as a policy (the critic is extra state).
  assert train.load_policy(str(tmp_path), 2).step == 2


@pytest.mark.parametrize("field, value, match", [
    ("critic.gamma", 1.5, r"critic.gamma=1.5"),
    ("critic.lam", -0.1, r"critic.lam=-0.1"),
    ("critic.value_clip", 0.0, r"critic.value_clip=0.0"),
    ("critic.learning_rate", 0.0, r"critic.learning_rate=0.0"),
    ("rl.advantage_clip", 2.0, r"rl.advantage_clip=2.0 with rl.advantage='gae'"),
])
def test_bad_critic_settings_fail_before_compile(field, value, match):
  config = loop_config(**{"rl.advantage": "gae", field: value})
  with pytest.raises(ValueError, match=match):
    train.build.validate(config)


def test_critic_config_only_with_gae():
  assert train.build.critic_config(loop_config()) is None
  cfg = train.build.critic_config(loop_config(**{
      "rl.advantage": "gae", "critic.gamma": 0.9, "critic.value_clip": None}))
  assert cfg == critic_lib.CriticConfig(gamma=0.9, lam=1.0, value_clip=None,
                                        whiten=True)


def test_arithmetic_ppo_config_builds_a_critic():
  config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs",
                                    "arithmetic_ppo.py"), "tiny")
  train.build.validate(config)
  assert train.build.step_config(config).critic is not None
