"""Reward -> advantage transforms in the optax protocol.

Each transform is an `optax.GradientTransformationExtraArgs` whose "updates"
are per-sample values: rewards go in, advantages come out, and transforms
compose with `optax.chain`:

    tx = optax.chain(center_by_group_mean(), scale_by_group_std())  # = grpo()
    state = tx.init(rewards_N)
    advantages_N, state = tx.update(rewards_N, state, group_size=8, mask_N=m)

Layout. `rewards_N` holds `N = num_groups * group_size` samples laid out
group-contiguous: samples `[g * G, (g + 1) * G)` are the `G` completions of
prompt `g`. Extra arguments are keyword-only:

* `group_size` (static Python `int`, required by the group transforms). Under
  `jax.jit` close over it (`functools.partial(tx.update, group_size=G)`) or
  pass it as a static argument; a traced value is rejected.
* `mask_N` (optional bool `[N]`): valid samples. Padding samples (a group with
  fewer than `G` completions, a dropped prompt) are `False`: they are ignored
  by every statistic and their advantage is exactly 0.

Several reward functions give rewards `[N, R]`; `sum_rewards` (weighted
sum) or `normalize_each_reward` (GDPO) turn them into one value per sample
at the head of a chain. Unknown extra arguments are accepted and ignored.

All statistics are computed in float32 and the advantages are returned in
the rewards' dtype. Every transform is O(N log N) or better (sorting within
groups), jit-able and vmap-able. With every baseline transform and preset, a
group whose valid rewards are all equal, or that has fewer valid samples
than the statistic needs, gets advantage exactly 0 (never NaN); the scale-only
transforms (`scale_by_*`) expect centred inputs. Advantages carry no
gradient (they are computed from rewards only).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import types

_Tx = optax.GradientTransformationExtraArgs


# ----------------------------------------------------------------------------
# Layout helpers.


def _check_group_size(fn: str, group_size: Any, n: int) -> int:
  if group_size is None:
    raise ValueError(
        f"{fn}: the keyword extra argument group_size is required (a Python "
        "int, the number of completions per prompt).")
  if isinstance(group_size, (jax.core.Tracer, bool)) or not isinstance(
      group_size, (int, np.integer)):
    raise TypeError(
        f"{fn}: group_size must be a static Python int; got "
        f"{type(group_size).__name__}. Under jax.jit, close over it with "
        "functools.partial(tx.update, group_size=G) or mark it static.")
  group_size = int(group_size)
  if group_size < 1 or n % group_size:
    raise ValueError(
        f"{fn}: group_size={group_size} must be a positive divisor of the "
        f"number of samples N={n}.")
  return group_size


def _check_rewards(fn: str, rewards: jax.Array, ndim: int) -> None:
  if rewards.ndim != ndim:
    want = "[N]" if ndim == 1 else "[N, R]"
    raise ValueError(
        f"{fn}: the updates (rewards) must have shape {want}; got shape "
        f"{rewards.shape}. Batch with jax.vmap for more leading axes.")


def _valid(fn: str, mask_N: Any, n: int) -> jax.Array:
  if mask_N is None:
    return jnp.ones((n,), bool)
  mask_N = jnp.asarray(mask_N)
  if mask_N.shape != (n,):
    raise ValueError(
        f"{fn}: mask_N must have shape ({n},) to match the rewards; got "
        f"{mask_N.shape}.")
  return mask_N.astype(bool)


def _grouped(fn, rewards_N, group_size, mask_N):
  """Returns float32 values [K, G] and validity [K, G], K = N // G."""
  _check_rewards(fn, rewards_N, 1)
  n = rewards_N.shape[0]
  g = _check_group_size(fn, group_size, n)
  valid = _valid(fn, mask_N, n)
  return (rewards_N.astype(jnp.float32).reshape(-1, g), valid.reshape(-1, g))


def _count(valid, axis=-1):
  return jnp.sum(valid, axis=axis, keepdims=True, dtype=jnp.float32)


