"""Several reward functions: rewards `[N, R]` in, one value per sample out."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_group_size, _check_nonneg, _check_rewards, _is_constant, _mean,
    _stateless, _std, _valid)


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
