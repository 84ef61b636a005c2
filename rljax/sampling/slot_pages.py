"""Continuous-batching slots on a paged KV cache (``SlotConfig.paged``).

The slots' dense cache gives each of the ``M`` slots ``P + T`` cache slots
of its own. On a paged cache (``rljax/models/paged_cache.py``) each slot is
a row of the block table instead:

* a fill claims blocks for the slots it starts (``claim``: the slot's old
  blocks released, room for the prefill reserved) and prefills into them
  through a view of those rows (``rows`` / ``merge``);
* a row whose prompt is already held, by its fill's leader or by a live
  slot (``SlotConfig.share_prompts``), points to the holder's prompt
  blocks (``share``): a group's prompt is stored once, and the block it
  ends in is copied when the row first writes into it (copy on write);
* before each decode step every live slot reserves its next cache slot
  (``paged_cache.reserve``: a slot that finds no free block ends there,
  cut, as the static paged sampler's rows do); a slot's blocks are
  released as soon as its row ends, so the blocks in use follow the live
  rows' tokens.

A row reads only slots below its own length (the causal mask), so what an
earlier writer left in a shared or reused block past that length is never
attended to. Tokens equal the dense slots' (same keys); logprobs agree to
float rounding: ``tests/test_paged_slots.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models import ModelConfig
from rljax.models import paged_cache as pc
from rljax.sampling.paged import PagedConfig, pool_stats


def slot_cache(mc: ModelConfig, slots: int, width: int, paged: PagedConfig,
               dtype) -> pc.PagedKVCache:
  """An empty pool for ``slots`` rows of ``width`` (``P + T``) cache slots:
  ``paged.num_blocks`` blocks, or the worst case (every slot holding
  ``width`` slots of its own), so no row is ever cut."""
  max_blocks = -(-width // paged.block_size)
  num_blocks = (slots * max_blocks if paged.num_blocks is None
                else paged.num_blocks)
  return pc.init_paged_cache(mc, slots, num_blocks, paged.block_size,
                             max_blocks, dtype)


def slot_mask(slot_R: jax.Array, valid_R: jax.Array, m: int) -> jax.Array:
  """``[M]`` bool: the slots ``slot_R`` of the valid rows."""
  return jnp.zeros((m,), jnp.bool_).at[slot_R].set(valid_R, mode="drop")


def claim(cache: pc.PagedKVCache, slots_M: jax.Array, width: int
          ) -> tuple[pc.PagedKVCache, jax.Array]:
  """Slots ``slots_M`` (bool ``[M]``) emptied (their blocks released) and
  given room for ``width`` cache slots from slot 0: ``(cache, failed_M)``
  (no free block for some of them)."""
  cache = pc.release(cache, slots_M)
  return pc.reserve(cache, slots_M, width)


def rows(cache: pc.PagedKVCache, slot_R: jax.Array, valid_R: jax.Array
         ) -> pc.PagedKVCache:
  """The cache seen by a prefill of rows in slots ``slot_R``: their tables
  (no block for invalid rows, whose writes are dropped), length 0."""
  m = cache.table.shape[0]
  table = jnp.where(valid_R[:, None], cache.table[jnp.minimum(slot_R, m - 1)],
                    -1)
  return cache._replace(table=table, lengths=jnp.zeros_like(slot_R))


def merge(cache: pc.PagedKVCache, prefilled: pc.PagedKVCache
          ) -> pc.PagedKVCache:
  """``cache`` with the pools a prefill through ``rows`` wrote."""
  return cache._replace(layers=prefilled.layers,
                        slot_mask=prefilled.slot_mask)


def set_lengths(cache: pc.PagedKVCache, slot_R: jax.Array, length_R
                ) -> pc.PagedKVCache:
  """Slots ``slot_R`` hold ``length_R`` cache slots, and only the blocks
  those need (a prefill as wide as ``P + T`` reserved blocks for a draft's
  rejected tail: released)."""
  cache = cache._replace(lengths=cache.lengths.at[slot_R].set(length_R,
                                                              mode="drop"))
  m, mb = cache.table.shape
  need = -(-cache.lengths // cache.block_size)
  touched = slot_mask(slot_R, jnp.ones_like(slot_R, jnp.bool_), m)
  drop = touched[:, None] & (jnp.arange(mb)[None] >= need[:, None])
  return cache._replace(table=jnp.where(drop, -1, cache.table))


def share(cache: pc.PagedKVCache, dst_R: jax.Array, src_R: jax.Array,
          valid_R: jax.Array, prompt_len: int) -> pc.PagedKVCache:
  """Slots ``dst_R`` (valid rows) point to the prompt blocks of slots
  ``src_R`` and hold ``prompt_len`` cache slots: the blocks are shared,
  and copied when a row writes into one (``paged_cache.reserve``)."""
  m, mb = cache.table.shape
  prompt_cols = jnp.arange(mb) < -(-prompt_len // cache.block_size)
  src = jnp.where(prompt_cols[None], cache.table[jnp.minimum(src_R, m - 1)],
                  -1)
  dst = jnp.where(valid_R, dst_R, m)  # m: dropped
  return cache._replace(
      table=cache.table.at[dst].set(src, mode="drop"),
      lengths=cache.lengths.at[dst].set(prompt_len, mode="drop"))


def pool_figures(cache: pc.PagedKVCache, peak, cut) -> dict[str, jax.Array]:
  """``paged.pool_stats`` of the slots' pool."""
  return pool_stats(cache, cache.num_blocks, peak, cut)


__all__ = ["claim", "merge", "pool_figures", "rows", "set_lengths", "share",
           "slot_cache", "slot_mask"]
