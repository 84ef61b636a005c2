"""Multi-turn episodes on a paged KV cache (``sampler.kv_cache="paged"``).

The episodes' dense cache gives each row ``P + T + O`` slots of its own for
the whole rollout. On a paged cache (``rljax/models/paged_cache.py``) each
row is a block table into one pool instead, and ``rljax/rollout/turns.py``
writes through the functions here, which take either cache:

* a prompt is prefilled once (a dense forward of the distinct prompts) and
  written into the blocks of the first row that plays it; the other rows
  that start with it point to the same blocks (``slot_pages.share``), and
  the block the prompt ends in is copied when a row first writes into it
  (copy on write);
* every forward (a decode step, an observation, a carried history, a
  SPEC-RL draft) first reserves the slots it writes in the rows that write
  (``paged_cache.reserve``; a row that finds no free block ends there, cut,
  as the static paged sampler's rows do: ``rollout/kv_cut_rows``); the
  other rows write nothing;
* after it, ``settle`` sets each row's length and keeps only the blocks
  that length needs (an observation narrower than ``O``, a draft's
  rejected tail: released), and a row whose episode is over releases its
  blocks, so the blocks in use follow the live episodes' tokens, an
  episode waiting for its environment keeping its own
  (``rollout/kv_blocks_peak``);
* a batch that shrinks (``sampler.shrink_batch_to``) moves block tables
  only: the rows outside hold their blocks (``PagedKVCache.held``).

A row reads only slots below its own length (the causal mask), so what was
left past it in a block is never attended to. Tokens equal the dense
cache's; logprobs agree to float rounding: ``tests/test_env_paged.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.models import paged_cache as pc
from rljax.models.kv_cache import KVCache, LayerKV
from rljax.sampling import slot_pages


def is_paged(cache: Any) -> bool:
  return isinstance(cache, pc.PagedKVCache)


def pool(mc, rows: int, width: int, paged, dtype) -> pc.PagedKVCache:
  """An empty pool for ``rows`` rows of ``width`` slots
  (``slot_pages.slot_cache``: the worst case unless ``paged.num_blocks``)."""
  return slot_pages.slot_cache(mc, rows, width, paged, dtype)


def dense_rows(prefilled_U: KVCache, source_N) -> KVCache:
  """The dense cache of ``N`` rows, row ``n`` a copy of prompt
  ``source_N[n]``'s prefill."""
  return KVCache(tuple(LayerKV(kv.k[source_N], kv.v[source_N])
                       for kv in prefilled_U.layers),
                 prefilled_U.mask[source_N],
                 jnp.full(source_N.shape, prefilled_U.mask.shape[1],
                          jnp.int32), prefilled_U.prefix)


def prompts(cache: pc.PagedKVCache, rows_N, prefilled_U: KVCache, source_N
            ) -> tuple[pc.PagedKVCache, jax.Array]:
  """Rows ``rows_N`` (bool ``[N]``) start over with prompt ``source_N[n]``
  of the dense ``prefilled_U`` (``P`` slots each): their blocks released,
  the prompt written into the blocks of its first row and the others
  pointing to them. Returns ``(cache, failed_N)``: rows whose prompt found
  no free block (they hold none)."""
  n = source_N.shape[0]
  p = prefilled_U.mask.shape[1]
  same = rows_N[None, :] & (source_N[None, :] == source_N[:, None])
  leader = jnp.argmax(same, axis=1).astype(jnp.int32)
  first = rows_N & (leader == jnp.arange(n))
  cache = pc.release(cache, rows_N)
  cache, failed = pc.reserve(cache, first, p)
  table = jnp.where((first & ~failed)[:, None], cache.table, -1)
  zeros = jnp.zeros((n,), jnp.int32)
  layers = tuple(LayerKV(*pc.write(
      pool_kv.k, pool_kv.v, table, zeros, kv.k[source_N], kv.v[source_N],
      cache.block_size)) for pool_kv, kv in zip(cache.layers,
                                                prefilled_U.layers))
  cache = cache._replace(
      layers=layers, slot_mask=pc.write_mask(
          cache.slot_mask, table, zeros, prefilled_U.mask[source_N]),
      lengths=jnp.where(first & ~failed, p, cache.lengths))
  failed = rows_N & failed[leader]
  cache = slot_pages.share(cache, jnp.arange(n), leader,
                           rows_N & ~first & ~failed, p)
  return pc.release(cache, failed), failed


