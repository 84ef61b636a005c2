"""The multi-turn rollout's device side: its state and the jitted steps.

``rljax.rollout.multi_turn.MultiTurnSampler`` runs the host loop over these:
``start`` and ``refill`` prefill prompts into cache rows, ``decode_turn``
decodes until rows end their turns (``decode_rows``: on a subset of rows,
the shrinking static batch), ``insert`` prefills observations, and
``to_rollout`` hands the buffers over; ``verify`` keeps what SPEC-RL
accepts of a turn's draft. The layout and the draws are described in
``multi_turn``'s docstring. The cache is dense or paged
(``sampler.kv_cache``): every write goes through
``rljax/rollout/turn_pages.py``, which takes either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models import ModelConfig, compute_logits, init_cache
from rljax.rollout import turn_latr, turn_pages
from rljax.sampling.continuous import ACCEPT_FOLD, accept_draft
from rljax.sampling.sampler import (Rollout, SamplerConfig, decode_setup,
                                    fused_logprobs, pick_logprob, token_keys)


class Turns(NamedTuple):
  cache: Any               # KVCache [N, K, S, H] per layer, index [N]
                           # (= P + column), or a PagedKVCache (turn_pages)
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
  peak: jax.Array          # [] int32, most KV blocks in use (paged; else 0)
  cut: jax.Array           # [] int32, rows cut for want of a block (paged)
  latr: Any = None         # turn_latr.LatrRows: LATR's branching, or None


def _prefill(params, prompt_tokens_UxP, prompt_mask_UxP, *, mc, sc, slots):
  """``(logits_UxV, cache, dtype)``: the ``U`` prompts prefilled into a
  dense cache of ``slots`` slots per prompt."""
  mask_U = prompt_mask_UxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, _ = decode_setup(params, mask_U[:1], mc, sc)
  hidden, cache = model.apply(
      {"params": params}, prompt_tokens_UxP,
      jnp.maximum(jnp.cumsum(mask_U.astype(jnp.int32), -1) - 1, 0),
      init_cache(mc, mask_U.shape[0], slots, cache_dtype),
      input_mask_BxT=mask_U)
  return (compute_logits(hidden[:, -1:], w_DxV, mc.final_logit_softcap)[:, 0],
          cache, cache_dtype)


def start(params, prompt_tokens_UxP, prompt_mask_UxP, source_N, keys_Nx2,
          row_N, *, mc, sc, obs_width, paged=None):
  """Each row's prompt in its own cache row; every row live.

  The ``U`` prompts are distinct ones, each prefilled once; row ``n``'s is
  prompt ``source_N[n]``, whose keys, values and first-token logits it
  copies (a group's ``G`` rows cost one prompt forward; on a paged cache,
  ``paged``, it points to the blocks of the first row with that prompt
  instead: ``turn_pages.prompts``). ``row_N``: the episode row each cache
  row plays; ``keys_Nx2``: that row's key data (its draws: ``row_keys``; a
  carried episode keeps the key it started with)."""
  p = prompt_tokens_UxP.shape[1]
  n = source_N.shape[0]
  t = sc.max_new_tokens
  logits, prefilled, dtype = _prefill(
      params, prompt_tokens_UxP, prompt_mask_UxP, mc=mc, sc=sc,
      slots=p if paged is not None else p + t + obs_width)
  cut = jnp.zeros((), jnp.int32)
  if paged is None:
    cache, failed = turn_pages.dense_rows(prefilled, source_N), None
  else:
    cache, failed = turn_pages.prompts(
        turn_pages.pool(mc, n, p + t + obs_width, paged, dtype),
        jnp.ones((n,), jnp.bool_), prefilled, source_N)
    cut = jnp.sum(failed).astype(jnp.int32)
  state = _fresh(logits[source_N], cache, prompt_mask_UxP, source_N,
                 keys_Nx2, row_N, sc)
  state = state._replace(peak=turn_pages.in_use(cache), cut=cut)
  return state if failed is None else state._replace(
      live=~failed, done=failed)


def _fresh(logits, cache, prompt_mask_UxP, source_N, keys_Nx2, row_N, sc):
  n = source_N.shape[0]
  t = sc.max_new_tokens
  mask = prompt_mask_UxP.astype(jnp.bool_)[source_N]
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
      row=row_N.astype(jnp.int32), steps=jnp.zeros((), jnp.int32),
      peak=jnp.zeros((), jnp.int32), cut=jnp.zeros((), jnp.int32))


def refill(params, state: Turns, refill_N, prompt_tokens_UxP,
           prompt_mask_UxP, source_N, keys_Nx2, row_N, *, mc, sc, obs_width,
           paged=None) -> Turns:
  """The slots in ``refill_N`` start the episodes ``row_N``, slot ``n``
  with prompt ``source_N[n]`` of the ``U`` given (``start``; every buffer
  reset); the other slots are unchanged. One program per ``U``."""
  if paged is None:
    fresh = start(params, prompt_tokens_UxP, prompt_mask_UxP, source_N,
                  keys_Nx2, row_N, mc=mc, sc=sc, obs_width=obs_width)
    failed = None
  else:  # the refilled rows' blocks only: the pool stays
    logits, prefilled, _ = _prefill(
        params, prompt_tokens_UxP, prompt_mask_UxP, mc=mc, sc=sc,
        slots=prompt_tokens_UxP.shape[1])
    cache, failed = turn_pages.prompts(state.cache, refill_N, prefilled,
                                       source_N)
    fresh = _fresh(logits[source_N], cache, prompt_mask_UxP, source_N,
                   keys_Nx2, row_N, sc)

  def pick(new, old):
    if new is None or new.ndim == 0:
      return old
    where = refill_N.reshape((-1,) + (1,) * (new.ndim - 1))
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.where(
          where[:, None], jax.random.key_data(new), jax.random.key_data(old)))
    return jnp.where(where, new, old)
  out = jax.tree.map(pick, fresh._replace(cache=None),
                     state._replace(cache=None), is_leaf=lambda x: x is None)
  out = out._replace(cache=(jax.tree.map(pick, fresh.cache, state.cache)
                            if failed is None else fresh.cache))
  if failed is None:
    return out
  return out._replace(live=out.live & ~failed, done=out.done | failed,
                      cut=out.cut + jnp.sum(failed).astype(jnp.int32),
                      peak=jnp.maximum(out.peak, turn_pages.in_use(fresh.cache)))


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
  hidden, cache, cut = turn_pages.forward(
      model, params, tokens_NxT, state.position[:, None] + jnp.arange(t),
      state.cache, jnp.full((n,), prompt_width, jnp.int32), restore_N,
      mask_NxT)
  restore_N = restore_N & ~cut
  last = jnp.take_along_axis(hidden, jnp.maximum(column - 1, 0)[:, None, None],
                             1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  has = column > 0
  rows = restore_N[:, None]

  def put(new, old):
    return jnp.where(rows, new.astype(old.dtype), old)

  column = jnp.where(restore_N, column, state.column)
  done = state.done | cut
  return state._replace(
      cache=turn_pages.settle(cache, prompt_width + column, done),
      live=state.live & ~cut, done=done,
      cut=state.cut + jnp.sum(cut).astype(jnp.int32),
      peak=jnp.maximum(state.peak, turn_pages.in_use(cache)),
      logits=jnp.where(has[:, None], logits, state.logits),
      tokens=put(tokens_NxT, state.tokens), mask=put(mask_NxT, state.mask),
      observed=put(observed_NxT & mask_NxT, state.observed),
      sampler_logp=put(sampler_logp_NxT, state.sampler_logp),
      policy_logp=(None if state.policy_logp is None
                   else put(policy_logp_NxT, state.policy_logp)),
      column=column,
      position=state.position + jnp.where(restore_N, column, 0),
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
                 prompt_width: int, latr: Any = None) -> Turns:
  """Decode steps until no row is live, until ``min_waiting`` rows have
  ended a turn, or until no more than ``fits`` rows are live (traced ints;
  ``fits``: the next smaller batch of a shrinking one, ``decode_rows``);
  ``clear_N``: rows whose ended turn the host has taken (their
  ``ended_turn`` is cleared first). With ``state.latr``, LATR's branches
  (``turn_latr``, its ``LatrConfig`` ``latr``) grow at each step."""
  state = state._replace(ended_turn=state.ended_turn & ~clear_N)
  if state.latr is not None:  # each row holds its own content so far
    state = state._replace(latr=state.latr._replace(
        origin=jnp.arange(state.live.shape[0], dtype=jnp.int32)))
  model, w_DxV, _, _ = decode_setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  samples = state.row % sc.num_samples
  max_turn = turns.max_turn_tokens or t

  def body(s: Turns) -> Turns:
    if s.latr is not None:
      s, forced, forced_token = turn_latr.branch(s, fork, latr,
                                                 sc.num_samples)
    # A paged cache's live rows reserve their next slot first; a row that
    # finds no free block ends here, cut (a dense cache: none is).
    cache, cut = turn_pages.reserve(s.cache, prompt_width + s.column, s.live,
                                    1)
    live = s.live & ~cut
    token, sampler_logp = sc.method.get_next_tokens(
        s.logits, token_keys(s.keys, s.column), samples)
    if s.latr is not None:  # a forced token's logprob at the temperature
      t_ = 1.0 if sc.method.greedy else sc.method.temperature
      token = jnp.where(forced, forced_token, token)
      sampler_logp = jnp.where(forced, pick_logprob(jax.nn.log_softmax(
          s.logits.astype(jnp.float32) / t_, -1), forced_token), sampler_logp)
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
    hidden, cache = turn_pages.apply(
        model, params, token[:, None], s.position[:, None], cache, live,
        live[:, None])
    logits = compute_logits(hidden, w_DxV, mc.final_logit_softcap)[:, 0]
    new_column = s.column + live.astype(jnp.int32)
    over_budget = live & (new_column >= t)
    long_turn = live & (new_column - s.turn_start >= max_turn)
    done = s.done | over_budget | cut
    out = s._replace(
        cache=turn_pages.settle(cache, prompt_width + new_column, done),
        peak=jnp.maximum(s.peak, turn_pages.in_use(cache)),
        cut=s.cut + jnp.sum(cut).astype(jnp.int32),
        logits=jnp.where(live[:, None], sharding.constrain(
            logits, ("batch", "act_vocab")), s.logits),
        tokens=tokens, mask=s.mask | at,
        sampler_logp=put(s.sampler_logp, sampler_logp),
        policy_logp=policy_logp, column=new_column,
        position=s.position + live.astype(jnp.int32),
        live=live & ~ended & ~over_budget & ~long_turn,
        ended_turn=s.ended_turn | ((ended | long_turn) & ~over_budget),
        done=done, steps=s.steps + 1)
    if out.latr is None:
      return out
    out = turn_latr.prune(out, latr)  # a pruned row's blocks go back
    return out._replace(cache=turn_pages.settle(
        out.cache, prompt_width + out.column, out.done))

  def more(s: Turns) -> jax.Array:
    waiting = jnp.sum((s.ended_turn & ~s.done).astype(jnp.int32))
    return ((jnp.sum(s.live.astype(jnp.int32)) > fits)
            & (waiting < min_waiting))

  return jax.lax.while_loop(more, body, state)


def take_rows(state: Turns, rows_L) -> Turns:
  """The state of the cache rows ``rows_L`` (``steps`` is shared; a paged
  cache's pool stays whole: ``turn_pages.take``)."""
  part = jax.tree.map(
      lambda x: x if x.ndim == 0 else jnp.take(x, rows_L, axis=0),
      state._replace(cache=None))
  return part._replace(cache=turn_pages.take(state.cache, rows_L))


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
  out = jax.tree.map(put, state._replace(cache=None), part._replace(cache=None))
  return out._replace(cache=turn_pages.put(state.cache, rows_L, part.cache))


def fork(state: Turns, src_N, forked_N, hold_N) -> Turns:
  """Tree episodes (``rljax/rollout/episode_tree.py``): each row in
  ``forked_N`` becomes a copy of row ``src_N[n]`` (its buffers, its place
  in the episode, its cache: ``turn_pages.fork``) and decodes next unless
  that episode is over; it keeps its own key and episode row, so its draws
  from here on are its own. Rows in ``hold_N`` wait for their group's fork
  (not live)."""
  own = ("cache", "keys", "row", "steps", "peak", "cut", "latr")
  taken = jax.tree.map(
      lambda x: jnp.take(x, src_N, axis=0),
      {f: getattr(state, f) for f in Turns._fields
       if f not in own and getattr(state, f) is not None})
  out = state._replace(cache=turn_pages.fork(state.cache, src_N), **taken)
  if state.latr is not None:  # LATR's branches: whose content each holds
    out = out._replace(latr=state.latr._replace(
        origin=state.latr.origin[src_N]))
  return out._replace(live=jnp.where(forked_N, ~out.done,
                                     state.live & ~hold_N))


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
  # LATR's tree phase is over when a batch shrinks: the rows decode as the
  # static batch's (episode_latr), their groups' slots apart.
  latr = state.latr
  part = decode_turn(params, take_rows(state._replace(latr=None), rows_L),
                      jnp.zeros(rows_L.shape, jnp.bool_),
                      min_waiting - waiting_outside, fits, **kw)
  return put_rows(state._replace(latr=None), rows_L, part)._replace(latr=latr)


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
  hidden, cache, cut = turn_pages.forward(
      model, params, obs_NxO, state.position[:, None] + jnp.arange(o),
      state.cache, prompt_width + state.column, obs_len_N > 0,
      jnp.arange(o)[None] < obs_len_N[:, None])
  # A row whose observation found no block ends with its last turn.
  end_N, resume_N = end_N | cut, resume_N & ~cut
  obs_len_N = jnp.where(cut, 0, obs_len_N)
  last = jnp.take_along_axis(
      hidden, jnp.maximum(obs_len_N - 1, 0)[:, None, None], 1)
  logits = compute_logits(last, w_DxV, mc.final_logit_softcap)[:, 0]
  # Completion column c holds observation token c - column.
  offset = jnp.arange(t)[None] - state.column[:, None]
  inside = (offset >= 0) & (offset < obs_len_N[:, None])
  obs_at = jnp.take_along_axis(obs_NxO, jnp.clip(offset, 0, o - 1), axis=1)
  column = state.column + obs_len_N
  done = state.done | end_N
  return state._replace(
      cache=turn_pages.settle(cache, prompt_width + column, done),
      peak=jnp.maximum(state.peak, turn_pages.in_use(cache)),
      cut=state.cut + jnp.sum(cut).astype(jnp.int32),
      logits=jnp.where((obs_len_N > 0)[:, None], logits, state.logits),
      tokens=jnp.where(inside, obs_at, state.tokens),
      mask=state.mask | inside, observed=state.observed | inside,
      column=column, position=state.position + obs_len_N,
      turn_start=jnp.where(resume_N, column, state.turn_start),
      live=state.live | resume_N, done=done,
      finished=state.finished | (end_N & env_done_N & ~cut))


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
  hidden, cache, cut = turn_pages.forward(
      model, params, draft_NxD, state.position[:, None] + cols_D[None],
      state.cache, prompt_width + state.column, draft_len_N > 0,
      cols_D[None] < draft_len_N[:, None])
  # A row whose draft found no block keeps none of it and ends, cut.
  draft_len_N = jnp.where(cut, 0, draft_len_N)
  has = has & ~cut
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
  if not turn_pages.is_paged(cache):  # paged: settle drops the tail
    slots = cache.mask.shape[1]
    start = prompt_width + state.column
    rejected = ((jnp.arange(slots)[None] >= (start + accepted)[:, None])
                & (jnp.arange(slots)[None] < (start + d)[:, None]))
    cache = cache._replace(mask=cache.mask & ~(rejected & has[:, None]))
  stop = ended | long_turn | over_budget | cut
  done = state.done | over_budget | cut
  return state._replace(
      cache=turn_pages.settle(cache, prompt_width + column, done),
      peak=jnp.maximum(state.peak, turn_pages.in_use(cache)),
      cut=state.cut + jnp.sum(cut).astype(jnp.int32),
      logits=jnp.where((accepted > 0)[:, None], next_logits, state.logits),
      tokens=tokens, mask=state.mask | inside,
      sampler_logp=put(state.sampler_logp, jnp.where(kept_D, sampler_lp, 0.0)),
      policy_logp=(None if state.policy_logp is None else put(
          state.policy_logp, jnp.where(kept_D, policy_lp, 0.0))),
      column=column, position=state.position + accepted,
      live=state.live & ~stop,
      ended_turn=state.ended_turn | ((ended | long_turn) & ~over_budget),
      done=done)


def to_rollout(prompt_tokens_NxP, prompt_mask_NxP, s: Turns,
                turn_rewards_NxT) -> Rollout:
  return Rollout(
      prompt_tokens=prompt_tokens_NxP, prompt_mask=prompt_mask_NxP,
      completion_tokens=s.tokens, completion_mask=s.mask,
      lengths=jnp.sum(s.mask & ~s.observed, -1).astype(jnp.int32),
      finished=s.finished, policy_logprobs=s.policy_logp,
      sampler_logprobs=s.sampler_logp, observation_mask=s.observed,
      turn_rewards=turn_rewards_NxT)
