"""Tests for the peers' objectives, rollout corrections, KL estimators and
aggregations (issue 10): each against an independent reference (the paper's
surrogate differentiated by `jax.grad`, or the peer's formula in numpy on a
hand-built batch), and through the shared property harness."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import objectives as obj
from tests import transform_harness as harness
from tests.test_objectives import _agg, coef_loss, extras, make_batch

B, T = 8, 6
sg = jax.lax.stop_gradient


def _np(*xs):
  return [np.asarray(x, np.float64) for x in xs]


# ----------------------------------------------------------------------------
# Direct surrogates (losses to minimise), written from the papers and the
# peers' code, independent of the library. Gradients flow through `lp`.


def direct_sapo(lp, old, sampler, adv, m, aggregation, tau_pos=1.0,
                tau_neg=1.05):
  """verl `compute_policy_loss_sapo` / TRL `loss_type="sapo"`."""
  del sampler
  a = adv[:, None]
  r = jnp.exp(lp - old)
  tau = jnp.where(a > 0, tau_pos, tau_neg)
  gate = jax.nn.sigmoid(tau * (r - 1)) * 4 / tau
  return _agg(-gate * a, m, aggregation)


def direct_gmpo(lp, old, sampler, adv, m, aggregation, eps=(0.4, 0.4)):
  """verl `compute_policy_loss_geo_mean` (torch.mean over rows)."""
  del sampler, aggregation
  a = jnp.broadcast_to(adv[:, None], lp.shape)
  d = lp - old
  sgn = jnp.sign(a)
  d_min = sgn * jnp.minimum(sgn * d, sgn * jnp.clip(d, -eps[0], eps[1]))
  n = jnp.sum(m, -1)
  ratio = jnp.exp(jnp.sum(d_min * m, -1) / (n + 1e-8))
  a_seq = jnp.sum(a * m, -1) / (n + 1e-8)
  return jnp.mean(-a_seq * ratio)


def direct_pnpo(lp, old, sampler, adv, m, aggregation, eps=(0.2, 0.2)):
  """PPO clip on w_t = exp(mean_{s<=t} log r_s), summed over tokens."""
  del sampler
  a = adv[:, None]
  d = jnp.where(m, lp - old, 0.0)
  w = jnp.exp(jnp.cumsum(d, -1) / jnp.maximum(jnp.cumsum(m, -1), 1))
  s = jnp.minimum(w * a, jnp.clip(w, 1 - eps[0], 1 + eps[1]) * a)
  return _agg(-s, m, aggregation)


def direct_dppo(lp, old, sampler, adv, m, aggregation, divergence="tv",
                delta=(0.2, 0.2), anchor="sampler", cap=10.0):
  """sail-sg/Stable-RL `compute_policy_loss_with_mask` (binary TV / KL)."""
  a = adv[:, None]
  prob, q_lp = jnp.exp(lp), (sampler if anchor == "sampler" else old)
  q = jnp.exp(q_lp)
  if divergence == "tv":
    bad_pos, bad_neg = prob - q > delta[1], prob - q < -delta[0]
  else:
    kl = q * (q_lp - lp) + (1 - q) * jnp.log((1 - q + 1e-8) / (1 - prob + 1e-8))
    bad_pos = (kl > delta[1]) & (prob > q)
    bad_neg = (kl > delta[0]) & (prob < q)
  valid = sg(1.0 - jnp.where(a > 0, bad_pos, bad_neg).astype(jnp.float32))
  ratio = sg(jnp.minimum(jnp.exp(jnp.minimum(lp - sampler, 20.0)), cap))
  return _agg(-a * ratio * valid * lp, m, aggregation)


def _cov(adv, lp, m):
  """verl's covariance over the valid tokens (lp without gradient)."""
  a = jnp.broadcast_to(adv[:, None], lp.shape)
  lp = sg(lp)
  mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / jnp.sum(m)
  return (a - mean(a)) * (lp - mean(lp))


def direct_clip_cov(lp, old, sampler, adv, m, aggregation, eps=(0.2, 0.2),
                    bounds=(0.01, 5.0)):
  """verl `compute_policy_loss_clip_cov` when every candidate is drawn."""
  del sampler
  a = adv[:, None]
  r = jnp.exp(lp - old)
  l1, l2 = -a * r, -a * jnp.clip(r, 1 - eps[0], 1 + eps[1])
  clip_by_origin = (l2 > l1) & m
  cov = _cov(adv, lp, m)
  corr = jnp.where(m & ~clip_by_origin & (cov > bounds[0]) & (cov < bounds[1]),
                   0.0, 1.0)
  return _agg(jnp.maximum(l1, l2) * sg(corr), m, aggregation)


def direct_kl_cov(lp, old, sampler, adv, m, aggregation, ratio=0.1, coef=1.0):
  """verl `compute_policy_loss_kl_cov` (top-k by covariance, torch.topk)."""
  del sampler
  a = adv[:, None]
  r = jnp.exp(lp - old)
  nm = np.asarray(m)
  valid_idx = np.flatnonzero(nm)  # torch.nonzero over the flat mask
  cov = _cov(adv, lp, m).reshape(-1)[valid_idx]
  k = max(1, int(valid_idx.size * ratio))
  chosen = valid_idx[jnp.argsort(-cov)[:k]]
  sel = jnp.zeros(nm.size, bool).at[chosen].set(True).reshape(nm.shape)
  loss = jnp.where(sel, -a * r + coef * jnp.abs(lp - old), -a * r)
  return _agg(loss, m, aggregation)


def direct_tis_floor_norm(lp, old, sampler, adv, m, aggregation,
                          level="token", floor=0.8, cap=1.5):
  """PPO clip times verl's truncated, batch-normalised IS weights."""
  d = jnp.where(m, old - sampler, 0.0)
  if level == "sequence":
    d = jnp.sum(d, -1, keepdims=True)
  w = jnp.clip(jnp.exp(d), floor, cap)
  if level == "sequence":
    mean = jnp.mean(w)
  else:
    mean = jnp.sum(w * m) / jnp.sum(m)
  a = adv[:, None]
  r = jnp.exp(lp - old)
  s = jnp.minimum(r * a, jnp.clip(r, 0.8, 1.2) * a)
  return _agg(-s * sg(w / mean), m, aggregation)


