"""Several reward functions: rewards `[N, R]` in, one value per sample out."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_group_size, _check_nonneg, _check_rewards, _is_constant, _mean,
    _stateless, _std, _valid)


def _weights(fn: str, reward_weights: Any, extra_weights: Any, r: int):
  """The `[R]` weights: the factory's, else the `reward_weights_R` extra
  argument, else all ones."""
  if reward_weights is not None and extra_weights is not None:
    raise ValueError(
        f"{fn}: reward weights were given twice (the factory's reward_weights "
        "and the extra argument reward_weights_R); give them in one place.")
  w = reward_weights if reward_weights is not None else extra_weights
  w_R = jnp.ones((r,), jnp.float32) if w is None else jnp.asarray(
      w, jnp.float32)
  if w_R.shape != (r,):
    raise ValueError(
        f"{fn}: reward_weights must have shape ({r},) to match the {r} "
        f"reward columns; got {w_R.shape}.")
  return w_R


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
    reward_weights: `[R]` weights; None reads the extra argument
      `reward_weights_R` (the training loop passes the `RewardSpec` weights
      there), or uses all ones without it.
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
                mask_N=None, reward_weights_R=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, rewards_NxR, 2)
    n, r = rewards_NxR.shape
    g = _check_group_size(fn, group_size, n)
    w_R = _weights(fn, reward_weights, reward_weights_R, r)
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
  function that returned None) counted as 0 when the row has at least one
  reward, as TRL's `nansum`. A row whose every reward is missing is not a
  reward of 0: TRL marks it NaN, leaves it out of every statistic and gives
  it advantage 0, and so does rljax, through `mask_N` (the training loop's
  Collector leaves such rows out of it; `rl.failed_rewards="zero"` keeps
  them in, as TRL before PR #5902 did). Here such a row outside `mask_N` sums
  to 0, and the transforms after this one ignore it. Chain it before a
  single-reward transform: `optax.chain(sum_rewards(w), grpo())`. With
  `reward_weights=None` the weights come from the extra argument
  `reward_weights_R` (all ones without it).

  References:
    TRL `trainer/grpo_trainer.py`, `_generate_and_score_completions`
    (`unscorable_mask`, https://github.com/huggingface/trl/pull/5902).
  """
  fn = "sum_rewards"

  def update_fn(rewards_NxR, state, params=None, *, reward_weights_R=None,
                mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, rewards_NxR, 2)
    n, r = rewards_NxR.shape
    w_R = _weights(fn, reward_weights, reward_weights_R, r)
    x = rewards_NxR.astype(jnp.float32)
    x = jnp.where(_valid(fn, mask_N, n)[:, None], x, 0.0)
    total = jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0) * w_R, axis=-1)
    return total.astype(rewards_NxR.dtype), state

  return _stateless(update_fn)
