"""Scalar metrics of a batch of rewards and advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import types
from rljax.advantages._common import _grouped, _is_constant, _mean, _std


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
