"""A paged KV cache: fixed-size blocks shared by rows, copied on write.

The dense cache (``kv_cache.KVCache``) gives every row ``S`` slots of its
own, whether it fills them or not. A paged cache keeps one pool of
``num_blocks`` blocks of ``block_size`` slots per layer, and a block table
per row: row ``r``'s logical slot ``s`` lives in block ``table[r, s //
block_size]`` at offset ``s % block_size`` (vLLM's PagedAttention, Kwon et
al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention", arXiv:2309.06180). Then

* a block is held only while a row's table points to it, so the memory in
  use follows the live rows' tokens (``blocks_in_use``);
* rows share blocks: a group's prompt is written once and every row of the
  group points to its blocks (``fork``), as does a tree's branch to its
  parent's segments;
* a write into a block that another row also points to first copies the
  block (copy on write, ``reserve``), so a row never changes what another
  row reads.

Reference counts are the number of table entries that point to each block
(``refcounts``): derived from the tables, never stored, so no sequence of
forks and releases can leave a count that disagrees with them; a block with
count 0 is free. Everything here is a pure function of arrays, jit-able
with fixed shapes.

Reads go through ``gather``: the row's blocks, in table order, as the dense
``[R, K, max_blocks * block_size, H]`` keys and values the decoder's
attention takes (the gather-based path every backend runs). The decoder
(``transformer.Decoder``) takes a ``PagedKVCache`` as it takes a dense one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models.config import ModelConfig
from rljax.models.kv_cache import LayerKV


class PagedLayer(NamedTuple):
  """What one attention layer of the decoder reads and writes: its pools
  ``k`` / ``v`` (``[num_blocks, K, block_size, H]``), and the cache's
  ``table`` and ``lengths``."""

  k: jax.Array
  v: jax.Array
  table: jax.Array
  lengths: jax.Array


class PagedKVCache(NamedTuple):
  """The pool, the block tables and each row's length.

  Attributes:
    layers: one ``LayerKV`` per layer, each ``k`` / ``v`` a pool
      ``[num_blocks, K, block_size, H]``.
    slot_mask: ``[num_blocks, block_size]`` bool, whether a slot holds a real
      token (a left-padded prompt's padding is written but not real).
    table: ``[R, max_blocks]`` int32, each row's blocks in order, -1 where
      it has none.
    lengths: ``[R]`` int32, the slots each row has written: its next write
      goes to logical slot ``lengths[r]``.
    held: ``[num_blocks]`` int32 or None: table entries of rows outside
      this cache's ``R``, which hold their blocks while a part of the rows
      decodes alone (a multi-turn batch that shrinks:
      ``rljax/rollout/turn_pages.py``); ``refcounts`` counts them.
  """

  layers: tuple[LayerKV, ...]
  slot_mask: jax.Array
  table: jax.Array
  lengths: jax.Array
  held: jax.Array | None = None

  @property
  def block_size(self) -> int:
    return self.slot_mask.shape[1]

  @property
  def num_blocks(self) -> int:
    return self.slot_mask.shape[0]


def init_paged_cache(config: ModelConfig, rows: int, num_blocks: int,
                     block_size: int, max_blocks: int,
                     dtype: Any = jnp.bfloat16) -> PagedKVCache:
  """An empty cache: every block free, every row of length 0.

  Raises:
    ValueError: naming the argument, for a size below 1.
  """
  for name, value in (("rows", rows), ("num_blocks", num_blocks),
                      ("block_size", block_size), ("max_blocks", max_blocks)):
    if value < 1:
      raise ValueError(f"init_paged_cache: {name}={value}: >= 1 is required.")
  shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)
  layers = tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(config.num_layers))
  return PagedKVCache(layers, jnp.zeros((num_blocks, block_size), jnp.bool_),
                      jnp.full((rows, max_blocks), -1, jnp.int32),
                      jnp.zeros((rows,), jnp.int32))


def refcounts(cache: PagedKVCache) -> jax.Array:
  """``[num_blocks]`` int32, how many table entries point to each block."""
  flat = cache.table.reshape(-1)
  counts = jnp.zeros((cache.num_blocks,), jnp.int32).at[
      jnp.where(flat >= 0, flat, cache.num_blocks)].add(1, mode="drop")
  return counts if cache.held is None else counts + cache.held


def blocks_in_use(cache: PagedKVCache) -> jax.Array:
  """``[]`` int32, the blocks some row points to."""
  return jnp.sum(refcounts(cache) > 0).astype(jnp.int32)


def _allocate(counts: jax.Array, need_R: jax.Array) -> jax.Array:
  """A distinct free block (``counts`` 0, the ``refcounts``) for each row of
  ``need_R`` (lowest ids first, in row order), -1 for the others and for
  the rows beyond the free blocks."""
  free = counts == 0
  rows = need_R.shape[0]
  ids = jnp.nonzero(free, size=rows, fill_value=-1)[0]
  rank = jnp.cumsum(need_R.astype(jnp.int32)) - 1
  return jnp.where(need_R, ids[jnp.clip(rank, 0, rows - 1)], -1)


def _copy_blocks(cache: PagedKVCache, src_R, dst_R) -> PagedKVCache:
  """Block ``src_R[r]``'s keys, values and slot mask copied into block
  ``dst_R[r]`` (rows with ``dst_R < 0`` copy nothing)."""
  n = cache.num_blocks
  dst = jnp.where(dst_R >= 0, dst_R, n)
  src = jnp.clip(src_R, 0, n - 1)
  layers = tuple(LayerKV(l.k.at[dst].set(l.k[src], mode="drop"),
                         l.v.at[dst].set(l.v[src], mode="drop"))
                 for l in cache.layers)
  return cache._replace(layers=layers, slot_mask=cache.slot_mask.at[dst].set(
      cache.slot_mask[src], mode="drop"))


def reserve(cache: PagedKVCache, rows_R: jax.Array, num_slots: int
            ) -> tuple[PagedKVCache, jax.Array]:
  """The cache with room for ``num_slots`` more slots in each row of
  ``rows_R`` (bool ``[R]``), written by no other row: ``(cache,
  failed_R)``.

  Each block that the write will touch is allocated if the row has none
  there, or copied to a new block if another row points to it too (copy on
  write: the other rows keep reading the old one). A shared block that
  every row pointing to it writes is kept by the first of them (lowest
  row), which writes it in place: only the others copy. ``failed_R`` (bool
  ``[R]``) marks the rows that found no free block, or whose slots run past
  their table: their write goes nowhere (``write`` drops it: a row that
  failed to copy a shared block no longer points to it), so the caller
  ends them or sizes the pool so that none fails.
  """
  bs, mb = cache.block_size, cache.table.shape[1]
  rows = jnp.arange(cache.table.shape[0])
  failed = rows_R & (cache.lengths + num_slots > mb * bs)

  def block_j(j, carry):
    # The j-th block slots [length, length + num_slots) fall in (at most
    # ceil(num_slots / bs) + 1 of them).
    cache, failed = carry
    col = cache.lengths // bs + j
    touched = rows_R & (col * bs < cache.lengths + num_slots) & (col < mb)
    col = jnp.clip(col, 0, mb - 1)
    current = cache.table[rows, col]
    counts = refcounts(cache)
    held = jnp.maximum(current, 0)
    holders = counts[held]
    shared = (current >= 0) & (holders > 1)
    # A shared block that all its holders write: the first of them (lowest
    # row) writes it in place, the others copy it, so the write needs one
    # block fewer than the holders.
    at = jnp.where(touched & shared, current, cache.num_blocks)
    writers = jnp.zeros_like(counts).at[at].add(1, mode="drop")
    first = jnp.full_like(counts, rows.shape[0]).at[at].min(rows, mode="drop")
    keeps = (touched & shared & (writers[held] == holders)
             & (first[held] == rows))
    shared = shared & ~keeps
    need = touched & ((current < 0) | shared)
    block = _allocate(counts, need)
    failed = failed | (need & (block < 0))
    copy = need & shared & (block >= 0)
    cache = _copy_blocks(cache, current, jnp.where(copy, block, -1))
    fresh = need & ~shared & (block >= 0)
    cache = _clear_slots(cache, jnp.where(fresh, block, -1))
    # A row that found no block lets go of the shared one it would have
    # copied, so its write is dropped there, never landing in a block
    # another row writes in place (or reads).
    cache = cache._replace(table=cache.table.at[rows, col].set(
        jnp.where(need, block, current)))
    return cache, failed

  # One compiled body, however wide the write (a carried history's or a
  # prompt's reservation unrolled would grow the program per block); on a
  # mesh, the tables whole on each device (``whole_on_each_device``).
  return sharding.whole_on_each_device(lambda c, f: jax.lax.fori_loop(
      0, -(-num_slots // bs) + 1, block_j, (c, f)))(cache, failed)


def _clear_slots(cache: PagedKVCache, block_R) -> PagedKVCache:
  """The slot masks of blocks ``block_R`` (>= 0) cleared: a block handed
  out again holds no real token until it is written."""
  n = cache.num_blocks
  idx = jnp.where(block_R >= 0, block_R, n)
  return cache._replace(slot_mask=cache.slot_mask.at[idx].set(False,
                                                              mode="drop"))


def fork(cache: PagedKVCache, src_R: jax.Array) -> PagedKVCache:
  """Every row ``r`` becomes a copy of row ``src_R[r]`` (its table and
  length; no key or value is copied): rows with ``src_R[r] == r`` keep
  theirs. A row's old blocks are released by the same stroke (nothing
  points to them from it any more)."""
  return cache._replace(table=cache.table[src_R], lengths=cache.lengths[src_R])


def release(cache: PagedKVCache, rows_R: jax.Array) -> PagedKVCache:
  """Rows ``rows_R`` (bool ``[R]``) point to no block and have length 0;
  a block no other row points to is free again."""
  return cache._replace(
      table=jnp.where(rows_R[:, None], -1, cache.table),
      lengths=jnp.where(rows_R, 0, cache.lengths))


def _slots(table_RxM, lengths_R, t: int, block_size: int, num_blocks: int):
  """``(block_RxT, offset_RxT)`` of each row's logical slots ``lengths[r] ..
  lengths[r] + t - 1``; ``num_blocks`` (out of range: a dropped write) where
  the row has no block there."""
  slot = lengths_R[:, None] + jnp.arange(t)[None]
  col = slot // block_size
  block = jnp.take_along_axis(
      table_RxM, jnp.clip(col, 0, table_RxM.shape[1] - 1), 1)
  block = jnp.where((block >= 0) & (col < table_RxM.shape[1]), block,
                    num_blocks)
  return block, slot % block_size


def write(pool_k, pool_v, table_RxM, lengths_R, new_k_RxKxTxH, new_v_RxKxTxH,
          block_size: int):
  """The pools with row ``r``'s ``T`` new keys and values written at its
  logical slots ``lengths[r] .. lengths[r] + T - 1`` (blocks from
  ``reserve``; a slot whose row has no block there is dropped). On a mesh
  the pool is whole on each device (``sharding.whole_on_each_device``):
  any row may point into any block."""
  def put(pool_k, pool_v, table_RxM, lengths_R, new_k, new_v):
    block, off = _slots(table_RxM, lengths_R, new_k.shape[2], block_size,
                        pool_k.shape[0])
    # [R, T, K, H] rows of the pool's [N, K, BS, H] at (block, :, off, :).
    k_rt = jnp.transpose(new_k, (0, 2, 1, 3)).astype(pool_k.dtype)
    v_rt = jnp.transpose(new_v, (0, 2, 1, 3)).astype(pool_v.dtype)
    return (pool_k.at[block, :, off, :].set(k_rt, mode="drop"),
            pool_v.at[block, :, off, :].set(v_rt, mode="drop"))
  return sharding.whole_on_each_device(put)(
      pool_k, pool_v, table_RxM, lengths_R, new_k_RxKxTxH, new_v_RxKxTxH)


def write_mask(slot_mask, table_RxM, lengths_R, mask_RxT):
  """The slot mask with ``mask_RxT`` written as ``write`` writes keys."""
  def put(slot_mask, table_RxM, lengths_R, mask_RxT):
    block, off = _slots(table_RxM, lengths_R, mask_RxT.shape[1],
                        slot_mask.shape[1], slot_mask.shape[0])
    return slot_mask.at[block, off].set(mask_RxT, mode="drop")
  return sharding.whole_on_each_device(put)(slot_mask, table_RxM, lengths_R,
                                            mask_RxT)


def gather(pool, table_RxM):
  """Each row's blocks in table order: ``[R, K, M * block_size, H]`` (a
  row's missing blocks read block 0; ``gather_mask`` masks them)."""
  blocks = pool[jnp.maximum(table_RxM, 0)]  # [R, M, K, BS, H]
  r, m, k, bs, h = blocks.shape
  return jnp.transpose(blocks, (0, 2, 1, 3, 4)).reshape(r, k, m * bs, h)


def gather_mask(slot_mask, table_RxM):
  """``[R, M * block_size]`` bool: the real tokens of each row's slots."""
  m = slot_mask[jnp.maximum(table_RxM, 0)] & (table_RxM >= 0)[..., None]
  return m.reshape(table_RxM.shape[0], -1)


__all__ = ["PagedKVCache", "PagedLayer", "blocks_in_use", "fork", "gather", "gather_mask",
           "init_paged_cache", "refcounts", "release", "reserve", "write",
           "write_mask"]