def direct_gspo_clamped(lp, old, sampler, adv, m, aggregation, eps=(0.05, 0.08),
                        max_log=0.05):
  """verl `compute_policy_loss_gspo`: log s clamped from above."""
  del sampler, aggregation
  log_s = jnp.sum(jnp.where(m, lp - old, 0.0), -1) / jnp.sum(m, -1)
  log_st = lp - sg(lp) + sg(log_s)[:, None]
  s = jnp.exp(jnp.minimum(log_st, max_log))
  a = adv[:, None]
  loss = jnp.maximum(-a * s, -a * jnp.clip(s, 1 - eps[0], 1 + eps[1]))
  return jnp.mean(jnp.sum(jnp.where(m, loss, 0.0), -1) / jnp.sum(m, -1))


def _verl_dual_clip_loss(r, a, low, high, clip_c):
  """verl's vanilla PPO loss with explicit bounds and the dual clip."""
  l1, l2 = -a * r, -a * jnp.clip(r, low, high)
  clip1 = jnp.maximum(l1, l2)
  return jnp.where(a < 0, jnp.minimum(-a * clip_c, clip1), clip1)


def direct_dcpo(lp, old, sampler, adv, m, aggregation, eps=(0.2, 0.28),
                clip_c=10.0):
  """lime-RL/DCPO `get_clip_low_high` + `compute_policy_loss_dcpo`."""
  del sampler
  q = jnp.exp(old)
  low_c = 1 - jnp.where(q != 0, 4 * eps[0] / q, 0)
  low_c = low_c * (low_c >= 0)
  high_c = jnp.where(q != 0, 1 + 4 * eps[1] / q, jnp.inf)
  low, high = (1 + jnp.sqrt(low_c)) / 2, (1 + jnp.sqrt(high_c)) / 2
  high = jnp.clip(high, 0, max(clip_c, 10))
  return _agg(_verl_dual_clip_loss(jnp.exp(lp - old), adv[:, None], low, high,
                                   clip_c), m, aggregation)


def direct_sat(lp, old, sampler, adv, m, aggregation, eps=(0.2, 0.2),
               level=0.9):
  """SAT, Eqs. 3.1-3.6 of the authors' page: q straight from its definition
  inf{x : F(x) >= level} (every candidate x against the empirical CDF F of
  |d| over valid tokens), then -min(r A, clip(r, lo, hi) A)."""
  d = sg(lp) - sampler
  abs_d = jnp.abs(d)
  valid = m.astype(jnp.float32)
  cdf = jnp.sum(valid[None, None] * (abs_d[None, None] <= abs_d[..., None, None]),
                axis=(-2, -1)) / jnp.sum(valid)
  q = jnp.min(jnp.where(m & (cdf >= level - 1e-6), abs_d, jnp.inf))
  gate = (q > 0) & (abs_d > q)
  hill = lambda u: 1 / (1 + (u / q) ** 2)
  c_plus = jnp.where(gate, hill(jnp.maximum(d, 0)), 1.0)
  c_minus = jnp.where(gate, hill(jnp.maximum(-d, 0)), 1.0)
  lo, hi = 1 - eps[0] * c_minus, 1 + eps[1] * c_plus
  r = jnp.exp(lp - old)
  a = adv[:, None]
  return _agg(-jnp.minimum(r * a, jnp.clip(r, lo, hi) * a), m, aggregation)


def _band_kl_numpy(p, delta, max_iter=50, tol=1e-6):
  """OpenMOSS/BandPO `universal_bisection_solver` with f_kl, in numpy."""
  f = lambda u: -np.log(u) + u - 1.0
  def g(r):  # p = 1 gives nan here, as in torch; `band` overrides p ~ 1.
    with np.errstate(divide="ignore", invalid="ignore"):
      comp = (1.0 - r * p) / (1.0 - p)
      return (p * f(np.maximum(r, 1e-12))
              + (1.0 - p) * f(np.maximum(comp, 1e-12)))
  up_sat, low_sat = g(1.0 / p) <= delta, g(np.zeros_like(p)) <= delta
  lo, hi = np.ones_like(p), 1.0 / p
  for _ in range(max_iter):
    mid = 0.5 * (lo + hi)
    right = g(mid) < delta
    lo, hi = np.where(right, mid, lo), np.where(right, hi, mid)
    if np.max(hi - lo) <= tol:
      break
  upper = np.where(up_sat, 1.0 / p, 0.5 * (lo + hi))
  lo, hi = np.zeros_like(p), np.ones_like(p)
  for _ in range(max_iter):
    mid = 0.5 * (lo + hi)
    left = g(mid) < delta
    hi, lo = np.where(left, mid, hi), np.where(left, lo, mid)
    if np.max(hi - lo) <= tol:
      break
  lower = np.where(low_sat, 0.0, 0.5 * (lo + hi))
  return lower, upper


def direct_band(lp, old, sampler, adv, m, aggregation, divergence="tv",
                delta=0.05, eps=(0.2, 0.28), upper_max=100.0):
  """OpenMOSS/BandPO `band` (closed forms, or the bisection for KL) in
  max(-A r, -A clip(r))."""
  del sampler
  p = jnp.exp(jnp.clip(old, -700.0, 0.0))
  if divergence == "kl":
    lo, up = _band_kl_numpy(np.asarray(p, np.float64), delta)
    lo, up, r_star = jnp.asarray(lo), jnp.asarray(up), math.exp(-delta)
  elif divergence == "tv":
    up, lo, r_star = 1 + delta / p, 1 - delta / p, max(1 - delta, 0.0)
  else:
    term = jnp.sqrt(delta * (1 - p) / p)
    up, lo, r_star = 1 + term, 1 - term, 1.0
  up, lo = jnp.minimum(up, 1 / p), jnp.maximum(lo, 0.0)
  up = jnp.where(p > 1 - 1e-6, 1.0, up)
  lo = jnp.where(p > 1 - 1e-6, r_star, lo)
  up = jnp.where(p < 1e-6, 1 / jnp.maximum(p, 1e-12), up)
  lo = jnp.where(p < 1e-6, 0.0, lo)
  lo = jnp.clip(jnp.minimum(lo, 1 - eps[0]), 0.0, 1.0)
  up = jnp.clip(jnp.maximum(up, 1 + eps[1]), 1.0, upper_max)
  a, r = adv[:, None], jnp.exp(lp - old)
  return _agg(jnp.maximum(-a * r, -a * jnp.clip(r, lo, up)), m, aggregation)


