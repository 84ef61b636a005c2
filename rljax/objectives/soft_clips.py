"""Trust regions that reshape the coefficient instead of cutting it:
SAPO's soft gate, GMPO's geometric mean, PNPO's prefix ratio."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _mask, _out, _stateless)


def sapo(tau_pos: float = 1.0, tau_neg: float = 1.05) -> _Tx:
  """SAPO: a sigmoid gate of the ratio in place of the hard clip.

  Surrogate per token: `f(r) * A` with `f(r) = sigmoid(tau * (r - 1)) * 4 /
  tau`, `tau = tau_pos` if `A > 0` else `tau_neg`. Its gradient is
  `f'(r) * r * A * grad logp`, so

      s = sigmoid(tau * (r - 1)),   c = 4 * s * (1 - s) * r

  (`c = 1` on-policy; it decays smoothly as `r` leaves 1, faster for
  negative advantages). verl and TRL aggregate it with
  `sequence_mean_token_mean` (TRL `loss_type="sapo"`, verl forces it).

  References:
    Gao et al., "Soft Adaptive Policy Optimization",
    https://arxiv.org/abs/2511.20347; verl `core_algos.py`
    (`compute_policy_loss_sapo`), TRL `grpo_trainer.py` (`loss_type="sapo"`,
    `sapo_temperature_pos=1.0`, `sapo_temperature_neg=1.05`).
  """
  fn = "sapo"
  _check_positive(fn, "tau_pos", tau_pos)
  _check_positive(fn, "tau_neg", tau_neg)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    r = ratio_BxT.astype(jnp.float32)
    tau = jnp.where(a > 0, tau_pos, tau_neg)
    s = jax.nn.sigmoid(tau * (r - 1.0))
    return _out(4.0 * s * (1.0 - s) * r, ratio_BxT), state

  return _stateless(update_fn)


def _clipped_log_ratio(log_r, a, eps_low, eps_high):
  """GMPO's per-token log-ratio clip, sign-selected by the advantage; and
  where it binds (no gradient there)."""
  pos, neg = a > 0, a < 0
  clipped = (pos & (log_r > eps_high)) | (neg & (log_r < -eps_low))
  log_r = jnp.where(pos, jnp.minimum(log_r, eps_high), log_r)
  log_r = jnp.where(neg, jnp.maximum(log_r, -eps_low), log_r)
  return jnp.where(pos | neg, log_r, 0.0), clipped


def gmpo(eps_low: float = 0.4, eps_high: float = 0.4) -> _Tx:
  """GMPO: the geometric mean of the token ratios, clipped in log space.

      l_t = min(log r_t, eps_high)    if A > 0
            max(log r_t, -eps_low)    if A < 0      (0 if A = 0)
      s_b = exp(sum_t mask * l_t / |y_b|)
      surrogate_b = s_b * A_b

  Gradient: `s_b * A_b * (1 / |y_b|) * sum_t [l_t not clipped] grad logp_t`,
  so `c_t = s_b * [not clipped_t]` aggregated with
  `sequence_mean_token_mean` (verl divides by all rows, `torch.mean`, and by
  `|y_b| + 1e-8`; rljax by the non-empty rows and `max(|y_b|, 1)`). The clip
  range is in log space: the paper's `(e^-0.4, e^0.4)` is `eps = 0.4`.

  References:
    Zhao et al., "Geometric-Mean Policy Optimization",
    https://arxiv.org/abs/2507.20673; callsys/GMPO
    `train_zero_math_gmpo.py`; verl `core_algos.py`
    (`compute_policy_loss_geo_mean`).
  """
  fn = "gmpo"
  _check_positive(fn, "eps_low", eps_low)
  _check_positive(fn, "eps_high", eps_high)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    log_r = jnp.log(ratio_BxT.astype(jnp.float32))
    l, clipped = _clipped_log_ratio(log_r, a, eps_low, eps_high)
    length = jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1)
    s = jnp.exp(jnp.sum(jnp.where(mask, l, 0.0), -1, keepdims=True) / length)
    return _out(jnp.where(clipped, 0.0, s), ratio_BxT), state

  return _stateless(update_fn)


def prefix_ratio(eps_low: float = 0.2, eps_high: float | None = None) -> _Tx:
  """PNPO: PPO clip on the prefix-normalised ratio.

      w_t = exp(sum_{s<=t} mask * log r_s / n_t),   n_t = sum_{s<=t} mask
      surrogate = sum_t mask * min(w_t * A, clip(w_t, 1-eps_low, 1+eps_high) * A)

  `w_t` depends on every earlier token, so `log r_s` receives gradient from
  every later unclipped `t`: with one advantage per sequence,

      c_s = sum_{t>=s} mask_t * [t not clipped] * w_t / n_t.

  Any aggregation then gives the surrogate's gradient under that
  aggregation. The advantage must be one per sequence (`[B]`, or `[B, T]`
  constant along `T`, as outcome rewards give): the transform reads the
  first column, so per-token advantages are not supported.

  References:
    PNPO, "Prefix-Normalized Policy Optimization" (2026), as summarised in
    the project's research notes (shared/research/methods-1.md, L53); no
    reference code was available, so this follows the stated ratio
    `w_t = exp(mean_{s<=t} log r_s)` inside PPO's clipped surrogate.
  """
  fn = "prefix_ratio"
  _check_positive(fn, "eps_low", eps_low)
  eps_high = eps_low if eps_high is None else eps_high
  _check_positive(fn, "eps_high", eps_high)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)[:, :1]
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    log_r = jnp.where(mask, jnp.log(ratio_BxT.astype(jnp.float32)), 0.0)
    n = jnp.maximum(jnp.cumsum(mask, -1), 1)
    w = jnp.exp(jnp.cumsum(log_r, -1) / n)
    clipped = (((a > 0) & (w > 1.0 + eps_high))
               | ((a < 0) & (w < 1.0 - eps_low)))
    g = jnp.where(mask & ~clipped, w / n, 0.0)
    c = jnp.flip(jnp.cumsum(jnp.flip(g, -1), -1), -1)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)
