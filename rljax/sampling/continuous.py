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
(``SlotConfig.share_prompts``, ``slot_fill.prefill_shared``): a group costs
one prompt forward, not ``G``. Rows that already hold tokens (a partial row
carried from an earlier call, APRIL's partial rollouts) prefill prompt and
tokens together and go on from there: their tokens are never re-sampled.

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
from rljax.models import paged_cache as pc
from rljax.models.kv_cache import KVCache
from rljax.sampling import slot_pages
from rljax.sampling.sampler import (SamplerConfig, _ended, fused_logprobs,
                                    pick_logprob, decode_setup, token_keys)
from rljax.sampling.slot_fill import (  # noqa: F401  (re-exported)
    ACCEPT_FOLD, NO_PROMPT, accept_draft, prefill_rows, prefill_shared)


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
    kv_stats: on a paged cache (``SlotConfig.paged``), the pool's figures
      (``paged.pool_stats``: the most blocks in use at once, the pool, the
      rows cut for want of a block, the blocks still held once every row
      ended or stopped: 0 unless a block leaked); else None.
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
  kv_stats: Any = None


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
    paged: a ``paged.PagedConfig``: the slots' KV cache in blocks
      (``rljax/sampling/slot_pages.py``), a group's prompt stored once and
      a slot's blocks freed when its row ends; None: a dense cache of
      ``P + T`` slots per slot.
  """

  slots: int
  refill_rows: int = 1
  carried: bool = False
  log_lenience: float | None = None
  share_prompts: bool = True
  paged: Any = None

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
                           # NO_PROMPT where none can be shared
  prompt_logits: jax.Array  # [M, V] fp32, the logits after that prompt
  kv_peak: jax.Array       # [] int32, most blocks in use (paged cache)
  kv_cut: jax.Array        # [] int32, rows cut for want of a block


def _step(params, state: _State, queue: Queue, *, model, w_DxV,
          mc: ModelConfig, sc: SamplerConfig) -> _State:
  """One decode step of every live slot; ended rows free their slot (and,
  on a paged cache, their blocks: a live slot first reserves its next
  cache slot, and one that finds no free block ends, cut)."""
  q, t = state.tokens.shape
  paged = isinstance(state.cache, pc.PagedKVCache)
  cut = jnp.zeros_like(state.live)
  if paged:
    cache, failed = pc.reserve(state.cache, state.live, 1)
    cut = state.live & failed
    state = state._replace(
        cache=cache, kv_peak=jnp.maximum(state.kv_peak,
                                         pc.blocks_in_use(cache)),
        kv_cut=state.kv_cut + jnp.sum(cut).astype(jnp.int32))
  live = state.live & ~cut
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
  if paged:
    cache = cache._replace(lengths=state.cache.lengths + live.astype(jnp.int32))
  else:
    cache = cache._replace(index=state.cache.index + live.astype(jnp.int32))
  logits = compute_logits(hidden, w_DxV, mc.final_logit_softcap)[:, 0]
  new_column = state.column + live.astype(jnp.int32)
  ending = live & (ended | (new_column >= t))
  end_row = jnp.where(ending | cut, state.slot_row, q)
  if paged:
    cache = pc.release(cache, ending | cut)
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
  if slots.paged is not None:
    cache = slot_pages.slot_cache(mc, m, p + t, slots.paged, cache_dtype)
  else:
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
      slot_prompt=jnp.full((m, p), NO_PROMPT, jnp.int32),
      prompt_logits=jnp.zeros((m, mc.vocab_size), jnp.float32),
      kv_peak=jnp.zeros((), jnp.int32), kv_cut=jnp.zeros((), jnp.int32))
  if state.policy_logp is None and sc.record_policy_logprobs:
    raise ValueError("the queue has no policy_logprobs but the sampler "
                     "records them.")
  kw = dict(model=model, w_DxV=w_DxV, mc=mc, sc=sc)
  drafts = slots.log_lenience is not None
  fill = functools.partial(prefill_rows, cache_dtype=cache_dtype,
                           log_lenience=slots.log_lenience, **kw)

  def fill_rows(state, num_rows, width):
    """A fill of ``num_rows``: shared prompts where only prompts are
    prefilled, with room for one leader per group of ``G`` rows (a fill
    starts at a multiple of the refill size, so groups of ``G`` rows are
    cut by its edges only when neither divides the other; then
    ``prefill_shared`` runs its leaders in more chunks)."""
    if slots.share_prompts and width == p:
      leaders = min(num_rows, -(-num_rows // sc.num_samples))
      return prefill_shared(params, state, queue, num_rows, leaders=leaders,
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
      prefilled_rows=state.prefilled_rows, accepted=state.accepted,
      started=jnp.arange(q) < state.next_row,
      # Rows still decoding when a partial call stops are carried and
      # prefilled again next time: their blocks go back with the call's.
      kv_stats=(None if slots.paged is None else slot_pages.pool_figures(
          pc.release(state.cache, state.live), state.kv_peak, state.kv_cut)))


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
