"""Order statistics (OrderGrad): advantages for L-statistic objectives over
`K`-subsets of a group, and rank-weight presets."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from rljax.advantages._common import (
    _Tx, _grouped, _is_constant, _out, _stateless)


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
