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


# ---------------------------------------------------------------------------
# Token-level returns: the discount `gamma` and per-token rewards.


def _is_one(gamma: Any) -> bool:
  """True for `gamma` None or a concrete scalar 1: the transforms' `[N]` path.

  Any other value, and a jax array (a `gamma` passed to
  `inject_hyperparams`), selects the per-token `[N, T]` path: the output
  shape must not depend on a traced value. The factories' default is None,
  which `inject_hyperparams` leaves static (it injects every numeric
  argument, defaults included), so their injected results stay `[N]`.
  """
  if gamma is None:
    return True
  if isinstance(gamma, (bool, np.bool_)):
    return False
  return isinstance(gamma, (int, float, np.integer, np.floating)) and float(
      gamma) == 1.0


def _check_gamma(fn: str, gamma: Any) -> None:
  if gamma is None:
    return
  if isinstance(gamma, (bool, np.bool_)):
    raise TypeError(f"{fn}: gamma={gamma!r} must be a number in [0, 1].")
  concrete = isinstance(gamma, (int, float, np.integer, np.floating,
                                np.ndarray))
  if concrete and not 0.0 <= float(np.asarray(gamma)) <= 1.0:
    raise ValueError(f"{fn}: gamma={gamma!r} must be in [0, 1].")


def _token_mask(fn: str, completion_mask_NxT: Any, valid_N: jax.Array,
                why: str) -> jax.Array:
  """`completion_mask_NxT` (bool) of the valid rows; a clear error without."""
  n = valid_N.shape[0]
  if completion_mask_NxT is None:
    raise ValueError(
        f"{fn}: {why} needs the keyword extra argument completion_mask_NxT "
        f"(the completion tokens, bool [{n}, T]); the training loop's "
        "Collector passes it.")
  mask = jnp.asarray(completion_mask_NxT)
  if mask.ndim != 2 or mask.shape[0] != n:
    raise ValueError(f"{fn}: completion_mask_NxT must have shape ({n}, T); "
                     f"got {mask.shape}.")
  return mask.astype(bool) & valid_N[:, None]


def _last_token_rewards(rewards_N: jax.Array, mask_NxT: jax.Array
                        ) -> jax.Array:
  """`[N, T]` float32: `rewards_N[i]` at row `i`'s last masked token, else 0."""
  mask = mask_NxT.astype(bool)
  # A masked token with no masked token after it is the row's last.
  later = jnp.flip(jnp.cumsum(jnp.flip(mask, 1), 1), 1) - mask
  return jnp.where(mask & (later == 0),
                   rewards_N.astype(jnp.float32)[:, None], 0.0)


def _token_rewards(fn: str, rewards_N: jax.Array, mask_NxT: jax.Array,
                   token_rewards_NxT: Any) -> jax.Array:
  """verl's `token_level_rewards` `[N, T]` (float32, 0 outside `mask_NxT`).

  `token_rewards_NxT` when given (the row rewards are then not read), else
  each row's reward on its last masked token.
  """
  if token_rewards_NxT is None:
    return _last_token_rewards(rewards_N, mask_NxT)
  token_rewards_NxT = jnp.asarray(token_rewards_NxT)
  if token_rewards_NxT.shape != mask_NxT.shape:
    raise ValueError(
        f"{fn}: token_rewards_NxT must have the shape of completion_mask_NxT "
        f"{mask_NxT.shape}; got {token_rewards_NxT.shape}.")
  return jnp.where(mask_NxT, token_rewards_NxT.astype(jnp.float32), 0.0)


def _discounted_returns(rewards_NxT: jax.Array, mask_NxT: jax.Array,
                        gamma: Any) -> jax.Array:
  """`G_t = r_t + gamma * G_t'` (`t'`: the next masked token), 0 unmasked.

  verl 0.9's `compute_reinforce_plus_plus_outcome_advantage` recursion: an
  unmasked token (padding, a multi-turn observation) neither reads its
  reward nor resets the running return, which it carries on unchanged.
  """
  mask = mask_NxT.astype(bool)
  rewards = jnp.where(mask, rewards_NxT.astype(jnp.float32), 0.0)
  gamma = 1.0 if gamma is None else gamma

  def step(running, x):
    r, m = x
    new = r + gamma * running
    return jnp.where(m, new, running), jnp.where(m, new, 0.0)

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, returns_TxN = jax.lax.scan(step, zeros, (rewards.T, mask.T),
                                reverse=True)
  return returns_TxN.T


def _whiten_tokens(values_NxT: jax.Array, mask_NxT: jax.Array,
                   eps: Any) -> jax.Array:
  """verl's `masked_whiten` over every masked token, 0 elsewhere.

  `(v - m) / sqrt(var + eps)`, `m` the token mean and `var` the Bessel
  variance; computed on `v` scaled by its largest magnitude (`_scale`). At
  most one masked token, or equal masked values, give exactly 0.
  """
  v = values_NxT.astype(jnp.float32).reshape(-1)
  m = mask_NxT.astype(bool).reshape(-1)
  scale = _scale(v, m, 0)[0]
  vs = jnp.where(m, v / scale, 0.0)
  n = jnp.sum(m, dtype=jnp.float32)
  mean = jnp.sum(vs) / jnp.maximum(n, 1.0)
  dev = jnp.where(m, vs - mean, 0.0)
  var = jnp.sum(dev * dev) / jnp.maximum(n - 1.0, 1.0)
  adv = dev / jnp.sqrt(var + eps / (scale * scale))
  keep = (n > 1) & ~_is_constant(v, m, 0)[0]
  return jnp.where(keep & m, adv, 0.0).reshape(values_NxT.shape)
