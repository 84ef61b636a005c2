"""DRO, VESPO, OPSM and DPPO's verl variant against NumPy ports of the
peers' code, and through the shared property harness.

Peers ported (independently, in float64, below):
  verl 0.9.0 (`release/v0.9.0`) `verl/trainer/ppo/core_algos.py`:
    `compute_policy_loss_dro`, `compute_policy_loss_dppo_tv`,
    `compute_policy_loss_dppo_kl`; the decoupled token IS weights of
    `trainer/ppo/rollout_corr_helper.py` (`min(exp(old - rollout), C)`).
  TRL v1.9.0 `trl/trainer/grpo_trainer.py`: `GRPOTrainer.get_gamma_weights`,
    `GRPOTrainer.get_off_policy_mask`, `_compute_loss` (dapo / cispo /
    vespo branches), and the vLLM IS ratio of
    `_generate_and_score_completions` (token_truncate / token_mask).

Each peer's loss is written as the peer writes it (detached tensors from the
NumPy port, the rest in jnp) and differentiated in float64; the rljax loss
is `policy_gradient_loss` of the transform's coefficient (plus, for DRO,
the aggregated `dro_penalty`), differentiated in float32.
"""

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import objectives as obj
from tests import transform_harness as harness

B, T = 4, 6
f32 = lambda x: jnp.asarray(x, jnp.float32)


# ----------------------------------------------------------------------------
# Hand-built batches: padding with junk values, both advantage signs (and a
# zero), ratios far outside the clip ranges, sampler/trainer gaps beyond the
# IS caps, and sequences on both sides of the OPSM threshold.


def hand_batch(seed, per_token_adv=False):
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.9, (B, T)))
  lp = old + rng.normal(scale=0.35, size=(B, T))
  sampler = old + rng.normal(scale=0.35, size=(B, T))
  # A large ratio kept by DPPO (A < 0, p > q) to bind the cap, and one far
  # below 1 - eps.
  old[1, 0] = sampler[1, 0] = math.log(0.1)
  lp[1, 0] = old[1, 0] + 1.5
  lp[2, 0] = old[2, 0] - 1.2
  # Sampler gaps beyond the IS caps: exp(old - mu) = e^1.5 and e^-1.2.
  sampler[0, 1] = old[0, 1] - 1.5
  old[2, 1] = math.log(0.2)
  sampler[2, 1] = old[2, 1] + 1.2
  # Sequences 0 (A > 0) and 1 (A < 0) moved away from the sampler (high
  # KL(mu || pi)), sequence 3 (A < 0) towards it.
  lp[0] -= 0.5
  lp[1, 1:] -= 0.6
  lp[3] = np.maximum(lp[3], sampler[3]) + 0.05
  lp = np.minimum(lp, -1e-3)
  sampler = np.minimum(sampler, -1e-3)
  lengths = np.array([6, 4, 2, 5]) if seed % 2 == 0 else np.array([5, 6, 3, 4])
  mask = np.arange(T)[None, :] < lengths[:, None]
  # Junk on the padding, which every path must ignore.
  lp = np.where(mask, lp, -30.0)
  old = np.where(mask, old, -0.01)
  sampler = np.where(mask, sampler, -40.0)
  adv = np.array([1.3, -0.7, 0.9, -1.6]) * (1.0 + 0.1 * seed)
  if per_token_adv:
    adv = adv[:, None] * rng.uniform(0.5, 1.5, (B, T))
    adv[0, 3] = 0.0
    adv[2, 1] = -0.4  # a sign flip inside a positive sequence
  return lp, old, sampler, adv, mask


def _token_mean(x, m):
  return jnp.sum(jnp.where(m, x, 0.0)) / jnp.sum(m)


def _adv_bxt(adv):
  return adv if adv.ndim == 2 else adv[:, None]


def rljax_grad(tx, lp, old, sampler, adv, mask, aggregation="token_mean",
               extra=None, pass_sampler=True):
  """jax.grad (float32) of the rljax loss: policy_gradient_loss of the
  chain's coefficient, plus `extra(lp, coef)` aggregated."""
  lp, old, sampler, adv = map(f32, (lp, old, sampler, adv))
  mask = jnp.asarray(mask)

  def loss(x):
    ratio = obj.importance_ratio(x, old, mask)
    coef, _ = tx.update(
        ratio, tx.init(ratio), advantages_BxT=adv, mask_BxT=mask,
        old_logprobs_BxT=old,
        sampler_logprobs_BxT=sampler if pass_sampler else None)
    total = obj.policy_gradient_loss(coef, adv, x, mask, aggregation)
    if extra is not None:
      total = total + obj.aggregate_loss(extra(x, coef), mask, aggregation)
    return total

  return np.asarray(jax.grad(loss)(lp), np.float64)


