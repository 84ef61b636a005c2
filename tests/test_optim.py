"""Tests for rljax.optim."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import objectives as obj
from rljax import optim
from tests import transform_harness as harness


def _params():
  return {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1])}


def _grads(seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), _params())


@pytest.mark.parametrize("rule, ess, factor", [
    ("sqrt", 0.25, 0.5), ("sqrt", 1.0, 1.0), ("sqrt", 2.0, 1.0),
    ("linear", 0.25, 0.25), ("sqrt", 0.0, 0.0), ("sqrt", float("nan"), 0.0),
])
def test_scale_by_ess_factor(rule, ess, factor):
  tx = optim.scale_by_ess(rule)
  grads = _grads()
  out, state = jax.jit(lambda g, e: tx.update(g, tx.init(g), ess=e))(
      grads, jnp.float32(ess))
  jax.tree.map(lambda o, g: np.testing.assert_allclose(o, factor * g,
                                                       rtol=1e-6), out, grads)
  np.testing.assert_allclose(state.scale, factor, rtol=1e-6)


def test_scale_by_ess_base_ratio_and_dtype():
  tx = optim.scale_by_ess("linear", base_ess_ratio=0.5)
  g = {"w": jnp.ones(3, jnp.bfloat16)}
  out, state = tx.update(g, tx.init(g), ess=0.2)
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out["w"], np.float32), 0.4,
                             rtol=1e-2)
  assert tx.init(g).scale == 1.0 and state.scale.dtype == jnp.float32


def test_scale_by_ess_errors():
  tx = optim.scale_by_ess()
  g = _grads()
  with pytest.raises(ValueError, match="ess"):
    tx.update(g, tx.init(g))
  with pytest.raises(ValueError, match="scalar"):
    tx.update(g, tx.init(g), ess=jnp.ones(2))
  with pytest.raises(ValueError, match="rule='cube'"):
    optim.scale_by_ess("cube")
  with pytest.raises(ValueError, match="base_ess_ratio=0"):
    optim.scale_by_ess(base_ess_ratio=0)


def test_vcpo_ess_from_sequence_weights():
  """VCPO: ESS over trajectories of w_i = pi_old(y_i) / mu(y_i)."""
  rng = np.random.default_rng(1)
  old = rng.normal(size=(5, 4)) * 0.5 - 1
  sampler = old + rng.normal(size=(5, 4)) * 0.4
  mask = np.arange(4)[None, :] < np.array([4, 2, 3, 1, 4])[:, None]
  w = np.exp(np.sum(np.where(mask, old - sampler, 0), -1))
  expected = w.sum() ** 2 / (len(w) * (w ** 2).sum())
  weights = obj.sequence_importance_weights(
      jnp.asarray(old, jnp.float32), jnp.asarray(sampler, jnp.float32),
      jnp.asarray(mask))
  np.testing.assert_allclose(obj.normalized_ess(weights), expected, rtol=1e-5)


def test_adamw_with_ess_scaling_equals_scaled_learning_rate():
  """Scaling the final update by sqrt(s) is VCPO's per-step LR scaling."""
  lr, wd, ess = 1e-2, 0.1, 0.36
  opt = optim.make_optimizer("adamw", lr, weight_decay=wd,
                             ess_scaling="sqrt")
  ref = optax.adamw(lr * np.sqrt(ess), weight_decay=wd)
  params = _params()
  state, ref_state = opt.init(params), ref.init(params)
  for seed in range(3):
    g = _grads(seed)
    u, state = opt.update(g, state, params, ess=ess)
    ref_u, ref_state = ref.update(g, ref_state, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4),
                 u, ref_u)
    params = optax.apply_updates(params, u)
  metrics = optim.optimizer_metrics(state)
  np.testing.assert_allclose(metrics["ess_scale"], 0.6, rtol=1e-6)
  np.testing.assert_allclose(metrics["learning_rate"], lr, rtol=1e-6)


