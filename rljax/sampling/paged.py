"""The static sampler on a paged KV cache (``rljax/models/paged_cache.py``).

The same rows as ``sampling.sample`` (each row's tokens are drawn with the
same keys: ``row_keys``), decoded over a pool of blocks instead of a dense
cache per row:

* each prompt is prefilled once, on its group's first row; the group's
  other rows point to the same blocks (``paged_cache.fork``), so a group of
  ``G`` holds one copy of its prompt; the block a prompt ends in is copied
  for a row when the row first writes into it (copy on write), as every
  later write of a row goes to blocks of its own;
* a row's blocks are released as soon as it ends, so the blocks in use
  follow the live rows' tokens (``rollout/kv_blocks_peak``), and a pool
  smaller than the worst case (``PagedConfig.num_blocks``) serves a
  long-tailed batch: a row that finds no free block ends there, truncated,
  and is counted (``rollout/kv_cut_rows``);
* attention reads each row's blocks gathered in table order (the
  gather-based path of every backend);
* with ``SamplerConfig.shrink_batch_to`` the decode batch halves as rows
  end (``shrink_levels``), as the dense sampler's does, but no key or value
  moves: the live rows' block tables and lengths are gathered into the
  smaller batch, and the pool stays where it is.

Tokens equal the dense sampler's; logprobs agree to float rounding (the
attention sums run over the slots in another order):
``tests/test_paged_cache.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from rljax.models import (ModelConfig, compute_logits, init_cache,
                          positions_from_mask)
from rljax.models import paged_cache as pc
from rljax.sampling.jitting import MeteredSampler, jit_rows
from rljax.sampling.decode_cache import shrink_levels
from rljax.sampling.sampler import (Rollout, SamplerConfig, _empty_state,
                                    _to_rollout, decode_setup, decode_step,
                                    row_keys, shrink_rest)


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  """The pool of a paged sampler (``sampler.kv_cache="paged"``).

  Attributes:
    block_size: slots per block.
    num_blocks: blocks in the pool, or None: the worst case (every row
      decoding to ``max_new_tokens``), so no row is ever cut.
  """

  block_size: int = 16
  num_blocks: int | None = None

  def __post_init__(self):
    if isinstance(self.block_size, bool) or not isinstance(
        self.block_size, int) or self.block_size < 1:
      raise ValueError(f"sampler.kv_block_size={self.block_size!r}: a "
                       "positive integer is required.")
    if self.num_blocks is not None and (
        isinstance(self.num_blocks, bool)
        or not isinstance(self.num_blocks, int) or self.num_blocks < 1):
      raise ValueError(f"sampler.kv_blocks={self.num_blocks!r}: a positive "
                       "integer or None is required.")

  def sizes(self, prompts: int, prompt_len: int, rows: int,
            max_new_tokens: int) -> tuple[int, int]:
    """``(num_blocks, max_blocks)``: the pool and each row's table width.

    The worst case: each prompt's blocks once, and for every row its own
    blocks from the one its prompt ends in to its last token.
    """
    bs = self.block_size
    max_blocks = -(-(prompt_len + max_new_tokens) // bs)
    worst = prompts * -(-prompt_len // bs) + rows * (
        -(-(prompt_len % bs + max_new_tokens) // bs))
    return (worst if self.num_blocks is None else self.num_blocks), max_blocks


def prefill_groups(params, prompt_tokens_BxP, prompt_mask_BxP, cache, g: int,
                   model) -> tuple[jax.Array, pc.PagedKVCache, jax.Array]:
  """``(hidden_BxD, cache, failed_B)``: the ``B`` prompts prefilled into the
  blocks of rows ``0, g, 2g, ...``, then every row of a group pointing to
  its prompt's blocks (``fork``). ``failed_B``: prompts that found no
  blocks."""
  b, p = prompt_tokens_BxP.shape
  leaders = cache._replace(table=cache.table[::g], lengths=cache.lengths[::g])
  leaders, failed = pc.reserve(leaders, jnp.ones((b,), jnp.bool_), p)
  hidden, leaders = model.apply(
      {"params": params}, prompt_tokens_BxP,
      positions_from_mask(prompt_mask_BxP), leaders,
      input_mask_BxT=prompt_mask_BxP)
  cache = leaders._replace(table=jnp.repeat(leaders.table, g, axis=0),
                           lengths=jnp.repeat(leaders.lengths, g))
  return hidden[:, -1], cache, failed


def prefill_prompts(params, prompt_tokens_BxP, prompt_mask_BxP, *, model,
                    mc: ModelConfig, rows_per_prompt: int, dtype,
                    paged: PagedConfig | None = None, pool_rows: int = 0,
                    max_new_tokens: int = 0):
  """``(hidden_BxD, cache, failed_B, num_blocks)``: each prompt prefilled
  once for its ``rows_per_prompt`` rows. A dense cache: a read-only shared
  prefix (``KVCache.prefix``) and no slots of the rows' own yet (no prompt
  fails; ``num_blocks`` 0). A paged one (``paged``): a pool sized for
  ``pool_rows`` rows of ``max_new_tokens`` (``PagedConfig.sizes``), each
  prompt in its first row's blocks and its other rows pointing to them
  (``prefill_groups``). The tree's, LATR's, the static paged sampler's and
  SPEC-RL's paged prefill."""
  b, p = prompt_tokens_BxP.shape
  if paged is None:
    prefix = init_cache(mc, b, p, dtype)
    hidden, prefix = model.apply(
        {"params": params}, prompt_tokens_BxP,
        positions_from_mask(prompt_mask_BxP), prefix,
        input_mask_BxT=prompt_mask_BxP)
    return (hidden[:, -1],
            init_cache(mc, b * rows_per_prompt, 0, dtype, prefix=prefix),
            jnp.zeros((b,), jnp.bool_), 0)
  num_blocks, max_blocks = paged.sizes(b, p, pool_rows, max_new_tokens)
  cache = pc.init_paged_cache(mc, b * rows_per_prompt, num_blocks,
                              paged.block_size, max_blocks, dtype)
  hidden_BxD, cache, failed_B = prefill_groups(
      params, prompt_tokens_BxP, prompt_mask_BxP, cache, rows_per_prompt,
      model)
  return hidden_BxD, cache, failed_B, num_blocks


