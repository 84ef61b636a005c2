"""Filling continuous-batching slots (``rljax/sampling/continuous.py``).

A fill starts waiting queue rows in free slots inside the slots'
``lax.while_loop``. ``prefill_rows`` runs the decoder on every starting row
(a row with carried tokens prefills them with its prompt; a SPEC-RL draft
is verified as it is prefilled, ``verify_drafts``/``accept_draft``).
``prefill_shared`` fills rows of prompts alone and runs the decoder once per
distinct prompt: the other rows copy its keys, values and first-token
logits (``SlotConfig.share_prompts``). The state is ``continuous._State``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.models import ModelConfig, compute_logits, init_cache
from rljax.models import paged_cache as pc
from rljax.models.kv_cache import KVCache, LayerKV
from rljax.sampling import slot_pages
from rljax.sampling.sampler import SamplerConfig, _ended, sampled_logprobs


def accept_draft(logits_RxTxV, tokens_RxT, length_R, old_lp_RxT, log_u_RxT,
                 sample_R, *, sc: SamplerConfig, log_lenience: float):
  """SPEC-RL's acceptance of drafted tokens (``sampling.speculative``):
  ``(accepted_R, sampler_lp_RxT, policy_lp_RxT)``. ``logits_RxTxV[:, j]``
  predicts draft token ``j``; ``length_R`` draft tokens are real;
  ``log_u_RxT``: the uniforms' logs of the rule; ``sample_R``: each row's
  sample index in its group (ReMax's greedy row accepts argmax tokens
  only). Shared by the slots (``verify_drafts``) and the multi-turn rollout
  (``rljax/rollout/turns.py``)."""
  t = tokens_RxT.shape[1]
  sampler_lp, policy_lp = sampled_logprobs(logits_RxTxV, tokens_RxT, sc)
  is_argmax = tokens_RxT == jnp.argmax(logits_RxTxV, -1).astype(jnp.int32)
  if sc.method.greedy:
    accept = is_argmax
  else:
    accept = log_u_RxT <= log_lenience + sampler_lp - old_lp_RxT
    every = getattr(sc.method, "greedy_every", 0)
    if every:  # ReMax's greedy row of each group
      greedy_row = (sample_R % every == every - 1)[:, None]
      accept = jnp.where(greedy_row, is_argmax, accept)
      sampler_lp = jnp.where(greedy_row, 0.0, sampler_lp)
  accept = accept & (jnp.arange(t)[None] < length_R[:, None])
  accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), 1), 1)
  return accepted, sampler_lp, policy_lp


def verify_drafts(hidden_RxWxD, tokens_RxT, length_R, old_lp_RxT, key_rows,
                  sample_R, *, p: int, w_DxV, mc: ModelConfig,
                  sc: SamplerConfig, log_lenience: float):
  """``accept_draft`` of the rows prefilled with their drafts. Row ``r``
  draws its uniforms from ``fold_in(key_r, ACCEPT_FOLD)``."""
  t = tokens_RxT.shape[1]
  logits = compute_logits(hidden_RxWxD[:, p - 1:p - 1 + t], w_DxV,
                          mc.final_logit_softcap)
  log_u = jnp.log(jax.vmap(lambda k: jax.random.uniform(
      jax.random.fold_in(k, ACCEPT_FOLD), (t,)))(key_rows))
  return accept_draft(logits, tokens_RxT, length_R, old_lp_RxT, log_u,
                      sample_R, sc=sc, log_lenience=log_lenience)


ACCEPT_FOLD = 0x7FFFFFFF  # a column no token has: the acceptance draws' key


def _starting_rows(state: Any, queue: Any, num_rows: int, limit):
  """``(count, valid [R], queue row [R], slot [R])`` of a fill: the next
  ``count`` waiting rows (at most ``limit`` and the free slots) and the free
  slots they take (``M`` for the rows beyond ``count``: dropped by the
  scatters)."""
  q, m = queue.prompt_tokens.shape[0], state.live.shape[0]
  count = jnp.minimum(jnp.minimum(jnp.sum(~state.live), limit),
                      queue.num_pending - state.next_row)
  r = jnp.arange(num_rows)
  valid = r < count
  slot = jnp.where(valid, jnp.argsort(state.live, stable=True)[
      jnp.minimum(r, m - 1)], m)
  return count, valid, jnp.minimum(state.next_row + r, q - 1), slot


def prefill_rows(params, state: Any, queue: Any, num_rows: int, width: int,
                 *, model, w_DxV, mc: ModelConfig, sc: SamplerConfig,
                 cache_dtype, limit, log_lenience: float | None = None
                 ) -> Any:
  """Starts up to ``num_rows`` waiting rows in free slots (one prefill).

  ``limit``: at most this many rows start (a traced int). The rows' prompts
  (and, ``width > P``, their carried tokens) are prefilled into a fresh
  ``[num_rows, S]`` cache whose rows then replace the chosen slots'. With
  ``log_lenience`` a drafted row (``Queue.verify``) keeps its draft up to
  the first rejected token; a row whose whole draft is kept and ended
  (EOS, stop sequence, or ``T`` tokens) is done at once and takes no slot.
  """
  p = queue.prompt_tokens.shape[1]
  count, valid, row, slot = _starting_rows(state, queue, num_rows, limit)
  paged = isinstance(state.cache, pc.PagedKVCache)
  if paged:  # the slots' blocks: room for the whole prefill
    m = state.live.shape[0]
    claimed, failed_m = slot_pages.claim(
        state.cache, slot_pages.slot_mask(slot, valid, m), width)
    cut = valid & failed_m[jnp.minimum(slot, m - 1)]
    valid = valid & ~cut
    state = state._replace(cache=claimed, kv_peak=jnp.maximum(
        state.kv_peak, pc.blocks_in_use(claimed)))
    fresh_cache = slot_pages.rows(claimed, slot, valid)
  else:
    s = state.cache.mask.shape[1]
    fresh_cache = init_cache(mc, num_rows, s, cache_dtype)
  extra = width - p
  length = jnp.where(valid, queue.length[row], 0) if extra else jnp.zeros(
      (num_rows,), jnp.int32)
  tokens = queue.prompt_tokens[row]
  mask = queue.prompt_mask[row]
  if extra:
    tokens = jnp.concatenate([tokens, queue.tokens[row][:, :extra]], 1)
    mask = jnp.concatenate(
        [mask, jnp.arange(extra)[None] < length[:, None]], 1)
  positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)
  hidden, fresh = model.apply(
      {"params": params}, tokens, positions, fresh_cache,
      input_mask_BxT=mask)
  key_rows = jax.random.wrap_key_data(queue.keys[row])
  live = valid
  q, t = state.tokens.shape
  if log_lenience is not None and extra and queue.verify is not None:
    verify = valid & queue.verify[row]
    draft = queue.tokens[row][:, :extra]
    accepted, sampler_lp, policy_lp = verify_drafts(
        hidden, draft, length, queue.sampler_logprobs[row], key_rows,
        queue.sample[row], p=p, w_DxV=w_DxV, mc=mc, sc=sc,
        log_lenience=log_lenience)
    length = jnp.where(verify, accepted, length)
    kept = jnp.arange(t)[None] < length[:, None]
    out = jnp.where(verify, row, q)  # q: dropped by the scatters
    last = jnp.maximum(length - 1, 0)
    ended = verify & (length > 0) & _ended(
        draft, last, jnp.take_along_axis(draft, last[:, None], 1)[:, 0],
        jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32),
        sc.stop_sequences)
    over = ended | (verify & (length >= t))
    zero = jnp.zeros_like(sampler_lp)
    state = state._replace(
        tokens=state.tokens.at[out].set(
            jnp.where(kept, draft, sc.pad_id), mode="drop"),
        mask=state.mask.at[out].set(kept, mode="drop"),
        sampler_logp=state.sampler_logp.at[out].set(
            jnp.where(kept, sampler_lp, zero), mode="drop"),
        policy_logp=(None if state.policy_logp is None else
                     state.policy_logp.at[out].set(
                         jnp.where(kept, policy_lp, zero), mode="drop")),
        accepted=state.accepted.at[out].set(accepted, mode="drop"),
        done=state.done.at[jnp.where(over, row, q)].set(True, mode="drop"),
        finished=state.finished.at[jnp.where(ended, row, q)].set(
            True, mode="drop"))
    live = valid & ~over
    if not paged:  # (paged: a row reads only slots below its length)
      # Rejected draft slots stay in the cache but are never attended to.
      fresh = fresh._replace(mask=fresh.mask & (
          jnp.arange(s)[None] < (p + length)[:, None]))
  last = jnp.take_along_axis(
      hidden, jnp.minimum(p - 1 + length, width - 1)[:, None, None], 1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  cache = state.cache
  if paged:
    # A row that ended at once (a whole draft kept) or was cut holds no
    # blocks; the others hold those of their prompt and kept tokens.
    cache = slot_pages.set_lengths(slot_pages.merge(cache, fresh),
                                   jnp.where(valid, slot, m), p + length)
    cache = pc.release(cache, slot_pages.slot_mask(slot, valid & ~live, m)
                       | slot_pages.slot_mask(slot, cut, m))
    state = _cut_rows(state, row, cut)
  else:
    layers = tuple(LayerKV(old.k.at[slot].set(new.k, mode="drop"),
                           old.v.at[slot].set(new.v, mode="drop"))
                   for old, new in zip(cache.layers, fresh.layers))
    cache = KVCache(layers, cache.mask.at[slot].set(fresh.mask, mode="drop"),
                    cache.index.at[slot].set(p + length, mode="drop"))
  prompt_len = jnp.sum(queue.prompt_mask[row].astype(jnp.int32), -1)
  # A slot filled with its prompt alone can lend it to later rows
  # (``prefill_shared``); one that holds carried or drafted tokens cannot
  # (its logits follow the tokens, not the prompt).
  held = (masked_prompt(queue, row) if not extra
          else jnp.full((num_rows, p), NO_PROMPT, jnp.int32))
  return state._replace(
      slot_row=state.slot_row.at[slot].set(row, mode="drop"),
      live=state.live.at[slot].set(live, mode="drop"),
      logits=state.logits.at[slot].set(logits, mode="drop"),
      cache=cache,
      column=state.column.at[slot].set(length, mode="drop"),
      position=state.position.at[slot].set(prompt_len + length, mode="drop"),
      keys=state.keys.at[slot].set(key_rows, mode="drop"),
      next_row=state.next_row + count,
      prefills=state.prefills + 1,
      prefilled_rows=state.prefilled_rows + count,
      slot_prompt=state.slot_prompt.at[slot].set(held, mode="drop"),
      prompt_logits=(state.prompt_logits if extra else
                     state.prompt_logits.at[slot].set(logits, mode="drop")))


def _cut_rows(state: Any, row: jax.Array, cut: jax.Array) -> Any:
  """Queue rows ``row`` where ``cut``: ended before their first token (no
  free block for their prompt), and counted."""
  q = state.done.shape[0]
  return state._replace(
      done=state.done.at[jnp.where(cut, row, q)].set(True, mode="drop"),
      kv_cut=state.kv_cut + jnp.sum(cut).astype(jnp.int32))


NO_PROMPT = -2  # a slot_prompt row no prompt equals (masked tokens are -1)


def masked_prompt(queue: Any, row: jax.Array) -> jax.Array:
  """``[R, P]``: the rows' prompt tokens, -1 at masked (padding) slots."""
  return jnp.where(queue.prompt_mask[row], queue.prompt_tokens[row], -1)