def _bapo_bounds_numpy(r, a, m, target, low, low_max, high, high_max, step):
  """WooooDyy/BAPO `compute_policy_loss_bapo`'s search, in numpy."""
  def rho(lo, hi):
    e = np.where(a >= 0, np.minimum(r, hi), np.maximum(r, lo)) * a * m
    pos, neg = np.clip(e, 0, None).sum(), (-np.clip(e, None, 0)).sum()
    return np.inf if neg <= 0 else pos / (neg + 1e-8)
  value = rho(low, high)
  while value < target and low < low_max:
    low = min(low + step, low_max)
    value = rho(low, high)
  while value < target and high < high_max:
    high = min(high + step, high_max)
    value = rho(low, high)
  return np.float32(low), np.float32(high)


def direct_bapo(lp, old, sampler, adv, m, aggregation, target=1.0):
  del sampler
  a, r = adv[:, None], jnp.exp(lp - old)
  bounds = jax.pure_callback(
      lambda r, a, m: _bapo_bounds_numpy(
          np.asarray(r, np.float64), np.asarray(a, np.float64), np.asarray(m),
          target, 0.6, 0.9, 1.2, 3.0, 0.05),
      (jax.ShapeDtypeStruct((), jnp.float32),) * 2, sg(r),
      jnp.broadcast_to(a, r.shape), m)
  return _agg(_verl_dual_clip_loss(r, a, bounds[0], bounds[1], 3.0), m,
              aggregation)


# name -> (transform factory, aggregation, direct loss, extra loss term)
def _kl_cov_term(lp, old, sampler, adv, mask, aggregation):
  return obj.aggregate_loss(
      obj.kl_cov_penalty(lp, old, adv, mask, kl_ratio=0.1, kl_coef=1.0), mask,
      aggregation)


CASES = {
    "sapo": (obj.sapo, "sequence_mean_token_mean", direct_sapo, None),
    "sapo_token_mean": (lambda: obj.sapo(0.5, 2.0), "token_mean",
                        functools.partial(direct_sapo, tau_pos=0.5,
                                          tau_neg=2.0), None),
    "gmpo": (lambda: obj.gmpo(0.1, 0.15), "sequence_mean_token_mean",
             functools.partial(direct_gmpo, eps=(0.1, 0.15)), None),
    "pnpo": (lambda: obj.prefix_ratio(0.1, 0.15), "token_mean",
             functools.partial(direct_pnpo, eps=(0.1, 0.15)), None),
    "pnpo_seq_mean": (lambda: obj.prefix_ratio(0.1), "sequence_mean_token_mean",
                      functools.partial(direct_pnpo, eps=(0.1, 0.1)), None),
    "dppo_tv": (lambda: obj.dppo("tv", 0.05, 0.08), "token_mean",
                functools.partial(direct_dppo, delta=(0.05, 0.08)), None),
    "dppo_kl": (lambda: obj.dppo("kl", 0.01, 0.02), "token_mean",
                functools.partial(direct_dppo, divergence="kl",
                                  delta=(0.01, 0.02)), None),
    "dppo_tv_old": (lambda: obj.dppo("tv", 0.05, anchor="old", cap=1.5),
                    "token_mean",
                    functools.partial(direct_dppo, delta=(0.05, 0.05),
                                      anchor="old", cap=1.5), None),
    "clip_cov": (lambda: obj.clip_cov(0.2, clip_ratio=1.0, cov_low=0.01,
                                      seed=3),
                 "token_mean", direct_clip_cov, None),
    "kl_cov": (obj.kl_cov, "token_mean", direct_kl_cov, _kl_cov_term),
    "tis_floor_batch_norm": (
        lambda: optax.chain(obj.ppo_clip(0.2), obj.truncated_is(
            1.5, floor=0.8, batch_normalize=True)),
        "token_mean", direct_tis_floor_norm, None),
    "tis_sequence_batch_norm": (
        lambda: optax.chain(obj.ppo_clip(0.2), obj.truncated_is(
            1.5, "sequence", floor=0.8, batch_normalize=True)),
        "sequence_mean_token_mean",
        functools.partial(direct_tis_floor_norm, level="sequence"), None),
    "gspo_clamped": (lambda: obj.gspo(0.05, 0.08, max_log_ratio=0.05),
                     "sequence_mean_token_mean", direct_gspo_clamped, None),
    "dcpo": (lambda: obj.dcpo_clip(0.2, 0.28, 1.5), "token_mean",
             functools.partial(direct_dcpo, clip_c=1.5), None),
    "bandpo_tv": (lambda: obj.band_clip("tv", 0.05, 0.1, 0.1), "token_mean",
                  functools.partial(direct_band, eps=(0.1, 0.1)), None),
    "bandpo_chi2": (lambda: obj.band_clip("chi2", 0.02, 0.1, 0.1),
                    "token_mean", functools.partial(
                        direct_band, divergence="chi2", delta=0.02,
                        eps=(0.1, 0.1)), None),
    "bandpo_kl": (lambda: obj.band_clip("kl", 0.02, None, None),
                  "token_mean", functools.partial(
                      direct_band, divergence="kl", delta=0.02,
                      eps=(0.0, 0.0)), None),
    "bapo": (obj.bapo_clip, "token_mean", direct_bapo, None),
    "sat": (obj.sat_clip, "token_mean", direct_sat, None),
    "sat_q75_seq_mean": (lambda: obj.sat_clip(0.2, 0.28, 0.75),
                         "sequence_mean_token_mean",
                         functools.partial(direct_sat, eps=(0.2, 0.28),
                                           level=0.75), None),
    "bapo_unreachable": (lambda: obj.bapo_clip(50.0), "token_mean",
                         functools.partial(direct_bapo, target=50.0), None),
}


def _both_grads(name, lp, old, sampler, adv, mask):
  factory, aggregation, direct, extra = CASES[name]
  tx = factory()

  def ours(lp):
    loss = coef_loss(tx, lp, old, sampler, adv, mask, aggregation)
    if extra is not None:
      loss = loss + extra(lp, old, sampler, adv, mask, aggregation)
    return loss

  g_ours = jax.grad(ours)(lp)
  g_direct = jax.grad(direct)(lp, old, sampler, adv, mask, aggregation)
  return np.asarray(g_ours), np.asarray(g_direct)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.slow
