"""The rollout sampler: one prefill, then one ``lax.while_loop`` of decode steps.

Layout. ``B`` prompts are left-padded to a bucket length ``P`` and each gets
``G`` samples; rollout rows are group-contiguous (row ``i`` is sample
``i % G`` of prompt ``i // G``), ``N = B * G``.

Shared group prefixes. The prompts are prefilled once, on ``B`` rows, into a
prefix cache ``[B, K, P, H]`` per layer. The decode cache holds only the
generated tokens, ``[N, T, K, H]``, and every decode step attends to the
prefix of its group through ``models.attend``'s prefix path, so a prompt is
neither recomputed nor copied ``G`` times. ``share_prefix=False`` repeats the
prompts instead (the baseline the benchmark compares with).

Per generated token the ``Rollout`` keeps up to two logprobs:
  * ``sampler_logprobs``: the log-probability under the distribution that
    was actually sampled from (temperature, then top-k / top-p / min-p,
    renormalised); 0 for greedy. Every off-policy correction's behaviour
    policy.
  * ``policy_logprobs`` (only with ``record_policy_logprobs=True``, else
    None): ``log softmax(logits / training_temperature)[y]``, full
    vocabulary: what the trainer's recomputation gives on-policy. The
    trainer's ``old_logprobs="sampler"`` (bypass) mode uses it as
    ``pi_old``; it costs a ``log_softmax`` over the vocabulary per decode
    step, so it is off by default.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax.models import (Decoder, KVCache, ModelConfig, compute_logits,
                          init_cache, output_projection, positions_from_mask)
from rljax.models.transformer import DECODE_BLOCK
from rljax.sampling.decode_cache import (_cache_slots, _gather_cache, _grow,
                                         _round_up, segment_ends,
                                         shrink_levels)
from rljax.sampling.methods import SamplingMethod

_CACHE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static settings of ``sample`` (frozen and hashable).

  Attributes:
    num_samples: samples per prompt (the group size G).
    max_new_tokens: generated tokens per sample at most (T).
    method: how tokens are drawn (temperature, top-k, top-p, min-p, greedy).
    training_temperature: temperature of ``Rollout.policy_logprobs``.
    eos_ids: token ids that end a sample (the EOS is part of the completion).
    stop_sequences: token sequences that end a sample (kept in the completion).
    pad_id: id written after a sample ends.
    cache_dtype: ``"bfloat16"``, ``"float32"`` or None (the default): the
      model's compute dtype ``ModelConfig.dtype``, so a float32 model decodes
      with a float32 cache. bfloat16 halves the cache's memory; on a CPU it
      decodes slower (XLA:CPU widens it element by element;
      ``launch/bench_sampler.py``), on accelerators it is the norm.
    prompt_buckets: allowed padded prompt lengths; a batch is padded to the
      smallest bucket that fits its longest prompt, so a few shapes compile.
    share_prefix: prefill each prompt once and share its cache in the group.
    record_policy_logprobs: also keep ``Rollout.policy_logprobs``.
    segment_slots: decode-step count of the first length segment; each next
      segment doubles it (``segment_ends``), and a segment's decode cache
      has only the slots its steps can fill, so decode cost follows the live
      length. None: one segment of ``max_new_tokens`` slots. Segmenting
      changes no token and no logprob (``tests/test_sampler_segments.py``).
    shrink_batch_to: the smallest decode batch, or None (the default: every
      row decodes until the last one ends). As rows end, the live ones are
      gathered into a batch half the size whenever they fit in it
      (``shrink_levels``), down to this many rows, so a long-tailed batch
      stops paying for its finished rows: a decode step's cost grows with
      its rows (``launch/bench_rollout.py``). The same tokens, to float
      rounding: a smaller batch may round its matmuls differently.
  """

  num_samples: int = 1
  max_new_tokens: int = 32
  method: SamplingMethod = SamplingMethod()
  training_temperature: float = 1.0
  eos_ids: tuple[int, ...] = ()
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  pad_id: int = 0
  cache_dtype: str | None = None
  prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
  share_prefix: bool = True
  record_policy_logprobs: bool = False
  segment_slots: int | None = 64
  shrink_batch_to: int | None = None

  def __post_init__(self):
    if self.shrink_batch_to is not None and (
        isinstance(self.shrink_batch_to, bool)
        or not isinstance(self.shrink_batch_to, int)
        or self.shrink_batch_to < 1):
      raise ValueError(f"sampler.shrink_batch_to={self.shrink_batch_to!r}: a "
                       "positive integer or None is required.")
    if self.segment_slots is not None and (
        not isinstance(self.segment_slots, int) or self.segment_slots < 1):
      raise ValueError(f"sampler.segment_slots={self.segment_slots!r}: a "
                       "positive integer or None is required.")
    for name in ("num_samples", "max_new_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"sampler.{name}={value!r}: a positive integer is required.")
    if self.cache_dtype is not None and self.cache_dtype not in _CACHE_DTYPES:
      raise ValueError(f"sampler.cache_dtype={self.cache_dtype!r}: accepted "
                       f"{tuple(_CACHE_DTYPES) + (None,)}.")
    if not self.training_temperature > 0:
      raise ValueError(
          f"sampler.training_temperature={self.training_temperature!r}: a "
          "positive number is required.")
    buckets = self.prompt_buckets
    if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
      raise ValueError(f"sampler.prompt_buckets={buckets!r}: a non-empty tuple "
                       "of positive integers is required.")
    if any(not s for s in self.stop_sequences):
      raise ValueError(f"sampler.stop_sequences={self.stop_sequences!r}: "
                       "empty stop sequences are not allowed.")

  def replace(self, **changes: Any) -> "SamplerConfig":
    return dataclasses.replace(self, **changes)


class Rollout(NamedTuple):
  """Sampled completions; rows are group-contiguous, ``N = B * G``.

  Attributes:
    prompt_tokens: ``[N, P]`` int32, left-padded prompt of each row.
    prompt_mask: ``[N, P]`` bool, real prompt tokens.
    completion_tokens: ``[N, T]`` int32, ``pad_id`` after the end.
    completion_mask: ``[N, T]`` bool, generated tokens up to and including the
      EOS token or the last token of a stop sequence.
    lengths: ``[N]`` int32, ``completion_mask.sum(-1)``.
    finished: ``[N]`` bool, ended by EOS or a stop sequence (False: truncated
      at ``max_new_tokens``).
    policy_logprobs: ``[N, T]`` fp32, under the policy at the training
      temperature, full vocabulary (0 where masked); None unless the
      sampler was built with ``record_policy_logprobs=True``.
    sampler_logprobs: ``[N, T]`` fp32, under the distribution sampled from
      (0 where masked).
    observation_mask: ``[N, T]`` bool, tokens inserted by an environment
      (``rljax.envs``: observations between model turns; inputs, never
      trained, sampler logprob 0), or None (every completion token was
      sampled).
    turn_rewards: ``[N, T]`` fp32, the rewards an environment's steps gave,
      each on the last model token of the turn the step answered (0
      elsewhere; a failed episode's row is 0), or None (no environment).
      The trainer turns them into per-token rewards
      (``train.batch_layout.token_rewards``).
    tree_nodes: ``[N, D]`` int32, a tree rollout's ancestors
      (``rljax/sampling/tree.py``): column ``d`` is the node of depth ``d``
      (its index among its prompt's nodes of that depth) the row descends
      from, so rows that agree on columns ``<= d`` share their first
      ``(d + 1) * segment_tokens`` tokens; None for independent rows.
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  completion_tokens: jax.Array
  completion_mask: jax.Array
  lengths: jax.Array
  finished: jax.Array
  policy_logprobs: jax.Array | None
  sampler_logprobs: jax.Array
  observation_mask: jax.Array | None = None
  turn_rewards: jax.Array | None = None
  tree_nodes: jax.Array | None = None

  def sequences(self) -> tuple[jax.Array, jax.Array]:
    """``(tokens_NxL, mask_NxL)``: prompt and completion, ``L = P + T``."""
    return (jnp.concatenate([self.prompt_tokens, self.completion_tokens], 1),
            jnp.concatenate([self.prompt_mask, self.completion_mask], 1))

  def sampled_mask(self) -> jax.Array:
    """``[N, T]`` bool, the sampled completion tokens (the trained ones):
    ``completion_mask`` less the ``observation_mask``."""
    if self.observation_mask is None:
      return self.completion_mask
    return self.completion_mask & ~self.observation_mask


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= ``length``; a clear error when none fits."""
  fitting = [b for b in sorted(buckets) if b >= length]
  if not fitting:
    raise ValueError(
        f"a prompt of {length} tokens is longer than the largest of "
        f"sampler.prompt_buckets={tuple(sorted(buckets))}: add a bucket >= "
        f"{length} or shorten the prompt.")
  return fitting[0]


def pad_prompts(prompts: Sequence[Sequence[int]], buckets: Sequence[int],
                pad_id: int = 0, *, longest: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to a bucket: ``(tokens_BxP int32, mask_BxP bool)``.

  The bucket fits the longest prompt, or ``longest`` tokens when given (the
  longest prompt of the whole batch, when this process holds a block of it).
  """
  if not prompts:
    raise ValueError("prompts is empty: at least one prompt is required.")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("a prompt has no tokens: every prompt needs at least one "
                     "token (e.g. BOS).")
  width = pick_bucket(max([len(p) for p in prompts] + [longest or 0]), buckets)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    tokens[i, width - len(p):] = p
    mask[i, width - len(p):] = True
  return tokens, mask


class _LoopState(NamedTuple):
  step: jax.Array              # [] int32, decode steps taken (slot index - base)
  logits: jax.Array            # [N, V] fp32, predicting each row's `column`
  cache: KVCache
  tokens: jax.Array            # [N, T] int32
  mask: jax.Array              # [N, T] bool
  policy_logp: jax.Array | None  # [N, T] fp32 (record_policy_logprobs)
  sampler_logp: jax.Array      # [N, T] fp32
  column: jax.Array            # [N] int32, completion column of the next token
  done: jax.Array              # [N] bool
  finished: jax.Array          # [N] bool
  next_position: jax.Array     # [N] int32


def row_keys(key: jax.Array, num_rows: int) -> jax.Array:
  """``[num_rows]`` keys, row ``r``'s ``fold_in(key, r)``.

  Row ``r``'s token at completion column ``j`` is drawn with
  ``fold_in(row_keys[r], j)`` (``token_keys``) and nothing else, so a row's
  sample does not depend on the batch it is decoded in: the static sampler,
  a mesh-padded batch, SPEC-RL's continuation and continuous batching's
  refilled slots give the same row the same draws.
  """
  return jax.vmap(jax.random.fold_in, (None, 0))(
      key, jnp.arange(num_rows, dtype=jnp.uint32))


def token_keys(keys_N: jax.Array, column_N: jax.Array) -> jax.Array:
  """The key of each row's token at ``column_N`` (``row_keys``)."""
  return jax.vmap(jax.random.fold_in)(keys_N, column_N.astype(jnp.uint32))


def _ended(tokens_NxT, column_N, token_N, eos_V, stop_sequences):
  """Whether ``token_N``, just written at ``column_N``, ends its row."""
  hit = jnp.any(token_N[:, None] == eos_V[None], axis=1)
  for seq in stop_sequences:
    offsets = jnp.arange(1 - len(seq), 1, dtype=jnp.int32)
    cols = column_N[:, None] + offsets[None]
    window = jnp.take_along_axis(tokens_NxT, jnp.maximum(cols, 0), axis=1)
    hit = hit | jnp.all((window == jnp.asarray(seq, jnp.int32)) & (cols >= 0),
                        axis=1)
  return hit


# The decode API the samplers share (this module's, continuous.py's,
# speculative.py's and the multi-turn rollout's, rljax/rollout/multi_turn.py):
# decode_setup, decode_step, pick_logprob, sampled_logprobs, fused_logprobs,
# row_keys and token_keys.


def pick_logprob(logp_xV, token_x):
  """``logp_xV[..., token_x]``: each token's entry of its log-distribution."""
  return jnp.take_along_axis(logp_xV, token_x[..., None], -1)[..., 0]


def sampled_logprobs(logits_xV, token_x, sc: SamplerConfig):
  """``(sampler_logp_x, policy_logp_x)`` of ``token_x`` (any leading shape).

  The sampler's is under the sampled distribution (0 for greedy); the
  policy's under ``training_temperature`` with the full vocabulary. With no
  truncation and equal temperatures the two are one ``log_softmax``.
  """
  m = sc.method
  if m.greedy:
    sampler_logp = jnp.zeros(token_x.shape, jnp.float32)
  else:
    sampler_logp = pick_logprob(jax.nn.log_softmax(m.truncated_logits(logits_xV), -1),
                         token_x)
  if fused_logprobs(sc):
    return sampler_logp, sampler_logp
  return sampler_logp, pick_logprob(jax.nn.log_softmax(
      logits_xV.astype(jnp.float32) / sc.training_temperature, -1), token_x)


def fused_logprobs(sc: SamplerConfig) -> bool:
  """Whether the policy logprob is the sampler's (same distribution)."""
  m = sc.method
  return (not m.greedy and not getattr(m, "greedy_every", 0)
          and m.top_k is None and m.min_p is None
          and (m.top_p is None or m.top_p >= 1.0)
          and m.temperature == sc.training_temperature)


_ROW_FIELDS = ("tokens", "mask", "policy_logp", "sampler_logp", "column",
               "done", "finished", "next_position")


def decode_step(params, state: _LoopState, keys_N, *, model, w_DxV,
                mc: ModelConfig, sc: SamplerConfig, choose=None) -> _LoopState:
  """One decode step of every row: draws each live row's token at its
  ``column`` (``token_keys``), writes it and its logprobs, and runs the
  decoder on it at the cache's next slot. Rows that are done write nothing.
  The step of ``_decode``'s loops, of the tree rollout
  (``rljax/sampling/tree.py``) and of LATR's (``rljax/sampling/latr.py``,
  whose ``choose(state, token_N, sampler_logp_N) -> (token_N,
  sampler_logp_N)`` replaces some rows' draws)."""
  t = sc.max_new_tokens
  eos = jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32)
  cols_T = jnp.arange(t, dtype=jnp.int32)
  i = state.step
  token, sampler_logp = sc.method.get_next_tokens(
      state.logits, token_keys(keys_N, state.column))
  if choose is not None:
    token, sampler_logp = choose(state, token, sampler_logp)
  live = ~state.done
  token = jnp.where(live, token, sc.pad_id)
  policy_logp = None
  if sc.record_policy_logprobs:
    policy_logp = (sampler_logp if fused_logprobs(sc) else pick_logprob(
        jax.nn.log_softmax(state.logits / sc.training_temperature, -1),
        token))
  at_NxT = (cols_T[None] == state.column[:, None]) & live[:, None]

  def put(buffer, value):
    return jnp.where(at_NxT, value[:, None].astype(buffer.dtype), buffer)

  tokens = put(state.tokens, token)
  ended = live & _ended(tokens, state.column, token, eos, sc.stop_sequences)
  hidden, cache = model.apply(
      {"params": params}, token[:, None], state.next_position[:, None],
      state.cache, input_mask_BxT=live[:, None])
  logits = compute_logits(hidden, w_DxV, mc.final_logit_softcap)[:, 0]
  column = state.column + live.astype(jnp.int32)
  return _LoopState(
      step=i + 1,
      logits=sharding.constrain(logits, ("batch", "act_vocab")),
      cache=cache,
      tokens=tokens,
      mask=state.mask | at_NxT,
      policy_logp=(None if policy_logp is None
                   else put(state.policy_logp, policy_logp)),
      sampler_logp=put(state.sampler_logp, sampler_logp),
      column=column,
      done=state.done | ended | (column >= t),
      finished=state.finished | ended,
      next_position=state.next_position + 1)


def _decode(params, state: _LoopState, key, *, model, w_DxV, mc: ModelConfig,
            sc: SamplerConfig, base_slots: int,
            row_multiple: int = 1) -> _LoopState:
  """Runs decode steps until every row is done or ``max_new_tokens`` steps.

  Each row writes its next token at its own ``column`` (so rows may start
  at different columns: accepted speculative drafts now, refilled slots of
  continuous batching later), while the KV cache slot is shared:
  ``base_slots + step``. The steps run in segments (``segment_ends``); in a
  segment the decode cache has ``base_slots + segment end`` slots, so the
  attention of step ``i`` costs ``O(base + 2 i)``, not ``O(base + T)``.

  With ``sc.shrink_batch_to``, once the live rows fit in the next of
  ``shrink_levels`` they are gathered into it (a full-size cache, the prefix
  copied in: ``_gather_cache``) and decoding goes on there; each row's
  buffers are written back to its own row when its batch shrinks again and
  at the end. The returned state holds every row's per-row fields; its
  ``logits`` and ``cache`` are those of the last decode batch.
  """
  t = sc.max_new_tokens
  n_rows = state.column.shape[0]
  levels = shrink_levels(n_rows, sc.shrink_batch_to, row_multiple)
  body = functools.partial(decode_step, params, model=model, w_DxV=w_DxV,
                           mc=mc, sc=sc)

  run = functools.partial(decode_while, body)
  keys_N = row_keys(key, n_rows)
  fits = levels[1] if len(levels) > 1 else 0
  for end in segment_ends(t, sc.segment_slots):
    state = state._replace(cache=_grow(
        state.cache, _cache_slots(base_slots + end, base_slots + t)))
    state = run(state, keys_N, end, fits)
  if len(levels) == 1:
    return state
  return shrink_rest(state, keys_N, levels,
                     lambda s, keys, fits: run(s, keys, t, fits),
                     lambda cache, pick_n: _gather_cache(cache, pick_n,
                                                         sc.num_samples))


def decode_while(body, state: _LoopState, keys_N, end, fits=0
                 ) -> _LoopState:
  """``body(state, keys_N)`` (a decode step) while ``step < end`` and more
  than ``fits`` rows are live, in one ``lax.while_loop``."""
  return jax.lax.while_loop(
      lambda s: (s.step < end) & (jnp.sum(~s.done) > fits),
      lambda s: body(s, keys_N), state)


def shrink_rest(state: _LoopState, keys_N, levels: tuple[int, ...], run,
                gather_cache) -> _LoopState:
  """Decoding to the end in the smaller batches ``levels[1:]``
  (``shrink_levels``), once the full batch ``state`` has run until its live
  rows fit ``levels[1]``: each time, the live rows first are gathered into
  the next batch (``take_rows``; ``gather_cache(cache, pick_n)`` gives their
  cache) and ``run(state, keys, fits)`` decodes it until its live rows fit
  the level after. Each batch's rows go back to their own rows when it
  shrinks again and at the end; the returned state holds every row's
  per-row fields, and the last batch's ``logits`` and ``cache``. The static
  sampler's and the tree's last width (``sampling.tree``) shrink so."""
  full, rows_n = state, None
  for k, n in enumerate(levels[1:], start=1):
    pick_n = jnp.argsort(state.done, stable=True)[:n]  # the live rows first
    if rows_n is not None:  # this batch's rows back to their own rows
      full = _write_rows(full, rows_n, state)
    rows_n = pick_n if rows_n is None else rows_n[pick_n]
    state = take_rows(state, pick_n, gather_cache(state.cache, pick_n))
    fits = levels[k + 1] if k + 1 < len(levels) else 0
    state = run(state, jnp.take(keys_N, rows_n, axis=0), fits)
  full = _write_rows(full, rows_n, state)
  return full._replace(step=state.step, logits=state.logits,
                       cache=state.cache)


def take_rows(state: _LoopState, pick_n, cache) -> _LoopState:
  """The smaller decode batch of rows ``pick_n``: their logits and per-row
  fields, on ``cache`` (their rows of the cache, gathered by the caller:
  dense here, block tables in ``sampling.paged``)."""
  return state._replace(
      logits=jnp.take(state.logits, pick_n, axis=0), cache=cache,
      **{f: (None if getattr(state, f) is None
             else jnp.take(getattr(state, f), pick_n, axis=0))
         for f in _ROW_FIELDS})


def _write_rows(full: _LoopState, rows_n, state: _LoopState) -> _LoopState:
  """``full`` with rows ``rows_n`` of its per-row fields set to ``state``'s."""
  return full._replace(**{
      f: (None if getattr(full, f) is None
          else getattr(full, f).at[rows_n].set(getattr(state, f)))
      for f in _ROW_FIELDS})


def _prefill(params, prompt_tokens_BxP, prompt_mask_BxP, *, model,
             w_DxV, mc: ModelConfig, sc: SamplerConfig, cache_dtype):
  """Prompt forward: ``(hidden_NxD of each row's last prompt token, cache)``.

  With ``share_prefix`` the ``B`` prompts fill a read-only prefix cache
  and the returned decode cache has 0 slots of its own; else the prompts are
  repeated ``G`` times into a ``P``-slot decode cache.
  """
  del w_DxV
  b, p = prompt_tokens_BxP.shape
  g = sc.num_samples
  if sc.share_prefix:
    prefix = init_cache(mc, b, p, cache_dtype)
    hidden, prefix = model.apply(
        {"params": params}, prompt_tokens_BxP,
        positions_from_mask(prompt_mask_BxP), prefix,
        input_mask_BxT=prompt_mask_BxP)
    return (jnp.repeat(hidden[:, -1], g, axis=0),
            init_cache(mc, b * g, 0, cache_dtype, prefix=prefix))
  tokens_NxP = jnp.repeat(prompt_tokens_BxP, g, axis=0)
  mask_NxP = jnp.repeat(prompt_mask_BxP, g, axis=0)
  # Exactly P slots where the whole cache fits one block (``_decode`` grows
  # it to P + T once), else whole blocks.
  slots = p if p + sc.max_new_tokens <= DECODE_BLOCK else _round_up(p)
  cache = init_cache(mc, b * g, slots, cache_dtype)
  hidden, cache = model.apply(
      {"params": params}, tokens_NxP, positions_from_mask(mask_NxP), cache,
      input_mask_BxT=mask_NxP)
  return hidden[:, -1], cache


def decode_setup(params, prompt_mask_BxP, mc: ModelConfig, sc: SamplerConfig):
  """``(decoder, w_DxV, cache dtype, prompt_len_N)`` of a decode: the model,
  its output projection, the KV cache's dtype (``SamplerConfig.cache_dtype``
  or the model's) and each of the ``B * num_samples`` rows' prompt length."""
  cache_dtype = (mc.jnp_dtype if sc.cache_dtype is None
                 else _CACHE_DTYPES[sc.cache_dtype])
  prompt_len_N = jnp.repeat(
      prompt_mask_BxP.astype(jnp.int32).sum(-1), sc.num_samples)
  return Decoder(mc), output_projection(params, mc), cache_dtype, prompt_len_N


def _empty_state(logits_NxV, cache, prompt_len_N, sc: SamplerConfig):
  n, t = logits_NxV.shape[0], sc.max_new_tokens
  zeros_f = jnp.zeros((n, t), jnp.float32)
  return _LoopState(
      step=jnp.zeros((), jnp.int32),
      logits=sharding.constrain(logits_NxV, ("batch", "act_vocab")),
      cache=cache, tokens=jnp.full((n, t), sc.pad_id, jnp.int32),
      mask=jnp.zeros((n, t), jnp.bool_),
      policy_logp=zeros_f if sc.record_policy_logprobs else None,
      sampler_logp=zeros_f, column=jnp.zeros((n,), jnp.int32),
      done=jnp.zeros((n,), jnp.bool_), finished=jnp.zeros((n,), jnp.bool_),
      next_position=prompt_len_N)


def _to_rollout(prompt_tokens_BxP, prompt_mask_BxP, final: _LoopState,
                sc: SamplerConfig) -> Rollout:
  g = sc.num_samples
  return Rollout(
      prompt_tokens=jnp.repeat(prompt_tokens_BxP, g, axis=0),
      prompt_mask=jnp.repeat(prompt_mask_BxP, g, axis=0),
      completion_tokens=final.tokens,
      completion_mask=final.mask,
      lengths=final.mask.sum(-1).astype(jnp.int32),
      finished=final.finished,
      policy_logprobs=final.policy_logp,
      sampler_logprobs=final.sampler_logp)


def _sample_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key, *,
                 model_config: ModelConfig, config: SamplerConfig,
                 row_multiple: int = 1) -> Rollout:
  mc, sc = model_config, config
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, prompt_len_N = decode_setup(params, prompt_mask_BxP,
                                                   mc, sc)
  hidden_NxD, cache = _prefill(params, prompt_tokens_BxP, prompt_mask_BxP,
                               model=model, w_DxV=w_DxV, mc=mc, sc=sc,
                               cache_dtype=cache_dtype)
  logits = compute_logits(hidden_NxD[:, None], w_DxV,
                          mc.final_logit_softcap)[:, 0]
  state = _empty_state(logits, cache, prompt_len_N, sc)
  final = _decode(params, state, key, model=model, w_DxV=w_DxV, mc=mc, sc=sc,
                  base_slots=cache.mask.shape[1], row_multiple=row_multiple)
  return _to_rollout(prompt_tokens_BxP, prompt_mask_BxP, final, sc)


sample = jax.jit(_sample_impl, static_argnames=("model_config", "config",
                                                "row_multiple"))
sample.__doc__ = """Samples ``G`` completions per prompt (jit-compiled).

Args:
  params: policy params (sharded or not).
  prompt_tokens_BxP: int32, left-padded prompts (see ``pad_prompts``).
  prompt_mask_BxP: bool, real prompt tokens; every row has at least one.
  key: PRNG key; the same key gives the same samples.
  model_config: static model config.
  config: static ``SamplerConfig``.

Returns:
  A ``Rollout`` of ``N = B * G`` group-contiguous rows.
"""