def reserve(cache, at_N, write_N, width: int) -> tuple[Any, jax.Array]:
  """``(cache, failed_N)``: the next write of each row at its slot
  ``at_N``; on a paged cache the rows ``write_N`` first reserve ``width``
  slots there (``failed_N``: found no free block)."""
  if not is_paged(cache):
    return cache._replace(index=at_N), jnp.zeros(at_N.shape, jnp.bool_)
  cache, failed = pc.reserve(cache._replace(lengths=at_N), write_N, width)
  return cache, failed & write_N


def apply(model, params, tokens_NxW, positions_NxW, cache, write_N, mask_NxW
          ) -> tuple[jax.Array, Any]:
  """``(hidden, cache)``: ``tokens_NxW`` run through the model at each
  row's next write (``reserve``). A dense cache: every row writes
  (``mask_NxW`` marks the real tokens). A paged one: only the rows
  ``write_N``, into the slots they reserved. The write position is then the
  model's (``+ W``) until ``settle``."""
  if not is_paged(cache):
    return model.apply({"params": params}, tokens_NxW, positions_NxW, cache,
                       input_mask_BxT=mask_NxW)
  view = cache._replace(table=jnp.where(write_N[:, None], cache.table, -1))
  hidden, out = model.apply({"params": params}, tokens_NxW, positions_NxW,
                            view, input_mask_BxT=mask_NxW)
  return hidden, out._replace(table=cache.table)


def forward(model, params, tokens_NxW, positions_NxW, cache, at_N, write_N,
            mask_NxW) -> tuple[jax.Array, Any, jax.Array]:
  """``reserve`` then ``apply``: ``(hidden, cache, failed_N)``, the rows
  that found no block writing nothing."""
  cache, failed = reserve(cache, at_N, write_N, tokens_NxW.shape[1])
  hidden, cache = apply(model, params, tokens_NxW, positions_NxW, cache,
                        write_N & ~failed, mask_NxW)
  return hidden, cache, failed


def settle(cache, length_N, over_N):
  """The cache with each row's next write at ``length_N``; on a paged one
  each row keeps only the blocks that length needs, and the rows
  ``over_N`` (episodes over, or cut) release theirs."""
  if not is_paged(cache):
    return cache._replace(index=length_N)
  cache = pc.release(cache, over_N)
  lengths = jnp.where(over_N, 0, length_N)
  need = -(-lengths // cache.block_size)
  cols = jnp.arange(cache.table.shape[1])[None]
  return cache._replace(table=jnp.where(cols < need[:, None], cache.table, -1),
                        lengths=lengths)


def in_use(cache) -> jax.Array:
  """Blocks in use (a dense cache: 0)."""
  return (pc.blocks_in_use(cache) if is_paged(cache)
          else jnp.zeros((), jnp.int32))


def take(cache, rows_L):
  """The cache of rows ``rows_L``: a dense cache's rows gathered; a paged
  one's tables and lengths, the pool whole, and the other rows' blocks
  ``held``."""
  if not is_paged(cache):
    return jax.tree.map(
        lambda x: x if x.ndim == 0 else jnp.take(x, rows_L, axis=0), cache)
  part = cache._replace(table=cache.table[rows_L],
                        lengths=cache.lengths[rows_L])
  return part._replace(held=pc.refcounts(cache) - pc.refcounts(part))


def fork(cache, src_N):
  """Every row ``n`` a copy of row ``src_N[n]``: a dense cache's rows
  gathered; a paged one's block tables (``paged_cache.fork``: the blocks
  shared, copied when a row first writes into one)."""
  if is_paged(cache):
    return pc.fork(cache, src_N)
  return take(cache, src_N)


def put(cache, rows_L, part):
  """``cache`` with rows ``rows_L`` set to ``part``'s (``take``)."""
  if not is_paged(cache):
    return jax.tree.map(lambda full, new: (new if full.ndim == 0
                                           else full.at[rows_L].set(new)),
                        cache, part)
  return cache._replace(layers=part.layers, slot_mask=part.slot_mask,
                        table=cache.table.at[rows_L].set(part.table),
                        lengths=cache.lengths.at[rows_L].set(part.lengths))


__all__ = ["apply", "dense_rows", "fork", "forward", "in_use", "is_paged", "pool",
           "prompts", "put", "reserve", "settle", "take"]