def peer_grad(peer_loss, lp):
  """jax.grad in float64 of a peer's loss written in jnp."""
  with jax.enable_x64(True):
    g = jax.grad(peer_loss)(jnp.asarray(lp, jnp.float64))
    return np.asarray(g, np.float64)


def assert_grads_match(ours, ref):
  np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-7)
  assert np.abs(ref).max() > 1e-3


# ----------------------------------------------------------------------------
# NumPy ports of the peers' detached tensors (float64).


def verl_token_is(old, rollout, mask, cap=2.0):
  """verl decoupled_token_is: min(exp(clamp(old - rollout, +-20)), C),
  computed on the masked log ratio."""
  d = np.clip(np.where(mask, old - rollout, 0.0), -20.0, 20.0)
  return np.minimum(np.exp(d), cap)


def trl_vllm_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
  """TRL `_generate_and_score_completions`, token_* modes."""
  ratio = np.exp((old - sampling) * mask)
  if mode == "token_truncate":
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    return np.clip(ratio, lo, hi)
  lo = -math.inf if clip_min is None else clip_min
  hi = math.inf if clip_max is None else clip_max
  return np.where((ratio < lo) | (ratio > hi), 0.0, ratio)


def trl_gamma_weights(adv, log_ratio, mask, is_ratio, k_pos=2.0,
                      lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
  """TRL `GRPOTrainer.get_gamma_weights` (B, 1) (or (B, T) for per-token A)."""
  lower = math.log(1e-8)
  seq = np.sum(np.clip(log_ratio, -20.0, 20.0) * mask, -1, keepdims=True)
  if is_ratio is not None:
    with np.errstate(divide="ignore"):
      log_is = np.clip(np.log(is_ratio), lower, 20.0)
    seq = seq + np.sum(log_is, -1, keepdims=True)
  log_w = np.clip(seq, lower, 20.0)
  w = np.exp(log_w)
  nonneg = adv >= 0
  k = np.where(nonneg, k_pos, k_neg)
  lam = np.maximum(np.where(nonneg, lambda_pos, lambda_neg), 1e-4)
  phi = np.exp(lam + k * log_w - lam * w)
  return np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def trl_off_policy_mask(adv, per_token_logps, sampling, mask, threshold):
  """TRL `GRPOTrainer.get_off_policy_mask` (B, 1), or (B, T) for per-token A."""
  kl = sampling - per_token_logps
  avg = (kl * mask).sum(1, keepdims=True) / np.maximum(
      mask.sum(1, keepdims=True), 1.0)
  return ((adv >= 0) | (avg <= threshold)).astype(np.float64)


def verl_dppo_valid(lp, old, adv, divergence, low, high):
  """verl `compute_policy_loss_dppo_tv` / `_kl` valid mask."""
  prob, old_prob = np.exp(lp), np.exp(old)
  if divergence == "tv":
    pos = (prob - old_prob) <= high
    neg = (prob - old_prob) >= -low
  else:
    kl = old_prob * (old - lp) + (1 - old_prob) * np.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    pos = (kl <= high) | (prob <= old_prob)
    neg = (kl <= low) | (prob >= old_prob)
  return np.where(adv > 0, pos, neg).astype(np.float64)


# ----------------------------------------------------------------------------
# DRO (verl `compute_policy_loss_dro`).


def verl_dro_loss(lp, old, adv, mask, beta, is_weights=None):
  a = jnp.asarray(_adv_bxt(adv))
  log_ratio = lp - old
  pg = -(lp * a - 0.5 * beta * jnp.square(log_ratio))
  if is_weights is not None:
    pg = pg * is_weights
  return jnp.sum(pg * mask) / jnp.sum(mask)  # agg_loss token-mean


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("with_is", [False, True], ids=["plain", "token_is"])
@pytest.mark.parametrize("per_token_adv", [False, True],
                         ids=["adv_B", "adv_BxT"])
def test_dro_matches_verl(seed, with_is, per_token_adv):
  lp, old, sampler, adv, mask = hand_batch(seed, per_token_adv)
  beta = 0.3
  tx = optax.chain(obj.dro(), obj.truncated_is(2.0)) if with_is else obj.dro()
  ours = rljax_grad(tx, lp, old, sampler, adv, mask, extra=lambda x, c:
                    obj.dro_penalty(x, f32(old), beta=beta, weights_BxT=c))
  w = verl_token_is(old, sampler, mask) if with_is else None
  ref = peer_grad(lambda x: verl_dro_loss(x, old, adv, mask, beta, w), lp)
  assert_grads_match(ours, ref)
  if with_is:
    assert (w[mask] == 2.0).any() and (w[mask] < 1.0).any()


def test_dro_penalty_acts_where_the_advantage_is_zero():
  lp = f32([[-1.0, -0.5, -2.0]])
  old = f32([[-1.5, -0.5, -1.0]])
  pen = obj.dro_penalty(lp, old, beta=0.2)
  np.testing.assert_allclose(pen, [[0.025, 0.0, 0.1]], rtol=1e-6)
  g = jax.grad(lambda x: jnp.sum(obj.dro_penalty(x, old, beta=0.2)))(lp)
  np.testing.assert_allclose(g, [[0.1, 0.0, -0.2]], rtol=1e-6)
  tx = obj.dro()
  ratio = jnp.full((2, 3), 7.0)
  np.testing.assert_array_equal(tx.update(ratio, tx.init(ratio))[0],
                                np.ones((2, 3)))


# ----------------------------------------------------------------------------
# VESPO (TRL `loss_type="vespo"`).


def trl_vespo_loss(lp, old, sampling, adv, mask, mode, clip_min, clip_max,
                   **kw):
  a = _adv_bxt(adv)
  is_ratio = (None if mode is None else
              trl_vllm_is_ratio(old, sampling, mask, mode, clip_min, clip_max))
  log_ratio = np.asarray(lp) - old  # detached inside get_gamma_weights
  phi = trl_gamma_weights(a, log_ratio, mask, is_ratio, **kw)

  def loss(x):
    per_token = -jnp.asarray(phi) * a * x
    return jnp.sum(per_token * mask) / jnp.sum(mask)  # num_items_in_batch
  return loss, phi


VESPO_CASES = {
    "default_truncate_3": (dict(), ("token_truncate", None, 3.0), {}),
    "mask_0.5_2": (dict(is_mode="mask", is_min=0.5, is_max=2.0),
                   ("token_mask", 0.5, 2.0), {}),
    "truncate_both": (dict(is_min=0.6, is_max=1.5),
                      ("token_truncate", 0.6, 1.5), {}),
    "no_is": (dict(is_mode=None), (None, None, None), {}),
    "other_k_lambda": (
        dict(k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=5.0),
        ("token_truncate", None, 3.0),
        dict(k_pos=1.0, lambda_pos=0.5, k_neg=4.0, lambda_neg=5.0)),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_token_adv", [False, True],
                         ids=["adv_B", "adv_BxT"])
@pytest.mark.parametrize("name", sorted(VESPO_CASES))
def test_vespo_matches_trl(name, per_token_adv, seed):
  kwargs, (mode, lo, hi), trl_kw = VESPO_CASES[name]
  lp, old, sampler, adv, mask = hand_batch(seed, per_token_adv)
  ours = rljax_grad(obj.vespo(**kwargs), lp, old, sampler, adv, mask)
  loss, phi = trl_vespo_loss(lp, old, sampler, adv, mask, mode, lo, hi,
                             **trl_kw)
  assert_grads_match(ours, peer_grad(loss, lp))
  # The kernel is not trivial on these batches: the sequences' weights
  # differ, some far below the on-policy 1.
  phi_valid = np.broadcast_to(phi, mask.shape)[mask]
  assert phi_valid.min() < 0.5 and phi_valid.max() > 2 * phi_valid.min()


def test_vespo_mask_mode_drops_a_sequence_with_a_masked_token():
  """TRL token_mask: a rejected token gives log(1e-8) to its sequence's
  log W, so phi of that sequence is ~0; the other rows are untouched."""
  lp, old, sampler, adv, mask = hand_batch(0)
  ratio = obj.importance_ratio(f32(lp), f32(old), mask)
  kw = dict(advantages_BxT=f32(adv), mask_BxT=mask, old_logprobs_BxT=f32(old),
            sampler_logprobs_BxT=f32(sampler))
  coef = lambda tx: np.asarray(tx.update(ratio, tx.init(ratio), **kw)[0])
  c = coef(obj.vespo(is_mode="mask", is_max=2.5))
  wide = coef(obj.vespo(is_mode="mask", is_max=10.0))
  assert math.exp(old[0, 1] - sampler[0, 1]) > 2.5  # only row 0 binds
  assert ((np.exp(old - sampler) > 2.5) & mask).sum() == 1
  assert c[0].max() < 1e-12 and wide[0].min() > 1e-2
  np.testing.assert_allclose(c[1:], wide[1:], rtol=1e-6)


def test_vespo_values():
  tx = obj.vespo(is_mode=None)
  r = jnp.asarray([[1.0, 1.0], [math.exp(0.25), math.exp(0.25)]])
  a = jnp.asarray([1.0, -1.0])
  c = np.asarray(tx.update(r, tx.init(r), advantages_BxT=a)[0])
  # Row 0: W = 1, phi(1) = 1. Row 1: log W = 0.5, A < 0: k = 3, lambda = 2.
  expect = math.exp(2.0 + 3 * 0.5 - 2.0 * math.exp(0.5))
  np.testing.assert_allclose(c, [[1.0, 1.0], [expect, expect]], rtol=1e-6)
  # TRL's floors: a masked token adds log(1e-8) to log W (not -inf), and
  # log W is clipped at log(1e-8) only afterwards. Here log r sums to 10.
  tx = obj.vespo(is_mode="mask", is_max=2.0)
  r = jnp.full((1, 2), math.exp(5.0))
  old = jnp.zeros((1, 2))
  mu = jnp.asarray([[0.0, -3.0]])  # rho = (1, e^3 > 2): the second masked
  c = np.asarray(tx.update(r, tx.init(r), advantages_BxT=jnp.ones(1),
                           old_logprobs_BxT=old, sampler_logprobs_BxT=mu)[0])
  log_w = math.log(1e-8) + 10.0
  expect = math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w))
  np.testing.assert_allclose(c, [[expect, expect]], rtol=1e-4)
  # Huge W: exp underflows to 0 (TRL's nan_to_num keeps it finite).
  big = jnp.full((1, 2), math.exp(15.0))
  c = tx.update(big, tx.init(big), advantages_BxT=jnp.ones(1))[0]
  assert np.all(np.asarray(c) == 0.0)


