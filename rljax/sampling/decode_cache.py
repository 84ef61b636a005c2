"""The decode cache's shapes: length segments that grow it, and a batch that
shrinks as rows end (``sampler._decode`` runs one ``lax.while_loop`` per
segment and per batch size)."""

from __future__ import annotations

import jax.numpy as jnp

from rljax.models import KVCache
from rljax.models.kv_cache import LayerKV
from rljax.models.transformer import DECODE_BLOCK


def segment_ends(num_steps: int, first: int | None) -> tuple[int, ...]:
  """Decode-step counts at which the decode cache grows: doubling from ``first``.

  ``segment_ends(128, 32) == (32, 64, 128)``; ``first=None`` gives one segment.
  A segment's decode cache has exactly as many slots as steps can have been
  taken by its end, so attention reads at most twice the live length and the
  cache is copied (grown) ``log2(T / first)`` times, never per step.
  """
  if first is None or first >= num_steps:
    return (num_steps,)
  ends, end = [], first
  while end < num_steps:
    ends.append(end)
    end *= 2
  return tuple(ends) + (num_steps,)


def shrink_levels(num_rows: int, smallest: int | None,
                  multiple: int = 1) -> tuple[int, ...]:
  """Decode batch sizes as rows end: ``num_rows``, then halvings (rounded up
  to a multiple of ``multiple``, the mesh's batch ways) while they are at
  least ``smallest`` rows and smaller than the last.

  ``shrink_levels(64, 8) == (64, 32, 16, 8)``; ``shrink_levels(64, None) ==
  (64,)``; ``shrink_levels(48, 8, multiple=8) == (48, 24, 16, 8)``.
  """
  levels = [num_rows]
  if smallest is None:
    return tuple(levels)
  while True:
    half = -(-levels[-1] // 2)
    half = -(-half // multiple) * multiple
    if half < smallest or half >= levels[-1]:
      return tuple(levels)
    levels.append(half)


def _round_up(slots: int) -> int:
  """Cache slots are whole blocks of ``decode_attend``, so that its sums are
  the same for every segment (bitwise-equal segmented decode)."""
  return -(-slots // DECODE_BLOCK) * DECODE_BLOCK


def _cache_slots(needed: int, final: int) -> int:
  """Slots of a cache that holds ``needed`` slots now and ``final`` at most.

  Whole ``DECODE_BLOCK``s, so that ``decode_attend``'s block sums line up in
  every segment; but a cache that never outgrows one block is sized
  ``final`` at once: it never grows, so there is nothing to line up, and
  short generations (6 new tokens after a 16-token prompt) attend over their
  own slots, not a 64-slot block of mostly empty ones.
  """
  return final if final <= DECODE_BLOCK else _round_up(needed)


def _grow(cache: KVCache, num_slots: int) -> KVCache:
  """The cache with empty slots appended up to ``num_slots`` (one copy)."""
  extra = num_slots - cache.mask.shape[1]
  pad4 = ((0, 0), (0, 0), (0, extra), (0, 0))  # [B, K, S, H]
  layers = tuple(LayerKV(jnp.pad(l.k, pad4), jnp.pad(l.v, pad4))
                 for l in cache.layers)
  return cache._replace(layers=layers,
                        mask=jnp.pad(cache.mask, ((0, 0), (0, extra))))


def _gather_cache(cache: KVCache, rows_n, group_size: int) -> KVCache:
  """The cache of rows ``rows_n``, with no prefix: a prefix (one row per
  group of ``group_size``) is copied in front of each row's own slots, so
  rows of different groups can share a batch. Empty slots go first, so that
  the slots are whole ``DECODE_BLOCK``s and the slot distance between any
  two real tokens (a sliding window's) is unchanged."""
  take = lambda x: jnp.take(x, rows_n, axis=0)
  layers = tuple(LayerKV(take(l.k), take(l.v)) for l in cache.layers)
  mask, index = take(cache.mask), cache.index
  if cache.prefix is not None:
    groups = rows_n // group_size
    pre = cache.prefix
    sp, s = pre.mask.shape[1], mask.shape[1]
    pad = _round_up(sp + s) - (sp + s)
    pad4 = ((0, 0), (0, 0), (pad, 0), (0, 0))
    layers = tuple(
        LayerKV(jnp.concatenate([jnp.pad(jnp.take(p.k, groups, axis=0), pad4),
                                 l.k], axis=2),
                jnp.concatenate([jnp.pad(jnp.take(p.v, groups, axis=0), pad4),
                                 l.v], axis=2))
        for p, l in zip(pre.layers, layers))
    mask = jnp.concatenate([jnp.pad(jnp.take(pre.mask, groups, axis=0),
                                    ((0, 0), (pad, 0))), mask], axis=1)
    index = index + pad + sp
  return KVCache(layers, mask, index)
