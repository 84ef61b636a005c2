"""Tests for rljax.objectives: coefficients, gradient identities, losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import objectives as obj
from tests import transform_harness as harness

B, T = 8, 6


def make_batch(seed, spread=0.3, b=B, t=T):
  """Random logprobs with ratios well on both sides of the clip ranges."""
  rng = np.random.default_rng(seed)
  lp = -np.abs(rng.normal(size=(b, t))) - 0.1
  old = lp + rng.normal(scale=spread, size=(b, t))
  sampler = old + rng.normal(scale=0.3, size=(b, t))
  adv = rng.normal(size=b)
  adv[::2] = np.abs(adv[::2]) + 0.1
  adv[1::2] = -np.abs(adv[1::2]) - 0.1
  lengths = rng.integers(1, t + 1, b)
  lengths[0] = t
  mask = np.arange(t)[None, :] < lengths[:, None]
  f = lambda x: jnp.asarray(x, jnp.float32)
  return f(lp), f(old), f(sampler), f(adv), jnp.asarray(mask)


def extras(old, sampler, adv, mask):
  return dict(advantages_BxT=adv, mask_BxT=mask, old_logprobs_BxT=old,
              sampler_logprobs_BxT=sampler)


def coef_loss(tx, lp, old, sampler, adv, mask, aggregation, **normalizers):
  ratio = obj.importance_ratio(lp, old, mask)
  coef, _ = tx.update(ratio, tx.init(ratio), **extras(old, sampler, adv, mask))
  return obj.policy_gradient_loss(coef, adv, lp, mask, aggregation,
                                  **normalizers)


# ----------------------------------------------------------------------------
# Direct implementations of each paper's surrogate (as a loss to minimise),
# written independently of the library: plain jnp, gradient through the
# ratio, no coefficient form.


def _token_mean(x, m):
  return jnp.sum(jnp.where(m, x, 0.0)) / jnp.sum(m)


def _agg(x, m, aggregation):
  lengths = jnp.sum(m, -1)
  total = jnp.sum(jnp.where(m, x, 0.0))
  if aggregation == "token_mean":
    return total / jnp.sum(m)
  if aggregation == "sequence_mean_token_mean":
    return jnp.mean(jnp.sum(jnp.where(m, x, 0.0), -1) / lengths)
  if aggregation == "sequence_mean_token_sum":
    return total / m.shape[0]
  if aggregation == "token_sum":
    return total
  return total / (m.shape[0] * m.shape[1])


def _ppo_surrogate(lp, old, adv, eps_low, eps_high, dual_c=None):
  a = adv[:, None]
  r = jnp.exp(lp - old)
  s = jnp.minimum(r * a, jnp.clip(r, 1 - eps_low, 1 + eps_high) * a)
  if dual_c is not None:
    s = jnp.where(a < 0, jnp.maximum(s, dual_c * a), s)
  return s


def direct_ppo(lp, old, sampler, adv, m, aggregation, eps_low=0.2,
               eps_high=0.2, dual_c=None):
  del sampler
  return _agg(-_ppo_surrogate(lp, old, adv, eps_low, eps_high, dual_c), m,
              aggregation)


def direct_gspo(lp, old, sampler, adv, m, aggregation, eps=(0.05, 0.08)):
  del sampler, aggregation
  s = jnp.exp(jnp.sum(jnp.where(m, lp - old, 0.0), -1) / jnp.sum(m, -1))
  j = jnp.minimum(s * adv, jnp.clip(s, 1 - eps[0], 1 + eps[1]) * adv)
  return -jnp.mean(j)


def direct_cispo(lp, old, sampler, adv, m, aggregation, cap=1.2, floor=None):
  del sampler
  r = jax.lax.stop_gradient(jnp.exp(lp - old))
  r = jnp.minimum(r, cap) if floor is None else jnp.clip(r, floor, cap)
  return _agg(-r * adv[:, None] * lp, m, aggregation)


def _is_weight(old, sampler, m, level):
  d = jnp.where(m, old - sampler, 0.0)
  if level == "sequence":
    d = jnp.sum(d, -1, keepdims=True)
  return jnp.exp(d)


def direct_tis(lp, old, sampler, adv, m, aggregation, level="token", cap=2.0):
  w = jnp.minimum(_is_weight(old, sampler, m, level), cap)
  return _agg(-_ppo_surrogate(lp, old, adv, 0.2, 0.2) * w, m, aggregation)


def direct_mis(lp, old, sampler, adv, m, aggregation, level="token", low=0.5,
               high=2.0):
  w = _is_weight(old, sampler, m, level)
  w = jnp.where((w >= low) & (w <= high), w, 0.0)
  return _agg(-_ppo_surrogate(lp, old, adv, 0.2, 0.2) * w, m, aggregation)


def direct_feynrl(lp, old, sampler, adv, m, aggregation):
  """FeynRL's P3O loss (algs/P3O/p3o.py), normalised by the token count.

  FeynRL's `old_logprobs` are the behaviour (sampler) logprobs recorded at
  rollout time, so the weights are pi_theta / mu with mu = `sampler`."""
  del old, aggregation
  old = sampler
  ell = jnp.where(m, lp - old, 0.0)
  w = jnp.exp(ell)
  s1, s2, n = jnp.sum(w * m), jnp.sum(w * w * m), jnp.sum(m)
  ess = jax.lax.stop_gradient(s1 ** 2 / (s2 + 1e-8) / n)
  rho = jax.lax.stop_gradient(jnp.clip(w, 0.0, ess))
  k_old = (lp - old) + jnp.exp(jnp.clip(old - lp, -10, 10)) - 1
  total = (jnp.sum(jnp.where(m, -rho * lp * adv[:, None], 0.0)) +
           (1 - ess) * jnp.sum(jnp.where(m, k_old, 0.0)))
  return total / n


def coef_feynrl(tx, lp, old, sampler, adv, mask, aggregation):
  w = obj.importance_ratio(lp, sampler, mask)
  ess = obj.normalized_ess(w, mask)
  pg = coef_loss(tx, lp, old, sampler, adv, mask, aggregation)
  kl = obj.aggregate_loss(obj.ess_kl_penalty(lp, sampler, ess), mask,
                          aggregation)
  return pg + kl


# name -> (transform, aggregation, direct loss, coefficient-form loss,
#          predicate(ratio-like, adv, mask) that is True where a limit binds).
def _ppo_bind(eps_low, eps_high):
  def bind(lp, old, sampler, adv, m):
    r, a = np.exp(lp - old), adv[:, None]
    return m & (((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low)))
  return bind


def _gspo_bind(lp, old, sampler, adv, m):
  s = np.exp(np.sum(np.where(m, lp - old, 0), -1) / np.sum(m, -1))
  return ((adv > 0) & (s > 1.08)) | ((adv < 0) & (s < 0.95))


OBJECTIVES = {
    "ppo_symmetric": (lambda: obj.ppo_clip(0.2), "token_mean", direct_ppo,
                      _ppo_bind(0.2, 0.2)),
    "ppo_clip_higher": (
        lambda: obj.ppo_clip(0.2, 0.28), "token_mean",
        functools.partial(direct_ppo, eps_high=0.28), _ppo_bind(0.2, 0.28)),
    "dual_clip": (
        lambda: optax.chain(obj.ppo_clip(0.2), obj.dual_clip(1.3)),
        "token_mean", functools.partial(direct_ppo, dual_c=1.3),
        lambda lp, old, s, adv, m: m & (adv[:, None] < 0) & (
            np.exp(lp - old) > 1.3)),
    "gspo": (lambda: obj.gspo(0.05, 0.08), "sequence_mean_token_mean",
             direct_gspo, _gspo_bind),
    "cispo": (lambda: obj.cispo(1.2), "token_mean", direct_cispo,
              lambda lp, old, s, adv, m: m & (np.exp(lp - old) > 1.2)),
    "cispo_floor": (lambda: obj.cispo(1.2, floor=0.9), "token_mean",
                    functools.partial(direct_cispo, floor=0.9),
                    lambda lp, old, s, adv, m: m & (np.exp(lp - old) < 0.9)),
    "tis_token": (
        lambda: optax.chain(obj.ppo_clip(0.2), obj.truncated_is(2.0)),
        "token_mean", direct_tis,
        lambda lp, old, s, adv, m: m & (np.exp(old - s) > 2.0)),
    "tis_sequence": (
        lambda: optax.chain(obj.ppo_clip(0.2),
                            obj.truncated_is(2.0, "sequence")),
        "sequence_mean_token_mean",
        functools.partial(direct_tis, level="sequence"),
        lambda lp, old, s, adv, m: np.exp(np.sum(
            np.where(m, old - s, 0), -1)) > 2.0),
    "mis_token": (
        lambda: optax.chain(obj.ppo_clip(0.2), obj.masked_is(2.0, 0.5)),
        "token_mean", direct_mis,
        lambda lp, old, s, adv, m: m & (np.abs(old - s) > np.log(2.0))),
    "mis_sequence": (
        lambda: optax.chain(obj.ppo_clip(0.2),
                            obj.masked_is(2.0, 0.5, "sequence")),
        "token_mean", functools.partial(direct_mis, level="sequence"),
        lambda lp, old, s, adv, m: np.abs(np.sum(
            np.where(m, old - s, 0), -1)) > np.log(2.0)),
    "ess_trust_region": (obj.ess_trust_region, "token_mean", direct_feynrl,
                         None),
}


@functools.lru_cache(maxsize=None)
def _grads(name):
  """One jitted function per objective: both gradients, compiled once."""
  factory, aggregation, direct, _ = OBJECTIVES[name]
  tx = factory()
  coef = coef_feynrl if name == "ess_trust_region" else coef_loss

  def both(lp, old, sampler, adv, mask):
    g_coef = jax.grad(coef, argnums=1)(tx, lp, old, sampler, adv, mask,
                                       aggregation)
    g_direct = jax.grad(direct)(lp, old, sampler, adv, mask, aggregation)
    return g_coef, g_direct

  return jax.jit(both)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_gradient_equals_paper_surrogate(name):
  binds = OBJECTIVES[name][3]
  for seed in range(2):
    lp, old, sampler, adv, mask = make_batch(seed)
    if binds is not None:  # The test data exercises both sides of the limit.
      hit = binds(*map(np.asarray, (lp, old, sampler, adv, mask)))
      assert hit.any() and not hit.all(), (name, hit)
    g_coef, g_direct = _grads(name)(lp, old, sampler, adv, mask)
    np.testing.assert_allclose(g_coef, g_direct, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(g_direct)).max() > 1e-3
  if name == "ess_trust_region":  # The ESS cap binds on some tokens.
    r = np.exp(np.asarray(lp - sampler))[np.asarray(mask)]
    ess = r.sum() ** 2 / (r.size * (r ** 2).sum())
    assert (r > ess).any() and (r < ess).any()


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_on_policy_gives_plain_policy_gradient(name):
  lp, _, _, adv, mask = make_batch(3)
  aggregation = OBJECTIVES[name][1]
  g_coef, _ = _grads(name)(lp, lp, lp, adv, mask)
  plain = lambda lp: _agg(-adv[:, None] * lp, mask, aggregation)
  np.testing.assert_allclose(g_coef, jax.grad(plain)(lp), rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("aggregation", obj.AGGREGATIONS)
@pytest.mark.parametrize("name", ["ppo_clip_higher", "tis_sequence"])
def test_gradient_identity_every_aggregation(name, aggregation):
  factory, _, direct, _ = OBJECTIVES[name]
  lp, old, sampler, adv, mask = make_batch(4)
  tx = factory()
  g_coef = jax.grad(coef_loss, argnums=1)(tx, lp, old, sampler, adv, mask,
                                          aggregation)
  g_direct = jax.grad(direct)(lp, old, sampler, adv, mask, aggregation)
  np.testing.assert_allclose(g_coef, g_direct, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# Hand-derived coefficient values.


def _apply(tx, ratio, **kw):
  ratio = jnp.asarray(ratio, jnp.float32)
  return np.asarray(tx.update(ratio, tx.init(ratio), **kw)[0])


def test_ppo_and_dual_clip_values():
  r = [[0.7, 0.7, 1.3, 1.3, 1.25]]
  a = jnp.array([[1., -1, 1, -1, 1]])
  np.testing.assert_allclose(_apply(obj.ppo_clip(0.2), r, advantages_BxT=a),
                             [[0.7, 0, 0, 1.3, 0]])
  np.testing.assert_allclose(
      _apply(obj.ppo_clip(0.2, 0.28), r, advantages_BxT=a),
      [[0.7, 0, 0, 1.3, 1.25]])
  chain = optax.chain(obj.ppo_clip(0.2), obj.dual_clip(3.0))
  np.testing.assert_allclose(
      _apply(chain, [[4., 4, 2]], advantages_BxT=jnp.array([[-1., 1, -1]])),
      [[0, 0, 2]])


def test_sequence_ratio_and_cispo_values():
  r = [[2., .5, 9.], [4., 1., 1.]]
  m = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
  out = _apply(obj.sequence_ratio(), r, mask_BxT=m)
  np.testing.assert_allclose(out, [[1, 1, 1], [4 ** (1 / 3)] * 3], rtol=1e-6)
  np.testing.assert_allclose(_apply(obj.cispo(2.0), [[.5, 3.]]), [[.5, 2.]])
  np.testing.assert_allclose(_apply(obj.cispo(2.0, floor=.8), [[.5, 3.]]),
                             [[.8, 2.]])


def test_truncated_and_masked_is_values():
  old = jnp.log(jnp.array([[3., .5]]))
  sampler = jnp.zeros((1, 2))
  kw = dict(old_logprobs_BxT=old, sampler_logprobs_BxT=sampler)
  ones = [[1., 1.]]
  np.testing.assert_allclose(_apply(obj.truncated_is(2.0), ones, **kw),
                             [[2., .5]], rtol=1e-6)
  np.testing.assert_allclose(_apply(obj.masked_is(2.0), ones, **kw),
                             [[0., .5]], rtol=1e-6)
  np.testing.assert_allclose(_apply(obj.masked_is(2.0, low=0.6), ones, **kw),
                             [[0., 0.]])
  # Sequence level: the weight is 3 * 0.5 = 1.5 for both tokens.
  for tx in (obj.truncated_is(2.0, "sequence"), obj.masked_is(2.0, 0.5,
                                                              "sequence")):
    np.testing.assert_allclose(_apply(tx, [[2., 1.]], **kw), [[3., 1.5]],
                               rtol=1e-6)
  # Padding is excluded from the sequence weight.
  m = jnp.array([[True, False]])
  np.testing.assert_allclose(
      _apply(obj.truncated_is(5.0, "sequence"), ones, mask_BxT=m, **kw),
      [[3., 3.]], rtol=1e-6)


def test_ess_values():
  ess = lambda w, m=None: float(obj.normalized_ess(jnp.asarray(w, jnp.float32),
                                                   m))
  assert ess([1., 1, 1, 1]) == 1.0
  assert ess([1., 0, 0, 0]) == 0.25
  np.testing.assert_allclose(ess([2., 1]), 0.9, rtol=1e-6)
  np.testing.assert_allclose(ess([2., 1, 50], jnp.array([1, 1, 0], bool)), 0.9,
                             rtol=1e-6)
  assert ess([3., 4], jnp.zeros(2, bool)) == 1.0
  stats = [obj.ess_statistics(jnp.array(w)) for w in ([2.], [1.])]
  total = jax.tree.map(jnp.add, *stats)
  np.testing.assert_allclose(obj.ess_from_statistics(total), 0.9, rtol=1e-6)
  # The trust region caps at the ESS; an explicit `ess` overrides it.
  np.testing.assert_allclose(_apply(obj.ess_trust_region(), [[2., 1.]]),
                             [[.9, .9]], rtol=1e-6)
  np.testing.assert_allclose(
      _apply(obj.ess_trust_region(), [[2., .2]], ess=0.5), [[.5, .2]])


def test_sequence_importance_weights():
  old = jnp.log(jnp.array([[2., 3., 7.], [.5, 1., 1.]]))
  m = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
  w = obj.sequence_importance_weights(old, jnp.zeros((2, 3)), m)
  np.testing.assert_allclose(w, [6., .5], rtol=1e-6)
  huge = obj.sequence_importance_weights(jnp.full((1, 3), 30.),
                                         jnp.zeros((1, 3)))
  np.testing.assert_allclose(huge, [np.exp(20.)], rtol=1e-6)


# ----------------------------------------------------------------------------
# Aggregation.


def test_aggregation_values():
  loss = jnp.array([[1., 2, 3], [4, 5, 6], [7, 8, 9]])
  m = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)
  agg = functools.partial(obj.aggregate_loss, loss, m)
  np.testing.assert_allclose(agg("token_mean"), 7 / 3, rtol=1e-6)
  np.testing.assert_allclose(agg("sequence_mean_token_mean"), 2.75)
  np.testing.assert_allclose(agg("sequence_mean_token_sum"), 3.5)
  np.testing.assert_allclose(agg("sequence_mean_token_sum_norm"), 7 / 6,
                             rtol=1e-6)
  np.testing.assert_allclose(
      agg("sequence_mean_token_sum_norm", max_length=10), 7 / 20, rtol=1e-6)
  np.testing.assert_allclose(agg("token_mean", num_tokens=14), 0.5)
  np.testing.assert_allclose(agg("sequence_mean_token_mean", num_sequences=4),
                             1.375)
  # Non-finite values in padding do not leak into any mode.
  for mode in obj.AGGREGATIONS:
    f = lambda x: obj.aggregate_loss(jnp.where(m, x, jnp.inf), m, mode)
    value, grad = jax.value_and_grad(f)(loss)
    clean = obj.aggregate_loss(loss, m, mode)
    np.testing.assert_allclose(value, clean, rtol=1e-6)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~m] == 0)


@pytest.mark.parametrize("aggregation", obj.AGGREGATIONS)
@pytest.mark.slow
def test_minibatch_accumulation_equals_whole_batch(aggregation):
  lp, old, sampler, adv, mask = make_batch(5, b=6)
  normalizers = dict(
      num_tokens=jnp.sum(mask), max_length=T,
      num_sequences=jnp.sum(jnp.any(mask, -1)))
  tx = obj.ppo_clip(0.2, 0.28)
  ess_tx = obj.ess_trust_region()

  def loss(lp, old, sampler, adv, mask, ess, **norm):
    pg = coef_loss(tx, lp, old, sampler, adv, mask, aggregation, **norm)
    ratio = obj.importance_ratio(lp, old, mask)
    c, _ = ess_tx.update(ratio, None, mask_BxT=mask, ess=ess)
    kl = obj.aggregate_loss(obj.ess_kl_penalty(lp, old, ess), mask,
                            aggregation, **norm)
    return pg + obj.policy_gradient_loss(c, adv, lp, mask, aggregation,
                                         **norm) + kl

  grad = jax.jit(jax.value_and_grad(loss))
  ess_full = obj.normalized_ess(obj.importance_ratio(lp, old, mask), mask)
  whole_value, whole = grad(lp, old, sampler, adv, mask, ess_full)
  # Minibatches: the ESS from summed statistics, the normalisers global.
  parts = [slice(0, 2), slice(2, 4), slice(4, 6)]
  stats = [obj.ess_statistics(obj.importance_ratio(lp[s], old[s], mask[s]),
                              mask[s]) for s in parts]
  ess = obj.ess_from_statistics(jax.tree.map(lambda *x: sum(x), *stats))
  np.testing.assert_allclose(ess, ess_full, rtol=1e-6)
  values, grads = zip(*[
      grad(lp[s], old[s], sampler[s], adv[s], mask[s], ess, **normalizers)
      for s in parts])
  np.testing.assert_allclose(sum(values), whole_value, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jnp.concatenate(grads), whole, rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("aggregation", obj.AGGREGATIONS)
def test_padding_garbage_and_all_masked(aggregation):
  lp, old, sampler, adv, mask = make_batch(6)
  tx = optax.chain(obj.ppo_clip(0.2), obj.truncated_is(2.0, "sequence"))
  loss = jax.jit(jax.value_and_grad(
      lambda lp, old, m: coef_loss(tx, lp, old, sampler, adv, m,
                                   aggregation)))
  clean_value, clean = loss(lp, old, mask)
  garbage = lambda x, fill: jnp.where(mask, x, fill)
  value, grad = loss(garbage(lp, jnp.nan), garbage(old, -jnp.inf), mask)
  np.testing.assert_allclose(value, clean_value, rtol=1e-6)
  np.testing.assert_allclose(grad, clean, rtol=1e-6)
  assert np.all(np.asarray(grad)[~np.asarray(mask)] == 0)
  none = jnp.zeros_like(mask)
  value, grad = loss(garbage(lp, jnp.nan), old, none)
  assert float(value) == 0.0 and np.all(np.asarray(grad) == 0)


def test_all_masked_transforms_and_metrics_are_finite():
  lp, old, sampler, adv, _ = make_batch(7)
  none = jnp.zeros((B, T), bool)
  ratio = obj.importance_ratio(lp, old, none)
  for factory, _, _, _ in OBJECTIVES.values():
    tx = factory()
    c, _ = tx.update(ratio, tx.init(ratio), **extras(old, sampler, adv, none))
    assert np.all(np.isfinite(c))
  metrics = {**obj.ratio_metrics(ratio, none, advantages_BxT=adv),
             **obj.coefficient_metrics(ratio, none),
             **obj.kl_metrics(lp, old, none)}
  for key, value in metrics.items():
    assert np.isfinite(value) and value == (1.0 if key == "ess" else 0.0), key


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_bf16_ratio(name):
  lp, old, sampler, adv, mask = make_batch(8)
  ratio = obj.importance_ratio(lp, old, mask)
  r16 = ratio.astype(jnp.bfloat16)
  tx = OBJECTIVES[name][0]()
  kw = extras(old, sampler, adv, mask)
  c16, _ = jax.jit(lambda r: tx.update(r, tx.init(r), **kw))(r16)
  c32, _ = jax.jit(lambda r: tx.update(r, tx.init(r), **kw))(
      r16.astype(jnp.float32))
  assert c16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(c16, np.float32),
                             np.asarray(c32.astype(jnp.bfloat16), np.float32))


# ----------------------------------------------------------------------------
# KL, entropy, metrics, errors.


def test_kl_estimators_values_and_gradients():
  lp = jnp.array([[-1.0, -0.5, -2.0]])
  ref = jnp.array([[-1.5, -0.5, -0.2]])
  ell = np.asarray(lp - ref)
  np.testing.assert_allclose(obj.kl_k1(lp, ref), ell, rtol=1e-6)
  np.testing.assert_allclose(obj.kl_k2(lp, ref), ell ** 2 / 2, rtol=1e-6)
  np.testing.assert_allclose(obj.kl_k3(lp, ref), np.exp(-ell) - 1 + ell,
                             rtol=1e-6)
  grad = lambda f: np.asarray(jax.grad(lambda x: jnp.sum(f(x, ref)))(lp))
  np.testing.assert_allclose(grad(obj.kl_k1), np.ones_like(ell))
  np.testing.assert_allclose(grad(obj.kl_k2), ell, rtol=1e-6)
  np.testing.assert_allclose(grad(obj.kl_k3), 1 - np.exp(-ell), rtol=1e-6)
  assert np.all(np.asarray(jax.grad(lambda r: jnp.sum(obj.kl_k3(lp, r)))(ref))
                == 0)  # The reference carries no gradient.


def test_ess_kl_penalty_gradient_and_entropy_loss():
  lp = jnp.array([[-1.0, -0.5]])
  old = jnp.array([[-1.2, -0.1]])
  g = jax.grad(lambda x: jnp.sum(obj.ess_kl_penalty(x, old, 0.75)))(lp)
  np.testing.assert_allclose(g, 0.25 * (1 - np.exp(np.asarray(old - lp))),
                             rtol=1e-6)
  ent = jnp.array([[1.0, 3.0, 5.0]])
  m = jnp.array([[True, True, False]])
  np.testing.assert_allclose(obj.entropy_loss(ent, m), -2.0)


def test_ratio_metrics_against_numpy():
  lp, old, _, adv, mask = make_batch(9)
  ratio = obj.importance_ratio(lp, old, mask)
  out = obj.ratio_metrics(ratio, mask, advantages_BxT=adv, eps_low=0.2,
                          eps_high=0.28)
  r, m = np.asarray(ratio), np.asarray(mask)
  a = np.broadcast_to(np.asarray(adv)[:, None], r.shape)
  low = (a < 0) & (r < 0.8)
  high = (a > 0) & (r > 1.28)
  np.testing.assert_allclose(out["clip_frac_low"], low[m].mean(), rtol=1e-6)
  np.testing.assert_allclose(out["clip_frac_high"], high[m].mean(), rtol=1e-6)
  np.testing.assert_allclose(out["clip_frac"], (low | high)[m].mean(),
                             rtol=1e-6)
  np.testing.assert_allclose(out["ratio_max"], r[m].max(), rtol=1e-6)
  np.testing.assert_allclose(out["ratio_mean"], r[m].mean(), rtol=1e-6)
  np.testing.assert_allclose(out["ess"], r[m].sum() ** 2 / (
      m.sum() * (r[m] ** 2).sum()), rtol=1e-5)
  c = obj.coefficient_metrics(jnp.where(jnp.asarray(low), 0.0, ratio), mask)
  np.testing.assert_allclose(c["frac_zero_coef"], low[m].mean(), rtol=1e-6)


def test_errors():
  r = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="advantages_BxT is required"):
    obj.ppo_clip().update(r, None)
  with pytest.raises(ValueError, match=r"advantages_BxT must have shape"):
    obj.ppo_clip().update(r, None, advantages_BxT=jnp.ones(3))
  with pytest.raises(ValueError, match=r"ratio_BxT must have shape \[B, T\]"):
    obj.cispo(2.0).update(jnp.ones(3), None)
  with pytest.raises(ValueError, match="old_logprobs_BxT is required"):
    obj.truncated_is().update(r, None, sampler_logprobs_BxT=r)
  with pytest.raises(ValueError, match="mask_BxT must have shape"):
    obj.sequence_ratio().update(r, None, mask_BxT=jnp.ones((2, 2), bool))
  with pytest.raises(ValueError, match="level='tokens'"):
    obj.masked_is(level="tokens")
  with pytest.raises(ValueError, match="eps_low=-0.1"):
    obj.ppo_clip(-0.1)
  with pytest.raises(ValueError, match="clip_ratio_c=0.5"):
    obj.dual_clip(0.5)
  with pytest.raises(ValueError, match="aggregation='mean'"):
    obj.aggregate_loss(r, r > 0, "mean")


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed):
  lp, old, sampler, adv, mask = make_batch(seed, b=4)
  return obj.importance_ratio(lp, old, mask), extras(old, sampler, adv, mask)


HARNESS_CASES = [
    harness.Case(name, factory, kwargs, _inputs)
    for name, factory, kwargs in [
        ("ppo_clip", obj.ppo_clip, dict(eps_low=0.2, eps_high=0.28)),
        ("dual_clip", obj.dual_clip, dict(clip_ratio_c=1.3)),
        ("sequence_ratio", obj.sequence_ratio, {}),
        ("cispo", obj.cispo, dict(cap=1.2, floor=0.9)),
        ("ess_trust_region", obj.ess_trust_region, {}),
        ("truncated_is_token", obj.truncated_is, dict(cap=1.5)),
        ("truncated_is_sequence", obj.truncated_is,
         dict(cap=1.5, level="sequence")),
        ("masked_is_token", obj.masked_is, dict(high=1.5, low=0.7)),
        ("masked_is_sequence", obj.masked_is, dict(high=1.5,
                                                   level="sequence")),
        ("gspo", obj.gspo, dict(eps_low=0.05, eps_high=0.08)),
    ]
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
@pytest.mark.slow
def test_harness(case, check):
  check(case)