# ----------------------------------------------------------------------------
# OPSM (TRL `off_policy_mask_threshold`).


def trl_dapo_opsm_loss(lp, old, sampling, adv, mask, threshold, eps=(0.2, 0.28),
                       objective="dapo"):
  """TRL `_compute_loss`: dapo (or cispo) per-token loss times the OPSM mask,
  divided by the number of completion tokens."""
  a = _adv_bxt(adv)
  opsm = trl_off_policy_mask(a, np.asarray(lp), sampling, mask, threshold)

  def loss(x):
    coef_1 = jnp.exp(x - old)
    if objective == "dapo":
      coef_2 = jnp.clip(coef_1, 1 - eps[0], 1 + eps[1])
      per_token = -jnp.minimum(coef_1 * a, coef_2 * a)
    else:  # cispo
      per_token = -jax.lax.stop_gradient(jnp.minimum(coef_1, eps[1])) * a * x
    per_token = per_token * opsm
    return jnp.sum(per_token * mask) / jnp.sum(mask)
  return loss, opsm


OPSM_CASES = {
    "dapo": (lambda: obj.ppo_clip(0.2, 0.28), dict(), True),
    "cispo": (lambda: obj.cispo(5.0), dict(objective="cispo", eps=(0, 5.0)),
              True),
    # No sampler logprobs: TRL's fallback `sampling = old`.
    "dapo_no_sampler": (lambda: obj.ppo_clip(0.2, 0.28), dict(), False),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_token_adv", [False, True],
                         ids=["adv_B", "adv_BxT"])