def _mean(x, valid, axis=-1):
  return jnp.sum(jnp.where(valid, x, 0.0), axis, keepdims=True) / jnp.maximum(
      _count(valid, axis), 1.0)


def _std(x, valid, ddof, axis=-1):
  """Masked std with `ddof`; 0 when fewer than `ddof + 1` valid values."""
  n = _count(valid, axis)
  dev = jnp.where(valid, x - _mean(x, valid, axis), 0.0)
  var = jnp.sum(dev * dev, axis, keepdims=True) / jnp.maximum(n - ddof, 1.0)
  return jnp.where(n > ddof, jnp.sqrt(var), 0.0)


def _is_constant(x, valid, axis=-1):
  """True where all valid values along `axis` are equal (or none is valid)."""
  hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis, keepdims=True)
  lo = jnp.min(jnp.where(valid, x, jnp.inf), axis, keepdims=True)
  return ~(hi > lo)


def _lower_median(x, valid):
  """Lower median of the valid entries of each row of [K, G]; 0 if none."""
  n = jnp.sum(valid, -1, keepdims=True)
  s = jnp.sort(jnp.where(valid, x, jnp.inf), axis=-1)
  idx = jnp.maximum((n - 1) // 2, 0)
  med = jnp.take_along_axis(s, idx, axis=-1)
  return jnp.where(n > 0, med, 0.0)


def _out(adv, valid, like):
  return jnp.where(valid, adv, 0.0).reshape(like.shape[0]).astype(like.dtype)


def _check_nonneg(fn: str, name: str, value: Any) -> None:
  concrete = isinstance(value, (int, float, np.ndarray))
  if concrete and np.any(np.asarray(value) < 0):
    raise ValueError(f"{fn}: {name}={value!r} must be >= 0.")


def _stateless(update_fn) -> _Tx:
  return _Tx(lambda params: optax.EmptyState(), update_fn)


# ----------------------------------------------------------------------------
# Group and batch statistics.


def center_by_group_mean() -> _Tx:
  """Subtracts each group's mean reward: `A_i = r_i - mean_{j in g(i)} r_j`.

  The baseline of GRPO and (without any std scaling) Dr.GRPO. The mean is over
  the valid samples of the group; a group whose valid rewards are all equal
  (including a group of one) gets exactly 0.

  References:
    Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
    in Open Language Models", https://arxiv.org/abs/2402.03300.
  """
  fn = "center_by_group_mean"

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    adv = jnp.where(_is_constant(x, valid), 0.0, x - _mean(x, valid))
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def scale_by_group_std(eps: float = 1e-6, ddof: int = 1) -> _Tx:
  """Divides by each group's std: `A_i = u_i / (std_{j in g(i)} u_j + eps)`.

  Use after a centering transform (GRPO: `center_by_group_mean`). The std has
  `ddof` (1: Bessel-corrected, as TRL and verl compute it) and is 0 for a
  group with at most `ddof` valid samples, so an already-centred zero-variance
  group or group of one stays exactly 0.

  Args:
    eps: added to the std. TRL uses 1e-4, verl 1e-6.
    ddof: delta degrees of freedom of the std.

  References:
    Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
    in Open Language Models", https://arxiv.org/abs/2402.03300.
  """
  fn = "scale_by_group_std"
  _check_nonneg(fn, "eps", eps)

  def update_fn(updates_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, updates_N, group_size, mask_N)
    return _out(x / (_std(x, valid, ddof) + eps), valid, updates_N), state

  return _stateless(update_fn)


def center_by_batch_mean() -> _Tx:
  """Subtracts the mean over all valid samples: `A_i = u_i - mean_j u_j`.

  Used for REINFORCE++'s global normalisation and GDPO's batch step. If the
  whole batch is constant the result is exactly 0. Under `jit` with a sharded
  input the mean is over the global batch.

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  fn = "center_by_batch_mean"

  def update_fn(updates_N, state, params=None, *, mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, updates_N, 1)
    x = updates_N.astype(jnp.float32)
    valid = _valid(fn, mask_N, x.shape[0])
    adv = jnp.where(_is_constant(x, valid), 0.0, x - _mean(x, valid))
    return _out(adv, valid, updates_N), state

  return _stateless(update_fn)


def scale_by_batch_std(eps: float = 1e-6, ddof: int = 1) -> _Tx:
  """Divides by the std over all valid samples: `A_i = u_i / (std_j u_j + eps)`.

  Args:
    eps: added to the std.
    ddof: delta degrees of freedom of the std.

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  fn = "scale_by_batch_std"
  _check_nonneg(fn, "eps", eps)

  def update_fn(updates_N, state, params=None, *, mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, updates_N, 1)
    x = updates_N.astype(jnp.float32)
    valid = _valid(fn, mask_N, x.shape[0])
    return _out(x / (_std(x, valid, ddof) + eps), valid, updates_N), state

  return _stateless(update_fn)


def leave_one_out() -> _Tx:
  """RLOO baseline: `A_i = r_i - mean_{j in g(i), j != i} r_j`.

  Over the valid samples of the group; a group with fewer than two valid
  samples, or with all rewards equal, gets exactly 0.

  References:
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs",
    https://arxiv.org/abs/2402.14740; Kool et al., "Buy 4 REINFORCE Samples,
    Get a Baseline for Free!" (ICLR 2019 DeepRLStructPred workshop).
  """
  fn = "leave_one_out"

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    n = _count(valid)
    total = jnp.sum(jnp.where(valid, x, 0.0), -1, keepdims=True)
    baseline = (total - x) / jnp.maximum(n - 1.0, 1.0)
    keep = (n > 1) & ~_is_constant(x, valid)
    return _out(jnp.where(keep, x - baseline, 0.0), valid, rewards_N), state

  return _stateless(update_fn)


def center_by_group_median() -> _Tx:
  """MC-GRPO baseline: `A_i = r_i - median_{j in g(i)} r_j` (lower median).

  MC-GRPO samples `G + 1` completions per prompt so that the group has an odd
  size; the median ("pivot") sample then has advantage exactly 0 and is
  excluded from the gradient. Its advantage is 0 here for any group size (for
  an even number of valid samples the lower median, as `torch.median`, is
  used). To also drop the pivot from the loss normalisers and the KL term, as
  the paper does, AND `group_median_pivot_mask(...)` into the loss mask. The
  authors' scaling by the median absolute deviation is `scale_by_group_mad`;
  `mc_grpo()` chains both.

  References:
    Kim, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning", https://arxiv.org/abs/2601.22582.
  """
  fn = "center_by_group_median"

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    return _out(x - _lower_median(x, valid), valid, rewards_N), state

  return _stateless(update_fn)


def scale_by_group_mad(eps: float = 1e-3) -> _Tx:
  """Divides by the group's median absolute deviation: `u_i / (MAD + eps)`.

  `MAD = median_j |u_j - median_k u_k|` over the valid samples (lower medians,
  as MC-GRPO's `torch.median`). MC-GRPO uses `eps=1e-3`; when more than half
  of a group shares one reward, MAD is 0 and the advantages are scaled by
  `1 / eps`, as in the authors' code.

  References:
    Kim, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning", https://arxiv.org/abs/2601.22582.
  """
  fn = "scale_by_group_mad"
  _check_nonneg(fn, "eps", eps)

  def update_fn(updates_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, updates_N, group_size, mask_N)
    mad = _lower_median(jnp.abs(x - _lower_median(x, valid)), valid)
    return _out(x / (mad + eps), valid, updates_N), state

  return _stateless(update_fn)


def group_median_pivot_mask(rewards_N: jax.Array, *, group_size: int,
                            mask_N: jax.Array | None = None) -> jax.Array:
  """Bool `[N]`: valid samples that are not their group's median pivot.

  The pivot of a group is the valid sample at the lower-median position of a
  stable sort of the group's valid rewards (ties broken by position), i.e.
  exactly one sample per non-empty group. MC-GRPO drops it from the batch.

  Args:
    rewards_N: rewards, group-contiguous.
    group_size: samples per group (static int).
    mask_N: optional bool validity mask.

  Returns:
    keep_N: `mask_N` with each group's pivot set to False.
  """
  fn = "group_median_pivot_mask"
  x, valid = _grouped(fn, rewards_N, group_size, mask_N)
  order = jnp.argsort(jnp.where(valid, x, jnp.inf), axis=-1, stable=True)
  n = jnp.sum(valid, -1, keepdims=True)
  pivot = jnp.take_along_axis(order, jnp.maximum((n - 1) // 2, 0), axis=-1)
  is_pivot = (jnp.arange(x.shape[1])[None, :] == pivot) & (n > 0)
  return (valid & ~is_pivot).reshape(-1)


# ----------------------------------------------------------------------------
# Several reward functions.


def normalize_each_reward(reward_weights: Any = None, eps: float = 1e-4,
                          ddof: int = 1) -> _Tx:
  """GDPO "normalize then sum": z-score each reward within its group, then sum.

      A_i = sum_r reward_weights[r] * (R_ir - mean_g R_.r) / (std_g R_.r + eps)

  The updates are rewards `[N, R]` (one column per reward function); the
  output is `[N]`. A non-finite entry (a reward function that returned None,
  stored as NaN) is ignored by that column's statistics and contributes 0, as
  TRL's `nanmean`/`nanstd`; a column that is constant within a group
  contributes exactly 0. GDPO then renormalises over the batch; `gdpo()` chains
  this with `scale_by_batch_std`.

  Args:
    reward_weights: `[R]` weights (default all ones).
    eps: added to each group std (GDPO: 1e-4).
    ddof: delta degrees of freedom of the std (GDPO/TRL: 1).

  References:
    Liu et al., "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization",
    https://arxiv.org/abs/2601.05242.
  """
  fn = "normalize_each_reward"
  _check_nonneg(fn, "eps", eps)

  def update_fn(rewards_NxR, state, params=None, *, group_size=None,
                mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, rewards_NxR, 2)
    n, r = rewards_NxR.shape
    g = _check_group_size(fn, group_size, n)
    if reward_weights is None:
      w_R = jnp.ones((r,), jnp.float32)
    else:
      w_R = jnp.asarray(reward_weights, jnp.float32)
      if w_R.shape != (r,):
        raise ValueError(
            f"{fn}: reward_weights must have shape ({r},) to match the {r} "
            f"reward columns; got {w_R.shape}.")
    x = rewards_NxR.astype(jnp.float32)
    sample_ok = _valid(fn, mask_N, n)
    valid = sample_ok[:, None] & jnp.isfinite(x)
    x = jnp.where(valid, x, 0.0).reshape(-1, g, r)
    valid = valid.reshape(-1, g, r)
    z = (x - _mean(x, valid, 1)) / (_std(x, valid, ddof, 1) + eps)
    z = jnp.where(valid & ~_is_constant(x, valid, 1), z, 0.0)
    adv = jnp.sum(z * w_R, axis=-1).reshape(n)
    return jnp.where(sample_ok, adv, 0.0).astype(rewards_NxR.dtype), state

  return _stateless(update_fn)


def sum_rewards(reward_weights: Any = None) -> _Tx:
  """Weighted sum of several rewards, `[N, R] -> [N]` ("sum then normalize").

  `r_i = sum_r reward_weights[r] * R_ir`, with a non-finite entry (a reward
  function that returned None) counted as 0, as TRL's `nansum`. Chain it
  before a single-reward transform: `optax.chain(sum_rewards(w), grpo())`.
  """
  fn = "sum_rewards"

  def update_fn(rewards_NxR, state, params=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, rewards_NxR, 2)
    r = rewards_NxR.shape[1]
    w_R = jnp.ones((r,)) if reward_weights is None else jnp.asarray(
        reward_weights, jnp.float32)
    if w_R.shape != (r,):
      raise ValueError(
          f"{fn}: reward_weights must have shape ({r},) to match the {r} "
          f"reward columns; got {w_R.shape}.")
    x = rewards_NxR.astype(jnp.float32)
    total = jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0) * w_R, axis=-1)
    return total.astype(rewards_NxR.dtype), state

  return _stateless(update_fn)


# ----------------------------------------------------------------------------
# Order statistics (OrderGrad).


def _log_comb_fn(max_n: int):
  lf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, max_n + 1)))])

  def comb(n, k):
    n, k = np.broadcast_arrays(np.asarray(n), np.asarray(k))
    ok = (n >= 0) & (k >= 0) & (k <= n)
    n0, k0 = np.where(ok, n, 0), np.where(ok, k, 0)
    return np.where(ok, np.exp(lf[n0] - lf[k0] - lf[n0 - k0]), 0.0)

  return comb


