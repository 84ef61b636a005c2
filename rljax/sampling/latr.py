"""LATR: lookahead tree rollouts, branching at uncertain tokens.

LATR (Xing et al. 2025, "Lookahead Tree-Based Rollouts for Enhanced
Trajectory-Level Exploration in Reinforcement Learning with Verifiable
Rewards", arXiv:2510.24302; code github.com/starreeze/latr) grows part of
each prompt's group as a tree that forks at single tokens:

* ``m = round(G * mix_ratio)`` of the prompt's ``G`` rows are the tree's
  (``LatrConfig.tree_rows``); the other ``G - m`` are sampled as usual. The
  tree starts as one root; its other ``m - 1`` rows are empty slots.
* At each step a tree row's two most likely next tokens (the policy's
  probabilities, before the sampling temperature) are a branch point when
  the second has ``p2 > abs_threshold`` and ``p1 - p2 > rel_threshold``
  (the authors' ``ProbFilter``: an alternative with real mass that
  sampling would rarely take, the first being well ahead of it).
  The row then takes the first candidate and an empty slot of its prompt a
  copy of the row with the second (its buffers, next-token logits and KV
  cache rows; on a paged cache its block table: copy on write). Branch
  points past the empty slots are suppressed, in row order.
* Until the prompt's tree is full a tree row that does not branch takes its
  most likely token; once it is full (no empty slot) its rows sample
  (LATR's ``sample_nk="full"``). The other rows always sample.
* Lookahead pruning: ``k`` tokens after a branch was born (each ``k`` of
  ``lookahead``) its last ``k`` tokens are compared with its parent's same
  columns; an edit distance below ``edit_distance x k`` means the branch
  stayed similar, and it is removed (its slot empty again, its children
  compared with no one). Branches whose window holds an end of either row
  are not compared.
* When no prompt can still branch or prune (every tree full or without a
  live row, every branch older than the longest lookahead), the rows decode
  to the end as the static batch's (``sampler.shrink_batch_to`` applies);
  a slot still empty then is filled with a copy of its prompt's root row
  (LATR's ``fill_return_sequences``; ``latr/copies``).

The defaults are the authors' scripts' (``scripts/grpo-kt-math.sh``:
``prob_filter_abs_thres=0.15``, ``prob_filter_rel_thres=0.25``, two
candidates per token; their scripts prune by suffix match and ROUGE-L, the
edit-distance criterion here is their ``rollout_filter_edit_dist_thres``,
default 0.4). What differs from their code (``docs/rollouts.md``): the
mix ratio is constant (their scripts lower it over training); and a forced
token's sampler logprob (a first candidate, a branch's second) is the
policy's log-probability at the sampling temperature, not truncated by
top-k/top-p, as the distribution the other rows draw from.

Each row's draws are its own (``row_keys``); the rollout is an ordinary
group of ``G`` completions for every advantage.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rljax import sharding
from rljax.models import ModelConfig, compute_logits
from rljax.models import paged_cache as pc
from rljax.sampling import paged as paged_lib
from rljax.sampling.decode_cache import (_cache_slots, _gather_cache, _grow,
                                         shrink_levels)
from rljax.sampling import tree_drafts
from rljax.sampling.jitting import MeteredSampler, jit_rows
from rljax.sampling.sampler import (_ROW_FIELDS, Rollout, SamplerConfig,
                                    _empty_state, decode_setup, decode_step,
                                    decode_while, row_keys, shrink_rest)
from rljax.sampling.speculative import Draft, check_lenience, jit_drafted
from rljax.sampling.tree import gather_rows


@dataclasses.dataclass(frozen=True)
class LatrConfig:
  """How LATR branches and prunes (``rl.latr.*``; the module docstring).

  Attributes:
    mix_ratio: the share of a prompt's rows grown as its tree.
    abs_threshold: a branch point's second candidate has ``p2`` above it.
    rel_threshold: and ``p1 - p2`` above it.
    lookahead: steps after a branch's birth at which it is compared with its
      parent (the authors' ``rollout_filter_steps``).
    edit_distance: a branch whose last ``k`` tokens are within
      ``edit_distance x k`` edits of its parent's is pruned.
  """

  mix_ratio: float = 1.0
  abs_threshold: float = 0.15
  rel_threshold: float = 0.25
  lookahead: tuple[int, ...] = (30, 50)
  edit_distance: float = 0.4

  def __post_init__(self):
    for name in ("mix_ratio", "abs_threshold", "rel_threshold",
                 "edit_distance"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or (
          not 0 <= value <= 1):
        raise ValueError(f"rl.latr.{name}={value!r}: a number in [0, 1] is "
                         "required.")
    steps = self.lookahead
    if (not isinstance(steps, tuple) or not steps or any(
        isinstance(k, bool) or not isinstance(k, int) or k < 1
        for k in steps)):
      raise ValueError(f"rl.latr.lookahead={steps!r}: a non-empty tuple of "
                       "positive integers is required.")

  def replace(self, **changes) -> "LatrConfig":
    return dataclasses.replace(self, **changes)

  def tree_rows(self, num_samples: int) -> int:
    """``m``, the tree's rows of a group of ``num_samples``.

    Raises:
      ValueError: for fewer than 2 (a tree of one row never branches),
        naming the fields.
    """
    m = int(round(num_samples * self.mix_ratio))
    if m < 2:
      raise ValueError(
          f"rl.latr.mix_ratio={self.mix_ratio!r} of {num_samples} rows per "
          f"prompt (rl.group_size, with the advantage's extra rows) grows a "
          f"tree of {m} rows; accepted: at least 2 (mix_ratio >= "
          f"{1.5 / num_samples:.3g}).")
    return m


def edit_distance(a_NxK: jax.Array, b_NxK: jax.Array) -> jax.Array:
  """``[N]`` int32, the Levenshtein distance between rows of two token
  arrays: the dynamic programme one row of ``K + 1`` at a time, each row's
  insertions as a running minimum (``D[j] = j + min_{k <= j} (E[k] - k)``)."""
  n, k = a_NxK.shape
  cols = jnp.arange(k + 1, dtype=jnp.int32)

  def row(prev, a_n):
    cost = (a_n[:, None] != b_NxK).astype(jnp.int32)
    e = jnp.minimum(prev[:, 1:] + 1, prev[:, :-1] + cost)
    e = jnp.concatenate([prev[:, :1] + 1, e], 1)
    return cols + jax.lax.cummin(e - cols, axis=1), None

  first = jnp.broadcast_to(cols, (n, k + 1))
  last, _ = jax.lax.scan(row, first, a_NxK.T)
  return last[:, -1]


def last_tokens(tokens_NxT, column_N, k: int):
  """Each row's last ``k`` tokens before ``column_N``."""
  cols = jnp.clip(column_N[:, None] - k + jnp.arange(k), 0,
                  tokens_NxT.shape[1] - 1)
  return jnp.take_along_axis(tokens_NxT, cols, 1)


def spawn_slots(ok_N, empty_N, g: int):
  """``(src_N, spawn_N, branch_N, full_N)``: each empty slot that takes a
  branch and the row it copies (the ``k``-th branch point of a prompt goes
  to its ``k``-th empty slot; points past the empty slots are suppressed),
  the rows that branch, and whether the prompt has no empty slot left."""
  n = ok_N.shape[0]
  ok, empty = ok_N.reshape(-1, g), empty_N.reshape(-1, g)
  rank_ok = jnp.cumsum(ok, 1)
  rank_empty = jnp.cumsum(empty, 1)
  branch = ok & (rank_ok <= jnp.sum(empty, 1, keepdims=True))
  match = (empty[:, :, None] & branch[:, None, :]
           & (rank_empty[:, :, None] == rank_ok[:, None, :]))
  spawn = jnp.any(match, -1)
  src = (jnp.arange(ok.shape[0], dtype=jnp.int32)[:, None] * g
         + jnp.argmax(match, -1).astype(jnp.int32)).reshape(n)
  full = jnp.sum(empty, 1) == jnp.sum(spawn, 1)
  spawn = spawn.reshape(n)
  return (jnp.where(spawn, src, jnp.arange(n, dtype=jnp.int32)), spawn,
          branch.reshape(n), jnp.repeat(full, g))


def _latr_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key, *,
               model_config: ModelConfig, config: SamplerConfig,
               latr: LatrConfig, paged: paged_lib.PagedConfig | None = None,
               row_multiple: int = 1, draft: Draft | None = None,
               log_lenience: float = 0.0):
  mc, sc = model_config, config
  g, t = sc.num_samples, sc.max_new_tokens
  m = latr.tree_rows(g)
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, prompt_len_N = decode_setup(
      params, prompt_mask_BxP, mc, sc)
  b = prompt_tokens_BxP.shape[0]
  n = b * g
  # A shared prompt prefix and a dense cache per row, or blocks: a branch
  # shares its parent's (copy on write).
  hidden_BxD, cache, failed_B, num_blocks = paged_lib.prefill_prompts(
      params, prompt_tokens_BxP, prompt_mask_BxP, model=model, mc=mc,
      rows_per_prompt=g, dtype=cache_dtype, paged=paged, pool_rows=n,
      max_new_tokens=t)
  if paged is None:  # (a draft's pass writes t slots before the decode)
    slots = t if draft is None else 2 * t
    cache = _grow(cache, _cache_slots(slots, slots))
  failed = jnp.repeat(failed_B, g)
  logits_B = compute_logits(hidden_BxD[:, None], w_DxV,
                            mc.final_logit_softcap)[:, 0]
  state = _empty_state(jnp.repeat(logits_B, g, axis=0), cache, prompt_len_N,
                       sc)
  slot = jnp.arange(n, dtype=jnp.int32) % g
  tree_N = slot < m
  active = (slot == 0) | ~tree_N  # the root and the rows sampled as usual
  # Empty slots decode nothing until a branch takes them.
  state = state._replace(done=~active | failed)
  accepted = jnp.zeros((n,), jnp.int32)
  if draft is not None:
    # SPEC-RL: the rows sampled as usual verify the draft of their own
    # slot (a row the earlier rollout sampled as usual too) from the
    # prompt, and decode on from their first rejected token; the tree's
    # rows, whose tokens are forced or branch, draft nothing.
    state, _, accepted, cut = tree_drafts.verify_segment(
        params, state, jnp.where(tree_N, -1, slot), draft, g, g, 0, t,
        jax.random.split(key)[1], model=model, w_DxV=w_DxV, mc=mc, sc=sc,
        log_lenience=log_lenience,
        slots=None if paged is not None else (2 * t, 2 * t))
  keys_N = row_keys(key, n)
  step_fn = functools.partial(decode_step, params, model=model, w_DxV=w_DxV,
                              mc=mc, sc=sc)
  longest = max(latr.lookahead)
  zero = jnp.zeros((), jnp.int32)
  counts = {"branches": zero, "pruned": zero, "branch_points": zero,
            "tree_steps": zero,
            "cut": jnp.sum(failed).astype(jnp.int32) + (
                0 if draft is None else jnp.sum(cut).astype(jnp.int32)),
            "peak": zero if paged is None else pc.blocks_in_use(cache)}

  def can_change(c):
    s, active, parent, birth, _ = c
    live = ~s.done
    empty_G = (tree_N & ~active).reshape(b, g)
    tree_live_G = (tree_N & active & live).reshape(b, g)
    growing = jnp.any(jnp.any(empty_G, 1) & jnp.any(tree_live_G, 1))
    young = jnp.any(tree_N & active & (parent >= 0)
                    & (s.step - birth < longest))
    return (s.step < t) & jnp.any(live) & (growing | young)

  def body(c):
    s, active, parent, birth, counts = c
    probs = jax.nn.softmax(s.logits.astype(jnp.float32), -1)
    top_p, _ = jax.lax.top_k(probs, 2)
    live = ~s.done
    ok = (tree_N & active & live & (top_p[:, 1] > latr.abs_threshold)
          & (top_p[:, 0] - top_p[:, 1] > latr.rel_threshold))
    src, spawn, branch, full = spawn_slots(ok, tree_N & ~active, g)
    if paged is None:
      s = jax.lax.cond(jnp.any(spawn), lambda x: gather_rows(x, src),
                       lambda x: x, s)
    else:  # a fork moves tables only
      s = gather_rows(s, src)
    active = active | spawn
    parent = jnp.where(spawn, src, parent)
    birth = jnp.where(spawn, s.step, birth)
    _, top_id = jax.lax.top_k(s.logits, 2)
    temperature = 1.0 if sc.method.greedy else sc.method.temperature
    logp_V = jax.nn.log_softmax(s.logits.astype(jnp.float32) / temperature,
                                -1)
    forced = tree_N & (spawn | branch | ~full)
    forced_token = jnp.where(spawn, top_id[:, 1], top_id[:, 0])

    def choose(_, token, sampler_logp):
      return (jnp.where(forced, forced_token, token),
              jnp.where(forced, jnp.take_along_axis(
                  logp_V, forced_token[:, None], 1)[:, 0], sampler_logp))

    cut = jnp.zeros((n,), jnp.bool_)
    peak = counts["peak"]
    if paged is not None:  # the most blocks in use: after the reservations
      cache, cut = pc.reserve(s.cache, ~s.done, 1)
      s = s._replace(cache=cache, done=s.done | cut)
      peak = jnp.maximum(peak, pc.blocks_in_use(cache))
    before = s.done
    s = step_fn(s, keys_N, choose=choose)
    # Lookahead: a branch ``k`` tokens old is compared with its parent.
    prune = jnp.zeros((n,), jnp.bool_)
    for k in sorted(set(latr.lookahead)):
      if k > t:
        continue
      p_safe = jnp.maximum(parent, 0)
      due = (tree_N & active & (parent >= 0) & (s.step - birth == k)
             & ~s.done & ~s.done[p_safe] & active[p_safe])

      def compare(s=s, due=due, k=k, p_safe=p_safe):
        mine = last_tokens(s.tokens, s.column, k)
        theirs = last_tokens(s.tokens[p_safe], s.column, k)
        return due & (edit_distance(mine, theirs)
                      < latr.edit_distance * k)

      prune = prune | jax.lax.cond(jnp.any(due), compare,
                                   lambda: jnp.zeros((n,), jnp.bool_))
    active = active & ~prune
    parent = jnp.where(prune[jnp.maximum(parent, 0)] & (parent >= 0), -1,
                       parent)
    parent = jnp.where(prune, -1, parent)
    s = s._replace(done=s.done | prune)
    if paged is not None:
      ended = (s.done & ~before) | cut
      s = s._replace(cache=pc.release(s.cache, ended))
    counts = dict(
        counts, branches=counts["branches"] + jnp.sum(spawn),
        pruned=counts["pruned"] + jnp.sum(prune),
        branch_points=counts["branch_points"] + jnp.sum(ok),
        tree_steps=counts["tree_steps"] + 1,
        cut=counts["cut"] + jnp.sum(cut), peak=peak)
    return s, active, parent, birth, counts

  parent = jnp.full((n,), -1, jnp.int32)
  birth = jnp.zeros((n,), jnp.int32)
  state, active, parent, birth, counts = jax.lax.while_loop(
      can_change, body, (state, active, parent, birth, counts))
  # The rest decodes as the static batch's (shrinking, on blocks or not).
  levels = shrink_levels(n, sc.shrink_batch_to, row_multiple)
  if paged is None:
    run = functools.partial(decode_while, step_fn)
    state = run(state, keys_N, t, levels[1] if len(levels) > 1 else 0)
    if len(levels) > 1:
      state = shrink_rest(
          state, keys_N, levels, lambda s, k, fits: run(s, k, t, fits),
          lambda cache, pick_n: _gather_cache(cache, pick_n, g))
  else:
    state, peak, cut = paged_lib.shrinking_decode(
        params, state, keys_N, model=model, w_DxV=w_DxV, mc=mc, sc=sc,
        row_multiple=row_multiple)
    counts = dict(counts, peak=jnp.maximum(counts["peak"], peak),
                  cut=counts["cut"] + cut)
  # A tree slot still empty takes a copy of its prompt's root.
  empty = tree_N & ~active
  root = jnp.arange(n, dtype=jnp.int32) // g * g
  rows = jnp.where(empty, root, jnp.arange(n, dtype=jnp.int32))
  take = lambda x: None if x is None else jnp.take(x, rows, axis=0)
  copies = {f: take(getattr(state, f)) for f in _ROW_FIELDS}
  rollout = Rollout(
      prompt_tokens=jnp.repeat(prompt_tokens_BxP, g, axis=0),
      prompt_mask=jnp.repeat(prompt_mask_BxP, g, axis=0),
      completion_tokens=copies["tokens"], completion_mask=copies["mask"],
      lengths=copies["mask"].sum(-1).astype(jnp.int32),
      finished=copies["finished"], policy_logprobs=copies["policy_logp"],
      sampler_logprobs=copies["sampler_logp"])
  stats = {
      "latr/branches": counts["branches"].astype(jnp.float32),
      "latr/pruned": counts["pruned"].astype(jnp.float32),
      "latr/copies": jnp.sum(empty).astype(jnp.float32),
      "latr/branch_points": counts["branch_points"].astype(jnp.float32),
      "latr/tree_steps": counts["tree_steps"].astype(jnp.float32)}
  if paged is not None:
    stats.update(paged_lib.pool_stats(state.cache, num_blocks,
                                      counts["peak"], counts["cut"]))
  if draft is not None:
    return rollout, jnp.take(accepted, rows), stats
  return rollout, stats


