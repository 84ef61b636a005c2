"""SPEC-RL's drafts on a tree rollout: each segment verified from an earlier tree.

``rl.rollout="tree"`` with ``sampler.speculative=True``. SPEC-RL (Liu et
al. 2025, arXiv:2509.23232) drafts a prompt's new rollout from its previous
one and keeps the prefix the current policy accepts. A tree rollout
(``sampling.tree``) is decoded segment by segment and forks between
segments, so here the draft is the prompt's previous tree, followed node by
node:

* each row of the tree follows one node of the draft tree (``src``, the
  first leaf below that node, or -1: no draft). The ``i``-th root follows
  the draft's ``i``-th distinct first segment; at a fork, the ``k``-th
  child of a row follows the ``k``-th distinct child of its row's node. So
  the children of one row follow different draft branches, and a tree
  drafted from a rollout of the same policy is that rollout again, not
  ``G`` copies of one branch. Draft nodes are told apart by their tokens
  (two leaves share a node at depth ``d`` when their first
  ``(d + 1) x segment_tokens`` tokens agree), so a draft needs no record of
  its tree: the draft store (``sampling.DraftStore``) keeps leaves as it
  keeps any rollout's rows;
* at the start of each segment, the rows that still follow a node verify
  that node's tokens of the segment in one forward pass (the acceptance
  rule of ``sampling.speculative``, ``accept_prefix``) and keep the
  accepted prefix; a row that rejects a token draws it, and the rest of
  the segment, from the current policy, and follows no node from there on
  (its children neither);
* the decode loop then runs each row that is not yet at the segment's end
  (the rows that accepted the whole segment wait), with the same keys as
  the tree sampler's, and the tree forks as it does without drafts, by the
  segments' surprisal (an accepted token's logprob is under the current
  policy, as a drawn one's). A row with no draft is decoded as the tree
  sampler decodes it: with an empty draft, the rollout is the tree
  sampler's, token for token.

``accepted_N`` counts each leaf's tokens that came from the draft (its
shared segments included, as the static sampler's rows count theirs).
LATR (``sampling.latr``) verifies the drafts of its rows sampled as usual
with ``verify_segment`` too, over the whole completion, before its loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models import compute_logits
from rljax.models import paged_cache as pc
from rljax.sampling import slot_pages
from rljax.sampling.decode_cache import _cache_slots, _grow
from rljax.sampling.sampler import _ended, sampled_logprobs
from rljax.sampling.speculative import _VERIFY_CHUNK, Draft, accept_prefix


def draft_levels(draft: Draft, b: int, g: int, widths: tuple[int, ...],
                 segment_tokens: int):
  """Per depth ``d`` of the tree (``widths``), ``(same_BxGxG, first_BxG)``:
  whether draft leaves ``i`` and ``j`` of a prompt share their depth-``d``
  node (their first ``(d + 1) x segment_tokens`` tokens agree, every token
  at the last depth), and whether leaf ``j`` is the first of its node."""
  t = draft.tokens.shape[1]
  tok = draft.tokens.reshape(b, g, t)
  mask = draft.mask.astype(jnp.bool_).reshape(b, g, t)
  agree = (mask[:, :, None] == mask[:, None]) & (
      ~mask[:, :, None] | (tok[:, :, None] == tok[:, None]))  # [B, G, G, T]
  out = []
  for d in range(len(widths)):
    length = t if d == len(widths) - 1 else min((d + 1) * segment_tokens, t)
    same = jnp.all(agree[..., :length], -1)
    first = jnp.argmax(same, 1) == jnp.arange(g)[None]
    out.append((same, first))
  return out


def _kth(candidates_BxWxG, k_BxW):
  """The index of the ``k``-th True of each row's candidates, or -1."""
  rank = jnp.cumsum(candidates_BxWxG, -1) - 1
  pick = candidates_BxWxG & (rank == k_BxW[..., None])
  return jnp.where(jnp.any(pick, -1), jnp.argmax(pick, -1), -1).astype(
      jnp.int32)


def root_sources(levels, draft: Draft, b: int, g: int, roots: int):
  """``[B * roots]``: each root's draft leaf (the ``i``-th distinct first
  segment of its prompt's draft), -1 where the prompt has no draft."""
  _, first = levels[0]
  k = jnp.broadcast_to(jnp.arange(roots, dtype=jnp.int32)[None], (b, roots))
  src = _kth(jnp.broadcast_to(first[:, None], (b, roots, g)), k)
  has = jnp.any(draft.mask.reshape(b, -1), 1)
  return jnp.where(has[:, None], src, -1).reshape(-1)


def child_sources(levels, d: int, src_BxW, parents_BxW2):
  """``[B, W2]``: the draft leaf each child of the fork after depth ``d``
  follows: the ``k``-th distinct depth-``d + 1`` node below its parent's
  node, for the parent's ``k``-th child (children of one parent are
  adjacent: ``fork_parents``), or -1."""
  same, _ = levels[d]
  _, first_next = levels[d + 1]
  w2 = parents_BxW2.shape[1]
  parent_src = jnp.take_along_axis(src_BxW, parents_BxW2, 1)
  first_child = jnp.argmax(parents_BxW2[:, None] == parents_BxW2[:, :, None],
                           -1)
  k = jnp.arange(w2, dtype=jnp.int32)[None] - first_child
  members = jnp.take_along_axis(same, jnp.maximum(parent_src, 0)[..., None],
                                1)  # [B, W2, G]
  src = _kth(members & first_next[:, None], k)
  return jnp.where(parent_src >= 0, src, -1)


