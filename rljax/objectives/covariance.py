"""Clip-Cov and KL-Cov: entropy-preserving updates that single out the
tokens whose advantage and logprob covary most.

Both compute, over the valid tokens of one call (one microbatch in
`rljax.train`, as verl's per-micro-batch loss),

    cov_t = (A_t - mean A) * (logp_t - mean logp)

Clip-Cov drops the gradient of a random `clip_ratio` fraction of the tokens
with `cov_low < cov_t < cov_high`; KL-Cov adds `kl_coef * |logp - logp_old|`
on the top `kl_ratio` fraction by `cov_t`.

References:
  Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
  Language Models", https://arxiv.org/abs/2505.22617; PRIME-RL/
  Entropy-Mechanism-of-RL and verl `trainer/ppo/core_algos.py`
  (`compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _logprobs, _mask, _out,
    _sg, _stateless)


def _covariance(a, lp, mask):
  n = jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
  mean_a = jnp.sum(jnp.where(mask, a, 0.0)) / n
  mean_lp = jnp.sum(jnp.where(mask, lp, 0.0)) / n
  return (a - mean_a) * (lp - mean_lp)


def _count(fraction, mask):
  """`max(floor(fraction * valid tokens), 1)`, as verl's `int(...)`."""
  n = jnp.sum(mask, dtype=jnp.float32)
  return jnp.maximum(jnp.floor(fraction * n), 1.0).astype(jnp.int32)


def _top(score, selectable, k):
  """Entries of `selectable` among the `k` largest `score`s (all of them
  when fewer than `k` are selectable)."""
  flat = jnp.where(selectable, score, -jnp.inf).reshape(-1)
  kth = jnp.sort(flat)[::-1][jnp.minimum(k, flat.size) - 1]
  return selectable & (score >= kth)


class ClipCovState(NamedTuple):
  """State of `clip_cov`."""
  key: jax.Array  # [2] uint32: raw PRNG key data, split at every update.


def clip_cov(eps_low: float = 0.2, eps_high: float | None = None,
             clip_ratio: float = 2e-4, cov_low: float = 1.0,
             cov_high: float = 5.0, *, seed: int) -> _Tx:
  """Clip-Cov: PPO clip, plus no gradient on a random few high-covariance tokens.

      c = 0   if PPO's clip binds (see `ppo_clip`)
      c = 0   on `max(floor(clip_ratio * n), 1)` tokens drawn uniformly
              without replacement from the unclipped valid tokens with
              `cov_low < cov_t < cov_high` (all of them if fewer)
      c = r   otherwise

  verl draws with `torch.randperm`; here the draw uses the PRNG key in the
  state (from `seed`), split at every call, so a run is reproducible and
  resumes exactly from a checkpoint. Needs `advantages_BxT` and
  `old_logprobs_BxT` (`logp = log r + old_logprobs`). verl's defaults:
  `clip_cov_ratio=2e-4`, `clip_cov_lb=1`, `clip_cov_ub=5`.

  References: see the module docstring.
  """
  fn = "clip_cov"
  _check_positive(fn, "eps_low", eps_low)
  eps_high = eps_low if eps_high is None else eps_high
  _check_positive(fn, "eps_high", eps_high)
  _check_positive(fn, "clip_ratio", clip_ratio)

  def init_fn(params):
    del params
    return ClipCovState(jax.random.key_data(jax.random.key(seed)))

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, old_logprobs_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    shape = ratio_BxT.shape
    a = _advantages(fn, advantages_BxT, shape)
    mask = _mask(fn, mask_BxT, shape)
    old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, shape)
    r = ratio_BxT.astype(jnp.float32)
    clipped = ((a > 0) & (r > 1.0 + eps_high)) | ((a < 0) & (r < 1.0 - eps_low))
    cov = _covariance(a, jnp.log(r) + old, mask)
    candidate = mask & ~clipped & (cov > cov_low) & (cov < cov_high)
    key, draw = jax.random.split(jax.random.wrap_key_data(state.key))
    chosen = _top(jax.random.uniform(draw, shape), candidate,
                  _count(clip_ratio, mask))
    c = jnp.where(clipped | chosen, 0.0, r)
    return _out(c, ratio_BxT), ClipCovState(jax.random.key_data(key))

  return _Tx(init_fn, update_fn)


def kl_cov() -> _Tx:
  """KL-Cov's policy-gradient part: the unclipped ratio, `c = r`.

  Add `kl_coef * aggregate(kl_cov_penalty(...))` to the loss for the
  method's pull on the high-covariance tokens (`rljax.train` does so with
  `rl.objective="kl_cov"`). References: see the module docstring.
  """

  def update_fn(ratio_BxT, state, params=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt("kl_cov", "ratio_BxT", ratio_BxT)
    return _out(ratio_BxT, ratio_BxT), state

  return _stateless(update_fn)


def kl_cov_penalty(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                   advantages_BxT: jax.Array, mask_BxT: jax.Array | None = None,
                   *, kl_ratio: float = 2e-4, kl_coef: float = 1.0
                   ) -> jax.Array:
  """KL-Cov's per-token penalty `[B, T]`.

      penalty_t = kl_coef * |logp_t - old_logprobs_t|   on the top
                  max(floor(kl_ratio * n), 1) valid tokens by cov_t
                  (ties at the threshold all count), 0 elsewhere

  Gradients flow through `logprobs_BxT`. verl's defaults: `kl_cov_ratio=
  2e-4`, `ppo_kl_coef=1`. References: see the module docstring.
  """
  fn = "kl_cov_penalty"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT).astype(jnp.float32)
  old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, lp.shape)
  a = _advantages(fn, advantages_BxT, lp.shape)
  mask = _mask(fn, mask_BxT, lp.shape)
  top = _top(_covariance(a, _sg(lp), mask), mask, _count(kl_ratio, mask))
  d = lp - old
  # |d| with gradient sign(d), 0 at d = 0 as torch's abs.
  return jnp.where(top, kl_coef * d * _sg(jnp.sign(d)), 0.0)