def _latr_drafted(params, prompt_tokens_BxP, prompt_mask_BxP, draft: Draft,
                  key, **kwargs):
  return _latr_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key,
                    draft=draft, **kwargs)


def make_latr_sampler(model_config: ModelConfig, config: SamplerConfig,
                      latr: LatrConfig, mesh: jax.sharding.Mesh | None = None,
                      param_shardings=None,
                      rules: sharding.Rules = sharding.DEFAULT_RULES, *,
                      paged: paged_lib.PagedConfig | None = None,
                      speculative: bool = False, log_lenience: float = 0.0
                      ) -> MeteredSampler:
  """A jitted ``fn(params, prompt_tokens_BxP, prompt_mask_BxP, key) ->
  Rollout`` sampling ``config.num_samples`` rows per prompt with LATR's
  branching (the module docstring); shardings as ``sampling.make_sampler``'s.
  ``with_metrics`` also returns its counts (``latr/*``) and, on a paged
  cache, the pool's figures. ``speculative``: SPEC-RL's drafts for the
  rows sampled as usual (the tree's rows draft nothing), ``fn(params,
  tokens_BxP, mask_BxP, draft, key) -> (Rollout, accepted_N, figures)`` as
  ``make_speculative_sampler``'s, with the acceptance rule's
  ``log_lenience``.

  Raises:
    ValueError: when the tree has fewer than 2 rows
      (``LatrConfig.tree_rows``).
  """
  latr.tree_rows(config.num_samples)
  if speculative:
    check_lenience(log_lenience)
    fn = functools.partial(_latr_drafted, model_config=model_config,
                           config=config, latr=latr, paged=paged,
                           log_lenience=float(log_lenience))
    return jit_drafted(fn, config, mesh, param_shardings, rules,
                       with_stats=True)
  fn = functools.partial(_latr_impl, model_config=model_config,
                         config=config, latr=latr, paged=paged)
  return MeteredSampler(jit_rows(fn, config, mesh, param_shardings, rules,
                                 with_stats=True), paged=paged, stats=True)


__all__ = ["LatrConfig", "edit_distance", "last_tokens", "make_latr_sampler",
           "spawn_slots"]
