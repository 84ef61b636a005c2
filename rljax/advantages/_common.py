"""Layout helpers shared by the advantage transforms.

Rewards are group-contiguous `[N]` (or `[N, R]`); these helpers check the
layout, reshape to `[K, G]` and compute masked float32 statistics. See the
package docstring for the protocol.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

_Tx = optax.GradientTransformationExtraArgs


def _check_group_size(fn: str, group_size: Any, n: int) -> int:
  if group_size is None:
    raise ValueError(
        f"{fn}: the keyword extra argument group_size is required (a Python "
        "int, the number of completions per prompt).")
  if isinstance(group_size, (jax.core.Tracer, bool)) or not isinstance(
      group_size, (int, np.integer)):
    raise TypeError(
        f"{fn}: group_size must be a static Python int; got "
        f"{type(group_size).__name__}. Under jax.jit, close over it with "
        "functools.partial(tx.update, group_size=G) or mark it static.")
  group_size = int(group_size)
  if group_size < 1 or n % group_size:
    raise ValueError(
        f"{fn}: group_size={group_size} must be a positive divisor of the "
        f"number of samples N={n}.")
  return group_size


def _check_rewards(fn: str, rewards: jax.Array, ndim: int) -> None:
  if rewards.ndim != ndim:
    want = "[N]" if ndim == 1 else "[N, R]"
    raise ValueError(
        f"{fn}: the updates (rewards) must have shape {want}; got shape "
        f"{rewards.shape}. Batch with jax.vmap for more leading axes.")


def _valid(fn: str, mask_N: Any, n: int) -> jax.Array:
  if mask_N is None:
    return jnp.ones((n,), bool)
  mask_N = jnp.asarray(mask_N)
  if mask_N.shape != (n,):
    raise ValueError(
        f"{fn}: mask_N must have shape ({n},) to match the rewards; got "
        f"{mask_N.shape}.")
  return mask_N.astype(bool)


def _grouped(fn, rewards_N, group_size, mask_N):
  """Returns float32 values [K, G] and validity [K, G], K = N // G."""
  _check_rewards(fn, rewards_N, 1)
  n = rewards_N.shape[0]
  g = _check_group_size(fn, group_size, n)
  valid = _valid(fn, mask_N, n)
  return (rewards_N.astype(jnp.float32).reshape(-1, g), valid.reshape(-1, g))


def _count(valid, axis=-1):
  return jnp.sum(valid, axis=axis, keepdims=True, dtype=jnp.float32)


def _scale(x, valid, axis):
  """The largest |valid x| along `axis` (1 where it is 0 or not finite).

  Sums and squares are taken of `x / scale`, so rewards up to float32's
  maximum (~3e38) neither overflow the mean nor the variance (1e30 squared
  would be inf in float32 and zero every advantage).
  """
  m = jnp.max(jnp.where(valid, jnp.abs(x), 0.0), axis, keepdims=True)
  return jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)


def _mean(x, valid, axis=-1):
  scale = _scale(x, valid, axis)
  total = jnp.sum(jnp.where(valid, x / scale, 0.0), axis, keepdims=True)
  return scale * (total / jnp.maximum(_count(valid, axis), 1.0))


def _std(x, valid, ddof, axis=-1):
  """Masked std with `ddof`; 0 when fewer than `ddof + 1` valid values.

  Computed on `x` scaled by its largest valid magnitude (see `_scale`), so
  large finite rewards give a finite std.
  """
  n = _count(valid, axis)
  dev = jnp.where(valid, x - _mean(x, valid, axis), 0.0)
  scale = _scale(dev, valid, axis)
  d = dev / scale
  var = jnp.sum(d * d, axis, keepdims=True) / jnp.maximum(n - ddof, 1.0)
  return jnp.where(n > ddof, scale * jnp.sqrt(var), 0.0)


def _is_constant(x, valid, axis=-1):
  """True where all valid values along `axis` are equal (or none is valid)."""
  hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis, keepdims=True)
  lo = jnp.min(jnp.where(valid, x, jnp.inf), axis, keepdims=True)
  return ~(hi > lo)


def _lower_median(x, valid):
  """Lower median of the valid entries of each row of [K, G]; 0 if none."""
  n = jnp.sum(valid, -1, keepdims=True)
  s = jnp.sort(jnp.where(valid, x, jnp.inf), axis=-1)
  idx = jnp.maximum((n - 1) // 2, 0)
  med = jnp.take_along_axis(s, idx, axis=-1)
  return jnp.where(n > 0, med, 0.0)


def _out(adv, valid, like):
  return jnp.where(valid, adv, 0.0).reshape(like.shape[0]).astype(like.dtype)


def _check_nonneg(fn: str, name: str, value: Any) -> None:
  concrete = isinstance(value, (int, float, np.ndarray))
  if concrete and np.any(np.asarray(value) < 0):
    raise ValueError(f"{fn}: {name}={value!r} must be >= 0.")


SINGLETONS = ("zero", "raw")


def _check_singleton(fn: str, singleton: Any) -> None:
  if singleton not in SINGLETONS:
    raise ValueError(f"{fn}: singleton={singleton!r} is unknown; accepted: "
                     f"{SINGLETONS}.")


def _lengths(fn: str, lengths_N: Any, n: int) -> jax.Array:
  """The completion lengths `[N]` as float32; a clear error without them."""
  if lengths_N is None:
    raise ValueError(
        f"{fn}: the keyword extra argument lengths_N (completion lengths "
        "[N], in tokens) is required; the training loop's Collector passes "
        "it.")
  lengths_N = jnp.asarray(lengths_N)
  if lengths_N.shape != (n,):
    raise ValueError(f"{fn}: lengths_N must have shape ({n},) to match the "
                     f"rewards; got {lengths_N.shape}.")
  return lengths_N.astype(jnp.float32)


def _stateless(update_fn) -> _Tx:
  return _Tx(lambda params: optax.EmptyState(), update_fn)