def test_gradient_equals_reference_surrogate(name):
  for seed in range(2):
    lp, old, sampler, adv, mask = make_batch(seed, spread=0.3)
    g_ours, g_direct = _both_grads(name, lp, old, sampler, adv, mask)
    np.testing.assert_allclose(g_ours, g_direct, rtol=2e-5, atol=1e-6)
    assert np.abs(g_direct).max() > 1e-3


def _zero_grad_fraction(name, seed=0):
  """Fraction of valid tokens the limit leaves without gradient."""
  lp, old, sampler, adv, mask = make_batch(seed, spread=0.3)
  _, g = _both_grads(name, lp, old, sampler, adv, mask)
  return (g[np.asarray(mask)] == 0).mean()


@pytest.mark.parametrize("name", ["gmpo", "pnpo", "dppo_tv", "dppo_kl",
                                  "dppo_tv_old", "clip_cov", "gspo_clamped",
                                  "dcpo", "bandpo_tv", "bandpo_chi2",
                                  "bandpo_kl", "bapo", "sat"])
def test_the_limit_binds_on_some_tokens_not_all(name):
  """The test batches exercise both sides of each limit."""
  fracs = [_zero_grad_fraction(name, s) for s in range(2)]
  assert any(f > 0 for f in fracs) and all(f < 1 for f in fracs), fracs


def test_tis_floor_and_batch_normalisation_bind():
  lp, old, sampler, adv, mask = map(np.asarray, make_batch(0))
  w = np.exp(old - sampler)[mask]
  assert (w < 0.8).any() and (w > 1.5).any()


