"""Argument checks and helpers shared by the coefficient transforms, losses
and metrics. See the package docstring for the protocol."""

from __future__ import annotations

import typing
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rljax import types

_Tx = optax.GradientTransformationExtraArgs
_sg = jax.lax.stop_gradient
LEVELS = typing.get_args(types.ImportanceLevel)


def _check_bxt(fn: str, name: str, x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"{fn}: {name} must have shape [B, T]; got {x.shape}.")
  return x


def _mask(fn: str, mask_BxT: Any, shape: tuple[int, ...]) -> jax.Array:
  if mask_BxT is None:
    return jnp.ones(shape, bool)
  mask_BxT = jnp.asarray(mask_BxT)
  if mask_BxT.shape != shape:
    raise ValueError(
        f"{fn}: mask_BxT must have shape {shape}; got {mask_BxT.shape}.")
  return mask_BxT.astype(bool)


def _advantages(fn: str, advantages_BxT: Any, shape: tuple[int, ...]):
  if advantages_BxT is None:
    raise ValueError(
        f"{fn}: advantages_BxT is required ([B, T] or [B]); got None.")
  a = jnp.asarray(advantages_BxT)
  if a.shape == shape[:1]:
    a = a[:, None]
  elif a.shape != shape:
    raise ValueError(
        f"{fn}: advantages_BxT must have shape {shape} or ({shape[0]},); got "
        f"{a.shape}.")
  return jnp.broadcast_to(_sg(a).astype(jnp.float32), shape)


def _logprobs(fn: str, name: str, x: Any, shape: tuple[int, ...]):
  if x is None:
    raise ValueError(f"{fn}: the keyword extra argument {name} is required.")
  x = jnp.asarray(x)
  if x.shape != shape:
    raise ValueError(f"{fn}: {name} must have shape {shape}; got {x.shape}.")
  return _sg(x).astype(jnp.float32)


def _check_level(fn: str, level: str) -> None:
  if level not in LEVELS:
    raise ValueError(f"{fn}: level={level!r}; accepted: {LEVELS}.")


def _check_positive(fn: str, name: str, value: Any) -> None:
  if isinstance(value, (int, float)) and value <= 0:
    raise ValueError(f"{fn}: {name}={value!r} must be > 0.")


def _stateless(update_fn) -> _Tx:
  return _Tx(lambda params: optax.EmptyState(), update_fn)


def _out(coef, like):
  return _sg(coef).astype(like.dtype)