def paged_decode(params, state, keys_N, end, *, model, w_DxV, mc, sc,
                 fits: int = 0):
  """Decode steps of every live row until ``step == end`` or at most
  ``fits`` rows are live, on a paged ``state.cache``: before each step a
  live row gets a block it alone writes (``reserve``; a row that finds
  none ends, cut); after it, rows that ended release their blocks. Returns
  ``(state, peak blocks in use, rows cut)``."""
  step = functools.partial(decode_step, params, model=model, w_DxV=w_DxV,
                           mc=mc, sc=sc)

  def body(carry):
    s, peak, cut = carry
    live = ~s.done
    cache, failed = pc.reserve(s.cache, live, 1)
    s = s._replace(cache=cache, done=s.done | failed)
    peak = jnp.maximum(peak, pc.blocks_in_use(cache))
    before = s.done
    s = step(s, keys_N)
    s = s._replace(cache=pc.release(s.cache, s.done & ~before | failed))
    return s, peak, cut + jnp.sum(failed).astype(jnp.int32)

  def cond(carry):
    s = carry[0]
    return (s.step < end) & (jnp.sum(~s.done) > fits)

  zero = jnp.zeros((), jnp.int32)
  return jax.lax.while_loop(cond, body, (state, pc.blocks_in_use(state.cache),
                                         zero))


