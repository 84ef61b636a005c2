"""The multi-turn rollout: model turns decoded on the devices, environment
steps on the host, observations prefilled into each row's KV cache.

Layout. ``N = B * G`` rows, each with its own KV cache row of
``S = P + T + O`` slots (prompt bucket, the episode's token budget
``T = max_new_tokens``, and one observation's width ``O``) written at its own
index (``KVCache.index`` ``[N]``, as continuous batching's slots). The
completion buffer ``[N, T]`` holds a row's model tokens and the observation
tokens between them, in order; slot ``P + j`` holds completion column ``j``
and the position of column ``j`` is ``prompt length + j``, so a row is one
contiguous sequence and the trainer's forward over ``prompt + completion``
sees what the sampler saw.

A turn. ``_decode_turn`` runs decode steps (one ``lax.while_loop``) until
every live row has ended its turn: at an end-of-turn (EOS) token, at one of
the environment's stop sequences (a tool call such as ``</calc>``), at
``max_turn_tokens``, or at the budget ``T``. The host then decodes each
ended turn to text, steps the environments (``EnvRunner``, in worker
processes), encodes each observation (``ObservationFormat``) and
``_insert`` prefills it into the row's cache at the row's own index: the
row's history is never prefilled again, and only the ``O``-wide observation
is computed. The row then decodes its next turn.

Token exactness. What the trainer gets is this buffer: the ids that were
sampled and the ids that were inserted, never a decode and re-encode of the
text. ``Rollout.observation_mask`` marks the inserted ids: they are inputs,
not trained (no loss, no sampler logprob, which is 0 there).

Draws. Row ``r``'s token at completion column ``j`` is drawn with
``fold_in(fold_in(key, r), j)`` (``sampling.row_keys``), so an episode that
ends after its first turn is exactly the static sampler's row.

References:
  The token-in, token-out contract of verl's agent loop
  (``verl/experimental/agent_loop``) and TRL's rollout-source RFC; the
  environment interface of Tunix's agentic RL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax import tokenizers as tok_lib
from rljax.envs.base import EnvOutcome, EnvRunner
from rljax.models import ModelConfig, compute_logits, init_cache
from rljax.models.kv_cache import KVCache
from rljax.sampling.sampler import (Rollout, SamplerConfig, _fused_logprobs,
                                    _pick, _setup, pad_prompts, row_keys,
                                    token_keys)


@dataclasses.dataclass(frozen=True)
class TurnConfig:
  """Static settings of the multi-turn rollout.

  Attributes:
    max_turns: model turns per episode; after the last one the episode ends
      (``env/turn_limit``) whatever the environment says.
    max_observation_tokens: ``O``; a longer observation is cut to ``O``
      tokens (``env/observation_truncated``).
    max_turn_tokens: tokens one model turn may have (None: the budget).
    stop_sequences: token sequences that end a turn (the environment's
      ``stop_strings``, encoded), besides the sampler's EOS ids.
    step_rows: a decode returns to the host once this many rows wait for
      their environment (``MultiTurnSampler.run``'s rounds); None: once every
      row's turn has ended (the batch moves turn by turn).
  """

  max_turns: int = 4
  max_observation_tokens: int = 16
  max_turn_tokens: int | None = None
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  step_rows: int | None = None

  def __post_init__(self):
    for name in ("max_turns", "max_observation_tokens"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"env.{name}={value!r}: a positive integer is "
                         "required.")
    for name in ("max_turn_tokens", "step_rows"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                            or v < 1):
        raise ValueError(f"env.{name}={v!r}: a positive integer or None is "
                         "required.")
    if any(not s for s in self.stop_sequences):
      raise ValueError("env.stop_strings: a stop string encodes to no "
                       "tokens.")


class _Turns(NamedTuple):
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


def _start(params, prompt_tokens_NxP, prompt_mask_NxP, key, *, mc, sc,
           obs_width):
  """Each row's prompt prefilled into its own cache row; every row live."""
  n, p = prompt_tokens_NxP.shape
  t = sc.max_new_tokens
  mask = prompt_mask_NxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, _ = _setup(params, mask[:1], mc, sc)
  cache = init_cache(mc, n, p + t + obs_width, cache_dtype)
  hidden, cache = model.apply(
      {"params": params}, prompt_tokens_NxP,
      jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0), cache,
      input_mask_BxT=mask)
  cache = cache._replace(index=jnp.full((n,), p, jnp.int32))
  logits = compute_logits(hidden[:, -1:], w_DxV, mc.final_logit_softcap)[:, 0]
  zeros = jnp.zeros((n, t), jnp.float32)
  false = jnp.zeros((n,), jnp.bool_)
  return _Turns(
      cache=cache, logits=logits,
      tokens=jnp.full((n, t), sc.pad_id, jnp.int32),
      mask=jnp.zeros((n, t), jnp.bool_), observed=jnp.zeros((n, t), jnp.bool_),
      sampler_logp=zeros,
      policy_logp=zeros if sc.record_policy_logprobs else None,
      column=jnp.zeros((n,), jnp.int32),
      position=jnp.sum(mask.astype(jnp.int32), -1),
      turn_start=jnp.zeros((n,), jnp.int32), keys=row_keys(key, n),
      live=~false, ended_turn=false, done=false, finished=false)