@pytest.mark.parametrize("name", sorted(OPSM_CASES))
def test_opsm_matches_trl(name, per_token_adv, seed):
  make_inner, trl_kw, pass_sampler = OPSM_CASES[name]
  lp, old, sampler, adv, mask = hand_batch(seed, per_token_adv)
  delta = 0.03
  tx = obj.off_policy_sequence_mask(make_inner(), delta)
  ours = rljax_grad(tx, lp, old, sampler, adv, mask, pass_sampler=pass_sampler)
  sampling = sampler if pass_sampler else old
  loss, keep = trl_dapo_opsm_loss(lp, old, sampling, adv, mask, delta,
                                  **trl_kw)
  assert_grads_match(ours, peer_grad(loss, lp))
  # The mask binds on some negative-advantage tokens, and not on all.
  neg = np.broadcast_to(_adv_bxt(adv), mask.shape) < 0
  dropped = np.broadcast_to(keep, mask.shape) == 0
  assert (dropped & mask).any() and (neg & mask & ~dropped).any()
  assert not (dropped & ~neg).any()


@pytest.mark.slow
def test_opsm_values_and_chained_correction():
  """Hand case; the wrapped chain's correction and state pass through."""
  old = jnp.zeros((2, 2))
  mu = jnp.full((2, 2), 0.3)
  ratio = jnp.asarray([[1.0, 1.0], [math.exp(0.25), math.exp(0.25)]])
  # mean KL = 0.3 - log r: row 0: 0.3 > 0.2 (dropped if A < 0); row 1: 0.05.
  tx = obj.off_policy_sequence_mask(
      optax.chain(obj.cispo(10.0), obj.truncated_is(2.0)), 0.2)
  kw = dict(old_logprobs_BxT=old, sampler_logprobs_BxT=mu)
  w = math.exp(-0.3)
  c = tx.update(ratio, tx.init(ratio), advantages_BxT=-jnp.ones(2), **kw)[0]
  np.testing.assert_allclose(c, [[0, 0], [math.exp(0.25) * w] * 2], rtol=1e-6)
  c = tx.update(ratio, tx.init(ratio), advantages_BxT=jnp.ones(2), **kw)[0]
  np.testing.assert_allclose(c, [[w, w], [math.exp(0.25) * w] * 2], rtol=1e-6)
  # Other extra arguments reach the wrapped objective (here `ess`).
  tx = obj.off_policy_sequence_mask(obj.ess_trust_region(), 0.2)
  c = tx.update(ratio, tx.init(ratio), advantages_BxT=-jnp.ones(2),
                ess=jnp.float32(0.5), **kw)[0]
  np.testing.assert_allclose(c, [[0, 0], [0.5, 0.5]], rtol=1e-6)
  # A stateful objective's state is carried.
  inner = obj.clip_cov(0.2, clip_ratio=0.5, cov_low=-1e9, cov_high=1e9, seed=0)
  tx = obj.off_policy_sequence_mask(inner, 0.2)
  state = tx.init(ratio)
  _, new = tx.update(ratio, state, advantages_BxT=jnp.ones(2), **kw)
  _, expect = inner.update(ratio, inner.init(ratio), advantages_BxT=jnp.ones(2),
                           **kw)
  np.testing.assert_array_equal(new.key, expect.key)