def _order_stat_tables(group_size: int, k: int) -> np.ndarray:
  """float64 [4, G + 1, G, k]: OrderGrad's A, B, C and W^- matrices for every
  number n = 0..G of valid samples (rows past n, and every row when n <= k,
  are 0)."""
  g = group_size
  comb = _log_comb_fn(g + 2)
  n = np.arange(g + 1)[:, None, None]
  m = np.arange(1, g + 1)[None, :, None]  # 1-based sorted position.
  j = np.arange(1, k + 1)[None, None, :]  # 1-based rank inside a k-subset.
  with np.errstate(divide="ignore", invalid="ignore"):
    inc = np.where(n > k, 1.0 / comb(n - 1, k - 1), 0.0)
    loo = np.where(n > k, 1.0 / comb(n - 1, k), 0.0)
  a = comb(m - 1, j - 1) * comb(n - m - 1, k - j - 1) * inc
  b = comb(m - 1, j - 1) * comb(n - m, k - j) * inc
  c = comb(m - 2, j - 2) * comb(n - m, k - j) * inc
  w = comb(m - 1, j - 1) * comb(n - 1 - m, k - j) * loo
  return np.stack([a, b, c, w])


def rank_weights(weights_K: Any) -> _Tx:
  """OrderGrad advantage for an L-statistic objective over `K`-subsets.

  The objective of one prompt is `E[sum_j weights_K[j] * R_(j:K)]`, the
  weighted sum of the order statistics (ascending, `j = 0` is the minimum) of
  `K` rewards drawn i.i.d. from the policy. With the group's `n` valid rewards
  sorted ascending (`x_(1) <= ... <= x_(n)`, stable), OrderGrad's unbiased
  likelihood-ratio advantage of the sample at sorted position `r` is

      A_r = q_r - v_r,
      q_r = E[L(S)]  over K-subsets S of the group that contain sample r,
      v_r = E[L(S)]  over K-subsets of the group without sample r,

  both evaluated exactly by prefix/suffix sums of the sorted rewards against
  binomial tables precomputed on the host (O(G^2 K) once per trace, O(N log N)
  per call). `K = len(weights_K) <= group_size - 1`; a group with at most `K`
  valid samples gets 0. The score-function gradient of the objective is
  `(K / n) * sum_i A_i * grad log pi(y_i)`; the constant `K / n` is left to
  the learning rate. Tied rewards get identical advantages (up to rounding),
  and a group whose valid rewards are all equal gets exactly 0. With `K = 1`
  this is RLOO; with uniform weights `A_r = (x_r - mean_{j != r} x_j) / K`.

  Args:
    weights_K: rank weights, lowest rank first; see `median_rank_weights`,
      `trimmed_mean_rank_weights`, `cvar_rank_weights`,
      `best_of_k_rank_weights`. May be injected (traced); only its length is
      static.

  References:
    Parmas et al., "OrderGrad: Optimizing Beyond the Mean with Order-Statistic
    Policy Gradient Estimation", https://arxiv.org/abs/2606.06096.
  """
  fn = "rank_weights"
  k = int(np.shape(weights_K)[0]) if np.ndim(weights_K) == 1 else 0
  if k < 1:
    raise ValueError(
        f"{fn}: weights_K must be a non-empty 1-d array of rank weights; got "
        f"shape {np.shape(weights_K)}.")

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    g = x.shape[1]
    if k > g - 1:
      raise ValueError(
          f"{fn}: len(weights_K)={k} must be at most group_size - 1 = {g - 1}.")
    tables = jnp.asarray(_order_stat_tables(g, k), jnp.float32)
    coef = tables @ jnp.asarray(weights_K, jnp.float32)  # [4, G + 1, G].
    n = jnp.sum(valid, -1)
    a, b, c, w = (coef[i][n] for i in range(4))  # [K, G] each.
    order = jnp.argsort(jnp.where(valid, x, jnp.inf), axis=-1, stable=True)
    xs = jnp.take_along_axis(jnp.where(valid, x, 0.0), order, axis=-1)
    xa, xc, xw = xs * a, xs * c, xs * w
    xw_next = jnp.pad(xs[:, 1:], ((0, 0), (0, 1))) * w
    below = lambda v: jnp.cumsum(v, -1) - v
    above = lambda v: jnp.sum(v, -1, keepdims=True) - jnp.cumsum(v, -1)
    q = below(xa) + xs * b + above(xc)
    v = below(xw) + above(xw_next) + xw_next
    adv_sorted = q - v
    adv = jnp.take_along_axis(adv_sorted, jnp.argsort(order, axis=-1), axis=-1)
    keep = (n > k)[:, None] & ~_is_constant(x, valid)
    return _out(jnp.where(keep, adv, 0.0), valid, rewards_N), state

  return _stateless(update_fn)