def _turn_ended(tokens_NxT, column_N, token_N, turn_start_N, eos_V,
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


def _decode_turn(params, state: _Turns, clear_N, min_waiting, *,
                 mc: ModelConfig, sc: SamplerConfig, turns: TurnConfig,
                 prompt_width: int) -> _Turns:
  """Decode steps until no row is live, or until ``min_waiting`` rows have
  ended a turn (a traced int); ``clear_N``: rows whose ended turn the host
  has taken (their ``ended_turn`` is cleared first)."""
  state = state._replace(ended_turn=state.ended_turn & ~clear_N)
  model, w_DxV, _, _ = _setup(params, state.mask[:1, :1], mc, sc)
  n, t = state.tokens.shape
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  rows = jnp.arange(n, dtype=jnp.int32)
  samples = rows % sc.num_samples
  max_turn = turns.max_turn_tokens or t

  def body(s: _Turns) -> _Turns:
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
      lp = (sampler_logp if _fused_logprobs(sc) else _pick(
          jax.nn.log_softmax(s.logits / sc.training_temperature, -1), token))
      policy_logp = put(policy_logp, lp)
    ended = live & _turn_ended(tokens, column, token, s.turn_start, eos,
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
        done=s.done | over_budget)

  def more(s: _Turns) -> jax.Array:
    waiting = jnp.sum((s.ended_turn & ~s.done).astype(jnp.int32))
    return jnp.any(s.live) & (waiting < min_waiting)

  return jax.lax.while_loop(more, body, state)


def _insert(params, state: _Turns, obs_NxO, obs_len_N, resume_N, end_N,
            env_done_N, *, mc: ModelConfig, sc: SamplerConfig,
            prompt_width: int) -> _Turns:
  """Appends each resumed row's observation (prefilled at its own index)
  and makes it live; ends the rows in ``end_N``. Rows in neither (decoding
  their turn, or done) are unchanged."""
  model, w_DxV, _, _ = _setup(params, state.mask[:1, :1], mc, sc)
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


def _to_rollout(prompt_tokens_NxP, prompt_mask_NxP, s: _Turns,
                turn_rewards_NxT) -> Rollout:
  return Rollout(
      prompt_tokens=prompt_tokens_NxP, prompt_mask=prompt_mask_NxP,
      completion_tokens=s.tokens, completion_mask=s.mask,
      lengths=jnp.sum(s.mask & ~s.observed, -1).astype(jnp.int32),
      finished=s.finished, policy_logprobs=s.policy_logp,
      sampler_logprobs=s.sampler_logp, observation_mask=s.observed,
      turn_rewards=turn_rewards_NxT)


class ObservationFormat:
  """Turns an observation's text into the ids appended after a model turn.

  Plain (a tokenizer without a chat template, e.g. sentencepiece): the
  observation's text as is (``tokenizers.continuation_ids``: no BOS, no
  sentencepiece start-of-text piece). Chat (a
  ``ChatPromptTokenizer``): the model turn is closed as the template closes an
  assistant message (less the end-of-turn token when the model wrote it),
  the observation is a message of ``role`` as the template renders it, and
  the assistant header follows: the text between two renders of a probe
  conversation, with and without the observation.

  Args:
    tokenizer: the run's tokenizer (``ChatPromptTokenizer`` for chat).
    role: the observation's role in a chat (``"user"`` or ``"tool"``, as
      the template knows it).
    eos_ids: the end-of-turn ids (their text is dropped from the closing
      when the model's turn ended with one).
  """

  _PROBE_USER, _PROBE_TURN, _PROBE_OBS = "\x01U\x01", "\x01A\x01", "\x01O\x01"

  def __init__(self, tokenizer: Any, *, role: str = "user",
               eos_ids: Sequence[int] = ()):
    self.tokenizer = tokenizer
    self.chat = isinstance(tokenizer, tok_lib.ChatPromptTokenizer)
    self.eos_ids = tuple(eos_ids)
    self.role = role
    if self.chat:
      render = tokenizer.tokenizer.apply_chat_template
      head = [{"role": "user", "content": self._PROBE_USER},
              {"role": "assistant", "content": self._PROBE_TURN}]
      before = render(head, add_generation_prompt=False)
      after = render(head + [{"role": role, "content": self._PROBE_OBS}],
                     add_generation_prompt=True)
      if not after.startswith(before) or self._PROBE_OBS not in after:
        raise ValueError(
            f"env.observation_role={role!r}: the chat template does not "
            "render an observation message after an assistant turn as a "
            "suffix of the conversation; try role 'user'.")
      close = before[before.index(self._PROBE_TURN) + len(self._PROBE_TURN):]
      middle = after[len(before):]
      self.close = close
      self.open, self.tail = middle.split(self._PROBE_OBS)
      piece = getattr(tokenizer, "id_to_piece", None) or (
          lambda i: tokenizer.decode([i]))
      eos_texts = [piece(i) for i in self.eos_ids]
      self.close_after_eos = next(
          (close[len(e):] for e in eos_texts if e and close.startswith(e)),
          close)

  def encode(self, observation: str, ended_with_eos: bool) -> list[int]:
    """The ids appended for ``observation`` after a turn (that ended with an
    end-of-turn id, or not: a tool call's stop sequence)."""
    if not self.chat:
      return tok_lib.continuation_ids(self.tokenizer, observation)
    close = self.close_after_eos if ended_with_eos else self.close
    return self.tokenizer.encode(close + self.open + observation + self.tail)


class Episodes(NamedTuple):
  """What ``MultiTurnSampler.run`` returns.

  Attributes:
    rollout: the ``Rollout`` (``observation_mask`` and ``turn_rewards``
      set), on the devices.
    prompts: each example's prompt (``Environment.reset``), ``B``.
    env_reward: ``[N]`` float, the sum of each episode's step rewards (0 if
      none gave one); NaN for a failed episode.
    failed: ``[N]`` bool, the environment raised, hung or answered malformed
      output (or its reset did).
    metrics: ``env/*`` host floats, and ``time/env`` (seconds in the
      environments' calls).
    turn_tokens: each row's turns as ``(start, end, kind)`` column spans,
      ``kind`` ``"model"`` or ``"observation"`` (tests and debugging).
  """

  rollout: Rollout
  prompts: list[str]
  env_reward: np.ndarray
  failed: np.ndarray
  metrics: dict[str, float]
  turn_tokens: list[list[tuple[int, int, str]]]


def _state_copy(state: Any) -> Any:
  return json.loads(json.dumps(state))


class MultiTurnSampler:
  """Runs episodes: ``run(params, examples, key) -> Episodes``.

  Args:
    model_config: the policy's config.
    config: the sampler's settings (``num_samples`` G, ``max_new_tokens`` is
      the episode's token budget T: model and observation tokens together).
    turns: the multi-turn settings (``TurnConfig``).
    runner: steps the environment (``EnvRunner``).
    tokenizer: encodes prompts and observations, decodes turns.
    buckets: prompt length buckets.
    mesh, param_shardings: where the params live (rows are replicated: the
      rollout's arrays are laid out by the compiler).
    observation_role: the chat role of observations (``ObservationFormat``).
  """

  def __init__(self, model_config: ModelConfig, config: SamplerConfig,
               turns: TurnConfig, runner: EnvRunner, tokenizer: Any,
               buckets: Sequence[int], *,
               mesh: jax.sharding.Mesh | None = None,
               param_shardings: Any = None, observation_role: str = "user"):
    self.model_config, self.config, self.turns = model_config, config, turns
    self.runner, self.tokenizer = runner, tokenizer
    self.buckets = tuple(buckets)
    self.mesh = mesh
    self.format = ObservationFormat(tokenizer, role=observation_role,
                                    eos_ids=config.eos_ids)
    kw = dict(mc=model_config, sc=config)
    self._start = jax.jit(functools.partial(
        _start, obs_width=turns.max_observation_tokens, **kw))
    self._decode = jax.jit(functools.partial(_decode_turn, turns=turns, **kw),
                           static_argnames=("prompt_width",))
    self._insert = jax.jit(functools.partial(_insert, **kw),
                           static_argnames=("prompt_width",))

  def _mesh(self):
    return (jax.set_mesh(self.mesh) if self.mesh is not None
            else contextlib.nullcontext())

  def run(self, params: Any, examples: Mapping[str, Sequence[Any]],
          key: jax.Array) -> Episodes:
    """Runs ``G`` episodes of each of the ``B`` examples.

    Rounds: a decode (until every live row has ended its turn, or until
    ``TurnConfig.step_rows`` rows wait) is dispatched to the devices; while
    it runs, the host steps the environments of the rows that ended a turn
    in the previous round; their observations are inserted after it. So an
    environment's latency overlaps the other rows' decoding, and with
    ``step_rows`` a row waiting on its environment does not wait for the
    batch's slowest turn. The draws do not depend on the rounds (each
    token's key is its row's and column's), so every ``step_rows`` gives the
    same episodes.

    Args:
      params: the policy params.
      examples: ``{field: list of B values}`` (every field reaches
        ``Environment.reset`` as the example dict).
      key: PRNG key of the draws.
    """
    g = self.config.num_samples
    names = list(examples)
    b = len(examples[names[0]])
    rows = [{k: examples[k][i] for k in names} for i in range(b)]
    n = b * g
    ep = _Bookkeeping(n)
    resets = ep.timed(lambda: self.runner.reset(rows))
    prompts, states = [], [None] * n
    for i, outcome in enumerate(resets):
      if outcome.status == "ok":
        prompts.append(outcome.value["prompt"])
        for r in range(i * g, (i + 1) * g):
          states[r] = _state_copy(outcome.value["state"])
      else:  # the example's prompt stands in; its rows end at once
        prompts.append(str(rows[i].get("prompt", "")) or " ")
        for r in range(i * g, (i + 1) * g):
          ep.fail(r, outcome)
    encoded = tok_lib.encode_prompts(self.tokenizer, prompts)
    longest = max(self.buckets)
    for i, ids in enumerate(encoded):
      if len(ids) > longest or not ids:  # fails its episodes, not the run
        for r in range(i * g, (i + 1) * g):
          ep.fail(r, EnvOutcome(
              "error", None, f"reset's prompt has {len(ids)} tokens; "
              f"accepted 1 to {longest} (sampler.prompt_buckets)"))
        encoded[i] = [self.tokenizer.pad_id]
    tokens_BxP, mask_BxP = pad_prompts(encoded, self.buckets,
                                       self.tokenizer.pad_id)
    p = tokens_BxP.shape[1]
    tokens_NxP = np.repeat(tokens_BxP, g, 0)
    mask_NxP = np.repeat(mask_BxP, g, 0)
    min_waiting = np.int32(self.turns.step_rows or n)
    no_rows = np.zeros(n, bool)
    with self._mesh():
      state = self._start(params, tokens_NxP, mask_NxP, key)
      decoding = ~ep.failed  # the rows live in the decode dispatched next
      if ep.failed.any():  # rows whose reset failed never decode
        state = state._replace(live=state.live & ~ep.failed,
                               done=state.done | ep.failed)
      taken = np.zeros(0, np.int64)  # rows whose turn waits for its env
      taken_turns = None
      while decoding.any() or len(taken):
        state = self._decode(params, state, _mask(n, taken), min_waiting,
                             prompt_width=p)
        resumed = no_rows
        if len(taken):  # overlaps the decode just dispatched
          inserts, resumed = self._step(taken, taken_turns, states, ep, p)
          state = self._insert(params, state, *inserts, prompt_width=p)
        host = jax.device_get((state.column, state.turn_start,
                               state.ended_turn, state.done))
        column, start, ended, done = (np.asarray(x) for x in host)
        stopped = decoding & (ended | done)  # their turn is over
        for r in np.flatnonzero(stopped):
          ep.spans[r].append((int(start[r]), int(column[r]), "model"))
          ep.turns[r] += 1
        taken = np.flatnonzero(stopped & ended & ~done)
        taken_turns = (jax.device_get(state.tokens), column, start)
        decoding = (decoding & ~stopped) | resumed
      rollout = _to_rollout(jnp.asarray(tokens_NxP), jnp.asarray(mask_NxP),
                            state, ep.turn_rewards(self.config.max_new_tokens))
    return ep.episodes(rollout, prompts, self.runner.restarts)

  def _step(self, taken, turns, states, ep: "_Bookkeeping", p: int):
    """Steps the environments of the ``taken`` rows: the arrays of
    ``_insert`` and the rows that go on."""
    del p
    toks, column, start = turns
    n, t = toks.shape
    o = self.turns.max_observation_tokens
    eos = set(self.config.eos_ids)
    actions, ended_eos = [], []
    for r in taken:
      ids = [int(x) for x in toks[r, start[r]:column[r]]]
      ended_eos.append(bool(ids) and ids[-1] in eos)
      actions.append(self.tokenizer.decode([x for x in ids if x not in eos]))
    outcomes = ep.timed(lambda: self.runner.step([states[r] for r in taken],
                                                 actions))
    obs = np.full((n, o), self.config.pad_id, np.int32)
    obs_len = np.zeros(n, np.int32)
    resume, end, env_done = (np.zeros(n, bool) for _ in range(3))
    for r, outcome, eos_end in zip(taken, outcomes, ended_eos):
      if outcome.status != "ok":
        ep.fail(r, outcome)
        end[r] = True
        continue
      value = outcome.value
      states[r] = value["state"]
      if value["reward"] is not None:
        ep.reward[r] += value["reward"]
        # The turn the step answered ends at column - 1.
        ep.rewards_at[r].append((int(column[r]) - 1, value["reward"]))
      for k, v in value["info"].items():
        ep.info[k] = ep.info.get(k, 0.0) + v
      if value["done"]:
        end[r] = env_done[r] = True
        continue
      if ep.turns[r] >= self.turns.max_turns:
        end[r] = True
        ep.turn_limit += 1
        continue
      ids = self.format.encode(value["observation"], eos_end)
      room = min(o, t - int(column[r]) - 1)  # keep one model token
      if room < len(ids):
        ep.truncated_obs += 1
      if room <= 0 and ids:
        end[r] = True  # no room for the observation and a reply
        continue
      ids = ids[:max(room, 0)]
      obs[r, :len(ids)] = ids
      obs_len[r] = len(ids)
      ep.obs_tokens += len(ids)
      resume[r] = True
      if ids:
        ep.spans[r].append((int(column[r]), int(column[r]) + len(ids),
                            "observation"))
    return (obs, obs_len, resume, end, env_done), resume


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
  out = np.zeros(n, bool)
  out[rows] = True
  return out


class _Bookkeeping:
  """The host's figures of one ``run``: rewards, failures, turns, spans."""

  def __init__(self, n: int):
    self.failed = np.zeros(n, bool)
    self.reward = np.zeros(n, np.float64)
    self.rewards_at: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    self.turns = np.zeros(n, np.int32)
    self.spans: list[list[tuple[int, int, str]]] = [[] for _ in range(n)]
    self.info: dict[str, float] = {}
    self.counts = {"errors": 0, "timeouts": 0}
    self.obs_tokens = self.truncated_obs = self.turn_limit = 0
    self.env_seconds = 0.0

  def timed(self, fn):
    t = time.monotonic()
    try:
      return fn()
    finally:
      self.env_seconds += time.monotonic() - t

  def fail(self, r: int, outcome) -> None:
    self.failed[r] = True
    self.counts["errors" if outcome.status == "error" else "timeouts"] += 1
    logging.getLogger("rljax").warning("environment %s: %s", outcome.status,
                                       outcome.message)

  def turn_rewards(self, t: int) -> np.ndarray:
    """``[N, T]`` float32: each step's reward on its turn's last model
    token; a failed episode's row is 0 (its ``env`` reward is NaN)."""
    out = np.zeros((len(self.failed), t), np.float32)
    for r, pairs in enumerate(self.rewards_at):
      if not self.failed[r]:
        for column, reward in pairs:
          out[r, column] += reward
    return out

  def episodes(self, rollout, prompts, restarts: int) -> Episodes:
    metrics = {
        "env/turns/mean": float(self.turns.mean()),
        "env/turns/max": float(self.turns.max()),
        "env/observation_tokens": float(self.obs_tokens),
        "env/observation_truncated": float(self.truncated_obs),
        "env/turn_limit": float(self.turn_limit),
        "env/failed_episodes": float(self.failed.sum()),
        "env/errors": float(self.counts["errors"]),
        "env/timeouts": float(self.counts["timeouts"]),
        "env/worker_restarts": float(restarts),
        "time/env": self.env_seconds,  # within time/sample
    }
    metrics.update({f"env/{k}": float(v) for k, v in self.info.items()})
    return Episodes(rollout, prompts,
                    np.where(self.failed, np.nan, self.reward), self.failed,
                    metrics, self.spans)


__all__ = ["Episodes", "MultiTurnSampler", "ObservationFormat", "TurnConfig"]
