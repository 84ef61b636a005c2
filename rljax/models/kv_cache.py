"""The decoding KV cache: a plain pytree per layer, created empty.

The decoder (``rljax.models.transformer``) writes it with
``dynamic_update_slice`` at ``index``; the sampler creates it with
``init_cache`` and carries it through its ``lax.while_loop``. A cache may hold
a read-only ``prefix`` with one row per group of ``G`` consecutive batch
rows: the prompt of a group is then stored (and read) once, not ``G`` times.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig


class LayerKV(NamedTuple):
  """Keys and values of one layer.

  Attributes:
    k: ``[B, K, S, H]`` keys (already rotated by RoPE), cache dtype: each
      KV head's slots are contiguous, the layout of decode attention's
      per-head products (``transformer.decode_attend``).
    v: ``[B, K, S, H]`` values, cache dtype.
  """

  k: jax.Array
  v: jax.Array


class KVCache(NamedTuple):
  """The decoding cache: a plain pytree, written with ``dynamic_update_slice``.

  Attributes:
    layers: one ``LayerKV`` per layer, each ``[B, K, S, H]``.
    mask: ``[B, S]`` bool, whether a slot holds a real token.
    index: ``[]`` int32, the next slot to write (shared by all rows).
    prefix: optional read-only cache of ``B // G`` rows holding each group's
      shared prompt; its slots precede this cache's slots.
  """

  layers: tuple[LayerKV, ...]
  mask: jax.Array
  index: jax.Array
  prefix: "KVCache | None" = None


def init_cache(config: ModelConfig, batch_size: int, num_slots: int,
               dtype: Any = jnp.bfloat16, prefix: KVCache | None = None,
               ) -> KVCache:
  """Returns an empty cache of ``num_slots`` slots for ``batch_size`` rows.

  Args:
    config: the model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
    batch_size: ``B``, the rows of the cache.
    num_slots: ``S``, the slots per row.
    dtype: the dtype of keys and values.
    prefix: an optional read-only prefix cache (see ``KVCache``).

  Returns:
    A ``KVCache`` with zero ``[B, K, S, H]`` keys and values, an all-false
    ``[B, S]`` mask and ``index`` 0.
  """
  shape = (batch_size, config.num_kv_heads, num_slots, config.head_dim)
  layers = tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(config.num_layers))
  return KVCache(layers, jnp.zeros((batch_size, num_slots), jnp.bool_),
                 jnp.zeros((), jnp.int32), prefix)
