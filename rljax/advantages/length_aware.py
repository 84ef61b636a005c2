"""Transforms that read the completion lengths (the extra argument `lengths_N`).

`lengths_N` is `[N]`, the number of generated tokens of each sample (the
training loop's Collector passes `Rollout.lengths`). Every other transform
ignores it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_gamma, _check_nonneg, _check_rewards, _discounted_returns,
    _grouped, _is_constant, _is_one, _lengths, _mean, _out, _scale,
    _stateless, _token_mask, _token_rewards, _valid, _whiten_tokens)


def center_by_length_weighted_group_mean() -> _Tx:
  """OPO's optimal baseline: `A_i = r_i - sum_j L_j r_j / sum_j L_j` per group.

  Under exact on-policy training, and when the squared norm of the gradient
  of `log pi(y|x)` grows in proportion to the completion length `L`, the
  variance-minimising baseline of a group is the length-weighted mean reward
  (OPO, Eq. 6). Over the valid samples of the group; a group whose valid
  rewards are all equal gets exactly 0, and a group whose valid completions
  are all empty falls back to the unweighted mean. verl's `opo` estimator
  uses the same baseline and a baseline of 0 for a group of one (here a group
  of one is its own baseline, advantage 0).

  References:
    Hao et al., "On-Policy RL with Optimal Reward Baseline",
    https://arxiv.org/abs/2505.23585; verl `trainer/ppo/core_algos.py`,
    `compute_opo_outcome_advantage`.
  """
  fn = "center_by_length_weighted_group_mean"

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, lengths_N=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    length = _lengths(fn, lengths_N, rewards_N.shape[0]).reshape(x.shape)
    w = jnp.where(valid, length, 0.0)
    total_w = jnp.sum(w, -1, keepdims=True)
    scale = _scale(x, valid, -1)
    weighted = scale * jnp.sum(w * jnp.where(valid, x / scale, 0.0), -1,
                               keepdims=True) / jnp.maximum(total_w, 1e-30)
    baseline = jnp.where(total_w > 0, weighted, _mean(x, valid))
    adv = jnp.where(_is_constant(x, valid), 0.0, x - baseline)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def whiten_by_tokens(eps: float = 1e-8, gamma: float | None = None) -> _Tx:
  """Token-level whitening: `A_i = (u_i - m) / sqrt(v + eps)` over all tokens.

  A per-sample value `u_i` stands for the same value on each of the sample's
  `L_i` completion tokens, and the mean and variance are taken over every
  valid token of the batch, as verl's `masked_whiten`:

      m = sum_i L_i u_i / sum_i L_i
      v = sum_i L_i (u_i - m)^2 / (sum_i L_i - 1)      (Bessel over tokens)

  so long completions weigh more than in `center_by_batch_mean` +
  `scale_by_batch_std` (per sample). verl's REINFORCE++ estimators use it:
  `reinforce_plus_plus` (this transform alone) and
  `reinforce_plus_plus_baseline` (group mean subtracted first;
  `reinforce_pp_token()`). A batch with at most one valid token, or whose
  values are all equal, gets exactly 0. verl's `masked_mean` adds 1e-8 to the
  token count; that relative change (~1e-8 / tokens) is not reproduced.

  Discount and per-token rewards (verl's `reinforce_plus_plus`). With
  `gamma` None (the default) or 1 (a Python number) and no
  `token_rewards_NxT`, the output is `[N]` as above: every token's return is
  the row's value. Otherwise the output is per token, `[N, T]`, exactly
  verl's `compute_reinforce_plus_plus_outcome_advantage`:

      r_t = u_i on row i's last completion token, 0 elsewhere
            (or r_t = token_rewards_NxT[i, t] when that is given; u_i unread)
      G_t = r_t + gamma * G_t'          (t': the next completion token)
      A_t = masked_whiten(G)            over completion tokens of valid rows

  `completion_mask_NxT` (the extra argument) is then required; unmasked
  tokens (padding, multi-turn observation spans) are skipped by the
  recursion, as verl 0.9 does, and get 0. A `gamma` given to
  `inject_hyperparams` is traced and selects the `[N, T]` path (at
  `gamma = 1` its values equal the `[N]` path's on every completion token,
  with `lengths_N` the row sums of `completion_mask_NxT`); the default None
  is left static.

  Args:
    eps: added to the variance inside the square root (verl: 1e-8).
    gamma: discount in `[0, 1]` (verl's `algorithm.gamma`, default 1); None
      is 1.

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262; verl
    v0.9.0 `trainer/ppo/core_algos.py`
    (`compute_reinforce_plus_plus_outcome_advantage`,
    `compute_reinforce_plus_plus_baseline_outcome_advantage`) and
    `utils/torch_functional.py` (`masked_whiten`).
  """
  return _token_whitening("whiten_by_tokens", eps, gamma, True)


def _token_whitening(fn: str, eps: Any, gamma: Any,
                     read_token_rewards: bool) -> _Tx:
  """`whiten_by_tokens`; `read_token_rewards=False` ignores
  `token_rewards_NxT` (the `reinforce_pp_token` preset, whose values are
  group-centred row rewards)."""
  _check_nonneg(fn, "eps", eps)
  _check_gamma(fn, gamma)

  def update_fn(updates_N, state, params=None, *, mask_N=None, lengths_N=None,
                completion_mask_NxT=None, token_rewards_NxT=None,
                **extra_args):
    del params, extra_args
    _check_rewards(fn, updates_N, 1)
    n = updates_N.shape[0]
    valid = _valid(fn, mask_N, n)
    if not read_token_rewards:
      token_rewards_NxT = None
    if token_rewards_NxT is not None or not _is_one(gamma):
      mask = _token_mask(fn, completion_mask_NxT, valid,
                         "gamma != 1 or token_rewards_NxT")
      rewards = _token_rewards(fn, updates_N, mask, token_rewards_NxT)
      adv = _whiten_tokens(_discounted_returns(rewards, mask, gamma), mask,
                           eps)
      return adv.astype(updates_N.dtype), state
    x = updates_N.astype(jnp.float32)
    w = jnp.where(valid, _lengths(fn, lengths_N, n), 0.0)
    total_w = jnp.sum(w)
    scale = _scale(x, valid, 0)[0]
    xs = jnp.where(valid, x / scale, 0.0)
    mean = jnp.sum(w * xs) / jnp.maximum(total_w, 1e-30)
    dev = jnp.where(valid, xs - mean, 0.0)
    var = jnp.sum(w * dev * dev) / jnp.maximum(total_w - 1.0, 1e-30)
    # Whitening is scale-free: (x - m) / sqrt(v) on x / scale, with eps
    # rescaled to keep `eps` on the original scale.
    adv = dev / jnp.sqrt(var + eps / (scale * scale))
    keep = (total_w > 1) & ~_is_constant(x, valid, 0)
    return _out(jnp.where(keep, adv, 0.0), valid, updates_N), state

  return _stateless(update_fn)


def overlong_penalty(max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> _Tx:
  """DAPO's soft overlong punishment, added to the reward before any baseline.

      r_i + clip(-(L_i - (max_length - buffer_length)) / buffer_length
                 * penalty_factor, -penalty_factor, 0)

  A completion up to `max_length - buffer_length` tokens is not penalised;
  the penalty then grows linearly to `-penalty_factor` at `max_length` (the
  generation budget). It acts on the summed reward `[N]` (put it right after
  the reward head: `overlong_penalty+center_by_group_mean+scale_by_group_std`
  is DAPO's reward with GRPO's advantage). A row outside `mask_N` stays 0.
  verl's DAPO reward manager computes `min(-exceed / buffer * factor, 0)`,
  equal for every length up to `max_length`.

  Args:
    max_length: the generation budget `L_max` (`sampler.max_new_tokens`).
    buffer_length: `L_cache`, the length of the penalty ramp (DAPO: 4096 of
      20480), in `[1, max_length]`.
    penalty_factor: the penalty at `max_length` (verl: 1.0).

  References:
    Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", https://arxiv.org/abs/2503.14476 (Eq. 13); verl
    `workers/reward_manager/dapo.py` (`overlong_buffer`).
  """
  fn = "overlong_penalty"
  if not (isinstance(max_length, int) and max_length >= 1):
    raise ValueError(f"{fn}: max_length={max_length!r} must be a positive "
                     "integer (the generation budget in tokens).")
  if not (isinstance(buffer_length, int) and 1 <= buffer_length <= max_length):
    raise ValueError(f"{fn}: buffer_length={buffer_length!r} must be an "
                     f"integer in [1, max_length={max_length}].")
  _check_nonneg(fn, "penalty_factor", penalty_factor)

  def update_fn(rewards_N, state, params=None, *, mask_N=None, lengths_N=None,
                **extra_args):
    del params, extra_args
    _check_rewards(fn, rewards_N, 1)
    n = rewards_N.shape[0]
    length = _lengths(fn, lengths_N, n)
    exceed = length - (max_length - buffer_length)
    penalty = jnp.clip(-exceed / buffer_length * penalty_factor,
                       -penalty_factor, 0.0)
    out = rewards_N.astype(jnp.float32) + penalty
    valid = _valid(fn, mask_N, n)
    return jnp.where(valid, out, 0.0).astype(rewards_N.dtype), state

  return _stateless(update_fn)