def verify_segment(params, state, src_N, draft: Draft, g: int, w: int,
                   lo: int, hi: int, key, *, model, w_DxV, mc, sc,
                   log_lenience: float, slots: tuple[int, int] | None):
  """The rows that follow a draft node (``src_N >= 0``, live) verify its
  tokens of columns ``[lo, hi)`` in one pass and keep the accepted prefix.

  ``slots``: on a dense cache ``(slots needed after this pass, the most
  the cache will need)``; None on a paged cache (``state.cache``). Returns
  ``(state, src_N, accepted_N, cut_N)``: ``src_N`` -1 where a row rejected a
  token or its node's tokens end within the segment; ``cut_N`` the rows of
  a paged cache that found no block (ended).
  """
  n, s = src_N.shape[0], hi - lo
  leaf = (jnp.arange(n) // w) * g + jnp.maximum(src_N, 0)
  take = lambda x: jnp.take(x, leaf, axis=0)[:, lo:hi]
  tokens, mask, draft_lp = take(draft.tokens), take(draft.mask), take(
      draft.logprobs)
  mask = mask.astype(jnp.bool_) & ((src_N >= 0) & ~state.done)[:, None]
  verifying = jnp.any(mask, 1)
  cut = jnp.zeros((n,), jnp.bool_)
  cache = state.cache
  if slots is None:
    cache, cut = pc.reserve(cache, verifying, s)
    mask = mask & ~cut[:, None]
    before = cache.lengths
  else:
    cache = _grow(cache, _cache_slots(*slots))
    start = cache.index
  hidden_NxSxD, cache = model.apply(
      {"params": params}, tokens,
      state.next_position[:, None] + jnp.arange(s, dtype=jnp.int32)[None],
      cache, input_mask_BxT=mask)
  # Column j's logits: the row's own before the pass, then the hidden
  # state after draft token j - 1; [N, chunk, V] of them at once.
  parts = []
  for a in range(0, s, _VERIFY_CHUNK):
    b = min(a + _VERIFY_CHUNK, s)
    logits = compute_logits(hidden_NxSxD[:, max(a - 1, 0):b - 1], w_DxV,
                            mc.final_logit_softcap)
    if a == 0:
      logits = jnp.concatenate([state.logits[:, None], logits], 1)
    parts.append((*sampled_logprobs(logits, tokens[:, a:b], sc),
                  tokens[:, a:b] == jnp.argmax(logits, -1).astype(jnp.int32)))
  sampler_lp, policy_lp, is_argmax = (jnp.concatenate(x, 1)
                                      for x in zip(*parts))
  accepted, sampler_lp = accept_prefix(sampler_lp, is_argmax, draft_lp, mask,
                                       key, sc, log_lenience)
  kept_NxS = jnp.arange(s)[None] < accepted[:, None]
  if slots is None:
    cache = slot_pages.set_lengths(cache, jnp.arange(n), before + accepted)
  else:
    cache = cache._replace(mask=jax.lax.dynamic_update_slice(
        cache.mask, kept_NxS & mask, (0, start)))
  t = sc.max_new_tokens
  cols = jnp.arange(t, dtype=jnp.int32)[None]
  kept_NxT = (cols >= lo) & (cols < lo + accepted[:, None])
  wide = lambda x: jnp.pad(x, ((0, 0), (lo, t - hi)))
  put = lambda buf, x: jnp.where(kept_NxT, wide(x).astype(buf.dtype), buf)
  out_tokens = put(state.tokens, tokens)
  last = jnp.maximum(state.column + accepted - 1, 0)
  ended = (accepted > 0) & _ended(
      out_tokens, last, jnp.take_along_axis(out_tokens, last[:, None], 1)[:, 0],
      jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32),
      sc.stop_sequences)
  column = state.column + accepted
  at = jnp.maximum(accepted - 1, 0)[:, None, None]
  next_logits = compute_logits(
      jnp.take_along_axis(hidden_NxSxD, at, 1), w_DxV,
      mc.final_logit_softcap)[:, 0]
  logits_N = jnp.where((accepted > 0)[:, None], next_logits, state.logits)
  done = state.done | ended | (column >= t) | cut
  if slots is None:
    cache = pc.release(cache, done & ~state.done)
  state = state._replace(
      logits=sharding.constrain(logits_N, ("batch", "act_vocab")),
      cache=cache, tokens=out_tokens, mask=state.mask | kept_NxT,
      sampler_logp=put(state.sampler_logp, sampler_lp),
      policy_logp=(None if state.policy_logp is None
                   else put(state.policy_logp, policy_lp)),
      column=column, done=done, finished=state.finished | ended,
      next_position=state.next_position + accepted)
  follows = (src_N >= 0) & (accepted == jnp.sum(mask, 1)) & (
      jnp.sum(mask, 1) == s) & ~done
  return state, jnp.where(follows, src_N, -1), accepted, cut


def hold_finished_rows(run, state, end: int, prompt_len_N, paged: bool):
  """``run(state)`` (a decode loop) with the rows already at column ``end``
  held out of it (marked done for its length, then restored): they
  accepted the segment's draft whole. Their next-token logits, positions
  (and on a paged cache their lengths) are put back as they were: a decode
  step runs the decoder on every row, done or not."""
  waiting = ~state.done & (state.column >= end)
  logits = state.logits
  lengths = state.cache.lengths if paged else None
  state = run(state._replace(done=state.done | waiting))
  cache = state.cache
  if paged:
    cache = cache._replace(lengths=jnp.where(
        waiting, lengths, cache.lengths))
  if state.logits.shape == logits.shape:  # (the last width may shrink)
    logits = jnp.where(waiting[:, None], logits, state.logits)
  else:
    logits = state.logits
  return state._replace(done=state.done & ~waiting, cache=cache,
                        logits=logits,
                        next_position=prompt_len_N + state.column)


__all__ = ["child_sources", "draft_levels", "hold_finished_rows",
           "root_sources", "verify_segment"]