def _sample_paged_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key, *,
                       model_config: ModelConfig, config: SamplerConfig,
                       paged: PagedConfig, row_multiple: int = 1
                       ) -> tuple[Rollout, dict[str, jax.Array]]:
  mc, sc = model_config, config
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, prompt_len_N = decode_setup(
      params, prompt_mask_BxP, mc, sc)
  b = prompt_tokens_BxP.shape[0]
  g = sc.num_samples
  hidden_BxD, cache, failed_B, num_blocks = prefill_prompts(
      params, prompt_tokens_BxP, prompt_mask_BxP, model=model, mc=mc,
      rows_per_prompt=g, dtype=cache_dtype, paged=paged, pool_rows=b * g,
      max_new_tokens=sc.max_new_tokens)
  logits = compute_logits(hidden_BxD[:, None], w_DxV,
                          mc.final_logit_softcap)[:, 0]
  state = _empty_state(jnp.repeat(logits, g, axis=0), cache, prompt_len_N, sc)
  # A prompt that found no blocks is cut before its first token.
  state = state._replace(done=jnp.repeat(failed_B, g))
  state, peak, cut = shrinking_decode(
      params, state, row_keys(key, b * g), model=model, w_DxV=w_DxV, mc=mc,
      sc=sc, row_multiple=row_multiple)
  return (_to_rollout(prompt_tokens_BxP, prompt_mask_BxP, state, sc),
          pool_stats(state.cache, num_blocks, peak,
                     cut + g * jnp.sum(failed_B).astype(jnp.int32)))


def shrinking_decode(params, state, keys_N, *, model, w_DxV, mc, sc,
                      row_multiple: int):
  """``paged_decode`` to the end, in batches that halve as rows end
  (``SamplerConfig.shrink_batch_to``; the module docstring): once the live
  rows fit the next level, they (live first) are gathered into it, their
  tables and lengths with them, and each batch's rows are written back to
  their own rows when it shrinks again and at the end."""
  t = sc.max_new_tokens
  levels = shrink_levels(keys_N.shape[0], sc.shrink_batch_to, row_multiple)
  run = functools.partial(paged_decode, params, model=model, w_DxV=w_DxV,
                          mc=mc, sc=sc)
  state, peak, cut = run(state, keys_N, t,
                         fits=levels[1] if len(levels) > 1 else 0)
  if len(levels) == 1:
    return state, peak, cut
  figures = [peak, cut]  # each smaller batch's, traced in order

  def run_level(state, keys, fits):
    state, more_peak, more_cut = run(state, keys, t, fits=fits)
    figures[:] = jnp.maximum(figures[0], more_peak), figures[1] + more_cut
    return state

  state = shrink_rest(state, keys_N, levels, run_level,
                      lambda cache, pick_n: cache._replace(
                          table=cache.table[pick_n],
                          lengths=cache.lengths[pick_n]))
  return state, figures[0], figures[1]


def pool_stats(cache: pc.PagedKVCache, num_blocks: int, peak, cut
               ) -> dict[str, jax.Array]:
  """A paged decode's figures: the most blocks in use at once, the pool,
  the rows cut for want of a block, and the blocks still held after the
  last row ended (released: 0)."""
  return {"rollout/kv_blocks_peak": peak.astype(jnp.float32),
          "rollout/kv_blocks_pool": jnp.asarray(num_blocks, jnp.float32),
          "rollout/kv_cut_rows": jnp.asarray(cut, jnp.float32),
          "rollout/kv_blocks_left": pc.blocks_in_use(cache).astype(
              jnp.float32)}


def make_paged_sampler(model_config: ModelConfig, config: SamplerConfig,
                       paged: PagedConfig,
                       mesh: jax.sharding.Mesh | None = None,
                       param_shardings: Any = None) -> MeteredSampler:
  """The static sampler's rows on a paged KV cache (the module docstring);
  without a mesh, or on one with the rows split over its batch axes as
  ``sampling.make_sampler``'s; ``with_metrics`` also returns the pool's
  figures (``pool_stats``)."""
  fn = functools.partial(_sample_paged_impl, model_config=model_config,
                         config=config, paged=paged)
  return MeteredSampler(jit_rows(fn, config, mesh, param_shardings,
                                 with_stats=True), paged=paged)


__all__ = ["PagedConfig", "make_paged_sampler",
           "paged_decode", "pool_stats", "prefill_groups", "shrinking_decode"]
