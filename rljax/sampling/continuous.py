"""Continuous batching: a fixed number of row slots, refilled as rows end.

The static sampler (``sampler.sample``) decodes a batch until its last row
has ended; rows that ended earlier keep their slot and keep computing. Here
the rows wait in a ``Queue`` and ``M`` slots decode them: when enough slots
are free, the next waiting rows are prefilled into them inside the same
``lax.while_loop``, so shapes never change and nothing recompiles, whatever
the lengths. The queue is ``Q`` rows, any ``Q``; ``M < Q`` is the point.

Layout. Each slot has its own KV cache row of ``S = P + T`` slots (prompt
bucket plus ``max_new_tokens``) written at its own index (``KVCache.index``
``[M]``). Rows of a group end and start at different times, so their slots
are not contiguous and cannot read one shared prefix; instead a fill of
prompts runs the decoder once per distinct prompt that no live slot holds
and copies the prompt's KV into the other rows' slots
(``SlotConfig.share_prompts``, ``_fill_shared``): a group costs one prompt
forward, not ``G``. Rows that already hold tokens (a partial row carried from an earlier
call, APRIL's partial rollouts) prefill prompt and tokens together and go on
from there: their tokens are never re-sampled.

Draws. Row ``q``'s token at completion column ``j`` is drawn with
``fold_in(keys[q], j)`` (``sampler.row_keys``/``token_keys``), the key the
static sampler gives that row, so with ``keys = row_keys(key, N)`` every row
is the row the static sampler draws (``tests/test_continuous.py``; logits
may differ in the last bits, since a slot's cache is laid out differently).

Stopping. The loop runs until every queued row has ended, or until
``target_groups`` groups (rows with the same ``Queue.group``) have all
their rows ended (partial rollouts: the rows still decoding are returned
unfinished, with ``done`` False, to be continued later).

References:
  Yu et al., "Orca: A Distributed Serving System for Transformer-Based
  Generative Models" (iteration-level scheduling), OSDI 2022.
  Zhou et al., "APRIL: Active Partial Rollouts in Reinforcement Learning to
  Tame Long-tail Generation", https://arxiv.org/abs/2509.18521.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax.models import ModelConfig, compute_logits, init_cache
from rljax.models.kv_cache import KVCache, LayerKV
from rljax.sampling.sampler import (SamplerConfig, _ended, fused_logprobs,
                                    pick_logprob, decode_setup, sampled_logprobs,
                                    token_keys)


class Queue(NamedTuple):
  """Rows waiting for a slot, in the order they start (``Q`` rows).

  Rows to decode come first (``num_pending`` of them); the rest are rows
  that have already ended (a carried group's finished rows) or padding:
  they take no slot but count towards their group.

  Attributes:
    prompt_tokens: ``[Q, P]`` int32, left-padded prompts.
    prompt_mask: ``[Q, P]`` bool.
    tokens: ``[Q, T]`` int32, completion tokens already generated (carried
      rows), ``pad_id`` after them.
    length: ``[Q]`` int32, how many (0 for a new row).
    sampler_logprobs: ``[Q, T]`` fp32 of those tokens.
    policy_logprobs: ``[Q, T]`` fp32, or None (the sampler records none).
    keys: ``[Q, 2]`` uint32, each row's key data (``sampler.row_keys``).
    sample: ``[Q]`` int32, the row's sample index in its group
      (``SamplingMethod.greedy_every`` reads it).
    group: ``[Q]`` int32 in ``[0, Q]``; ``Q`` marks padding (no group).
    done: ``[Q]`` bool, the row has ended already.
    finished: ``[Q]`` bool, ended by EOS or a stop sequence.
    num_pending: ``[]`` int32, rows to decode (the first ones).
    verify: ``[Q]`` bool or None: the row's tokens are a SPEC-RL draft
      (``sampler_logprobs``: their logprobs when drawn), verified when the
      row is prefilled (``SlotConfig.log_lenience``) and kept up to the
      first rejected token.
  """

  prompt_tokens: Any
  prompt_mask: Any
  tokens: Any
  length: Any
  sampler_logprobs: Any
  policy_logprobs: Any
  keys: Any
  sample: Any
  group: Any
  done: Any
  finished: Any
  num_pending: Any
  verify: Any = None


class SlotRollout(NamedTuple):
  """What ``continuous_sample`` returns, one row per queue row.

  Attributes:
    completion_tokens: ``[Q, T]`` int32 (carried tokens included).
    completion_mask: ``[Q, T]`` bool.
    lengths: ``[Q]`` int32.
    finished: ``[Q]`` bool, ended by EOS or a stop sequence.
    done: ``[Q]`` bool, ended (finished or ``max_new_tokens`` reached);
      False: still partial (stopped at ``target_groups``, or never started).
    policy_logprobs: ``[Q, T]`` fp32 or None.
    sampler_logprobs: ``[Q, T]`` fp32.
    decode_steps: ``[]`` int32, decode steps run.
    kept_tokens: ``[]`` int32, tokens generated (slot-steps that kept one):
      slot utilisation is ``kept_tokens / (decode_steps * M)``.
    prefills: ``[]`` int32, prefill calls (the first fill and refills).
    prefilled_rows: ``[]`` int32, rows those calls ran through the decoder
      (with ``SlotConfig.share_prompts``, one per distinct prompt that no
      live slot held; else one per started row).
    accepted: ``[Q]`` int32, draft tokens kept (rows with ``verify``).
    started: ``[Q]`` bool, the row was prefilled into a slot (a row not
      started is returned as queued, its draft unverified).
  """

  completion_tokens: jax.Array
  completion_mask: jax.Array
  lengths: jax.Array
  finished: jax.Array
  done: jax.Array
  policy_logprobs: jax.Array | None
  sampler_logprobs: jax.Array
  decode_steps: jax.Array
  kept_tokens: jax.Array
  prefills: jax.Array
  prefilled_rows: jax.Array
  accepted: jax.Array
  started: jax.Array


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """Static settings of continuous batching.

  Attributes:
    slots: ``M``, rows decoded at once.
    refill_rows: ``R``, rows prefilled per refill; a refill runs when ``R``
      slots are free (or every waiting row fits the free slots). Larger
      ``R``: fewer, bigger prefills, slots idle longer.
    carried: whether the queue may hold rows with tokens (partial rows);
      they are prefilled with their tokens, at width ``P + T``, and must all
      fit the first fill (be among the first ``M`` rows).
    log_lenience: SPEC-RL drafts (``Queue.verify``): every prefill is
      ``P + T`` wide and verifies a drafted row's tokens with the rule of
      ``sampling.speculative`` (accept ``y_j`` with probability
      ``min(1, e^log_lenience p_new / p_old)``, the kept tokens' sampler
      logprobs are ``p_new``'s), so a row whose draft is rejected early
      decodes in its own slot and no longer holds the batch. None: off.
    share_prompts: a prefill of prompts alone (no carried tokens, no
      drafts) runs the decoder once per distinct prompt among its rows that
      no live slot already holds, and copies each other row's prompt KV
      (and first-token logits) from a slot that holds its prompt: a group
      of ``G`` rows costs one prompt forward instead of ``G``. False: every
      row prefills its own prompt (the baseline ``launch/bench_rollout.py``
      times it against).
  """

  slots: int
  refill_rows: int = 1
  carried: bool = False
  log_lenience: float | None = None
  share_prompts: bool = True

  def __post_init__(self):
    for name in ("slots", "refill_rows"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"rl.rollout_{name}={value!r}: a positive integer "
                         "is required.")
    if self.log_lenience is not None and not self.log_lenience >= 0:
      raise ValueError(f"sampler.spec_log_lenience={self.log_lenience!r}: a "
                       "number >= 0 is required.")
    if self.refill_rows > self.slots:
      raise ValueError(f"rl.rollout_refill_rows={self.refill_rows} is more "
                       f"than rl.rollout_slots={self.slots}: at most the "
                       "number of slots.")


class _State(NamedTuple):
  slot_row: jax.Array      # [M] int32, queue row in the slot (Q: none)
  live: jax.Array          # [M] bool
  logits: jax.Array        # [M, V] fp32, predicting each slot's next token
  cache: KVCache           # [M, K, S, H] per layer, index [M]
  column: jax.Array        # [M] int32, completion column of the next token
  position: jax.Array      # [M] int32, position of the next token
  keys: jax.Array          # [M] typed keys of the slots' rows
  tokens: jax.Array        # [Q, T] int32
  mask: jax.Array          # [Q, T] bool
  sampler_logp: jax.Array  # [Q, T]
  policy_logp: jax.Array | None
  done: jax.Array          # [Q] bool
  finished: jax.Array      # [Q] bool
  next_row: jax.Array      # [] int32, next queue row to start
  steps: jax.Array         # [] int32
  kept: jax.Array          # [] int32
  prefills: jax.Array      # [] int32
  prefilled_rows: jax.Array  # [] int32, rows run through the decoder
  accepted: jax.Array      # [Q] int32, draft tokens kept
  slot_prompt: jax.Array   # [M, P] int32: the prompt whose KV the slot's
                           # first P cache slots hold (-1 where masked),
                           # _NO_PROMPT where none can be shared
  prompt_logits: jax.Array  # [M, V] fp32, the logits after that prompt


def accept_draft(logits_RxTxV, tokens_RxT, length_R, old_lp_RxT, log_u_RxT,
                 sample_R, *, sc: SamplerConfig, log_lenience: float):
  """SPEC-RL's acceptance of drafted tokens (``sampling.speculative``):
  ``(accepted_R, sampler_lp_RxT, policy_lp_RxT)``. ``logits_RxTxV[:, j]``
  predicts draft token ``j``; ``length_R`` draft tokens are real;
  ``log_u_RxT``: the uniforms' logs of the rule; ``sample_R``: each row's
  sample index in its group (ReMax's greedy row accepts argmax tokens
  only). Shared by the slots (``_verify``) and the multi-turn rollout
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


def _verify(hidden_RxWxD, tokens_RxT, length_R, old_lp_RxT, key_rows, sample_R,
            *, p: int, w_DxV, mc: ModelConfig, sc: SamplerConfig,
            log_lenience: float):
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


def _fill(params, state: _State, queue: Queue, num_rows: int, width: int, *,
          model, w_DxV, mc: ModelConfig, sc: SamplerConfig, cache_dtype,
          limit, log_lenience: float | None = None) -> _State:
  """Starts up to ``num_rows`` waiting rows in free slots (one prefill).

  ``limit``: at most this many rows start (a traced int). The rows' prompts
  (and, ``width > P``, their carried tokens) are prefilled into a fresh
  ``[num_rows, S]`` cache whose rows then replace the chosen slots'. With
  ``log_lenience`` a drafted row (``Queue.verify``) keeps its draft up to
  the first rejected token; a row whose whole draft is kept and ended
  (EOS, stop sequence, or ``T`` tokens) is done at once and takes no slot.
  """
  q, p = queue.prompt_tokens.shape
  m, s = state.live.shape[0], state.cache.mask.shape[1]
  free = ~state.live
  count = jnp.minimum(jnp.minimum(jnp.sum(free), limit),
                      queue.num_pending - state.next_row)
  r = jnp.arange(num_rows)
  valid = r < count
  slot = jnp.where(valid, jnp.argsort(state.live, stable=True)[
      jnp.minimum(r, m - 1)], m)  # m: dropped by the scatters below
  row = jnp.minimum(state.next_row + r, q - 1)
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
      {"params": params}, tokens, positions,
      init_cache(mc, num_rows, s, cache_dtype), input_mask_BxT=mask)
  key_rows = jax.random.wrap_key_data(queue.keys[row])
  live = valid
  q, t = state.tokens.shape
  if log_lenience is not None and extra and queue.verify is not None:
    verify = valid & queue.verify[row]
    draft = queue.tokens[row][:, :extra]
    accepted, sampler_lp, policy_lp = _verify(
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
    # Rejected draft slots stay in the cache but are never attended to.
    fresh = fresh._replace(mask=fresh.mask & (
        jnp.arange(s)[None] < (p + length)[:, None]))
  last = jnp.take_along_axis(
      hidden, jnp.minimum(p - 1 + length, width - 1)[:, None, None], 1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  cache = state.cache
  layers = tuple(LayerKV(old.k.at[slot].set(new.k, mode="drop"),
                         old.v.at[slot].set(new.v, mode="drop"))
                 for old, new in zip(cache.layers, fresh.layers))
  cache = KVCache(layers, cache.mask.at[slot].set(fresh.mask, mode="drop"),
                  cache.index.at[slot].set(p + length, mode="drop"))
  prompt_len = jnp.sum(queue.prompt_mask[row].astype(jnp.int32), -1)
  # A slot filled with its prompt alone can lend it to later rows
  # (``_fill_shared``); one that holds carried or drafted tokens cannot
  # (its logits follow the tokens, not the prompt).
  held = (_masked_prompt(queue, row) if not extra
          else jnp.full((num_rows, p), _NO_PROMPT, jnp.int32))
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


_NO_PROMPT = -2  # a slot_prompt row no prompt equals (masked tokens are -1)


def _masked_prompt(queue: Queue, row: jax.Array) -> jax.Array:
  """``[R, P]``: the rows' prompt tokens, -1 at masked (padding) slots."""
  return jnp.where(queue.prompt_mask[row], queue.prompt_tokens[row], -1)


def _fill_shared(params, state: _State, queue: Queue, num_rows: int, *,
                 leaders: int, model, w_DxV, mc: ModelConfig,
                 sc: SamplerConfig, cache_dtype, limit, **unused) -> _State:
  """``_fill`` of prompts alone (no carried tokens, no drafts), sharing
  each distinct prompt's forward (``SlotConfig.share_prompts``).

  A starting row whose prompt a live slot holds copies that slot's prompt
  KV and first-token logits (a live slot is never refilled, so it is a
  safe source); of the other rows, the first with each prompt (the
  leader) is prefilled and the rest copy it. Up to ``leaders`` leaders
  run in one forward of ``leaders`` rows (none runs when every row
  copies); more fall back to ``_fill``'s forward of every row. Each row's
  KV and logits are what its own prefill would give: the prompt's keys
  and values depend on the prompt alone.
  """
  del unused
  q, p = queue.prompt_tokens.shape
  m, s = state.live.shape[0], state.cache.mask.shape[1]
  count = jnp.minimum(jnp.minimum(jnp.sum(~state.live), limit),
                      queue.num_pending - state.next_row)
  r = jnp.arange(num_rows)
  valid = r < count
  row = jnp.minimum(state.next_row + r, q - 1)
  prompt = _masked_prompt(queue, row)
  same_slot = jnp.all(prompt[:, None] == state.slot_prompt[None], -1)
  same_slot &= state.live[None]
  from_slot = valid & jnp.any(same_slot, 1)
  donor = jnp.argmax(same_slot, 1)
  first = jnp.argmax(jnp.all(prompt[:, None] == prompt[None], -1), 1)
  leader = valid & ~from_slot & (first == r)
  num_leaders = jnp.sum(leader)

  def shared(state: _State) -> _State:
    lead = jnp.nonzero(leader, size=leaders, fill_value=0)[0]
    rank = jnp.cumsum(leader) - 1  # a leader's index in ``lead``
    lead_row = row[lead]

    def forward(_):
      mask = queue.prompt_mask[lead_row]
      positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)
      hidden, fresh = model.apply(
          {"params": params}, queue.prompt_tokens[lead_row], positions,
          init_cache(mc, leaders, s, cache_dtype), input_mask_BxT=mask)
      logits = compute_logits(hidden[:, p - 1:p], w_DxV,
                              mc.final_logit_softcap)[:, 0]
      return fresh.layers, fresh.mask, logits

    def nothing(_):
      shape = (leaders, mc.num_kv_heads, s, mc.head_dim)
      return (tuple(LayerKV(jnp.zeros(shape, cache_dtype),
                            jnp.zeros(shape, cache_dtype))
                    for _ in range(mc.num_layers)),
              jnp.zeros((leaders, s), jnp.bool_),
              jnp.zeros((leaders, mc.vocab_size), jnp.float32))

    fresh_layers, fresh_mask, lead_logits = jax.lax.cond(
        num_leaders > 0, forward, nothing, None)
    source = rank[first]  # each row's leader, for rows that do not copy
    prompt_slots = jnp.arange(s) < p
    copy = from_slot[:, None, None, None]
    keep = prompt_slots[None, None, :, None]

    def rows_of(slot_kv, lead_kv):
      kv = jnp.where(copy, slot_kv[donor], lead_kv[source])
      return jnp.where(keep, kv, jnp.zeros((), kv.dtype))

    slot = jnp.where(valid, jnp.argsort(state.live, stable=True)[
        jnp.minimum(r, m - 1)], m)  # m: dropped by the scatters below
    cache = state.cache
    layers = tuple(
        LayerKV(old.k.at[slot].set(rows_of(old.k, new.k), mode="drop"),
                old.v.at[slot].set(rows_of(old.v, new.v), mode="drop"))
        for old, new in zip(cache.layers, fresh_layers))
    mask = jnp.where(from_slot[:, None], cache.mask[donor] & prompt_slots,
                     fresh_mask[source])
    cache = KVCache(layers, cache.mask.at[slot].set(mask, mode="drop"),
                    cache.index.at[slot].set(p, mode="drop"))
    logits = jnp.where(from_slot[:, None], state.prompt_logits[donor],
                       lead_logits[source])
    prompt_len = jnp.sum(queue.prompt_mask[row].astype(jnp.int32), -1)
    return state._replace(
        slot_row=state.slot_row.at[slot].set(row, mode="drop"),
        live=state.live.at[slot].set(valid, mode="drop"),
        logits=state.logits.at[slot].set(logits, mode="drop"),
        cache=cache,
        column=state.column.at[slot].set(0, mode="drop"),
        position=state.position.at[slot].set(prompt_len, mode="drop"),
        keys=state.keys.at[slot].set(
            jax.random.wrap_key_data(queue.keys[row]), mode="drop"),
        next_row=state.next_row + count,
        prefills=state.prefills + 1,
        prefilled_rows=state.prefilled_rows + num_leaders,
        slot_prompt=state.slot_prompt.at[slot].set(prompt, mode="drop"),
        prompt_logits=state.prompt_logits.at[slot].set(logits, mode="drop"))

  def every_row(state: _State) -> _State:
    return _fill(params, state, queue, num_rows, p, model=model, w_DxV=w_DxV,
                 mc=mc, sc=sc, cache_dtype=cache_dtype, limit=limit)

  return jax.lax.cond(num_leaders <= leaders, shared, every_row, state)


def _step(params, state: _State, queue: Queue, *, model, w_DxV,
          mc: ModelConfig, sc: SamplerConfig) -> _State:
  """One decode step of every live slot; ended rows free their slot."""
  q, t = state.tokens.shape
  live = state.live
  row = jnp.where(live, state.slot_row, q)  # q: dropped by the scatters
  safe_row = jnp.minimum(state.slot_row, q - 1)
  token, sampler_logp = sc.method.get_next_tokens(
      state.logits, token_keys(state.keys, state.column),
      queue.sample[safe_row])
  token = jnp.where(live, token, sc.pad_id)
  column = jnp.minimum(state.column, t - 1)
  tokens = state.tokens.at[row, column].set(token, mode="drop")
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  window = tokens[safe_row] if sc.stop_sequences else None
  ended = live & _ended(window, column, token, eos, sc.stop_sequences)
  policy_logp = state.policy_logp
  if policy_logp is not None:
    lp = (sampler_logp if fused_logprobs(sc) else pick_logprob(
        jax.nn.log_softmax(state.logits / sc.training_temperature, -1), token))
    policy_logp = policy_logp.at[row, column].set(lp, mode="drop")
  hidden, cache = model.apply(
      {"params": params}, token[:, None], state.position[:, None],
      state.cache, input_mask_BxT=live[:, None])
  cache = cache._replace(index=state.cache.index + live.astype(jnp.int32))
  logits = compute_logits(hidden, w_DxV, mc.final_logit_softcap)[:, 0]
  new_column = state.column + live.astype(jnp.int32)
  ending = live & (ended | (new_column >= t))
  end_row = jnp.where(ending, state.slot_row, q)
  return state._replace(
      live=live & ~ending,
      logits=sharding.constrain(logits, ("batch", "act_vocab")),
      cache=cache, column=new_column,
      position=state.position + live.astype(jnp.int32),
      tokens=tokens,
      mask=state.mask.at[row, column].set(True, mode="drop"),
      sampler_logp=state.sampler_logp.at[row, column].set(sampler_logp,
                                                          mode="drop"),
      policy_logp=policy_logp,
      done=state.done.at[end_row].set(True, mode="drop"),
      finished=state.finished.at[end_row].set(ended, mode="drop"),
      steps=state.steps + 1,
      kept=state.kept + jnp.sum(live.astype(jnp.int32)))


def complete_groups(done_Q: jax.Array, group_Q: jax.Array) -> jax.Array:
  """How many groups (``group_Q`` ids below ``Q``) have every row done."""
  q = done_Q.shape[0]
  size = jax.ops.segment_sum(jnp.ones((q,), jnp.int32), group_Q, q + 1)
  ended = jax.ops.segment_sum(done_Q.astype(jnp.int32), group_Q, q + 1)
  return jnp.sum((size[:q] > 0) & (ended[:q] == size[:q]))


def _continuous_impl(params, queue: Queue, target_groups, *,
                     model_config: ModelConfig, config: SamplerConfig,
                     slots: SlotConfig) -> SlotRollout:
  mc, sc = model_config, config
  q, p = queue.prompt_tokens.shape
  t, m = sc.max_new_tokens, slots.slots
  queue = queue._replace(prompt_mask=queue.prompt_mask.astype(jnp.bool_))
  model, w_DxV, cache_dtype, _ = decode_setup(params, queue.prompt_mask[:1], mc, sc)
  cache = init_cache(mc, m, p + t, cache_dtype)
  cache = cache._replace(index=jnp.zeros((m,), jnp.int32))
  state = _State(
      slot_row=jnp.full((m,), q, jnp.int32), live=jnp.zeros((m,), jnp.bool_),
      logits=jnp.zeros((m, mc.vocab_size), jnp.float32), cache=cache,
      column=jnp.zeros((m,), jnp.int32), position=jnp.zeros((m,), jnp.int32),
      keys=jax.random.wrap_key_data(jnp.zeros((m, 2), jnp.uint32)),
      tokens=queue.tokens, mask=jnp.arange(t)[None] < queue.length[:, None],
      sampler_logp=queue.sampler_logprobs,
      policy_logp=(queue.policy_logprobs if sc.record_policy_logprobs
                   else None),
      done=queue.done, finished=queue.finished,
      next_row=jnp.zeros((), jnp.int32), steps=jnp.zeros((), jnp.int32),
      kept=jnp.zeros((), jnp.int32), prefills=jnp.zeros((), jnp.int32),
      prefilled_rows=jnp.zeros((), jnp.int32),
      accepted=jnp.zeros((q,), jnp.int32),
      slot_prompt=jnp.full((m, p), _NO_PROMPT, jnp.int32),
      prompt_logits=jnp.zeros((m, mc.vocab_size), jnp.float32))
  if state.policy_logp is None and sc.record_policy_logprobs:
    raise ValueError("the queue has no policy_logprobs but the sampler "
                     "records them.")
  kw = dict(model=model, w_DxV=w_DxV, mc=mc, sc=sc)
  drafts = slots.log_lenience is not None
  fill = functools.partial(_fill, cache_dtype=cache_dtype,
                           log_lenience=slots.log_lenience, **kw)

  def fill_rows(state, num_rows, width):
    """A fill of ``num_rows``: shared prompts where only prompts are
    prefilled, with room for one leader per group of ``G`` rows (a fill
    starts at a multiple of the refill size, so groups of ``G`` rows are
    cut by its edges only when neither divides the other; then
    ``_fill_shared`` may fall back to a prefill per row)."""
    if slots.share_prompts and width == p:
      leaders = min(num_rows, -(-num_rows // sc.num_samples))
      return _fill_shared(params, state, queue, num_rows, leaders=leaders,
                          cache_dtype=cache_dtype, limit=num_rows, **kw)
    return fill(params, state, queue, num_rows, width, limit=num_rows)

  state = fill_rows(state, m, p + (t if slots.carried or drafts else 0))
  r = slots.refill_rows
  refill_width = p + (t if drafts else 0)

  def body(state: _State) -> _State:
    waiting = queue.num_pending - state.next_row
    free = jnp.sum(~state.live)
    ready = (waiting > 0) & (free >= jnp.minimum(r, waiting))
    state = jax.lax.cond(
        ready, lambda s: fill_rows(s, r, refill_width),
        lambda s: s, state)
    # No decode step while every slot is empty (rows a prefill ended: whole
    # drafts kept); the next iteration refills.
    return jax.lax.cond(jnp.any(state.live),
                        lambda s: _step(params, s, queue, **kw),
                        lambda s: s, state)

  def more(state: _State) -> jax.Array:
    busy = jnp.any(state.live) | (state.next_row < queue.num_pending)
    return busy & (complete_groups(state.done, queue.group) < target_groups)

  state = jax.lax.while_loop(more, body, state)
  return SlotRollout(
      completion_tokens=state.tokens, completion_mask=state.mask,
      lengths=state.mask.sum(-1).astype(jnp.int32), finished=state.finished,
      done=state.done, policy_logprobs=state.policy_logp,
      sampler_logprobs=state.sampler_logp, decode_steps=state.steps,
      kept_tokens=state.kept, prefills=state.prefills,
      prefilled_rows=state.prefilled_rows, accepted=state.accepted, started=jnp.arange(q) < state.next_row)


def make_continuous_sampler(model_config: ModelConfig, config: SamplerConfig,
                            slots: SlotConfig,
                            mesh: jax.sharding.Mesh | None = None,
                            param_shardings: Any = None):
  """A jitted ``fn(params, queue, target_groups) -> SlotRollout``.

  With a mesh the params take ``param_shardings`` and the queue and the
  outputs are replicated (the slots' arrays are laid out by the compiler).
  ``target_groups``: stop once that many groups have ended (a Python or
  traced int; the number of groups: run every row to its end).
  """
  fn = functools.partial(_continuous_impl, model_config=model_config,
                         config=config, slots=slots)
  if mesh is None:
    return jax.jit(fn)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  jitted = jax.jit(fn, in_shardings=(param_shardings, replicated, replicated),
                   out_shardings=replicated)

  def call(params, queue, target_groups):
    with jax.set_mesh(mesh):
      return jitted(params, queue, target_groups)
  call.jitted = jitted
  return call


def fresh_queue(prompt_tokens_BxP: np.ndarray, prompt_mask_BxP: np.ndarray,
                key: jax.Array, config: SamplerConfig,
                policy_logprobs: bool | None = None) -> Queue:
  """The queue of ``B * G`` new rows, group-contiguous as the static
  sampler's, each with the static sampler's row key (``row_keys``)."""
  from rljax.sampling.sampler import row_keys  # pylint: disable=g-import-not-at-top
  g, t = config.num_samples, config.max_new_tokens
  b = prompt_tokens_BxP.shape[0]
  n = b * g
  record = (config.record_policy_logprobs if policy_logprobs is None
            else policy_logprobs)
  zeros = np.zeros((n, t), np.float32)
  return Queue(
      prompt_tokens=np.repeat(np.asarray(prompt_tokens_BxP, np.int32), g, 0),
      prompt_mask=np.repeat(np.asarray(prompt_mask_BxP, bool), g, 0),
      tokens=np.full((n, t), config.pad_id, np.int32),
      length=np.zeros((n,), np.int32), sampler_logprobs=zeros,
      policy_logprobs=zeros.copy() if record else None,
      keys=np.asarray(jax.random.key_data(row_keys(key, n))),
      sample=np.tile(np.arange(g, dtype=np.int32), b),
      group=np.repeat(np.arange(b, dtype=np.int32), g),
      done=np.zeros((n,), bool), finished=np.zeros((n,), bool),
      num_pending=np.int32(n))


__all__ = ["Queue", "SlotConfig", "SlotRollout", "complete_groups",
           "fresh_queue", "make_continuous_sampler"]
