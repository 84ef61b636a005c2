"""The multi-turn rollout's device side: its state and the jitted steps.

``rljax.rollout.multi_turn.MultiTurnSampler`` runs the host loop over these:
``start`` and ``refill`` prefill prompts into cache rows, ``decode_turn``
decodes until rows end their turns (``decode_rows``: on a subset of rows,
the shrinking static batch), ``insert`` prefills observations, and
``to_rollout`` hands the buffers over; ``verify`` keeps what SPEC-RL
accepts of a turn's draft. The layout and the draws are described in
``multi_turn``'s docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models import ModelConfig, compute_logits, init_cache
from rljax.models.kv_cache import KVCache, LayerKV
from rljax.sampling.continuous import ACCEPT_FOLD, accept_draft
from rljax.sampling.sampler import (Rollout, SamplerConfig, decode_setup,
                                    fused_logprobs, pick_logprob, token_keys)


class Turns(NamedTuple):
  cache: KVCache           # [N, K, S, H] per layer, index [N] (= P + column)
  logits: jax.Array        # [N, V] fp32, predicting each row's next token
  tokens: jax.Array        # [N, T] int32
  mask: jax.Array          # [N, T] bool, real tokens
  observed: jax.Array      # [N, T] bool, inserted observation tokens
  sampler_logp: jax.Array  # [N, T]
  policy_logp: jax.Array | None
  column: jax.Array        # [N] int32, completion column of the next token
  position: jax.Array      # [N] int32
  turn_start: jax.Array    # [N] int32, column where the current turn began
  keys: jax.Array          # [N] typed keys (row_keys)
  live: jax.Array          # [N] bool, decoding its turn
  ended_turn: jax.Array    # [N] bool, its turn ended (waits for the env)
  done: jax.Array          # [N] bool, episode over
  finished: jax.Array      # [N] bool, ended by the environment
  row: jax.Array           # [N] int32, the episode row each cache row plays
  steps: jax.Array         # [] int32, decode steps run so far


def start(params, prompt_tokens_UxP, prompt_mask_UxP, source_N, keys_Nx2,
          row_N, *, mc, sc, obs_width):
  """Each row's prompt in its own cache row; every row live.

  The ``U`` prompts are distinct ones, each prefilled once; row ``n``'s is
  prompt ``source_N[n]``, whose keys, values and first-token logits it
  copies (a group's ``G`` rows cost one prompt forward). ``row_N``: the
  episode row each cache row plays; ``keys_Nx2``: that row's key data (its
  draws: ``row_keys``; a carried episode keeps the key it started with)."""
  p = prompt_tokens_UxP.shape[1]
  n = source_N.shape[0]
  t = sc.max_new_tokens
  mask_U = prompt_mask_UxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, _ = decode_setup(params, mask_U[:1], mc, sc)
  hidden, cache = model.apply(
      {"params": params}, prompt_tokens_UxP,
      jnp.maximum(jnp.cumsum(mask_U.astype(jnp.int32), -1) - 1, 0),
      init_cache(mc, mask_U.shape[0], p + t + obs_width, cache_dtype),
      input_mask_BxT=mask_U)
  cache = KVCache(tuple(LayerKV(kv.k[source_N], kv.v[source_N])
                        for kv in cache.layers), cache.mask[source_N],
                  jnp.full((n,), p, jnp.int32), cache.prefix)
  logits = compute_logits(hidden[:, -1:], w_DxV,
                          mc.final_logit_softcap)[source_N, 0]
  mask = mask_U[source_N]
  zeros = jnp.zeros((n, t), jnp.float32)
  false = jnp.zeros((n,), jnp.bool_)
  return Turns(
      cache=cache, logits=logits,
      tokens=jnp.full((n, t), sc.pad_id, jnp.int32),
      mask=jnp.zeros((n, t), jnp.bool_), observed=jnp.zeros((n, t), jnp.bool_),
      sampler_logp=zeros,
      policy_logp=zeros if sc.record_policy_logprobs else None,
      column=jnp.zeros((n,), jnp.int32),
      position=jnp.sum(mask.astype(jnp.int32), -1),
      turn_start=jnp.zeros((n,), jnp.int32),
      keys=jax.random.wrap_key_data(keys_Nx2),
      live=~false, ended_turn=false, done=false, finished=false,
      row=row_N.astype(jnp.int32), steps=jnp.zeros((), jnp.int32))


def refill(params, state: Turns, refill_N, prompt_tokens_UxP,
           prompt_mask_UxP, source_N, keys_Nx2, row_N, *, mc, sc, obs_width
           ) -> Turns:
  """The slots in ``refill_N`` start the episodes ``row_N``, slot ``n``
  with prompt ``source_N[n]`` of the ``U`` given (``start``; every buffer
  reset); the other slots are unchanged. One program per ``U``."""
  fresh = start(params, prompt_tokens_UxP, prompt_mask_UxP, source_N,
                keys_Nx2, row_N, mc=mc, sc=sc, obs_width=obs_width)

  def pick(new, old):
    if new is None or new.ndim == 0:
      return old
    where = refill_N.reshape((-1,) + (1,) * (new.ndim - 1))
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.where(
          where[:, None], jax.random.key_data(new), jax.random.key_data(old)))
    return jnp.where(where, new, old)
  return jax.tree.map(pick, fresh, state, is_leaf=lambda x: x is None)


def restore(params, state: Turns, restore_N, tokens_NxT, mask_NxT,
            observed_NxT, sampler_logp_NxT, policy_logp_NxT, turn_start_N, *,
            mc: ModelConfig, sc: SamplerConfig, prompt_width: int) -> Turns:
  """Rows just started (``start``) go on with a carried episode's history
  (``restore_N``; ``rljax/rollout/episode_carry.py``): its completion
  buffers are written back and its tokens, model and observation alike,
  are prefilled after the prompt in one forward under these params (never
  re-sampled), so the row decodes on from its last token. A history is
  contiguous: its column is its count of real tokens. The other rows are
  unchanged (they are fresh: nothing after their prompt is attended to)."""
  model, w_DxV, _, _ = decode_setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  mask_NxT = mask_NxT & restore_N[:, None]
  column = jnp.sum(mask_NxT.astype(jnp.int32), -1)
  cache = state.cache._replace(index=jnp.full((n,), prompt_width, jnp.int32))
  hidden, cache = model.apply(
      {"params": params}, tokens_NxT,
      state.position[:, None] + jnp.arange(t), cache, input_mask_BxT=mask_NxT)
  last = jnp.take_along_axis(hidden, jnp.maximum(column - 1, 0)[:, None, None],
                             1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  has = column > 0
  rows = restore_N[:, None]

  def put(new, old):
    return jnp.where(rows, new.astype(old.dtype), old)

  return state._replace(
      cache=cache._replace(index=prompt_width + column),
      logits=jnp.where(has[:, None], logits, state.logits),
      tokens=put(tokens_NxT, state.tokens), mask=put(mask_NxT, state.mask),
      observed=put(observed_NxT & mask_NxT, state.observed),
      sampler_logp=put(sampler_logp_NxT, state.sampler_logp),
      policy_logp=(None if state.policy_logp is None
                   else put(policy_logp_NxT, state.policy_logp)),
      column=jnp.where(restore_N, column, state.column),
      position=state.position + column,
      turn_start=jnp.where(restore_N, turn_start_N, state.turn_start))


def turn_ended(tokens_NxT, column_N, token_N, turn_start_N, eos_V,
                stop_sequences):
  """Whether ``token_N`` (just written at ``column_N``) ends the turn: an EOS
  id, or the last token of a stop sequence that lies within the turn."""
  hit = jnp.any(token_N[:, None] == eos_V[None], axis=1)
  for seq in stop_sequences:
    offsets = jnp.arange(1 - len(seq), 1, dtype=jnp.int32)
    cols = column_N[:, None] + offsets[None]
    window = jnp.take_along_axis(tokens_NxT, jnp.maximum(cols, 0), axis=1)
    hit = hit | jnp.all((window == jnp.asarray(seq, jnp.int32))
                        & (cols >= turn_start_N[:, None]), axis=1)
  return hit


def decode_turn(params, state: Turns, clear_N, min_waiting, fits=0, *,
                 mc: ModelConfig, sc: SamplerConfig, turns: Any,
                 prompt_width: int) -> Turns:
  """Decode steps until no row is live, until ``min_waiting`` rows have
  ended a turn, or until no more than ``fits`` rows are live (traced ints;
  ``fits``: the next smaller batch of a shrinking one, ``decode_rows``);
  ``clear_N``: rows whose ended turn the host has taken (their
  ``ended_turn`` is cleared first)."""
  state = state._replace(ended_turn=state.ended_turn & ~clear_N)
  model, w_DxV, _, _ = decode_setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  samples = state.row % sc.num_samples
  max_turn = turns.max_turn_tokens or t

  def body(s: Turns) -> Turns:
    live = s.live
    token, sampler_logp = sc.method.get_next_tokens(
        s.logits, token_keys(s.keys, s.column), samples)
    token = jnp.where(live, token, sc.pad_id)
    column = jnp.minimum(s.column, t - 1)
    at = (jnp.arange(t)[None] == column[:, None]) & live[:, None]

    def put(buffer, value):
      return jnp.where(at, value[:, None].astype(buffer.dtype), buffer)

    tokens = put(s.tokens, token)
    policy_logp = s.policy_logp
    if policy_logp is not None:
      lp = (sampler_logp if fused_logprobs(sc) else pick_logprob(
          jax.nn.log_softmax(s.logits / sc.training_temperature, -1), token))
      policy_logp = put(policy_logp, lp)
    ended = live & turn_ended(tokens, column, token, s.turn_start, eos,
                               turns.stop_sequences)
    cache = s.cache._replace(index=prompt_width + s.column)
    hidden, cache = model.apply(
        {"params": params}, token[:, None], s.position[:, None], cache,
        input_mask_BxT=live[:, None])
    logits = compute_logits(hidden, w_DxV, mc.final_logit_softcap)[:, 0]
    new_column = s.column + live.astype(jnp.int32)
    over_budget = live & (new_column >= t)
    long_turn = live & (new_column - s.turn_start >= max_turn)
    return s._replace(
        cache=cache._replace(index=prompt_width + new_column),
        logits=jnp.where(live[:, None], sharding.constrain(
            logits, ("batch", "act_vocab")), s.logits),
        tokens=tokens, mask=s.mask | at,
        sampler_logp=put(s.sampler_logp, sampler_logp),
        policy_logp=policy_logp, column=new_column,
        position=s.position + live.astype(jnp.int32),
        live=live & ~ended & ~over_budget & ~long_turn,
        ended_turn=s.ended_turn | ((ended | long_turn) & ~over_budget),
        done=s.done | over_budget, steps=s.steps + 1)

  def more(s: Turns) -> jax.Array:
    waiting = jnp.sum((s.ended_turn & ~s.done).astype(jnp.int32))
    return ((jnp.sum(s.live.astype(jnp.int32)) > fits)
            & (waiting < min_waiting))

  return jax.lax.while_loop(more, body, state)


def take_rows(state: Turns, rows_L) -> Turns:
  """The state of the cache rows ``rows_L`` (``steps`` is shared)."""
  return jax.tree.map(
      lambda x: x if x.ndim == 0 else jnp.take(x, rows_L, axis=0), state)


def put_rows(state: Turns, rows_L, part: Turns) -> Turns:
  """``state`` with its rows ``rows_L`` set to ``part``'s (and its
  ``steps``)."""
  def put(full, new):
    if full.ndim == 0:
      return new
    if jax.dtypes.issubdtype(full.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jax.random.key_data(full).at[
          rows_L].set(jax.random.key_data(new)))
    return full.at[rows_L].set(new)
  return jax.tree.map(put, state, part)


def decode_rows(params, state: Turns, clear_N, min_waiting, rows_L, fits,
                 **kw) -> Turns:
  """``decode_turn`` on the cache rows ``rows_L`` only (a shrinking static
  batch: ``sampler.shrink_batch_to``): they are gathered into a batch of
  ``len(rows_L)`` rows, decoded, and written back. ``rows_L`` holds every
  row that decodes (``live``); the others do not change in a decode. The
  rows outside that wait for their environment count towards
  ``min_waiting``, as they would in the whole batch."""
  state = state._replace(ended_turn=state.ended_turn & ~clear_N)
  inside = jnp.zeros(state.live.shape, jnp.bool_).at[rows_L].set(True)
  waiting_outside = jnp.sum((state.ended_turn & ~state.done
                             & ~inside).astype(jnp.int32))
  part = decode_turn(params, take_rows(state, rows_L),
                      jnp.zeros(rows_L.shape, jnp.bool_),
                      min_waiting - waiting_outside, fits, **kw)
  return put_rows(state, rows_L, part)


def insert(params, state: Turns, obs_NxO, obs_len_N, resume_N, end_N,
            env_done_N, *, mc: ModelConfig, sc: SamplerConfig,
            prompt_width: int) -> Turns:
  """Appends each resumed row's observation (prefilled at its own index)
  and makes it live; ends the rows in ``end_N``. Rows in neither (decoding
  their turn, or done) are unchanged."""
  model, w_DxV, _, _ = decode_setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  o = obs_NxO.shape[1]
  obs_len_N = jnp.where(resume_N, obs_len_N, 0)
  valid = jnp.arange(o)[None] < obs_len_N[:, None]
  cache = state.cache._replace(index=prompt_width + state.column)
  hidden, cache = model.apply(
      {"params": params}, obs_NxO, state.position[:, None] + jnp.arange(o),
      cache, input_mask_BxT=valid)
  last = jnp.take_along_axis(
      hidden, jnp.maximum(obs_len_N - 1, 0)[:, None, None], 1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  # Completion column c holds observation token c - column.
  offset = jnp.arange(t)[None] - state.column[:, None]
  inside = (offset >= 0) & (offset < obs_len_N[:, None])
  obs_at = jnp.take_along_axis(obs_NxO, jnp.clip(offset, 0, o - 1), axis=1)
  column = state.column + obs_len_N
  return state._replace(
      cache=cache._replace(index=prompt_width + column),
      logits=jnp.where((obs_len_N > 0)[:, None], logits, state.logits),
      tokens=jnp.where(inside, obs_at, state.tokens),
      mask=state.mask | inside, observed=state.observed | inside,
      column=column, position=state.position + obs_len_N,
      turn_start=jnp.where(resume_N, column, state.turn_start),
      live=state.live | resume_N,
      done=state.done | end_N,
      finished=state.finished | (end_N & env_done_N))


def verify(params, state: Turns, draft_NxD, draft_len_N, draft_lp_NxD, *,
           mc: ModelConfig, sc: SamplerConfig, turns: Any, prompt_width: int,
           log_lenience: float) -> Turns:
  """SPEC-RL on the turn each row is about to decode: the rows with a
  draft (``draft_len_N > 0``; the others are unchanged) run it through the
  model in one forward at their own index, keep it up to the first token
  the acceptance rule rejects (``continuous.accept_draft``; the uniform of
  the token at completion column ``j`` is drawn from
  ``fold_in(token key of j, ACCEPT_FOLD)``), and decode on from there. A
  kept token's sampler logprob is the current policy's (SPEC-RL's rule).
  A row whose kept draft ends its turn (an EOS id, a stop sequence,
  ``max_turn_tokens``) waits for its environment; one that reaches the
  budget ``T`` is done. Rejected tokens stay in the cache, never attended
  to: the mask clears them and the next token overwrites them."""
  model, w_DxV, _, _ = decode_setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  d = draft_NxD.shape[1]
  has = draft_len_N > 0
  draft_len_N = jnp.minimum(jnp.where(has, draft_len_N, 0), t - state.column)
  cols_D = jnp.arange(d, dtype=jnp.int32)
  valid = cols_D[None] < draft_len_N[:, None]
  cache = state.cache._replace(index=prompt_width + state.column)
  hidden, cache = model.apply(
      {"params": params}, draft_NxD, state.position[:, None] + cols_D[None],
      cache, input_mask_BxT=valid)
  # Row j of `before` predicts draft token j: the state's logits, then the
  # draft's own hidden states.
  logits = jnp.concatenate([state.logits[:, None], compute_logits(
      hidden[:, :-1], w_DxV, mc.final_logit_softcap)], 1)
  columns = jnp.minimum(state.column[:, None] + cols_D[None], t - 1)

  def uniforms(key, columns_D):  # one per draft token, keyed by its column
    return jax.vmap(lambda c: jax.random.uniform(jax.random.fold_in(
        jax.random.fold_in(key, c.astype(jnp.uint32)), ACCEPT_FOLD)))(
            columns_D)

  log_u = jnp.log(jax.vmap(uniforms)(state.keys, columns))
  accepted, sampler_lp, policy_lp = accept_draft(
      logits, draft_NxD, draft_len_N, draft_lp_NxD, log_u,
      state.row % sc.num_samples, sc=sc, log_lenience=log_lenience)
  kept_D = cols_D[None] < accepted[:, None]
  # Completion column c holds draft token c - column.
  offset = jnp.arange(t)[None] - state.column[:, None]
  inside = (offset >= 0) & (offset < accepted[:, None])
  at = jnp.clip(offset, 0, d - 1)

  def put(buffer, values_NxD):
    return jnp.where(inside, jnp.take_along_axis(values_NxD, at, 1).astype(
        buffer.dtype), buffer)

  tokens = put(state.tokens, draft_NxD)
  column = state.column + accepted
  last = jnp.maximum(column - 1, 0)
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  ended = (accepted > 0) & turn_ended(
      tokens, last, jnp.take_along_axis(tokens, last[:, None], 1)[:, 0],
      state.turn_start, eos, turns.stop_sequences)
  long_turn = (accepted > 0) & (
      column - state.turn_start >= (turns.max_turn_tokens or t))
  over_budget = (accepted > 0) & (column >= t)
  # The next token's logits: after the last kept draft token.
  after = jnp.take_along_axis(
      hidden, jnp.maximum(accepted - 1, 0)[:, None, None], 1)
  next_logits = compute_logits(after, w_DxV, mc.final_logit_softcap)[:, 0]
  slots = cache.mask.shape[1]
  start = prompt_width + state.column
  rejected = ((jnp.arange(slots)[None] >= (start + accepted)[:, None])
              & (jnp.arange(slots)[None] < (start + d)[:, None]))
  cache = cache._replace(index=prompt_width + column,
                         mask=cache.mask & ~(rejected & has[:, None]))
  stop = ended | long_turn | over_budget
  return state._replace(
      cache=cache,
      logits=jnp.where((accepted > 0)[:, None], next_logits, state.logits),
      tokens=tokens, mask=state.mask | inside,
      sampler_logp=put(state.sampler_logp, jnp.where(kept_D, sampler_lp, 0.0)),
      policy_logp=(None if state.policy_logp is None else put(
          state.policy_logp, jnp.where(kept_D, policy_lp, 0.0))),
      column=column, position=state.position + accepted,
      live=state.live & ~stop,
      ended_turn=state.ended_turn | ((ended | long_turn) & ~over_budget),
      done=state.done | over_budget)


def to_rollout(prompt_tokens_NxP, prompt_mask_NxP, s: Turns,
                turn_rewards_NxT) -> Rollout:
  return Rollout(
      prompt_tokens=prompt_tokens_NxP, prompt_mask=prompt_mask_NxP,
      completion_tokens=s.tokens, completion_mask=s.mask,
      lengths=jnp.sum(s.mask & ~s.observed, -1).astype(jnp.int32),
      finished=s.finished, policy_logprobs=s.policy_logp,
      sampler_logprobs=s.sampler_logp, observation_mask=s.observed,
      turn_rewards=turn_rewards_NxT)