def test_make_optimizer_clips_and_skips_nonfinite():
  opt = optim.make_optimizer("sgd", 1.0, max_grad_norm=1.0,
                             max_consecutive_nonfinite=2)
  params = {"w": jnp.zeros(2)}
  state = opt.init(params)
  update = jax.jit(opt.update)
  u, state = update({"w": jnp.array([3.0, 4.0])}, state, params)
  np.testing.assert_allclose(u["w"], [-0.6, -0.8], rtol=1e-6)  # Norm 5 -> 1.
  bad = {"w": jnp.array([jnp.nan, 1.0])}
  for count in (1, 2):
    u, state = update(bad, state, params)
    assert np.all(np.asarray(u["w"]) == 0)
    metrics = optim.optimizer_metrics(state)
    assert int(metrics["nonfinite_skipped_total"]) == count
    assert int(metrics["nonfinite_consecutive"]) == count
  u, state = update(bad, state, params)  # A third in a row is let through.
  assert np.isnan(np.asarray(u["w"])).any()


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_make_optimizer_names(name):
  schedule = optax.linear_schedule(1e-3, 0.0, 10)
  opt = optim.make_optimizer(
      name, schedule, weight_decay=0.01 if name in ("adamw", "lion") else 0.0,
      momentum=0.9 if name == "sgd" else None)
  params = _params()
  state = opt.init(params)
  u, state = opt.update(_grads(), state, params)
  assert jax.tree.structure(u) == jax.tree.structure(params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u))
  np.testing.assert_allclose(optim.optimizer_metrics(state)["learning_rate"],
                             1e-3, rtol=1e-6)


def test_make_optimizer_errors():
  with pytest.raises(ValueError, match="name='rmsprop'"):
    optim.make_optimizer("rmsprop")
  with pytest.raises(ValueError, match="weight_decay=0.1"):
    optim.make_optimizer("adam", weight_decay=0.1)


def _inputs(seed):
  return _grads(seed), {"ess": jnp.float32(0.3 + 0.2 * seed)}


HARNESS_CASES = [
    harness.Case("scale_by_ess_sqrt", optim.scale_by_ess,
                 dict(rule="sqrt", base_ess_ratio=0.8), _inputs),
    harness.Case("scale_by_ess_linear", optim.scale_by_ess,
                 dict(rule="linear"), _inputs),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
def test_harness(case, check):
  check(case)


@pytest.mark.parametrize("name", ["adamw", "adam", "lion", "sgd"])
def test_bfloat16_params_keep_their_state_dtypes(name):
  """The injected float32 hyperparameters do not promote bfloat16 moments:
  the state can be a ``lax.scan`` carry (the RL step's updates)."""
  params = {"w": jnp.ones((3,), jnp.bfloat16), "b": jnp.zeros((), jnp.float32)}
  tx = optim.make_optimizer(name, 1e-2, momentum=0.9 if name == "sgd" else None)
  state = tx.init(params)
  grads = {"w": jnp.full((3,), 0.5, jnp.bfloat16), "b": jnp.ones(())}
  updates, new = tx.update(grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(
      lambda x: x.dtype, state)
  moved = optax.apply_updates(params, updates)
  assert moved["w"].dtype == jnp.bfloat16 and float(moved["w"][0]) < 1.0
  jax.lax.scan(lambda s, _: (tx.update(grads, s, params)[1], None), state,
               None, length=2)


@pytest.mark.parametrize("num_steps", [1, 2, 10, 20, 21])
def test_warmup_cosine_accepts_any_step_count(num_steps):
  """SFT's and reward-model training's schedule: 0 at the first step, the
  peak after max(1, n // 10) warm-up steps, a tenth of it at n (one step,
  the smallest count, crashed optax before: no steps left to decay)."""
  peak = 1e-3
  warmup = max(1, num_steps // 10)
  fn = optim.warmup_cosine(peak, num_steps)
  assert float(fn(0)) == 0.0
  np.testing.assert_allclose(float(fn(warmup)), peak, rtol=1e-6)
  if num_steps > warmup:
    np.testing.assert_allclose(float(fn(num_steps)), peak / 10, rtol=1e-5)
    # Cosine half-way through the decay: between the peak and its tenth.
    mid = (warmup + num_steps) / 2
    np.testing.assert_allclose(float(fn(mid)), peak / 10 + (peak - peak / 10)
                               * 0.5 * (1 + np.cos(np.pi * 0.5)), rtol=1e-4)