@pytest.mark.parametrize("name", ["sapo", "gmpo", "pnpo", "kl_cov", "dppo_tv"])
def test_on_policy_gives_plain_policy_gradient(name):
  """At r = 1 (and mu = pi_old) each objective is the plain policy
  gradient; PNPO's prefix ratios spread it as `c_s = sum_{t>=s} 1 / n_t`."""
  lp, _, _, adv, mask = make_batch(3)
  factory, aggregation, _, _ = CASES[name]
  tx = factory()
  g = jax.grad(lambda x: coef_loss(tx, x, sg(x), sg(x), adv, mask,
                                   aggregation))(lp)
  if name == "pnpo":  # Every prefix ratio is 1: c_s = sum_{t>=s} 1 / n_t.
    m = np.asarray(mask)
    n = np.maximum(np.cumsum(m, -1), 1)
    c = np.flip(np.cumsum(np.flip(m / n, -1), -1), -1)
    plain = jax.grad(lambda x: _agg(-c * adv[:, None] * x, mask, aggregation))
  else:
    plain = jax.grad(lambda x: _agg(-adv[:, None] * x, mask, aggregation))
  np.testing.assert_allclose(g, plain(lp), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Hand values.


def _apply(tx, ratio, **kw):
  ratio = jnp.asarray(ratio, jnp.float32)
  return np.asarray(tx.update(ratio, tx.init(ratio), **kw)[0])


def test_sapo_values():
  a = jnp.array([[1., -1., 1.]])
  out = _apply(obj.sapo(1.0, 2.0), [[1.0, 1.0, 2.0]], advantages_BxT=a)
  s = 1 / (1 + math.exp(-1.0))  # tau_pos * (2 - 1) = 1
  np.testing.assert_allclose(out, [[1.0, 1.0, 4 * s * (1 - s) * 2]], rtol=1e-6)


def test_gmpo_values():
  r = np.exp([[0.5, -0.5, 0.1], [0.5, -0.5, 0.1]])
  a = jnp.array([1.0, -1.0])
  out = _apply(obj.gmpo(0.2, 0.3), r, advantages_BxT=a)
  # A > 0: log r clipped to min(., 0.3) -> (0.3, -0.5, 0.1), first clipped.
  # A < 0: clipped to max(., -0.2) -> (0.5, -0.2, 0.1), second clipped.
  s_pos, s_neg = math.exp(-0.1 / 3), math.exp(0.4 / 3)
  np.testing.assert_allclose(out, [[0, s_pos, s_pos], [s_neg, 0, s_neg]],
                             rtol=1e-6)


def test_prefix_ratio_values():
  r = [[2.0, 0.5, 4.0]]
  out = _apply(obj.prefix_ratio(10.0), r, advantages_BxT=jnp.ones(1))
  w = [2.0, 1.0, 4 ** (1 / 3)]  # prefix geometric means
  g = [w[0] / 1, w[1] / 2, w[2] / 3]
  np.testing.assert_allclose(out, [[sum(g), g[1] + g[2], g[2]]], rtol=1e-6)


def test_dppo_values():
  # p = 0.5 -> 0.9 (TV +0.4) and 0.5 -> 0.45 (TV -0.05), anchor = sampler.
  old = jnp.log(jnp.array([[0.5, 0.5]]))
  mu = old
  r = [[0.9 / 0.5, 0.45 / 0.5]]
  kw = dict(old_logprobs_BxT=old, sampler_logprobs_BxT=mu)
  pos = _apply(obj.dppo("tv", 0.1), r, advantages_BxT=jnp.ones(1), **kw)
  np.testing.assert_allclose(pos, [[0.0, 0.9]], rtol=1e-6)
  neg = _apply(obj.dppo("tv", 0.1), r, advantages_BxT=-jnp.ones(1), **kw)
  np.testing.assert_allclose(neg, [[1.8, 0.9]], rtol=1e-6)
  # The coefficient is the ratio to mu, capped.
  kw = dict(old_logprobs_BxT=old, sampler_logprobs_BxT=old - 3.0)
  capped = _apply(obj.dppo("tv", 0.9, cap=10.0), [[1.0, 1.0]],
                  advantages_BxT=jnp.ones(1), **kw)
  np.testing.assert_allclose(capped, [[10.0, 10.0]])


def test_dcpo_band_and_bapo_bounds():
  """Hand values of the adaptive intervals."""
  ones = jnp.ones((1, 2))
  old = jnp.log(jnp.array([[1.0, 0.1]]))
  # DCPO: q = 1: low = (1 + sqrt(0.2)) / 2 = 0.7236, high = (1 + sqrt(2.12))
  # / 2 = 1.228; q = 0.1: low = 0.5, high = (1 + sqrt(12.2)) / 2 = 2.246.
  r = jnp.array([[1.25, 2.2]])
  np.testing.assert_allclose(
      _apply(obj.dcpo_clip(), r, advantages_BxT=ones, old_logprobs_BxT=old),
      [[0.0, 2.2]], rtol=1e-6)
  r = jnp.array([[0.7, 0.55]])
  np.testing.assert_allclose(
      _apply(obj.dcpo_clip(), r, advantages_BxT=-ones, old_logprobs_BxT=old),
      [[0.0, 0.55]], rtol=1e-6)
  # BandPO TV, delta 0.05, no relaxation: p = 0.1 -> [0.5, 1.5].
  tx = obj.band_clip("tv", 0.05, None, None)
  np.testing.assert_allclose(
      _apply(tx, [[1.45, 1.55]], advantages_BxT=ones,
             old_logprobs_BxT=jnp.log(jnp.full((1, 2), 0.1))), [[1.45, 0.0]],
      rtol=1e-6)
  # BAPO: one positive token at r = 1 (A = 1), one negative at r = 0.5
  # (A = -1): rho = 1 / max(0.5, low); low 0.6 -> 1/0.6 >= 1 at once.
  c = _apply(obj.bapo_clip(), [[1.0, 0.5]], advantages_BxT=jnp.array(
      [[1.0, -1.0]]))
  np.testing.assert_allclose(c, [[1.0, 0.0]])  # 0.5 < low = 0.6: clipped


def test_clip_cov_draws_the_requested_count_reproducibly():
  lp, old, sampler, adv, mask = make_batch(0, b=16, t=16)
  ratio = obj.importance_ratio(lp, old, mask)
  kw = extras(old, sampler, adv, mask)
  tx = obj.clip_cov(10.0, clip_ratio=0.05, cov_low=-1e9, cov_high=1e9, seed=1)
  state = tx.init(ratio)
  c1, state1 = tx.update(ratio, state, **kw)
  c2, _ = tx.update(ratio, state1, **kw)
  again, _ = tx.update(ratio, state, **kw)
  n = int(np.asarray(mask).sum())
  for c in (c1, c2):
    assert int((np.asarray(c)[np.asarray(mask)] == 0).sum()) == int(0.05 * n)
  np.testing.assert_array_equal(c1, again)  # same key, same draw
  assert not np.array_equal(c1, c2)  # the key advances


def test_kl_cov_penalty_selects_top_covariance():
  adv = jnp.array([1.0, -1.0])
  lp = jnp.array([[-0.1, -2.0], [-0.1, -2.0]])
  old = lp - 0.5
  m = jnp.ones((2, 2), bool)
  # cov = (A - 0)(lp - mean lp): +0.95, -0.95 | -0.95, +0.95.
  out = obj.kl_cov_penalty(lp, old, adv, m, kl_ratio=0.5, kl_coef=2.0)
  np.testing.assert_allclose(out, [[1.0, 0.0], [0.0, 1.0]], rtol=1e-6)


# ----------------------------------------------------------------------------
# KL estimators: values from verl's and TRL's formulas (numpy), gradients.


LP = np.array([[-1.0, -0.5, -2.0, -30.0, -0.1]])
REF = np.array([[-1.5, -0.5, -0.2, -0.1, -25.0]])
OLD = np.array([[-1.2, -0.4, -2.5, -29.0, -0.3]])


def _verl_kl(lp, ref, name):
  """verl `kl_penalty_forward`, in numpy."""
  if name in ("kl", "k1"):
    return lp - ref
  if name == "abs":
    return np.abs(lp - ref)
  if name in ("mse", "k2"):
    return 0.5 * (lp - ref) ** 2
  kl = np.clip(ref - lp, -20, 20)
  return np.clip(np.exp(kl) - kl - 1, -10, 10)


@pytest.mark.parametrize("estimator,verl_name", [
    ("k1", "k1"), ("k2", "k2"), ("abs", "abs"), ("low_var_kl", "low_var_kl"),
    ("k1+", "k1"), ("k3+", "low_var_kl")])
def test_kl_values_match_verl(estimator, verl_name):
  out = obj.kl_penalty(jnp.asarray(LP, jnp.float32),
                       jnp.asarray(REF, jnp.float32), estimator)
  np.testing.assert_allclose(out, _verl_kl(LP, REF, verl_name), rtol=1e-5)


def test_kl_gradients():
  lp, ref = jnp.asarray(LP, jnp.float32), jnp.asarray(REF, jnp.float32)
  grad = lambda name: np.asarray(jax.grad(
      lambda x: jnp.sum(obj.kl_penalty(x, ref, name)))(lp))
  ell = LP - REF
  np.testing.assert_allclose(grad("abs"), np.sign(ell))
  # Straight-through: the gradient of k2 whatever the value.
  for name in ("k1+", "k3+"):
    np.testing.assert_allclose(grad(name), ell, rtol=1e-5)
  # verl's clamps: value beyond +-10 (4th token: ref - lp = 29.9) or log
  # ratio beyond +-20 has gradient 0; elsewhere 1 - exp(-ell).
  expected = 1 - np.exp(-ell)
  d = REF - LP
  value = np.exp(np.clip(d, -20, 20)) - np.clip(d, -20, 20) - 1
  expected = np.where((np.abs(d) > 20) | (np.abs(value) > 10), 0.0, expected)
  np.testing.assert_allclose(grad("low_var_kl"), expected, rtol=1e-5,
                             atol=1e-6)
  # rljax's k3 keeps the linear part's gradient beyond the exponent clip.
  np.testing.assert_allclose(
      grad("k3"), 1 - np.where(np.abs(d) <= 20, np.exp(d), 0.0), rtol=1e-5)
  # The value clamp option of kl_k3.
  k = obj.kl_k3(lp, ref, max_value=10.0)
  assert float(jnp.max(k)) == 10.0


def test_trl_bias_corrected_kl_value_and_gradient():
  lp, ref, old = (jnp.asarray(x, jnp.float32) for x in (LP, REF, OLD))
  lp, ref, old = lp[:, :3], ref[:, :3], old[:, :3]
  n_lp, n_ref, n_old = _np(lp, ref, old)
  trl = np.exp(n_lp - n_old) * (np.exp(n_ref - n_lp) - (n_ref - n_lp) - 1)
  out = obj.kl_penalty(lp, ref, "k3_is", old_logprobs_BxT=old)
  np.testing.assert_allclose(out, trl, rtol=1e-5)
  # The gradient of TRL's expression (coef_1 = exp(lp - old) not detached).
  direct = lambda x: jnp.sum(jnp.exp(x - old) * (jnp.exp(ref - x) - (ref - x)
                                                 - 1))
  np.testing.assert_allclose(
      jax.grad(lambda x: jnp.sum(obj.kl_penalty(
          x, ref, "k3_is", old_logprobs_BxT=old)))(lp),
      jax.grad(direct)(lp), rtol=1e-5)
  with pytest.raises(ValueError, match="k3_is.*old_logprobs_BxT"):
    obj.kl_penalty(lp, ref, "k3_is")
  with pytest.raises(ValueError, match="estimator='k4'"):
    obj.kl_penalty(lp, ref, "k4")


# ----------------------------------------------------------------------------
# Aggregation and the peers' normalisers, on one hand-built batch.

LOSS = np.array([[1., 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)


def _ours(mode, **kw):
  return float(obj.aggregate_loss(jnp.asarray(LOSS, jnp.float32),
                                  jnp.asarray(MASK), mode, **kw))


def test_new_aggregations_and_passed_normalisers():
  total = (LOSS * MASK).sum()  # 29
  assert _ours("token_sum") == total
  # Tunix sequence-mean-token-scale: sum_rows(sum_t l / width) / non-zero rows.
  tunix = (LOSS * MASK).sum(-1)[MASK.any(-1)].sum() / 4 / MASK.any(-1).sum()
  np.testing.assert_allclose(_ours("sequence_mean_token_scale"), tunix,
                             rtol=1e-6)
  # A passed normaliser is not clamped to >= 1 any more.
  np.testing.assert_allclose(_ours("token_mean", num_tokens=0.5), total / 0.5)
  np.testing.assert_allclose(
      _ours("sequence_mean_token_sum", num_sequences=0.25), total / 0.25)
  # The computed one still is: an all-padding batch gives 0.
  assert float(obj.aggregate_loss(jnp.ones((2, 2)), jnp.zeros((2, 2), bool),
                                  "token_mean")) == 0.0
  with pytest.raises(ValueError, match="dp_size=0"):
    _ours("token_mean", num_tokens=3, dp_size=0)


def test_trl_dapo_normaliser_per_process():
  """TRL dapo/cispo: sum / (num_items_in_batch / num_processes)."""
  num_items, processes = MASK.sum(), 4
  trl = (LOSS * MASK).sum() / (num_items / processes)
  np.testing.assert_allclose(
      _ours("token_mean", num_tokens=float(num_items), dp_size=processes),
      trl, rtol=1e-6)


def test_verl_agg_loss_modes():
  """verl `agg_loss` with its dp_size and global normalisers."""
  dp, global_tokens, global_bs = 2, 12.0, 4.0
  s = LOSS * MASK
  seq_mask = MASK.sum(-1) > 0
  verl_token_mean = s.sum() / global_tokens * dp
  verl_seq_sum = s.sum(-1)[seq_mask].sum() / global_bs * dp
  verl_seq_mean = (s.sum(-1) / (MASK.sum(-1) + 1e-8))[seq_mask].sum() \
      / global_bs * dp
  verl_sum_norm = s.sum() / 16.0  # loss_scale_factor
  np.testing.assert_allclose(
      _ours("token_mean", num_tokens=global_tokens, dp_size=dp),
      verl_token_mean, rtol=1e-6)
  np.testing.assert_allclose(
      _ours("sequence_mean_token_sum", num_sequences=global_bs, dp_size=dp),
      verl_seq_sum, rtol=1e-6)
  np.testing.assert_allclose(
      _ours("sequence_mean_token_mean", num_sequences=global_bs, dp_size=dp),
      verl_seq_mean, rtol=1e-6)
  np.testing.assert_allclose(
      _ours("sequence_mean_token_sum_norm", num_sequences=1.0, max_length=16),
      verl_sum_norm, rtol=1e-6)


def test_trl_grpo_and_dr_grpo_count_every_row():
  """TRL grpo: mean over all rows of the per-row token mean; dr_grpo:
  sum / (rows * max_completion_length). An empty row counts in both."""
  s = LOSS * MASK
  trl_grpo = (s.sum(-1) / np.maximum(MASK.sum(-1), 1)).mean()
  trl_dr = s.sum() / (LOSS.shape[0] * 8)
  rows = float(LOSS.shape[0])
  np.testing.assert_allclose(
      _ours("sequence_mean_token_mean", num_sequences=rows), trl_grpo,
      rtol=1e-6)
  np.testing.assert_allclose(
      _ours("sequence_mean_token_sum_norm", num_sequences=rows, max_length=8),
      trl_dr, rtol=1e-6)
  # rljax's default leaves the empty row out (verl's seq_mask).
  assert _ours("sequence_mean_token_mean") != pytest.approx(trl_grpo)


# ----------------------------------------------------------------------------
# Rejection (verl rollout_rs) against its formula in numpy.


def _verl_rejection(old, rollout, mask, options):
  """verl `compute_rollout_rejection_mask`, in numpy (log_ratio = old -
  rollout)."""
  d = np.clip(old - rollout, -20, 20)
  k = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - 1 - d}
  keep = np.ones(mask.shape, bool)
  for name, lower, upper in options:
    level, kind = name.rsplit("_", 1)
    x = k[kind]
    if level == "seq_sum":
      x = (x * mask).sum(-1, keepdims=True)
    elif level == "seq_mean":
      x = (x * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1,
                                                                keepdims=True), 1)
    elif level == "seq_max":
      x = np.where(mask, x, -np.inf).max(-1, keepdims=True)
    if kind == "k1":
      ok = (x >= np.log(lower)) & (x <= np.log(upper))
    else:
      ok = x <= upper
    keep = keep & np.broadcast_to(ok, mask.shape)
  return keep & mask


REJECTION_SPECS = [
    ("token_k1:0.8:1.25", [("token_k1", 0.8, 1.25)]),
    ("token_k2:0.02", [("token_k2", None, 0.02)]),
    ("token_k3:0.02", [("token_k3", None, 0.02)]),
    ("seq_sum_k1:0.5:2.0", [("seq_sum_k1", 0.5, 2.0)]),
    ("seq_sum_k2:0.1", [("seq_sum_k2", None, 0.1)]),
    ("seq_sum_k3:0.1", [("seq_sum_k3", None, 0.1)]),
    ("seq_mean_k1:0.9:1.1", [("seq_mean_k1", 0.9, 1.1)]),
    ("seq_mean_k2:0.03", [("seq_mean_k2", None, 0.03)]),
    ("seq_mean_k3:0.03", [("seq_mean_k3", None, 0.03)]),
    ("seq_max_k2:0.08", [("seq_max_k2", None, 0.08)]),
    ("seq_max_k3:0.08", [("seq_max_k3", None, 0.08)]),
    ("token_k3:0.05,seq_max_k2:0.2",
     [("token_k3", None, 0.05), ("seq_max_k2", None, 0.2)]),
]


@pytest.mark.parametrize("spec,options", REJECTION_SPECS,
                         ids=[s for s, _ in REJECTION_SPECS])
def test_rejection_mask_matches_verl(spec, options):
  _, old, sampler, _, mask = make_batch(11, b=12)
  ours = np.asarray(obj.rejection_mask(old, sampler, mask,
                                       obj.parse_rejection(spec)))
  ref = _verl_rejection(*_np(old, sampler), np.asarray(mask), options)
  np.testing.assert_array_equal(ours, ref)
  m = np.asarray(mask)
  assert ours[m].any() and not ours[m].all(), spec  # the threshold binds


def test_rejected_tokens_leave_the_normaliser_unlike_masked_is():
  """Rejection (verl rollout_rs) vs MIS (TRL token_mask): the same tokens
  lose their gradient, but only rejection shrinks the token-mean divisor."""
  lp, old, sampler, adv, mask = make_batch(12)
  keep = obj.rejection_mask(old, sampler, mask,
                            obj.parse_rejection("token_k1:0.5:2.0"))
  tx = obj.ppo_clip(0.2)
  g_rs = jax.grad(lambda x: coef_loss(tx, x, old, sampler, adv, keep,
                                      "token_mean"))(lp)
  mis = optax.chain(obj.ppo_clip(0.2), obj.masked_is(2.0, 0.5))
  g_mis = jax.grad(lambda x: coef_loss(mis, x, old, sampler, adv, mask,
                                       "token_mean"))(lp)
  # verl divides by the kept tokens; MIS by all of them (and weights by w).
  w = np.exp(np.asarray(old - sampler))
  n_all, n_kept = float(np.sum(mask)), float(np.sum(keep))
  assert n_kept < n_all
  k = np.asarray(keep)
  np.testing.assert_allclose(np.asarray(g_rs)[k] * n_kept,
                             np.asarray(g_mis)[k] * n_all / w[k], rtol=1e-5)
  assert np.all(np.asarray(g_rs)[~k] == 0) and np.all(np.asarray(g_mis)[~k] == 0)


def test_parse_rejection_errors():
  assert obj.parse_rejection("") == ()
  assert obj.parse_rejection("seq_sum_k1:0.5:2.0, token_k3:0.1") == (
      obj.Rejection("seq_sum_k1", 2.0, 0.5), obj.Rejection("token_k3", 0.1))
  for bad, match in [("seq_max_k1:0.5:2", "statistic 'seq_max_k1'"),
                     ("token_k1:2.0", "lower:upper"),
                     ("token_k3:0.1:0.2", "'token_k3:upper'"),
                     ("token_k3:x", "numbers"), ("token_k3:-1", "> 0"),
                     ("token_k1:2:1", "lower > upper")]:
    with pytest.raises(ValueError, match=match):
      obj.parse_rejection(bad)


def test_constructor_errors():
  with pytest.raises(ValueError, match="divergence='js'"):
    obj.dppo("js")
  with pytest.raises(ValueError, match="anchor='ref'"):
    obj.dppo(anchor="ref")
  with pytest.raises(ValueError, match="tau_neg=0"):
    obj.sapo(1.0, 0)
  with pytest.raises(ValueError, match="floor=3.0 must be <= cap=2.0"):
    obj.truncated_is(2.0, floor=3.0)
  with pytest.raises(ValueError, match="clip_ratio=0"):
    obj.clip_cov(clip_ratio=0, seed=0)


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed):
  lp, old, sampler, adv, mask = make_batch(seed, b=4)
  return obj.importance_ratio(lp, old, mask), extras(old, sampler, adv, mask)