def prefill_shared(params, state: Any, queue: Any, num_rows: int, *,
                 leaders: int, model, w_DxV, mc: ModelConfig,
                 sc: SamplerConfig, cache_dtype, limit, **unused) -> Any:
  """``prefill_rows`` of prompts alone (no carried tokens, no drafts), sharing
  each distinct prompt's forward (``SlotConfig.share_prompts``).

  A starting row whose prompt a live slot holds copies that slot's prompt
  KV and first-token logits (a live slot is never refilled, so it is a
  safe source); of the other rows, the first with each prompt (the
  leader) is prefilled and the rest copy it. The leaders run in chunks of
  ``leaders`` rows, one forward per chunk in a ``fori_loop`` (none runs
  when every row copies; a fill with more distinct prompts than one per
  ``G`` rows runs more chunks), so the program traces one forward.
  Each row's KV and logits are what its own prefill would give: the
  prompt's keys and values depend on the prompt alone.
  """
  del unused
  if isinstance(state.cache, pc.PagedKVCache):
    return _prefill_shared_paged(params, state, queue, num_rows,
                                 leaders=leaders, model=model, w_DxV=w_DxV,
                                 mc=mc, limit=limit)
  p, s = queue.prompt_tokens.shape[1], state.cache.mask.shape[1]
  count, valid, row, slot = _starting_rows(state, queue, num_rows, limit)
  prompt, from_slot, donor, first, leader = _shared_plan(state, queue, row,
                                                         valid)
  num_leaders = jnp.sum(leader)

  # The leaders, in chunks of ``leaders`` rows: one traced forward, run
  # once per chunk (none when every row copies). A fill of groups cut by
  # its edges has more distinct prompts than one per ``G`` rows: more
  # chunks, still only the leaders' rows. Each chunk writes its leaders'
  # prompt KV straight into the slots of the rows that take it (theirs
  # and their followers'), so no buffer holds every leader's.
  m = state.live.shape[0]
  chunks = -(-num_rows // leaders)
  lead = jnp.nonzero(leader, size=chunks * leaders, fill_value=0)[0]
  rank = jnp.cumsum(leader) - 1  # a leader's index in ``lead``
  source = rank[first]  # each row's leader, for rows that do not copy
  prompt_slots = jnp.arange(s) < p
  keep = prompt_slots[None, None, :, None]

  def forward(c, out):
    layers, masks, logits = out
    start = c * leaders
    lead_row = row[jax.lax.dynamic_slice_in_dim(lead, start, leaders)]
    mask = queue.prompt_mask[lead_row]
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)
    hidden, fresh = model.apply(
        {"params": params}, queue.prompt_tokens[lead_row], positions,
        init_cache(mc, leaders, s, cache_dtype), input_mask_BxT=mask)
    lead_logits = compute_logits(hidden[:, p - 1:p], w_DxV,
                                 mc.final_logit_softcap)[:, 0]
    local = source - start
    mine = valid & ~from_slot & (local >= 0) & (local < leaders)
    local = jnp.clip(local, 0, leaders - 1)
    target = jnp.where(mine, slot, m)  # m: dropped by the scatters

    def put(old, new):
      return old.at[target].set(
          jnp.where(keep, new[local], jnp.zeros((), new.dtype)), mode="drop")
    return (tuple(LayerKV(put(o.k, n.k), put(o.v, n.v))
                  for o, n in zip(layers, fresh.layers)),
            masks.at[target].set(fresh.mask[local], mode="drop"),
            jnp.where(mine[:, None], lead_logits[local], logits))

  cache = state.cache
  layers, cache_mask, logits = jax.lax.fori_loop(
      0, -(-num_leaders // leaders), forward,
      (cache.layers, cache.mask,
       jnp.zeros((num_rows, mc.vocab_size), jnp.float32)))
  # Rows whose prompt a live slot holds copy it (a live slot is never a
  # fill's target, so the chunks above left it as it was).
  donor_slot = jnp.where(from_slot, slot, m)
  copy_kv = lambda old: old.at[donor_slot].set(  # noqa: E731
      jnp.where(keep, old[donor], jnp.zeros((), old.dtype)), mode="drop")
  layers = tuple(LayerKV(copy_kv(kv.k), copy_kv(kv.v)) for kv in layers)
  cache_mask = cache_mask.at[donor_slot].set(
      cache_mask[donor] & prompt_slots, mode="drop")
  cache = KVCache(layers, cache_mask,
                  cache.index.at[slot].set(p, mode="drop"))
  logits = jnp.where(from_slot[:, None], state.prompt_logits[donor], logits)
  return _started(state, queue, row, slot, valid, logits, cache, count,
                  num_leaders, prompt)


def _started(state: Any, queue: Any, row, slot, live, logits, cache, count,
             prefilled, prompt) -> Any:
  """The state after a fill of prompts alone: queue rows ``row`` in slots
  ``slot`` (``live`` where they decode), their first-token ``logits``, the
  filled ``cache``, ``count`` rows taken from the queue, ``prefilled`` of
  them run through the decoder; each live slot lends its ``prompt``."""
  prompt_len = jnp.sum(queue.prompt_mask[row].astype(jnp.int32), -1)
  return state._replace(
      slot_row=state.slot_row.at[slot].set(row, mode="drop"),
      live=state.live.at[slot].set(live, mode="drop"),
      logits=state.logits.at[slot].set(logits, mode="drop"),
      cache=cache,
      column=state.column.at[slot].set(0, mode="drop"),
      position=state.position.at[slot].set(prompt_len, mode="drop"),
      keys=state.keys.at[slot].set(
          jax.random.wrap_key_data(queue.keys[row]), mode="drop"),
      next_row=state.next_row + count,
      prefills=state.prefills + 1,
      prefilled_rows=state.prefilled_rows + prefilled,
      slot_prompt=state.slot_prompt.at[slot].set(
          jnp.where(live[:, None], prompt, NO_PROMPT), mode="drop"),
      prompt_logits=state.prompt_logits.at[slot].set(logits, mode="drop"))


def _shared_plan(state: Any, queue: Any, row, valid):
  """Which starting rows copy a live slot's prompt (``from_slot``, from
  slot ``donor``), which lead their prompt in the fill (``leader``), and
  each row's first row of its prompt (``first``)."""
  r = jnp.arange(row.shape[0])
  prompt = masked_prompt(queue, row)
  same_slot = jnp.all(prompt[:, None] == state.slot_prompt[None], -1)
  same_slot &= state.live[None]
  from_slot = valid & jnp.any(same_slot, 1)
  donor = jnp.argmax(same_slot, 1)
  first = jnp.argmax(jnp.all(prompt[:, None] == prompt[None], -1), 1)
  leader = valid & ~from_slot & (first == r)
  return prompt, from_slot, donor, first, leader


def _prefill_shared_paged(params, state: Any, queue: Any, num_rows: int, *,
                          leaders: int, model, w_DxV, mc: ModelConfig,
                          limit) -> Any:
  """``prefill_shared`` on a paged cache (``slot_pages``): the leaders'
  prompts are prefilled into their slots' blocks, in chunks of ``leaders``
  rows; every other row points to its leader's, or a live slot's, prompt
  blocks (no key or value is copied until it writes). A leader that finds
  no free block is cut, with the rows that would share its prompt."""
  p = queue.prompt_tokens.shape[1]
  m = state.live.shape[0]
  count, valid, row, slot = _starting_rows(state, queue, num_rows, limit)
  prompt, from_slot, donor, first, leader = _shared_plan(state, queue, row,
                                                         valid)
  num_leaders = jnp.sum(leader)
  cache, failed_m = slot_pages.claim(
      state.cache, slot_pages.slot_mask(slot, leader, m), p)
  peak = jnp.maximum(state.kv_peak, pc.blocks_in_use(cache))
  lead_failed = leader & failed_m[jnp.minimum(slot, m - 1)]
  # A row that does not copy a live slot shares its prompt's first row's.
  cut = valid & ~from_slot & lead_failed[first]
  chunks = -(-num_rows // leaders)
  lead = jnp.nonzero(leader, size=chunks * leaders, fill_value=0)[0]
  rank = jnp.cumsum(leader) - 1
  source = rank[first]

  def forward(c, out):
    cache, logits = out
    start = c * leaders
    idx = jax.lax.dynamic_slice_in_dim(lead, start, leaders)
    ok = (start + jnp.arange(leaders)) < num_leaders
    lead_row = row[idx]
    mask = queue.prompt_mask[lead_row]
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)
    hidden, fresh = model.apply(
        {"params": params}, queue.prompt_tokens[lead_row], positions,
        slot_pages.rows(cache, slot[idx], ok & ~lead_failed[idx]),
        input_mask_BxT=mask)
    lead_logits = compute_logits(hidden[:, p - 1:p], w_DxV,
                                 mc.final_logit_softcap)[:, 0]
    local = source - start
    mine = valid & ~from_slot & (local >= 0) & (local < leaders)
    local = jnp.clip(local, 0, leaders - 1)
    return (slot_pages.merge(cache, fresh),
            jnp.where(mine[:, None], lead_logits[local], logits))

  cache, logits = jax.lax.fori_loop(
      0, -(-num_leaders // leaders), forward,
      (cache, jnp.zeros((num_rows, mc.vocab_size), jnp.float32)))
  cache = slot_pages.set_lengths(cache, jnp.where(leader, slot, m),
                                 jnp.full((num_rows,), p, jnp.int32))
  # Followers point to their leader's blocks, rows whose prompt a live
  # slot holds to that slot's (a live slot is never a fill's target).
  follower = valid & ~from_slot & ~leader
  cache = slot_pages.share(cache, slot, slot[first], follower, p)
  cache = slot_pages.share(cache, slot, donor, from_slot, p)
  cache = pc.release(cache, slot_pages.slot_mask(slot, cut, m))
  state = _cut_rows(state._replace(kv_peak=peak), row, cut)
  logits = jnp.where(from_slot[:, None], state.prompt_logits[donor], logits)
  return _started(state, queue, row, slot, valid & ~cut, logits, cache, count,
                  num_leaders, prompt)


__all__ = ["ACCEPT_FOLD", "NO_PROMPT", "accept_draft", "masked_prompt",
           "prefill_rows", "prefill_shared", "verify_drafts"]
