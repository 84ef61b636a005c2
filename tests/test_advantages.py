"""Tests for rljax.advantages against independent NumPy references."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import transform_harness as harness
from rljax import advantages as adv


# ----------------------------------------------------------------------------
# Independent float64 references: explicit loops over groups and samples.


def _groups(r, g, mask):
  for start in range(0, len(r), g):
    idx = [i for i in range(start, start + g) if mask[i]]
    yield np.array(idx, int), np.asarray(r, np.float64)[idx]


def _std(v, ddof):
  return float(np.std(v, ddof=ddof)) if len(v) > ddof else 0.0


def _lower_median(v):
  return float(np.sort(v)[(len(v) - 1) // 2])


def ref_center_group_mean(r, g, mask):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v) and v.max() > v.min():
      out[idx] = v - v.mean()
  return out


def ref_scale_group_std(r, g, mask, eps=1e-6, ddof=1):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    out[idx] = v / (_std(v, ddof) + eps)
  return out


def ref_leave_one_out(r, g, mask):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v) >= 2 and v.max() > v.min():
      for a, i in enumerate(idx):
        out[i] = v[a] - np.mean(np.delete(v, a))
  return out


def ref_center_group_median(r, g, mask):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v):
      out[idx] = v - _lower_median(v)
  return out


def ref_scale_group_mad(r, g, mask, eps=1e-3):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v):
      out[idx] = v / (_lower_median(np.abs(v - _lower_median(v))) + eps)
  return out


def ref_batch(r, mask, center, eps=1e-6):
  out = np.zeros(len(r))
  v = np.asarray(r, np.float64)[mask]
  if center:
    out[mask] = v - v.mean() if len(v) and v.max() > v.min() else 0.0
  else:
    out[mask] = v / (_std(v, 1) + eps)
  return out


def ref_grpo(r, g, mask, eps=1e-6):
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v) and v.max() > v.min():
      out[idx] = (v - v.mean()) / (_std(v, 1) + eps)
  return out


def ref_reinforce_pp(r, g, mask, eps=1e-6):
  u = ref_center_group_mean(r, g, mask)
  v = u[mask]
  out = np.zeros(len(r))
  out[mask] = (v - v.mean()) / (_std(v, 1) + eps)
  return out


def ref_mc_grpo(r, g, mask, eps=1e-3):
  return ref_scale_group_mad(ref_center_group_median(r, g, mask), g, mask, eps)


def ref_gdpo(r_nr, g, mask, w, eps=1e-4):
  """TRL/GDPO: nan-aware per-reward group z-score, weighted nansum, then a
  batch z-score (centring included)."""
  n, num_r = r_nr.shape
  a = np.zeros((n, num_r))
  for col in range(num_r):
    for start in range(0, n, g):
      idx = [i for i in range(start, start + g)
             if mask[i] and np.isfinite(r_nr[i, col])]
      v = np.asarray(r_nr[idx, col], np.float64)
      if len(v) >= 2 and v.max() > v.min():
        a[idx, col] = (v - v.mean()) / (np.std(v, ddof=1) + eps)
  total = a @ np.asarray(w, np.float64)
  out = np.zeros(n)
  v = total[mask]
  out[mask] = (v - v.mean()) / (np.std(v, ddof=1) + eps)
  return out


def ref_rank_weights(r, g, mask, weights):
  """Brute force: average the L-statistic over every K-subset."""
  k = len(weights)
  lstat = lambda s: sum(w * x for w, x in zip(weights, sorted(s)))
  out = np.zeros(len(r))
  for idx, v in _groups(r, g, mask):
    if len(v) <= k:
      continue
    for a, i in enumerate(idx):
      others = list(np.delete(v, a))
      q = np.mean([lstat([v[a], *c])
                   for c in itertools.combinations(others, k - 1)])
      base = np.mean([lstat(c) for c in itertools.combinations(others, k)])
      out[i] = q - base
  return out


# ----------------------------------------------------------------------------
# Data. Every test of a named transform uses N=20, G=4, so that its jitted
# update compiles twice (float32 and bfloat16).

G = 4
# Groups: mixed binary; constant fractional (zero variance); one padding
# sample; a group of one; ties at the median.
HAND_R = np.array([1, 0, 0, 1, .1, .1, .1, .1, 0, 1, 5, 3, 7, 9, 9, 9,
                   3, 1, 1, 2], np.float32)
HAND_M = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0,
                   1, 1, 1, 1], bool)
# Four zero-variance groups with values that do not round-trip through a
# float mean, then one group with signal.
ZERO_VARIANCE = np.array([.1, .1, .1, .1, 1 / 3, 1 / 3, 1 / 3, 1 / 3,
                          7.3, 7.3, 7.3, 7.3, -2.2, -2.2, -2.2, -2.2,
                          0, 1, 3, 4], np.float32)


def random_data(seed, g=G, groups=5):
  rng = np.random.default_rng(seed)
  r = np.where(rng.random(g * groups) < 0.5,
               rng.integers(0, 3, g * groups), rng.normal(size=g * groups))
  m = rng.random(g * groups) < 0.85
  m[:g] = True
  m[g:2 * g] = False  # A fully padded group.
  return r.astype(np.float32), m


# name -> (factory, reference(r, g, mask) or None, exact zero for constant
# groups). Scale-only transforms have no zero-variance guarantee on raw
# rewards (they expect centred inputs).
CASES = {
    "center_by_group_mean": (adv.center_by_group_mean, ref_center_group_mean,
                             True),
    "leave_one_out": (adv.leave_one_out, ref_leave_one_out, True),
    "center_by_group_median": (adv.center_by_group_median,
                               ref_center_group_median, True),
    "center_by_batch_mean": (adv.center_by_batch_mean,
                             lambda r, g, m: ref_batch(r, m, True), False),
    "scale_by_group_std": (adv.scale_by_group_std, ref_scale_group_std, False),
    "scale_by_group_mad": (adv.scale_by_group_mad, ref_scale_group_mad, False),
    "scale_by_batch_std": (adv.scale_by_batch_std,
                           lambda r, g, m: ref_batch(r, m, False), False),
    "grpo": (adv.grpo, ref_grpo, True),
    "dr_grpo": (adv.dr_grpo, ref_center_group_mean, True),
    "rloo": (adv.rloo, ref_leave_one_out, True),
    "reinforce_pp_baseline": (adv.reinforce_pp_baseline, ref_reinforce_pp,
                              True),
    "mc_grpo": (adv.mc_grpo, ref_mc_grpo, True),
    "rank_weights_k1": (lambda: adv.rank_weights(np.ones(1)),
                        lambda r, g, m: ref_rank_weights(r, g, m, [1.0]),
                        True),
    "rank_weights_median3": (
        lambda: adv.rank_weights(adv.median_rank_weights(3)),
        lambda r, g, m: ref_rank_weights(r, g, m, [0, 1, 0]), True),
    "rank_weights_best_of_2": (
        lambda: adv.rank_weights(adv.best_of_k_rank_weights(2)),
        lambda r, g, m: ref_rank_weights(r, g, m, [0, 1]), True),
}
SCALE_ONLY = ("scale_by_group_std", "scale_by_group_mad", "scale_by_batch_std")


@functools.lru_cache(maxsize=None)
def _jitted(name, group_size):
  tx = CASES[name][0]()
  update = jax.jit(functools.partial(tx.update, group_size=group_size))
  return lambda r, m: np.asarray(update(r, tx.init(r), mask_N=m)[0])


def run_named(name, r, group_size, mask=None):
  mask = np.ones(len(r), bool) if mask is None else mask
  return _jitted(name, group_size)(jnp.asarray(r), jnp.asarray(mask))


def run(tx, r, group_size, mask=None):
  """Applies an ad-hoc `tx` under jit (one compile, not one per eager op)."""
  r = jnp.asarray(r)
  update = jax.jit(functools.partial(tx.update, group_size=group_size))
  return np.asarray(update(r, tx.init(r), mask_N=mask)[0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_reference(name):
  _, ref, _ = CASES[name]
  r, m = random_data(0)
  np.testing.assert_allclose(run_named(name, r, G, m), ref(r, G, m),
                             rtol=1e-5, atol=1e-4)
  if name not in SCALE_ONLY:  # Near-constant groups make 1/std ill-posed.
    np.testing.assert_allclose(run_named(name, HAND_R, G, HAND_M),
                               ref(HAND_R, G, HAND_M), rtol=1e-5, atol=1e-5)


def test_hand_values():
  """A few values derived by hand, independent of any reference code."""
  r = np.zeros(20, np.float32)
  r[:8] = [1, 0, 0, 1, 0, 1, 5, 3]
  m = np.zeros(20, bool)
  m[:7] = True
  np.testing.assert_allclose(run_named("center_by_group_mean", r, G, m)[:8],
                             [.5, -.5, -.5, .5, -2, -1, 3, 0])
  np.testing.assert_allclose(run_named("leave_one_out", r, G, m)[:8],
                             [2 / 3, -2 / 3, -2 / 3, 2 / 3, -3, -1.5, 4.5, 0],
                             rtol=1e-6)
  # std of [1, 0, 0, 1] with ddof=1 is sqrt(1/3).
  np.testing.assert_allclose(run_named("grpo", r, G, m)[:4],
                             np.array([.5, -.5, -.5, .5]) * np.sqrt(3),
                             rtol=1e-5)
  # Median of [0, 1, 5] is 1; MAD is median(|[-1, 0, 4]|) = 1.
  np.testing.assert_allclose(run_named("mc_grpo", r, G, m)[4:8],
                             np.array([-1, 0, 4, 0]) / 1.001, rtol=1e-6)


@pytest.mark.parametrize(
    "name", sorted(n for n in CASES if CASES[n][2]))
def test_zero_variance_groups_are_exactly_zero(name):
  for dtype in (jnp.float32, jnp.bfloat16):
    out = run_named(name, jnp.asarray(ZERO_VARIANCE, dtype), G)
    assert out.dtype == dtype
    assert np.all(out[:16] == 0), out
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert np.any(out[16:] != 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_group_of_one_and_all_masked(name):
  r = HAND_R.copy()
  one = np.zeros(20, bool)
  one[4] = True
  out = run_named(name, r, G, one)
  assert np.all(np.isfinite(out)) and np.all(np.delete(out, 4) == 0)
  if name not in SCALE_ONLY:
    assert out[4] == 0  # A lone sample has no baseline information.
  assert np.all(run_named(name, r, G, np.zeros(20, bool)) == 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_samples_are_ignored(name):
  r, m = random_data(1)
  garbage = r.copy()
  garbage[~m] = np.where(np.arange((~m).sum()) % 2, np.nan, 1e30)
  clean = run_named(name, r, G, m)
  np.testing.assert_array_equal(run_named(name, garbage, G, m), clean)
  assert np.all(clean[~m] == 0)


@pytest.mark.parametrize("name", sorted(set(CASES) - set(SCALE_ONLY)))
def test_bf16_matches_reference(name):
  _, ref, _ = CASES[name]
  r16 = jnp.asarray(HAND_R, jnp.bfloat16)
  out = run_named(name, r16, G, HAND_M)
  assert out.dtype == jnp.bfloat16
  expected = ref(np.asarray(r16, np.float64), G, HAND_M)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected,
                             rtol=2e-2, atol=2e-2)


def test_median_ties_and_pivot():
  r = np.array([1, 1, 2, 2, 3, 1, 1, 2, 5, 5, 5, 5], np.float32)
  # Lower medians: 1 of [1, 1, 2, 2], 1 of [3, 1, 1, 2], 5 of [5, 5, 5, 5].
  # The pivot is the sample at position (n - 1) // 2 = 1 of a stable sort:
  # indices 1, 6 and 9.
  np.testing.assert_array_equal(run(adv.center_by_group_median(), r, 4),
                                [0, 0, 1, 1, 2, 0, 0, 1, 0, 0, 0, 0])
  pivot = jax.jit(adv.group_median_pivot_mask, static_argnames="group_size")
  keep = np.asarray(pivot(jnp.asarray(r), group_size=4))
  np.testing.assert_array_equal(np.where(~keep)[0], [1, 6, 9])
  # G + 1 = 3: one pivot per group, padding never chosen, empty group none.
  r3 = np.array([2, 9, 4, 7, 7, 1, 0, 0, 0], np.float32)
  m3 = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0], bool)
  keep = np.asarray(pivot(jnp.asarray(r3), group_size=3,
                          mask_N=jnp.asarray(m3)))
  np.testing.assert_array_equal(keep, [True, True, False, False, True, False,
                                       False, False, False])


@functools.lru_cache(maxsize=None)
def _rank_weights_update(k):
  """Jitted, with the weights traced: one compile per K."""
  del k
  return jax.jit(lambda w, r, m: adv.rank_weights(w).update(
      r, None, group_size=6, mask_N=m)[0])


@pytest.mark.parametrize("weights", [
    [1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0, 0.0], [0.3, -0.2, 0.9],
    list(adv.cvar_rank_weights(3, 0.34)), list(adv.trimmed_mean_rank_weights(
        4, 1))])
def test_rank_weights_brute_force(weights):
  rng = np.random.default_rng(len(weights))
  r = rng.integers(0, 4, 24).astype(np.float32)  # Many ties.
  r[:6] += rng.normal(size=6).astype(np.float32)
  m = np.ones(24, bool)
  m[6:8] = False  # n = 4 valid.
  m[12:15] = False  # n = 3 valid.
  out = np.asarray(_rank_weights_update(len(weights))(
      jnp.asarray(weights, jnp.float32), r, m))
  np.testing.assert_allclose(out, ref_rank_weights(r, 6, m, weights),
                             rtol=1e-5, atol=1e-5)
  for idx, v in _groups(r, 6, m):  # Tied rewards, identical advantages.
    for a, b in itertools.combinations(range(len(v)), 2):
      if v[a] == v[b]:
        np.testing.assert_allclose(out[idx[a]], out[idx[b]], atol=1e-5)


def test_rank_weights_uniform_is_scaled_loo():
  """With uniform weights the L-statistic is the subset mean, so
  q_i - v_i = (x_i - mean_{j != i} x_j) / K (derived by hand)."""
  r, m = random_data(3, g=6)
  out = run(adv.rank_weights(np.full(3, 1 / 3)), r, 6, m)
  n_valid = np.array([m[s:s + 6].sum() for s in range(0, 30, 6)]).repeat(6)
  expected = np.where(n_valid > 3, ref_leave_one_out(r, 6, m) / 3, 0.0)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_rank_weight_presets():
  np.testing.assert_array_equal(adv.median_rank_weights(4), [0, .5, .5, 0])
  np.testing.assert_array_equal(adv.median_rank_weights(3), [0, 1, 0])
  np.testing.assert_allclose(adv.trimmed_mean_rank_weights(5, 1),
                             [0, 1 / 3, 1 / 3, 1 / 3, 0])
  np.testing.assert_allclose(adv.cvar_rank_weights(4, 0.5), [.5, .5, 0, 0])
  np.testing.assert_array_equal(adv.best_of_k_rank_weights(3), [0, 0, 1])
  with pytest.raises(ValueError, match="trim"):
    adv.trimmed_mean_rank_weights(4, 2)
  with pytest.raises(ValueError, match="alpha"):
    adv.cvar_rank_weights(4, 0.0)


def test_gdpo_against_reference_with_missing_rewards():
  rng = np.random.default_rng(5)
  r = rng.integers(0, 3, (24, 3)).astype(np.float32)
  r[:, 2] = rng.normal(size=24)
  r[3, 0] = np.nan  # A reward function returned None.
  r[12:16, 1] = 2.0  # A column constant within a group.
  m = np.ones(24, bool)
  m[20] = False
  w = np.array([1.0, 0.5, 2.0])
  out = run(adv.gdpo(w), r, 4, jnp.asarray(m))
  np.testing.assert_allclose(out, ref_gdpo(r, 4, m, w), rtol=1e-5, atol=1e-5)
  assert out.shape == (24,) and out[20] == 0


def test_normalize_each_reward_zero_variance_is_zero():
  r = np.array([[1, 2], [1, 2], [1, 2], [0, 5], [1, 5], [1, 5]], np.float32)
  out = run(adv.normalize_each_reward(np.array([1.0, 1.0])), r, 3)
  assert np.all(out[:3] == 0)
  # Group 2: column 0 z-scores of [0, 1, 1] with ddof=1, column 1 constant.
  s = np.std([0, 1, 1], ddof=1)
  np.testing.assert_allclose(out[3:], (np.array([0, 1, 1]) - 2 / 3) /
                             (s + 1e-4), rtol=1e-5)


def test_sum_rewards_then_grpo():
  r = np.array([[1, 0], [0, np.nan], [1, 1], [0, 0]], np.float32)
  out = run(optax.chain(adv.sum_rewards(np.array([1.0, 2.0])), adv.grpo()),
            r, 4)
  total = np.array([1, 0, 3, 0])  # NaN counts as 0.
  np.testing.assert_allclose(out, (total - 1) / (np.std(total, ddof=1) +
                                                 1e-6), rtol=1e-5)


def test_clip_advantages():
  tx = adv.clip_advantages(1.5)
  out = tx.update(jnp.array([-3., -1, 0, 2]), tx.init(jnp.zeros(4)))[0]
  np.testing.assert_array_equal(out, [-1.5, -1, 0, 1.5])


def test_metrics():
  r = np.array([1, 0, 0, 1, 2, 2, 2, 2, 0, 1, 5, 3], np.float32)
  m = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], bool)
  a = run(adv.grpo(), r, 4, m)
  metric_fn = jax.jit(adv.advantage_metrics, static_argnames="group_size")
  metrics = metric_fn(jnp.asarray(r), jnp.asarray(a), group_size=4,
                      mask_N=jnp.asarray(m))
  v = r[m]
  np.testing.assert_allclose(metrics["reward_mean"], v.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["reward_std"], v.std(), rtol=1e-6)
  np.testing.assert_allclose(metrics["advantage_abs_max"],
                             np.abs(a[m]).max(), rtol=1e-6)
  assert float(metrics["frac_zero_variance_groups"]) == 0.5  # Empty skipped.
  assert float(metrics["frac_zero_advantage"]) == 0.5
  empty = metric_fn(jnp.asarray(r), jnp.zeros(12), group_size=4,
                    mask_N=jnp.zeros(12, bool))
  assert all(np.isfinite(x) and x == 0 for x in jax.device_get(empty).values())


def test_errors():
  r = jnp.zeros(8)
  tx = adv.center_by_group_mean()
  with pytest.raises(ValueError, match="group_size=3"):
    tx.update(r, tx.init(r), group_size=3)
  with pytest.raises(ValueError, match="group_size is required"):
    tx.update(r, tx.init(r))
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(lambda g: tx.update(r, tx.init(r), group_size=g))(4)
  with pytest.raises(ValueError, match="mask_N"):
    tx.update(r, tx.init(r), group_size=4, mask_N=jnp.ones(7, bool))
  with pytest.raises(ValueError, match=r"shape \[N\]"):
    tx.update(jnp.zeros((8, 2)), None, group_size=4)
  with pytest.raises(ValueError, match="at most group_size - 1"):
    run(adv.rank_weights(np.ones(4)), np.zeros(8, np.float32), 4)
  with pytest.raises(ValueError, match="reward_weights"):
    run(adv.normalize_each_reward(np.ones(3)), np.zeros((8, 2), np.float32),
        4)


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed, n_rewards=None):
  rng = np.random.default_rng(seed)
  shape = (12,) if n_rewards is None else (12, n_rewards)
  r = jnp.asarray(rng.integers(0, 3, shape) + rng.normal(size=shape) * 0.1,
                  jnp.float32)
  m = rng.random(12) < 0.8
  m[0] = True
  return r, {"mask_N": jnp.asarray(m)}


def _case(name, factory, static_args=(), n_rewards=None, **kwargs):
  return harness.Case(
      name, factory, kwargs, functools.partial(_inputs, n_rewards=n_rewards),
      static_extra={"group_size": 4}, static_args=static_args)


HARNESS_CASES = [
    _case("center_by_group_mean", adv.center_by_group_mean),
    _case("scale_by_group_std", adv.scale_by_group_std, eps=1e-6, ddof=1),
    _case("center_by_batch_mean", adv.center_by_batch_mean),
    _case("scale_by_batch_std", adv.scale_by_batch_std, eps=1e-6),
    _case("leave_one_out", adv.leave_one_out),
    _case("center_by_group_median", adv.center_by_group_median),
    _case("scale_by_group_mad", adv.scale_by_group_mad, eps=1e-3),
    _case("normalize_each_reward", adv.normalize_each_reward, n_rewards=2,
          reward_weights=np.array([1.0, 0.5])),
    _case("sum_rewards", adv.sum_rewards, n_rewards=2,
          reward_weights=np.array([1.0, 0.5])),
    _case("rank_weights", adv.rank_weights, weights_K=np.array([.2, .3, .5])),
    _case("clip_advantages", adv.clip_advantages, max_abs=0.5),
    _case("grpo", adv.grpo, eps=1e-6),
    _case("dr_grpo", adv.dr_grpo),
    _case("rloo", adv.rloo),
    _case("reinforce_pp_baseline", adv.reinforce_pp_baseline, eps=1e-6),
    _case("mc_grpo", adv.mc_grpo, eps=1e-3),
    _case("gdpo", adv.gdpo, n_rewards=3, reward_weights=np.ones(3)),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
@pytest.mark.slow
def test_harness(case, check):
  check(case)


def test_chain_passes_extra_args_and_matches_steps():
  r, m = random_data(7, g=6)
  tx = optax.chain(adv.center_by_group_median(), adv.clip_advantages(0.5))
  expected = np.clip(ref_center_group_median(r, 6, m), -0.5, 0.5)
  np.testing.assert_allclose(run(tx, r, 6, m), expected, atol=1e-6)


def test_reward_heads_read_the_weights_from_the_extra_argument():
  rng = np.random.default_rng(3)
  r = rng.normal(size=(8, 3)).astype(np.float32)
  r[2, 1] = np.nan
  w = np.array([1.0, 0.5, -2.0], np.float32)
  total, _ = adv.sum_rewards().update(jnp.asarray(r), optax.EmptyState(),
                                      reward_weights_R=w)
  np.testing.assert_allclose(total, np.nansum(r * w, axis=1), rtol=1e-6)
  # normalize_each_reward: the weights multiply each column's group z-score.
  z = r.reshape(2, 4, 3).astype(np.float64)
  ok = np.isfinite(z)
  mean = np.nansum(z, 1, keepdims=True) / ok.sum(1, keepdims=True)
  std = np.sqrt(np.nansum((z - mean) ** 2, 1, keepdims=True)
                / (ok.sum(1, keepdims=True) - 1))
  expected = np.nansum((z - mean) / (std + 1e-4) * w, -1).reshape(-1)
  got, _ = adv.normalize_each_reward().update(
      jnp.asarray(r), optax.EmptyState(), group_size=4, reward_weights_R=w)
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="given twice"):
    adv.sum_rewards(w).update(jnp.asarray(r), optax.EmptyState(),
                              reward_weights_R=w)


def test_sum_rewards_leaves_rows_outside_the_mask_at_zero():
  r = jnp.ones((4, 2))
  total, _ = adv.sum_rewards().update(
      r, optax.EmptyState(), mask_N=jnp.array([True, False, True, True]))
  np.testing.assert_array_equal(total, [2.0, 0.0, 2.0, 2.0])


@pytest.mark.parametrize("scale", [1e30, 1e36])
def test_large_finite_rewards_do_not_zero_the_advantages(scale):
  """float32 squares of 1e30 overflow: the statistics are taken scaled."""
  r = np.array([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 5.0, 1.0], np.float32) * scale
  x = (r / scale).astype(np.float64).reshape(2, 4)
  expected = ((x - x.mean(1, keepdims=True))
              / x.std(1, ddof=1, keepdims=True)).reshape(-1)
  for tx in (adv.grpo(), optax.chain(adv.center_by_group_mean(),
                                     adv.scale_by_batch_std())):
    a, _ = tx.update(jnp.asarray(r), tx.init(jnp.asarray(r)), group_size=4)
    assert np.isfinite(a).all() and np.abs(a).max() > 0.1
  tx = adv.grpo()
  a, _ = tx.update(jnp.asarray(r), tx.init(jnp.asarray(r)), group_size=4)
  np.testing.assert_allclose(a, expected, rtol=1e-4, atol=1e-5)
