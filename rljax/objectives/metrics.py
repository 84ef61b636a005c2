"""Scalar metrics of ratios, coefficients and KL over valid tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import types
from rljax.objectives._common import _advantages, _check_bxt, _mask, _sg
from rljax.objectives.kl import kl_k1, kl_k2, kl_k3
from rljax.objectives.ratios import normalized_ess


def _masked_mean(x, mask):
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(
      jnp.sum(mask, dtype=jnp.float32), 1.0)


def _masked_extreme(x, mask, reduce, fill):
  return jnp.where(jnp.any(mask), reduce(jnp.where(mask, x, fill)), 0.0)


def ratio_metrics(ratio_BxT: jax.Array, mask_BxT: jax.Array | None = None, *,
                  advantages_BxT: jax.Array | None = None,
                  eps_low: float = 0.2,
                  eps_high: float | None = None) -> types.Metrics:
  """Ratio mean/min/max and ESS over valid tokens; with advantages also the
  PPO clip fractions `clip_frac_low` (A < 0, r < 1 - eps_low),
  `clip_frac_high` (A > 0, r > 1 + eps_high) and `clip_frac`."""
  fn = "ratio_metrics"
  r = _check_bxt(fn, "ratio_BxT", ratio_BxT).astype(jnp.float32)
  mask = _mask(fn, mask_BxT, r.shape)
  out = {
      "ratio_mean": _masked_mean(r, mask),
      "ratio_min": _masked_extreme(r, mask, jnp.min, jnp.inf),
      "ratio_max": _masked_extreme(r, mask, jnp.max, -jnp.inf),
      "ess": normalized_ess(r, mask),
  }
  if advantages_BxT is not None:
    a = _advantages(fn, advantages_BxT, r.shape)
    eps_high = eps_low if eps_high is None else eps_high
    low = (a < 0) & (r < 1.0 - eps_low)
    high = (a > 0) & (r > 1.0 + eps_high)
    out["clip_frac_low"] = _masked_mean(low, mask)
    out["clip_frac_high"] = _masked_mean(high, mask)
    out["clip_frac"] = _masked_mean(low | high, mask)
  return out


def coefficient_metrics(coef_BxT: jax.Array,
                        mask_BxT: jax.Array | None = None) -> types.Metrics:
  """Mean and max coefficient, and the fraction of valid tokens whose
  coefficient is 0 (clipped away or rejected: they carry no gradient)."""
  c = _check_bxt("coefficient_metrics", "coef_BxT", coef_BxT).astype(
      jnp.float32)
  mask = _mask("coefficient_metrics", mask_BxT, c.shape)
  return {
      "coef_mean": _masked_mean(c, mask),
      "coef_max": _masked_extreme(c, mask, jnp.max, -jnp.inf),
      "frac_zero_coef": _masked_mean(c == 0, mask),
  }


def kl_metrics(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
               mask_BxT: jax.Array | None = None) -> types.Metrics:
  """Token means of the k1, k2 and k3 estimators against the reference."""
  mask = _mask("kl_metrics", mask_BxT, jnp.shape(logprobs_BxT))
  lp = _sg(jnp.asarray(logprobs_BxT))
  return {
      "kl_k1": _masked_mean(kl_k1(lp, ref_logprobs_BxT), mask),
      "kl_k2": _masked_mean(kl_k2(lp, ref_logprobs_BxT), mask),
      "kl_k3": _masked_mean(kl_k3(lp, ref_logprobs_BxT), mask),
  }
