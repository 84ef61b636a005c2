"""Importance ratios and the normalised effective sample size (ESS)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.objectives._common import _check_bxt, _logprobs, _mask, _sg


def importance_ratio(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                     mask_BxT: jax.Array | None = None, *,
                     max_log_ratio: float = 20.0) -> jax.Array:
  """`ratio = exp(clip(logprobs - old_logprobs, +-max_log_ratio))`, no gradient.

  Padding tokens get ratio 1. The clamp keeps `exp` finite. verl's PPO
  losses clamp the log-ratio to +-20 the same way, but there the ratio
  carries the gradient, so `torch.clamp` also zeroes a token's gradient
  beyond +-20; here the ratio has none and a coefficient transform sees the
  clamped value (e.g. `ppo_clip` gives `c = exp(20)` to a token with `A < 0`
  and log-ratio > 20 where verl gives 0; verl's default dual clip, `c = 3`,
  zeroes that token anyway, as `dual_clip` does here). TRL does not clamp
  (pass a large `max_log_ratio` to match, at the risk of `inf`). verl's
  separate value clamp (+-10) is on its k3 KL (`kl_penalty`), not here.
  """
  fn = "importance_ratio"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT)
  old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, lp.shape)
  mask = _mask(fn, mask_BxT, lp.shape)
  log_r = jnp.clip(_sg(lp).astype(jnp.float32) - old, -max_log_ratio,
                   max_log_ratio)
  return jnp.exp(jnp.where(mask, log_r, 0.0))


def sequence_importance_weights(logprobs_BxT: jax.Array,
                                base_logprobs_BxT: jax.Array,
                                mask_BxT: jax.Array | None = None, *,
                                max_log_ratio: float = 20.0) -> jax.Array:
  """`w_B = exp(clip(sum_t mask * (logprobs - base_logprobs), +-max))`.

  E.g. VCPO's per-trajectory staleness weight `pi_old(y) / mu(y)` with
  `logprobs = old_logprobs`, `base = sampler_logprobs`. VCPO does not clamp;
  the clamp keeps the weight (and the ESS computed from it) finite.
  """
  fn = "sequence_importance_weights"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT)
  base = _logprobs(fn, "base_logprobs_BxT", base_logprobs_BxT, lp.shape)
  mask = _mask(fn, mask_BxT, lp.shape)
  log_w = jnp.sum(jnp.where(mask, _sg(lp).astype(jnp.float32) - base, 0.0), -1)
  return jnp.exp(jnp.clip(log_w, -max_log_ratio, max_log_ratio))


class EssStatistics(NamedTuple):
  """Additive sufficient statistics of the normalised ESS.

  Sum them over minibatches (`jax.tree.map(jnp.add, ...)`) to get the ESS of
  the whole batch.
  """
  sum_w: jax.Array  # [] float32: sum of the valid weights.
  sum_w_sq: jax.Array  # [] float32: sum of their squares.
  count: jax.Array  # [] float32: number of valid weights.


def ess_statistics(weights: jax.Array,
                   mask: jax.Array | None = None) -> EssStatistics:
  """`EssStatistics` of the valid entries of `weights` (any shape)."""
  w = _sg(jnp.asarray(weights)).astype(jnp.float32)
  m = jnp.ones(w.shape, bool) if mask is None else jnp.asarray(mask, bool)
  if m.shape != w.shape:
    raise ValueError(
        f"ess_statistics: mask shape {m.shape} must equal weights shape "
        f"{w.shape}.")
  w = jnp.where(m, w, 0.0)
  return EssStatistics(jnp.sum(w), jnp.sum(w * w),
                       jnp.sum(m, dtype=jnp.float32))


def ess_from_statistics(stats: EssStatistics) -> jax.Array:
  """Normalised ESS `(sum w)^2 / (n * sum w^2)`, in `[1/n, 1]`, no gradient.

  Falls back to 1.0 when there is no valid weight or the value is not finite
  (FeynRL's rule). Unlike FeynRL, no 1e-8 is added to `sum w^2`, so an
  on-policy batch has ESS exactly 1.
  """
  mean_w = stats.sum_w / jnp.maximum(stats.count, 1.0)
  mean_w_sq = stats.sum_w_sq / jnp.maximum(stats.count, 1.0)
  ess = mean_w * mean_w / mean_w_sq
  ok = (stats.count > 0.5) & jnp.isfinite(ess)
  return _sg(jnp.where(ok, ess, 1.0))


def normalized_ess(weights: jax.Array,
                   mask: jax.Array | None = None) -> jax.Array:
  """Normalised effective sample size of the valid `weights` (any shape)."""
  return ess_from_statistics(ess_statistics(weights, mask))
