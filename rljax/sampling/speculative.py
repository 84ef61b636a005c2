"""SPEC-RL speculative rollouts: an earlier rollout of the same prompt is the draft.

For a prompt sampled before (an epoch over the dataset, or replay), the
previous rollout of the same prompt and sample slot is the draft. The
current policy verifies the whole draft in one parallel forward pass (which
also fills the KV cache of every draft slot), keeps the accepted prefix of
each row, and the ordinary decode loop (``sampler._decode``) continues each
row from its own first rejected column.

Acceptance rule (SPEC-RL's ``spec_cut_with_knobs`` with ``scale = 1`` and
``bias = -log_lenience``). Draft token ``y_j`` was drawn with recorded log
probability ``lp_old_j`` (its ``sampler_logprobs``); under the current
sampling distribution (temperature, top-k / top-p / min-p of ``config``)
it has ``lp_new_j``. With ``u_j ~ U(0, 1)`` the row keeps
``a = min{j : log u_j > log_lenience + lp_new_j - lp_old_j}`` draft
tokens, i.e. token ``j`` is accepted with probability
``min(1, lenience * p_new / p_old)``; greedy decoding accepts exactly the
tokens that are the current argmax. The token at the first rejected column
is drawn from the current policy itself.

Exactness. This is *lenient*, not exact, for ``log_lenience >= 0``:
exact speculative sampling (Leviathan et al. 2023) draws the rejected
position from the residual ``max(0, p_new - p_old)``, which needs the old
policy's full distribution at that position; only the drafted token's old
logprob is stored. The marginal of a kept token is
``q(y) min(1, l p(y)/q(y)) + (1 - sum_y' q(y') min(1, l p(y')/q(y'))) p(y)``
(``q`` old, ``p`` new, ``l`` lenience), which equals ``p`` when ``q == p``
and moves towards ``q`` as ``l`` grows; ``tests/test_spec_rl.py`` checks
the sampler against this formula with a chi-square test and reports its
distance to ``p``. It is exact in two cases: a draft from the current
policy (every token is accepted, the output is the draft) and greedy
decoding (and the greedy rows of ``SamplingMethod.greedy_every``).

Logprobs. An accepted token's ``sampler_logprobs`` is ``lp_new`` (its
logprob under the current sampling distribution: the distribution it
would have been drawn from; under the lenient rule its actual acceptance
probability is not a per-token distribution, so this is the defined choice)
and a drawn token's is as in plain sampling. ``policy_logprobs`` is always
under the current policy at the training temperature, so the trainer's
importance corrections see the current policy exactly.

References:
  Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning via
  Speculative Rollouts", https://arxiv.org/abs/2509.23232, code
  github.com/ShopeeLLM/Spec-RL (``verl/utils/speculative_decoding.py``).
  Leviathan et al., "Fast Inference from Transformers via Speculative
  Decoding", https://arxiv.org/abs/2211.17192.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models import ModelConfig, compute_logits
from rljax.models import paged_cache as pc
from rljax.sampling import paged as paged_lib
from rljax.sampling import slot_pages
from rljax.sampling.jitting import mesh_shardings, pad_rows
from rljax.sampling.sampler import (Rollout, SamplerConfig, _decode, _ended,
                                    _LoopState, _grow, _prefill,
                                    _round_up, decode_setup, _to_rollout,
                                    row_keys, sampled_logprobs)

_VERIFY_CHUNK = 128  # draft positions whose [N, chunk, V] logits exist at once


class Draft(NamedTuple):
  """Draft completions, one per rollout row (``N = B * G``, group-contiguous).

  Attributes:
    tokens: ``[N, T]`` int32, an earlier completion of the row's prompt.
    mask: ``[N, T]`` bool, its real tokens (all False: no draft for the row).
    logprobs: ``[N, T]`` fp32, their ``sampler_logprobs`` when drawn.
  """

  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array


def _speculative_impl(params, prompt_tokens_BxP, prompt_mask_BxP, draft: Draft,
                      key, *, model_config: ModelConfig, config: SamplerConfig,
                      log_lenience: float, row_multiple: int = 1
                      ) -> tuple[Rollout, jax.Array]:
  mc, sc = model_config, config
  t = sc.max_new_tokens
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, prompt_len_N = decode_setup(params, prompt_mask_BxP,
                                                   mc, sc)
  last_NxD, cache = _prefill(params, prompt_tokens_BxP, prompt_mask_BxP,
                             model=model, w_DxV=w_DxV, mc=mc, sc=sc,
                             cache_dtype=cache_dtype)
  draft_mask_NxT = draft.mask.astype(jnp.bool_)
  start = cache.index
  cache = _grow(cache, _round_up(cache.mask.shape[1] + t))
  cols_T = jnp.arange(t, dtype=jnp.int32)
  hidden_NxTxD, cache = model.apply(
      {"params": params}, draft.tokens, prompt_len_N[:, None] + cols_T[None],
      cache, input_mask_BxT=draft_mask_NxT)
  key_accept, key_decode = jax.random.split(key)
  state = _verified_state(last_NxD, hidden_NxTxD, draft, key_accept, cache,
                          prompt_len_N, w_DxV=w_DxV, mc=mc, sc=sc,
                          log_lenience=log_lenience)
  # Rejected draft slots stay in the cache but are never attended to again.
  state = state._replace(cache=cache._replace(mask=jax.lax.dynamic_update_slice(
      cache.mask, state.mask, (0, start))))
  final = _decode(params, state, key_decode, model=model, w_DxV=w_DxV, mc=mc,
                  sc=sc, base_slots=cache.mask.shape[1],
                  row_multiple=row_multiple)
  return (_to_rollout(prompt_tokens_BxP, prompt_mask_BxP, final, sc),
          state.column)  # the draft tokens each row kept


def _speculative_paged_impl(params, prompt_tokens_BxP, prompt_mask_BxP,
                            draft: Draft, key, *, model_config: ModelConfig,
                            config: SamplerConfig, log_lenience: float,
                            paged: Any, row_multiple: int = 1
                            ) -> tuple[Rollout, jax.Array, dict]:
  """``_speculative_impl`` on a paged KV cache (``sampling.paged``): each
  group's prompt is prefilled once into blocks its rows share; each row
  reserves blocks for its whole draft (copying the block its prompt ends
  in), the verification pass writes them, and a row keeps only the blocks
  of the tokens it accepted before decoding on (``paged.paged_decode``).
  The same rows as the dense cache's; also the pool's figures."""
  mc, sc = model_config, config
  t = sc.max_new_tokens
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, prompt_len_N = decode_setup(
      params, prompt_mask_BxP, mc, sc)
  b, p = prompt_tokens_BxP.shape
  g = sc.num_samples
  n = b * g
  hidden_BxD, cache, failed_B, num_blocks = paged_lib.prefill_prompts(
      params, prompt_tokens_BxP, prompt_mask_BxP, model=model, mc=mc,
      rows_per_prompt=g, dtype=cache_dtype, paged=paged, pool_rows=n,
      max_new_tokens=t)
  no_prompt_N = jnp.repeat(failed_B, g)
  cache, failed_N = pc.reserve(cache, ~no_prompt_N, t)
  cut_N = no_prompt_N | failed_N  # rows with no room for their draft
  peak = pc.blocks_in_use(cache)
  cols_T = jnp.arange(t, dtype=jnp.int32)
  hidden_NxTxD, cache = model.apply(
      {"params": params}, draft.tokens, prompt_len_N[:, None] + cols_T[None],
      cache, input_mask_BxT=draft.mask.astype(jnp.bool_))
  key_accept, key_decode = jax.random.split(key)
  state = _verified_state(jnp.repeat(hidden_BxD, g, axis=0), hidden_NxTxD,
                          draft, key_accept, cache, prompt_len_N, w_DxV=w_DxV,
                          mc=mc, sc=sc, log_lenience=log_lenience)
  kept = state.mask & ~cut_N[:, None]
  accepted_N = jnp.where(cut_N, 0, state.column)
  cache = slot_pages.set_lengths(cache, jnp.arange(n), p + accepted_N)
  done = state.done | cut_N
  state = state._replace(
      cache=pc.release(cache, done), mask=kept, column=accepted_N, done=done,
      finished=state.finished & ~cut_N,
      tokens=jnp.where(kept, state.tokens, sc.pad_id),
      sampler_logp=jnp.where(kept, state.sampler_logp, 0.0),
      policy_logp=(None if state.policy_logp is None
                   else jnp.where(kept, state.policy_logp, 0.0)),
      next_position=prompt_len_N + accepted_N)
  final, more_peak, cut = paged_lib.shrinking_decode(
      params, state, row_keys(key_decode, n), model=model, w_DxV=w_DxV,
      mc=mc, sc=sc, row_multiple=row_multiple)
  return (_to_rollout(prompt_tokens_BxP, prompt_mask_BxP, final, sc),
          accepted_N, paged_lib.pool_stats(
              final.cache, num_blocks, jnp.maximum(peak, more_peak),
              cut + jnp.sum(cut_N).astype(jnp.int32)))


def _verified_state(last_NxD, hidden_NxTxD, draft: Draft, key_accept, cache,
                    prompt_len_N, *, w_DxV, mc: ModelConfig,
                    sc: SamplerConfig, log_lenience: float) -> _LoopState:
  """The decode state after the verification pass: each row's accepted
  draft prefix (the acceptance rule of the module docstring) as its first
  tokens, and the logits that predict its next one. ``last_NxD``: the
  hidden state after each row's prompt; ``hidden_NxTxD``: after each draft
  token. Shared by the dense and the paged cache (``cache``, unchanged)."""
  t = sc.max_new_tokens
  cols_T = jnp.arange(t, dtype=jnp.int32)
  draft_mask_NxT = draft.mask.astype(jnp.bool_)
  # Row j of `before` is the hidden state that predicts draft token j.
  before_NxTxD = jnp.concatenate([last_NxD[:, None], hidden_NxTxD[:, :-1]], 1)
  sampler_lp, policy_lp, argmax = [], [], []
  for lo in range(0, t, _VERIFY_CHUNK):
    hi = min(lo + _VERIFY_CHUNK, t)
    logits = compute_logits(before_NxTxD[:, lo:hi], w_DxV,
                            mc.final_logit_softcap)
    s, p = sampled_logprobs(logits, draft.tokens[:, lo:hi], sc)
    sampler_lp.append(s)
    policy_lp.append(p)
    argmax.append(jnp.argmax(logits, -1).astype(jnp.int32))
  sampler_lp = jnp.concatenate(sampler_lp, 1)
  policy_lp = jnp.concatenate(policy_lp, 1)
  is_argmax = draft.tokens == jnp.concatenate(argmax, 1)
  accepted_N, sampler_lp = accept_prefix(
      sampler_lp, is_argmax, draft.logprobs, draft_mask_NxT, key_accept, sc,
      log_lenience)
  kept_NxT = cols_T[None] < accepted_N[:, None]
  tokens = jnp.where(kept_NxT, draft.tokens, sc.pad_id)
  next_NxD = jnp.take_along_axis(
      before_NxTxD, jnp.minimum(accepted_N, t - 1)[:, None, None], 1)
  logits = compute_logits(next_NxD, w_DxV, mc.final_logit_softcap)[:, 0]
  last = jnp.maximum(accepted_N - 1, 0)
  ended = (accepted_N > 0) & _ended(
      tokens, last, jnp.take_along_axis(tokens, last[:, None], 1)[:, 0],
      jnp.asarray(sc.eos_ids if sc.eos_ids else (-1,), jnp.int32),
      sc.stop_sequences)
  zero = jnp.zeros_like(sampler_lp)
  return _LoopState(
      step=jnp.zeros((), jnp.int32),
      logits=sharding.constrain(logits, ("batch", "act_vocab")),
      cache=cache, tokens=tokens, mask=kept_NxT,
      policy_logp=(jnp.where(kept_NxT, policy_lp, zero)
                   if sc.record_policy_logprobs else None),
      sampler_logp=jnp.where(kept_NxT, sampler_lp, zero),
      column=accepted_N, done=ended | (accepted_N >= t), finished=ended,
      next_position=prompt_len_N + accepted_N)


def check_lenience(log_lenience: float) -> None:
  """Raises a ``ValueError`` naming ``sampler.spec_log_lenience`` unless it
  is a number >= 0 (the acceptance rule's ``log l``)."""
  if not log_lenience >= 0:
    raise ValueError(f"sampler.spec_log_lenience={log_lenience!r}: a number "
                     ">= 0 is required.")


def accept_prefix(sampler_lp_NxS, is_argmax_NxS, draft_lp_NxS, draft_mask_NxS,
                  key, sc: SamplerConfig, log_lenience: float):
  """``(accepted_N, sampler_lp_NxS)``: how many draft tokens each row keeps
  under the acceptance rule (the module docstring; greedy decoding and the
  greedy rows of ``SamplingMethod.greedy_every`` keep the current argmax),
  and the sampler logprobs with a greedy row's set to 0. ``sampler_lp``:
  the draft tokens' logprobs under the current sampling distribution;
  ``key``: the uniforms' (one per row and column). The static batch's
  verification pass and the tree's per segment (``sampling.tree``)."""
  n, s = draft_mask_NxS.shape
  if sc.method.greedy:
    accept = is_argmax_NxS
  else:
    log_u = jnp.log(jax.random.uniform(key, (n, s)))
    accept = log_u <= log_lenience + sampler_lp_NxS - draft_lp_NxS
    every = getattr(sc.method, "greedy_every", 0)
    if every:  # ReMax's greedy row of each group (SamplingMethod.greedy_every)
      greedy_row = (jnp.arange(n) % every == every - 1)[:, None]
      accept = jnp.where(greedy_row, is_argmax_NxS, accept)
      sampler_lp_NxS = jnp.where(greedy_row, 0.0, sampler_lp_NxS)
  accept = accept & draft_mask_NxS.astype(jnp.bool_)
  return (jnp.sum(jnp.cumprod(accept.astype(jnp.int32), 1), 1),
          sampler_lp_NxS)


def make_speculative_sampler(model_config: ModelConfig, config: SamplerConfig,
                             mesh: jax.sharding.Mesh | None = None,
                             param_shardings: Any = None,
                             rules: sharding.Rules = sharding.DEFAULT_RULES,
                             *, log_lenience: float = 0.0, paged: Any = None):
  """A jitted ``fn(params, tokens_BxP, mask_BxP, draft, key) -> (Rollout, accepted_N)``.

  ``accepted_N`` (int32) is the number of draft tokens each row kept.
  Shardings and the padding of a prompt count that does not divide the
  batch axes are those of ``sampling.make_sampler`` (the draft rows are
  padded with the last prompt's rows).

  Args:
    model_config: static model config.
    config: the ``SamplerConfig`` of the rollouts (the same as plain
      sampling's: the draft only changes which tokens are proposed).
    mesh, param_shardings, rules: as ``make_sampler``.
    log_lenience: ``log l >= 0`` of the acceptance rule (module docstring):
      0 is SPEC-RL's strict rule, 0.5 its "lenience 0.5" runs.
    paged: a ``sampling.PagedConfig``: decode on a paged KV cache; the
      function then returns ``(Rollout, accepted_N, pool figures)``
      (``paged.pool_stats``).
  """
  check_lenience(log_lenience)
  fn = functools.partial(
      _speculative_impl if paged is None else functools.partial(
          _speculative_paged_impl, paged=paged),
      model_config=model_config, config=config,
      log_lenience=float(log_lenience))
  return jit_drafted(fn, config, mesh, param_shardings, rules,
                     with_stats=paged is not None)


def jit_drafted(fn, config: SamplerConfig, mesh: jax.sharding.Mesh | None,
                param_shardings: Any = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES, *,
                tree_nodes: bool = False, with_stats: bool = False):
  """``fn(params, tokens_BxP, mask_BxP, draft, key[, row_multiple]) ->
  (Rollout, accepted_N[, figures])`` jitted as ``make_sampler`` describes
  (``jitting.jit_rows``), the draft's rows padded with the prompts'.
  ``tree_nodes``: the ``Rollout`` has ``tree_nodes`` (the tree's drafted
  sampler, ``sampling.tree``); ``with_stats``: ``fn`` also returns a dict
  of scalars (a paged pool's figures), replicated."""
  if mesh is None:
    return jax.jit(fn)
  s = mesh_shardings(mesh, rules, config)
  b2 = s.batch2
  rollout = s.rollout._replace(tree_nodes=b2) if tree_nodes else s.rollout
  jitted = jax.jit(functools.partial(fn, row_multiple=s.ways),
                   in_shardings=(param_shardings, b2, b2, Draft(b2, b2, b2),
                                 s.replicated),
                   out_shardings=(rollout, s.batch1) + (
                       (s.replicated,) if with_stats else ()))
  g = config.num_samples

  def call(params, prompt_tokens_BxP, prompt_mask_BxP, draft: Draft, key):
    b = prompt_tokens_BxP.shape[0]
    extra = -b % s.ways
    prompt_tokens_BxP, prompt_mask_BxP = pad_rows(
        extra, prompt_tokens_BxP, prompt_mask_BxP)
    draft = Draft(*pad_rows(extra, *draft, block=g))
    with jax.set_mesh(mesh):
      rollout, accepted_N, *pool = jitted(params, prompt_tokens_BxP,
                                          prompt_mask_BxP, draft, key)
    if extra:
      n = b * g
      rollout = jax.tree.map(lambda x: x[:n], rollout)
      accepted_N = accepted_N[:n]
    return (rollout, accepted_N, *pool)
  call.jitted = jitted
  return call
