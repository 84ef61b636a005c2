"""VCPO's minimum-variance off-policy baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_nonneg, _grouped, _is_constant, _lengths, _mean, _out, _scale,
    _stateless, _std)


def center_by_min_variance_baseline(norm_by_std: bool = True,
                                    std_floor: float = 1e-8,
                                    max_log_ratio: float = 20.0) -> _Tx:
  """VCPO's closed-form off-policy baseline, per group:

      b = sum_i W_i R_i / sum_i W_i,     W_i = w_i^2 ||grad log pi(y_i)||^2
      A_i = (R_i - b) / sigma      (sigma: population std of the group's R,
                                    when norm_by_std and sigma > std_floor)

  `w_i = pi_old(y_i) / mu(y_i)` is the sequence importance ratio of sample `i`
  (the extra argument `seq_log_ratio_N`, `log w_i`; 0, i.e. on-policy, when
  absent). The squared gradient norm of `log pi(y_i)` comes from the extra
  argument `sq_grad_norms_N` when the caller has it; otherwise it is
  approximated by the completion length `lengths_N` (token score vectors of
  about equal norm and uncorrelated, the approximation OPO's baseline rests
  on). The reference code computes exact per-trajectory gradient norms with
  one backward pass per trajectory, which the training loop does not do; with
  `w = 1` this baseline is OPO's (`center_by_length_weighted_group_mean`).
  A group whose valid rewards are all equal gets exactly 0 (the reference's
  `+1e-8` in the denominator leaves it at about 0); a group whose weights are
  all 0 falls back to the unweighted mean.

  Args:
    norm_by_std: divide by the group's population std (the released VCPO
      scripts set `norm_by_std=True`).
    std_floor: no division when the std is at most this (reference: 1e-8).
    max_log_ratio: `log w_i` is clipped to `[-max, max]` before squaring, so
      that `w^2` stays finite (verl's rollout correction clamps log ratios
      to +-20; the VCPO path does not clamp).

  References:
    Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for
    LLMs", https://arxiv.org/abs/2602.17616 (the README's closed form); code
    https://github.com/mit-han-lab/vcpo
    (`recipe/fully_async_policy/staleness_utils.py`, `compute_opob_baseline`).
  """
  fn = "center_by_min_variance_baseline"
  _check_nonneg(fn, "std_floor", std_floor)
  _check_nonneg(fn, "max_log_ratio", max_log_ratio)

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, lengths_N=None, seq_log_ratio_N=None,
                sq_grad_norms_N=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    n = rewards_N.shape[0]
    if sq_grad_norms_N is None:
      norm2 = _lengths(fn, lengths_N, n)
    else:
      norm2 = jnp.asarray(sq_grad_norms_N, jnp.float32)
      if norm2.shape != (n,):
        raise ValueError(f"{fn}: sq_grad_norms_N must have shape ({n},); got "
                         f"{norm2.shape}.")
    log_w = (jnp.zeros((n,), jnp.float32) if seq_log_ratio_N is None
             else jnp.asarray(seq_log_ratio_N, jnp.float32))
    if log_w.shape != (n,):
      raise ValueError(f"{fn}: seq_log_ratio_N must have shape ({n},); got "
                       f"{log_w.shape}.")
    log_w = jax.lax.stop_gradient(
        jnp.clip(log_w, -max_log_ratio, max_log_ratio)).reshape(x.shape)
    # W = w^2 |g|^2, normalised by the group's largest log-weight so that
    # exp never overflows (b is invariant to a common factor of W).
    log_top = jnp.max(jnp.where(valid, 2.0 * log_w, -jnp.inf), -1,
                      keepdims=True)
    log_top = jnp.where(jnp.isfinite(log_top), log_top, 0.0)
    w = jnp.where(valid, jnp.exp(2.0 * log_w - log_top)
                  * norm2.reshape(x.shape), 0.0)
    total_w = jnp.sum(w, -1, keepdims=True)
    scale = _scale(x, valid, -1)
    weighted = scale * jnp.sum(w * jnp.where(valid, x / scale, 0.0), -1,
                               keepdims=True) / jnp.maximum(total_w, 1e-30)
    baseline = jnp.where(total_w > 0, weighted, _mean(x, valid))
    adv = x - baseline
    if norm_by_std:
      sigma = _std(x, valid, 0)
      adv = jnp.where(sigma > std_floor, adv / jnp.maximum(sigma, std_floor),
                      adv)
    adv = jnp.where(_is_constant(x, valid), 0.0, adv)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)