def median_rank_weights(k: int) -> np.ndarray:
  """Median of `k` draws: 1 on the middle rank (0.5/0.5 on two if `k` even)."""
  out = np.zeros(k)
  if k % 2:
    out[k // 2] = 1.0
  else:
    out[k // 2 - 1: k // 2 + 1] = 0.5
  return out


def trimmed_mean_rank_weights(k: int, trim: int) -> np.ndarray:
  """Mean of the `k` draws without the `trim` lowest and `trim` highest."""
  if not 0 <= 2 * trim < k:
    raise ValueError(f"trim={trim}: 0 <= 2 * trim < k={k} is required.")
  out = np.zeros(k)
  out[trim: k - trim] = 1.0 / (k - 2 * trim)
  return out


def cvar_rank_weights(k: int, alpha: float) -> np.ndarray:
  """Lower-tail mean (CVaR) at level `alpha`: mean of the `ceil(alpha k)`
  lowest of `k` draws."""
  if not 0.0 < alpha <= 1.0:
    raise ValueError(f"alpha={alpha}: 0 < alpha <= 1 is required.")
  m = max(1, math.ceil(alpha * k))
  out = np.zeros(k)
  out[:m] = 1.0 / m
  return out


def best_of_k_rank_weights(k: int) -> np.ndarray:
  """Best-of-`k`: all weight on the maximum of `k` draws."""
  out = np.zeros(k)
  out[-1] = 1.0
  return out


# ----------------------------------------------------------------------------
# Clipping and presets.


def clip_advantages(max_abs: float) -> _Tx:
  """Clips each advantage to `[-max_abs, max_abs]`; padding stays 0."""
  _check_nonneg("clip_advantages", "max_abs", max_abs)

  def update_fn(updates_N, state, params=None, **extra_args):
    del params, extra_args
    return jnp.clip(updates_N, -max_abs, max_abs).astype(updates_N.dtype), state

  return _stateless(update_fn)


def grpo(eps: float = 1e-6) -> _Tx:
  """GRPO: `(r - mean_g r) / (std_g r + eps)` (Bessel-corrected std).

  References:
    Shao et al., "DeepSeekMath", https://arxiv.org/abs/2402.03300.
  """
  return optax.chain(center_by_group_mean(), scale_by_group_std(eps=eps))


def dr_grpo() -> _Tx:
  """Dr.GRPO: `r - mean_g r`, no std scaling (pair it with the
  `sequence_mean_token_sum_norm` loss aggregation).

  References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783.
  """
  return optax.chain(center_by_group_mean())


def rloo() -> _Tx:
  """RLOO: `r_i - mean_{j != i} r_j` within the group.

  References:
    Ahmadian et al., https://arxiv.org/abs/2402.14740.
  """
  return optax.chain(leave_one_out())


def reinforce_pp_baseline(eps: float = 1e-6) -> _Tx:
  """REINFORCE++ with baseline: group mean subtracted, then batch std scaling.

  The paper z-scores the group-centred rewards over the global batch. Their
  batch mean is exactly 0 in exact arithmetic, so the centring step is left
  out: it would only add rounding noise (~1e-8) to zero-variance groups,
  which stay exactly 0 here. Statistics are per sample over the valid samples
  (verl whitens over tokens instead, which weights long completions more).

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  return optax.chain(center_by_group_mean(), scale_by_batch_std(eps=eps))


def mc_grpo(eps: float = 1e-3) -> _Tx:
  """MC-GRPO: `(r - median_g r) / (MAD_g + eps)`; mask the pivot in the loss
  with `group_median_pivot_mask`.

  References:
    Kim, "MC-GRPO", https://arxiv.org/abs/2601.22582.
  """
  return optax.chain(center_by_group_median(), scale_by_group_mad(eps=eps))


def gdpo(reward_weights: Any = None, eps: float = 1e-4) -> _Tx:
  """GDPO: per-reward group z-scores, weighted sum, then batch std scaling.

  GDPO's batch step is a z-score; the weighted sum of group z-scores already
  has batch mean exactly 0 (each group's z-scores sum to 0), so the centring is
  left out for the same reason as in `reinforce_pp_baseline`.

  References:
    Liu et al., "GDPO", https://arxiv.org/abs/2601.05242.
  """
  return optax.chain(normalize_each_reward(reward_weights, eps=eps),
                     scale_by_batch_std(eps=eps))


# ----------------------------------------------------------------------------
# Metrics.


def advantage_metrics(rewards_N: jax.Array, advantages_N: jax.Array, *,
                      group_size: int,
                      mask_N: jax.Array | None = None) -> types.Metrics:
  """Scalars describing one batch of rewards and advantages.

  Returns:
    `reward_mean`, `reward_std` (population, over valid samples),
    `advantage_mean`, `advantage_std`, `advantage_abs_max`,
    `frac_zero_advantage` (valid samples with advantage exactly 0) and
    `frac_zero_variance_groups` (groups with at least one valid sample whose
    valid rewards are all equal; such groups carry no learning signal).
  """
  fn = "advantage_metrics"
  x, valid = _grouped(fn, rewards_N, group_size, mask_N)
  if advantages_N.shape != rewards_N.shape:
    raise ValueError(
        f"{fn}: advantages_N shape {advantages_N.shape} must equal rewards_N "
        f"shape {rewards_N.shape}.")
  a = advantages_N.astype(jnp.float32).reshape(x.shape)
  nonempty = jnp.any(valid, -1)
  zero_var = _is_constant(x, valid)[:, 0] & nonempty
  n = jnp.maximum(jnp.sum(valid), 1)
  return {
      "reward_mean": _mean(x, valid, None).reshape(()),
      "reward_std": _std(x, valid, 0, None).reshape(()),
      "advantage_mean": _mean(a, valid, None).reshape(()),
      "advantage_std": _std(a, valid, 0, None).reshape(()),
      "advantage_abs_max": jnp.max(jnp.where(valid, jnp.abs(a), 0.0)),
      "frac_zero_advantage": jnp.sum(valid & (a == 0)) / n,
      "frac_zero_variance_groups":
          jnp.sum(zero_var) / jnp.maximum(jnp.sum(nonempty), 1),
  }