# ----------------------------------------------------------------------------
# DPPO: verl 0.9's dppo_tv / dppo_kl (anchor and ratio base pi_old, cap
# clip_ratio_c), and the Stable-RL default left unchanged.


def verl_dppo_loss(lp, old, adv, mask, divergence, low, high, clip_ratio_c,
                   is_weights=None):
  a = _adv_bxt(adv)
  lp_np = np.asarray(lp)
  ratio = np.exp(np.clip(lp_np - old, -20.0, 20.0))
  truncated = np.minimum(ratio, clip_ratio_c)  # .detach()
  valid = verl_dppo_valid(lp_np, old, np.broadcast_to(a, lp_np.shape),
                          divergence, low, high)

  def loss(x):
    pg = -a * truncated * x * valid
    if is_weights is not None:
      pg = pg * is_weights
    return jnp.sum(pg * mask) / jnp.sum(mask)
  return loss, valid, ratio


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("with_is", [False, True], ids=["plain", "token_is"])
@pytest.mark.parametrize("divergence,low,high", [("tv", 0.05, 0.08),
                                                 ("kl", 0.01, 0.02)])
def test_dppo_verl_variant_matches_verl(divergence, low, high, with_is, seed):
  lp, old, sampler, adv, mask = hand_batch(seed)
  tx = obj.dppo(divergence, low, high, anchor="old", cap=3.0,
                ratio_base="old")
  if with_is:
    tx = optax.chain(tx, obj.truncated_is(2.0))
  ours = rljax_grad(tx, lp, old, sampler, adv, mask)
  w = verl_token_is(old, sampler, mask) if with_is else None
  loss, valid, ratio = verl_dppo_loss(lp, old, adv, mask, divergence, low,
                                      high, 3.0, w)
  assert_grads_match(ours, peer_grad(loss, lp))
  assert (valid[mask] == 0).any() and (valid[mask] == 1).any()
  assert ((ratio > 3.0) & (valid == 1) & mask).any()  # the cap binds