HARNESS_CASES = [
    harness.Case("dcpo_clip", obj.dcpo_clip, dict(eps_low=0.2, eps_high=0.28,
                                                  clip_ratio_c=1.5), _inputs),
    harness.Case("band_clip_tv", obj.band_clip,
                 dict(divergence="tv", delta=0.05, eps_low=0.1), _inputs),
    harness.Case("band_clip_chi2", obj.band_clip,
                 dict(divergence="chi2", delta=0.02, eps_high=None), _inputs),
    harness.Case("band_clip_kl", obj.band_clip,
                 dict(divergence="kl", delta=0.05), _inputs),
    harness.Case("bapo_clip", obj.bapo_clip, dict(target=1.0, step=0.05),
                 _inputs, static_args=("step",)),
    harness.Case("sat_clip", obj.sat_clip,
                 dict(eps_low=0.2, eps_high=0.28, quantile=0.8), _inputs),
    harness.Case("sapo", obj.sapo, dict(tau_pos=1.0, tau_neg=1.05), _inputs),
    harness.Case("gmpo", obj.gmpo, dict(eps_low=0.1, eps_high=0.15), _inputs),
    harness.Case("prefix_ratio", obj.prefix_ratio,
                 dict(eps_low=0.1, eps_high=0.15), _inputs),
    harness.Case("dppo_tv", obj.dppo, dict(divergence="tv", delta_low=0.05,
                                           delta_high=0.08), _inputs),
    harness.Case("dppo_kl", obj.dppo, dict(divergence="kl", delta_low=0.01,
                                           anchor="old"), _inputs),
    harness.Case("clip_cov", obj.clip_cov,
                 dict(eps_low=0.2, clip_ratio=0.1, cov_low=-1.0, seed=0),
                 _inputs, static_args=("seed",)),
    harness.Case("kl_cov", obj.kl_cov, {}, _inputs),
    harness.Case("truncated_is_floor_norm", obj.truncated_is,
                 dict(cap=1.5, floor=0.8, batch_normalize=True), _inputs),
    harness.Case("truncated_is_sequence_norm", obj.truncated_is,
                 dict(cap=1.5, level="sequence", batch_normalize=True),
                 _inputs),
    harness.Case("sequence_ratio_clamped", obj.sequence_ratio,
                 dict(max_log_ratio=0.05), _inputs),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
@pytest.mark.slow
def test_harness(case, check):
  check(case)


def test_log_ratio_clamp_conventions():
  """verl's PPO losses: exp(clamp(d, -20, 20)); TRL: exp(d), no clamp."""
  d = np.array([[25.0, -25.0, 1.0]])
  old = jnp.zeros((1, 3))
  lp = jnp.asarray(d, jnp.float32)
  verl = np.exp(np.clip(d, -20, 20))
  trl = np.exp(d)
  np.testing.assert_allclose(obj.importance_ratio(lp, old), verl, rtol=1e-5)
  np.testing.assert_allclose(obj.importance_ratio(lp, old, max_log_ratio=30.0),
                             trl, rtol=1e-5)


def test_functions_plain_jit_and_vmap_agree():
  """The non-transform functions (KL estimators, rejection, KL-Cov's
  penalty, the new aggregations) give the same values plain, under jit and
  under vmap over a leading axis."""
  batches = [make_batch(s, b=4) for s in (20, 21)]
  stack = lambda i: jnp.stack([b[i] for b in batches])
  lp, old, sampler, adv, mask = (stack(i) for i in range(5))
  crit = obj.parse_rejection("token_k3:0.05,seq_mean_k1:0.8:1.25")
  fns = {f"kl_{e}": functools.partial(
      lambda lp, old, s, a, m, e: obj.kl_penalty(lp, s, e, old_logprobs_BxT=old),
      e=e) for e in obj.KL_ESTIMATORS}
  fns["rejection"] = lambda lp, old, s, a, m: obj.rejection_mask(old, s, m,
                                                                 crit)
  fns["kl_cov"] = lambda lp, old, s, a, m: obj.kl_cov_penalty(
      lp, old, a, m, kl_ratio=0.2)
  for mode in ("token_sum", "sequence_mean_token_scale"):
    fns[mode] = functools.partial(
        lambda lp, old, s, a, m, mode: obj.aggregate_loss(lp - old, m, mode),
        mode=mode)

  def all_fns(*args):
    return {k: f(*args) for k, f in fns.items()}

  batched = jax.jit(jax.vmap(all_fns))(lp, old, sampler, adv, mask)
  for i in range(2):
    args = (lp[i], old[i], sampler[i], adv[i], mask[i])
    plain, jitted = all_fns(*args), jax.jit(all_fns)(*args)
    for k in fns:
      np.testing.assert_allclose(np.asarray(jitted[k], np.float64),
                                 np.asarray(plain[k], np.float64), rtol=1e-6,
                                 atol=1e-7, err_msg=k)
      np.testing.assert_allclose(np.asarray(batched[k][i], np.float64),
                                 np.asarray(plain[k], np.float64), rtol=1e-6,
                                 atol=1e-7, err_msg=k)


# ----------------------------------------------------------------------------
# Config errors: named, before any compile.


@pytest.mark.parametrize("field,value,message", [
    ("kl_estimator", "k4", "rl.kl_estimator='k4' is unknown"),
    ("rejection", "token_k9:1", "rl.rejection='token_k9:1'"),
    ("rejection", "token_k1:2.0", "lower:upper"),
    ("is_floor", 3.0, "rl.is_floor=3.0 > rl.is_cap=2.0"),
    ("objective", "ppo", "rl.objective='ppo' is unknown"),
    ("sat_quantile", 1.5, "rl.sat_quantile=1.5"),
    ("dual_clip_c", 0.5, "rl.dual_clip_c=0.5: a number > 1"),
])
def test_config_errors_name_the_field(field, value, message):
  from configs import common
  from rljax.train import build as build_lib
  from tests.compile_count import no_compiles
  config = common.tiny(common.base())
  config.rl[field] = value
  with no_compiles(), pytest.raises(ValueError, match=re.escape(message)):
    build_lib.validate(config)


def test_clip_cov_needs_a_seed():
  from rljax.train import algorithm as alg_lib
  with pytest.raises(ValueError, match="clip_cov.*seed"):
    alg_lib.coefficient_chain({"objective": "clip_cov"})
  assert alg_lib.coefficient_chain({"objective": "clip_cov"}, seed=0)


def test_sat_contracts_only_the_stale_side_and_only_beyond_the_quantile():
  """Hand case: ten tokens, |d| = 0.1 .. 1.0, so q (level 0.9) is 0.9 and
  only the token with |d| = 1.0 is gated, with c = 1 / (1 + (1/0.9)^2)."""
  d = np.array([0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8, 0.9, 1.0])
  mu = np.zeros((1, 10))
  old = np.zeros((1, 10))
  c = 1 / (1 + (1.0 / 0.9) ** 2)
  # A > 0: the gated token (d = +1) has upper bound 1 + 0.2 c; r = e^1 is
  # clipped under both intervals; probe with r between the two bounds.
  r = np.full((1, 10), 1 + 0.2 * c + 0.01)
  lp = np.log(r) + old  # the ratio given to the transform
  # d comes from log r + old - mu, so set mu to give the intended d.
  mu = lp - d[None]
  ones = np.ones(1, np.float32)
  out = _apply(obj.sat_clip(0.2, 0.2), r, advantages_BxT=ones,
               old_logprobs_BxT=jnp.asarray(old, jnp.float32),
               sampler_logprobs_BxT=jnp.asarray(mu, jnp.float32))
  expect = r.copy()
  expect[0, 9] = 0.0  # only the gated token's upper endpoint moved below r
  np.testing.assert_allclose(out, expect, rtol=1e-6)
  # A < 0 and d > 0 on the gated token: the lower endpoint is untouched.
  r_low = np.full((1, 10), 0.81)
  mu_low = np.log(r_low) - d[None]
  out = _apply(obj.sat_clip(0.2, 0.2), r_low, advantages_BxT=-ones,
               old_logprobs_BxT=jnp.asarray(old, jnp.float32),
               sampler_logprobs_BxT=jnp.asarray(mu_low, jnp.float32))
  np.testing.assert_allclose(out, r_low, rtol=1e-6)