def test_dppo_default_is_unchanged():
  """The default keeps Stable-RL's form (ratio to the sampler, cap 10)."""
  assert inspect.signature(obj.dppo).parameters["cap"].default == 10.0
  assert inspect.signature(obj.dppo).parameters["ratio_base"].default == \
      "sampler"
  lp, old, sampler, adv, mask = hand_batch(0)
  ours = rljax_grad(obj.dppo("tv", 0.05, 0.08), lp, old, sampler, adv, mask)
  prob, q = np.exp(lp), np.exp(sampler)
  a = adv[:, None]
  bad = np.where(a > 0, prob - q > 0.08, prob - q < -0.05)
  ratio = np.minimum(np.exp(np.minimum(lp - sampler, 20.0)), 10.0)
  coef = ratio * (1.0 - bad)
  ref = peer_grad(lambda x: jnp.sum(-a * coef * x * mask) / jnp.sum(mask), lp)
  assert_grads_match(ours, ref)


# ----------------------------------------------------------------------------
# Constructor errors.


def test_constructor_errors():
  with pytest.raises(ValueError, match="is_mode='sequence_mask'"):
    obj.vespo(is_mode="sequence_mask")
  with pytest.raises(ValueError, match="is_min=3.0 must be <= is_max=2.0"):
    obj.vespo(is_min=3.0, is_max=2.0)
  with pytest.raises(ValueError, match="lambda_neg=0"):
    obj.vespo(lambda_neg=0)
  with pytest.raises(ValueError, match="delta=0"):
    obj.off_policy_sequence_mask(obj.ppo_clip(), 0)
  with pytest.raises(ValueError, match="beta=0"):
    obj.dro_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), beta=0)
  with pytest.raises(ValueError, match="ratio_base='mu'"):
    obj.dppo(ratio_base="mu")
  with pytest.raises(ValueError, match="old_logprobs_BxT is required"):
    r = jnp.ones((1, 2))
    obj.vespo().update(r, None, advantages_BxT=jnp.ones(1),
                       sampler_logprobs_BxT=r)


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed):
  lp, old, sampler, adv, mask = hand_batch(seed)
  lp, old, sampler, adv = map(f32, (lp, old, sampler, adv))
  mask = jnp.asarray(mask)
  return obj.importance_ratio(lp, old, mask), dict(
      advantages_BxT=adv, mask_BxT=mask, old_logprobs_BxT=old,
      sampler_logprobs_BxT=sampler)


HARNESS_CASES = [
    harness.Case("vespo", obj.vespo, dict(k_pos=2.0, lambda_pos=3.0,
                                          k_neg=3.0, lambda_neg=2.0), _inputs),
    harness.Case("vespo_mask", obj.vespo,
                 dict(is_mode="mask", is_min=0.5, is_max=2.0), _inputs),
    harness.Case("dro", obj.dro, {}, _inputs),
    harness.Case("opsm_ppo_clip", obj.off_policy_sequence_mask,
                 dict(objective=obj.ppo_clip(0.2, 0.28), delta=0.1), _inputs,
                 static_args=("objective",)),
    harness.Case("opsm_clip_cov", obj.off_policy_sequence_mask,
                 dict(objective=obj.clip_cov(0.2, clip_ratio=0.2, seed=0),
                      delta=0.1), _inputs, static_args=("objective",)),
    harness.Case("dppo_verl", obj.dppo,
                 dict(divergence="tv", delta_low=0.05, delta_high=0.08,
                      anchor="old", cap=3.0, ratio_base="old"), _inputs),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
def test_harness(case, check):
  check(case)


def test_dro_penalty_plain_jit_and_vmap_agree():
  batches = [hand_batch(s) for s in (0, 1)]
  lp = jnp.stack([f32(b[0]) for b in batches])
  old = jnp.stack([f32(b[1]) for b in batches])
  w = jnp.stack([f32(np.exp(b[1] - b[2])) for b in batches])
  fn = functools.partial(obj.dro_penalty, beta=0.3)
  batched = jax.jit(jax.vmap(lambda x, o, ww: fn(x, o, weights_BxT=ww)))(
      lp, old, w)
  for i in range(2):
    plain = fn(lp[i], old[i], weights_BxT=w[i])
    np.testing.assert_allclose(batched[i], plain, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(fn)(lp[i], old[i], weights_BxT=w[i]),
                               plain, rtol=1e-6)
