"""Tree rollouts: segments decoded once per node, forked where uncertain.

TreePO (Li et al. 2025, "TreePO: Bridging the Gap of Policy Optimization
and Efficacy and Inference Efficiency with Heuristic Tree-based Modeling",
arXiv:2508.17445) samples a prompt's completions as a tree: fixed-length
segments are decoded, and at each segment boundary the paths branch, so the
``G`` completions of a prompt share their early segments and each shared
segment is decoded once, not once per completion.

The plan here, in one jitted program of fixed shapes:

* a prompt starts as ``roots`` rows (``TreeConfig.roots``); its prompt is
  prefilled once into the shared prefix cache (``KVCache.prefix``);
* the rows decode ``segment_tokens`` tokens, then fork: every row keeps one
  child and the prompt's ``(branch - 1) x width`` new children are
  apportioned among its live rows, by the mean surprisal ``-log p`` of the
  segment each row just sampled (``branch_by="uncertainty"``: the local
  uncertainty TreePO branches on) or equally (``"uniform"``, TreePO's fixed
  width). A row that has ended keeps exactly one child, so no completion is
  copied, unless every row of its prompt has ended: then the children are
  copies of ended rows (``tree_copies`` counts them);
* a child is its parent's row, gathered: tokens, logprobs, the logits of
  its next token and its KV cache rows (the prompt prefix stays shared); the
  widths grow ``roots, roots * branch, ...`` up to ``G``, after
  ``D = log_branch(G / roots)`` forks, and the last width decodes to the
  end (with ``SamplerConfig.shrink_batch_to``, in batches that halve as its
  leaves end: ``sampler.shrink_rest``, the static sampler's). Children draw
  their next tokens with keys of their own (row ``r`` of width ``d``:
  ``fold_in(fold_in(key, d), r)``), so siblings diverge.

``Rollout.tree_nodes`` (``[N, D]``) records each leaf's ancestors, for
TreePO's segment-level advantage (``advantages.treepo``). Each leaf is an
ordinary completion for everything else: its sampler logprobs are those of
the distribution each of its tokens was drawn from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax.models import ModelConfig, compute_logits
from rljax.models import paged_cache as pc
from rljax.models.kv_cache import LayerKV
from rljax.sampling import paged as paged_lib
from rljax.sampling.decode_cache import (_cache_slots, _gather_cache, _grow,
                                         shrink_levels)
from rljax.sampling.jitting import MeteredSampler, jit_rows
from rljax.sampling.speculative import Draft, check_lenience, jit_drafted
from rljax.sampling import tree_drafts
from rljax.sampling.sampler import (_ROW_FIELDS, Rollout, SamplerConfig,
                                    _empty_state, decode_setup, decode_step,
                                    decode_while, row_keys, shrink_rest)

BRANCH_BY = ("uncertainty", "uniform")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """How a tree rollout grows (``rl.tree.*``; ``docs/rollouts.md``).

  Attributes:
    segment_tokens: tokens decoded between two forks (TreePO's segment).
    branch: each fork multiplies a prompt's rows by this.
    roots: a prompt's rows before the first fork.
    branch_by: ``"uncertainty"`` (more children for the rows whose last
      segment was sampled with the highest mean surprisal) or
      ``"uniform"`` (``branch`` children per live row).
  """

  segment_tokens: int = 4
  branch: int = 2
  roots: int = 2
  branch_by: str = "uncertainty"

  def __post_init__(self):
    for name, low in (("segment_tokens", 1), ("branch", 2), ("roots", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"rl.tree.{name}={value!r}: an integer >= {low} is "
                         "required.")
    if self.branch_by not in BRANCH_BY:
      raise ValueError(f"rl.tree.branch_by={self.branch_by!r}: accepted "
                       f"{BRANCH_BY}.")

  def widths(self, num_samples: int, max_new_tokens: int | None = None
             ) -> tuple[int, ...]:
    """A prompt's rows at each depth: ``roots``, ``roots * branch``, ...,
    ``num_samples`` (the leaves).

    Raises:
      ValueError: when ``num_samples`` is not ``roots * branch ** D`` for a
        ``D >= 1``, or when the ``D`` forks (after ``segment_tokens``,
        ``2 segment_tokens``, ...) do not all come before
        ``max_new_tokens``, naming the fields (None: no segment check; the
        segments of tree episodes are turns, ``rljax/rollout/episode_tree.py``).
    """
    widths = [self.roots]
    while widths[-1] < num_samples:
      widths.append(widths[-1] * self.branch)
    if widths[-1] != num_samples or len(widths) < 2:
      powers = [self.roots * self.branch ** d for d in range(1, 6)]
      raise ValueError(
          f"rl.tree: rl.tree.roots={self.roots} x rl.tree.branch="
          f"{self.branch}^D leaves must make the {num_samples} rows sampled "
          f"per prompt (rl.group_size, with the advantage's extra rows) for "
          f"some D >= 1; accepted row counts: {powers}.")
    forks = len(widths) - 1
    if max_new_tokens is not None and (
        forks * self.segment_tokens >= max_new_tokens):
      raise ValueError(
          f"rl.tree.segment_tokens={self.segment_tokens}: its {forks} forks "
          f"(one after each segment) need more than {forks} x "
          f"{self.segment_tokens} new tokens, and sampler.max_new_tokens="
          f"{max_new_tokens}; accepted: rl.tree.segment_tokens <= "
          f"{(max_new_tokens - 1) // forks}.")
    return tuple(widths)


def _apportion(weights_BxW, extra: int):
  """Integer counts ``[B, W]`` summing to ``extra`` per row, in proportion
  to ``weights_BxW`` (>= 0, some > 0 per row): floors, then one more for the
  largest remainders (ties to the lower index)."""
  w = weights_BxW.shape[1]
  quota = extra * weights_BxW / jnp.sum(weights_BxW, 1, keepdims=True)
  base = jnp.floor(quota).astype(jnp.int32)
  left = extra - jnp.sum(base, 1, keepdims=True)
  rank = jnp.argsort(jnp.argsort(-(quota - base), axis=1, stable=True),
                     axis=1, stable=True)
  counts = base + (rank < left).astype(jnp.int32)
  # Float rounding may leave the sum one off: the largest weight absorbs it.
  fix = extra - jnp.sum(counts, 1)
  top = jax.nn.one_hot(jnp.argmax(weights_BxW, 1), w, dtype=jnp.int32)
  return jnp.maximum(counts + fix[:, None] * top, 0)


def fork_parents(done_BxW, surprisal_BxW, width: int, branch_by: str):
  """Each child's parent, ``[B, width]`` indices into the ``W`` rows of its
  prompt, children of one parent adjacent.

  Every row keeps one child; the ``width - W`` others go to the live rows
  (``~done``) in proportion to their surprisal (``"uncertainty"``) or
  equally (``"uniform"``); a prompt with no live row spreads them equally
  over its ended rows (copies)."""
  b, w = done_BxW.shape
  live = ~done_BxW
  if branch_by == "uncertainty":
    weight = jnp.where(live, jnp.maximum(surprisal_BxW, 0.0) + 1e-3, 0.0)
  else:
    weight = live.astype(jnp.float32)
  none_live = ~jnp.any(live, 1, keepdims=True)
  weight = jnp.where(none_live, 1.0, weight)
  counts = 1 + _apportion(weight, width - w)
  ends = jnp.cumsum(counts, 1)
  return jax.vmap(lambda e: jnp.searchsorted(
      e, jnp.arange(width), side="right"))(ends).astype(jnp.int32)


def gather_rows(state, rows_n):
  """The decode state of rows ``rows_n``: per-row fields, next-token logits
  and the decode cache's own rows (a shared prompt prefix stays), or on a
  paged cache the rows' block tables (``paged_cache.fork``: no key or value
  is copied until a row writes into a shared block)."""
  take = lambda x: None if x is None else jnp.take(x, rows_n, axis=0)
  cache = state.cache
  if isinstance(cache, pc.PagedKVCache):
    cache = pc.fork(cache, rows_n)
  else:
    cache = cache._replace(
        layers=tuple(LayerKV(take(l.k), take(l.v)) for l in cache.layers),
        mask=take(cache.mask))
  return state._replace(
      logits=sharding.constrain(take(state.logits), ("batch", "act_vocab")),
      cache=cache, **{f: take(getattr(state, f)) for f in _ROW_FIELDS})


def _sample_tree_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key, *,
                      model_config: ModelConfig, config: SamplerConfig,
                      tree: TreeConfig, paged: paged_lib.PagedConfig | None = None,
                      row_multiple: int = 1, draft: Draft | None = None,
                      log_lenience: float = 0.0):
  mc, sc = model_config, config
  t, seg = sc.max_new_tokens, tree.segment_tokens
  widths = tree.widths(sc.num_samples, t)
  forks = len(widths) - 1
  prompt_mask_BxP = prompt_mask_BxP.astype(jnp.bool_)
  model, w_DxV, cache_dtype, _ = decode_setup(params, prompt_mask_BxP, mc, sc)
  b = prompt_tokens_BxP.shape[0]
  w0 = widths[0]
  # A shared prompt prefix and a dense cache per row, or blocks: forks
  # share their parents' (copy on write).
  hidden_BxD, cache, failed_B, num_blocks = paged_lib.prefill_prompts(
      params, prompt_tokens_BxP, prompt_mask_BxP, model=model, mc=mc,
      rows_per_prompt=w0, dtype=cache_dtype, paged=paged,
      pool_rows=b * sc.num_samples, max_new_tokens=t)
  logits_B = compute_logits(hidden_BxD[:, None], w_DxV,
                            mc.final_logit_softcap)[:, 0]
  prompt_len_B = prompt_mask_BxP.astype(jnp.int32).sum(-1)
  state = _empty_state(jnp.repeat(logits_B, w0, axis=0), cache,
                       jnp.repeat(prompt_len_B, w0), sc)
  peak = cut = jnp.zeros((), jnp.int32)
  if paged is not None:
    state = state._replace(done=jnp.repeat(failed_B, w0))
    cut = w0 * jnp.sum(failed_B).astype(jnp.int32)
  nodes = jnp.zeros((b * w0, forks), jnp.int32)
  run = functools.partial(decode_while, functools.partial(
      decode_step, params, model=model, w_DxV=w_DxV, mc=mc, sc=sc))
  g = sc.num_samples
  if draft is not None:  # SPEC-RL's drafts, node by node (tree_drafts)
    levels_d = tree_drafts.draft_levels(draft, b, g, widths, seg)
    src = tree_drafts.root_sources(levels_d, draft, b, g, w0)
    accepted = jnp.zeros((b * w0,), jnp.int32)
    accept_key = jax.random.split(key)[1]
    used = 0  # dense cache slots that passes and loops may have written

  # The last width decodes to the end, in batches that halve as its rows
  # end (``sampler.shrink_batch_to``, as the static sampler's).
  levels = shrink_levels(b * widths[-1], sc.shrink_batch_to, row_multiple)
  cols_T = jnp.arange(t, dtype=jnp.int32)
  figures = [peak, cut]  # a paged pool's, traced in order

  def decode(state, keys, d, end, slots):
    """The rows' decode loop of depth ``d`` until step ``end`` (a dense
    cache grown to ``slots``: ``(needed, final)``)."""
    if paged is not None:
      if d == forks:
        state, more_peak, more_cut = paged_lib.shrinking_decode(
            params, state, keys, model=model, w_DxV=w_DxV, mc=mc, sc=sc,
            row_multiple=row_multiple)
      else:
        state, more_peak, more_cut = paged_lib.paged_decode(
            params, state, keys, end, model=model, w_DxV=w_DxV, mc=mc, sc=sc)
      figures[:] = (jnp.maximum(figures[0], more_peak),
                    figures[1] + more_cut)
      return state
    state = state._replace(cache=_grow(state.cache, _cache_slots(*slots)))
    last = d == forks and len(levels) > 1
    state = run(state, keys, end, levels[1] if last else 0)
    if last:
      state = shrink_rest(
          state, keys, levels, lambda s, k, fits: run(s, k, t, fits),
          lambda cache, pick_n: _gather_cache(cache, pick_n, widths[-1]))
    return state

  for d, w in enumerate(widths):
    end = t if d == forks else (d + 1) * seg
    keys = row_keys(jax.random.fold_in(key, d), b * w)
    if draft is None:
      state = decode(state, keys, d, end, (end, t))
    else:
      lo = d * seg
      state, src, more, more_cut = tree_drafts.verify_segment(
          params, state, src, draft, g, w, lo, end,
          jax.random.fold_in(accept_key, d), model=model, w_DxV=w_DxV,
          mc=mc, sc=sc, log_lenience=log_lenience,
          slots=None if paged is not None else (used + end - lo, 2 * t))
      accepted = accepted + more
      if paged is not None:
        figures[:] = (jnp.maximum(figures[0], pc.blocks_in_use(state.cache)),
                      figures[1] + jnp.sum(more_cut).astype(jnp.int32))
      slots = (used + 2 * (end - lo), 2 * t)
      used += 2 * (end - lo)
      # Steps count from 0: a row starts where its draft left it.
      state = tree_drafts.hold_finished_rows(
          lambda s: decode(s, keys, d, end - lo, slots),
          state._replace(step=jnp.zeros((), jnp.int32)), end,
          jnp.repeat(prompt_len_B, w), paged is not None)
    if d == forks:
      break
    in_seg = state.mask & (cols_T[None] >= d * seg)
    surprisal = -jnp.sum(jnp.where(in_seg, state.sampler_logp, 0.0), 1) / (
        jnp.maximum(jnp.sum(in_seg, 1), 1))
    parents = fork_parents(state.done.reshape(b, w), surprisal.reshape(b, w),
                           widths[d + 1], tree.branch_by)
    rows = (jnp.arange(b, dtype=jnp.int32)[:, None] * w + parents).reshape(-1)
    state = gather_rows(state, rows)
    nodes = jnp.take(nodes, rows, axis=0).at[:, d].set(parents.reshape(-1))
    if draft is not None:
      src = tree_drafts.child_sources(levels_d, d, src.reshape(b, w),
                                      parents).reshape(-1)
      accepted = jnp.take(accepted, rows)
  peak, cut = figures
  rollout = Rollout(
      prompt_tokens=jnp.repeat(prompt_tokens_BxP, g, axis=0),
      prompt_mask=jnp.repeat(prompt_mask_BxP, g, axis=0),
      completion_tokens=state.tokens, completion_mask=state.mask,
      lengths=state.mask.sum(-1).astype(jnp.int32), finished=state.finished,
      policy_logprobs=state.policy_logp, sampler_logprobs=state.sampler_logp,
      tree_nodes=nodes)
  out = (rollout,) if draft is None else (rollout, accepted)
  if paged is not None:
    out += (paged_lib.pool_stats(state.cache, num_blocks, peak, cut),)
  return out[0] if len(out) == 1 else out


def _sample_tree_drafted(params, prompt_tokens_BxP, prompt_mask_BxP,
                         draft: Draft, key, **kwargs):
  return _sample_tree_impl(params, prompt_tokens_BxP, prompt_mask_BxP, key,
                           draft=draft, **kwargs)


def make_tree_sampler(model_config: ModelConfig, config: SamplerConfig,
                      tree: TreeConfig, mesh: jax.sharding.Mesh | None = None,
                      param_shardings=None,
                      rules: sharding.Rules = sharding.DEFAULT_RULES, *,
                      paged: paged_lib.PagedConfig | None = None,
                      speculative: bool = False, log_lenience: float = 0.0):
  """A jitted ``fn(params, prompt_tokens_BxP, prompt_mask_BxP, key) ->
  Rollout`` sampling ``config.num_samples`` leaves per prompt as a tree
  (the module docstring); shardings as ``sampling.make_sampler``'s.
  ``paged``: on a paged KV cache, a fork sharing its parent's blocks
  (``sampling.paged``). ``speculative``: SPEC-RL's drafted tree
  (``sampling.tree_drafts``), ``fn(params, tokens_BxP, mask_BxP, draft,
  key) -> (Rollout, accepted_N[, pool figures])`` as
  ``make_speculative_sampler``'s, with the acceptance rule's
  ``log_lenience``.

  Raises:
    ValueError: when the tree's widths do not fit (``TreeConfig.widths``).
  """
  tree.widths(config.num_samples, config.max_new_tokens)
  if speculative:
    check_lenience(log_lenience)
    fn = functools.partial(_sample_tree_drafted, model_config=model_config,
                           config=config, tree=tree, paged=paged,
                           log_lenience=float(log_lenience))
    return jit_drafted(fn, config, mesh, param_shardings, rules,
                       tree_nodes=True, with_stats=paged is not None)
  fn = functools.partial(_sample_tree_impl, model_config=model_config,
                         config=config, tree=tree, paged=paged)
  return MeteredSampler(jit_rows(fn, config, mesh, param_shardings, rules,
                                 tree_nodes=True,
                                 with_stats=paged is not None),
                        paged=paged, tree=tree)


def tree_counts(tree_nodes_NxD: np.ndarray, lengths_N: np.ndarray,
                group_rows: int, segment_tokens: int) -> dict[str, float]:
  """Host counts of a tree rollout's rows (group-contiguous, ``group_rows``
  per prompt; any whole groups, so that processes may add theirs):

  * ``rollout/generated_tokens``: the tokens the tree decoded, each node's
    segment once (a segment shared by ``k`` leaves is counted once, not
    ``k`` times);
  * ``rollout/tree_leaf_tokens``: the leaves' tokens, ``sum(lengths)``;
  * ``rollout/tree_copies``: leaves whose whole completion lies in a
    segment they share with an earlier leaf of their prompt: copies of an
    ended row (the children of a prompt whose rows had all ended).
  """
  nodes, lengths = np.asarray(tree_nodes_NxD), np.asarray(lengths_N)
  n, depth = nodes.shape
  prompt = np.arange(n) // group_rows
  decoded = int(np.clip(lengths - depth * segment_tokens, 0, None).sum())
  copy = np.zeros(n, bool)
  for d in range(depth):
    _, first, inverse = np.unique(np.stack([prompt, nodes[:, d]], 1), axis=0,
                                  return_index=True, return_inverse=True)
    seg = np.clip(lengths - d * segment_tokens, 0, segment_tokens)
    decoded += int(seg[first].sum())
    later = np.arange(n) != first[inverse.reshape(-1)]
    copy |= later & (lengths <= (d + 1) * segment_tokens)
  return {"rollout/generated_tokens": float(decoded),
          "rollout/tree_leaf_tokens": float(lengths.sum()),
          "rollout/tree_copies": float(copy.sum())}


def tree_metrics(counts: list[dict[str, float]]) -> dict[str, float]:
  """Every process's ``tree_counts`` as one batch's metrics, with
  ``rollout/tree_token_saving = 1 - generated / leaf tokens``: the share of
  the leaves' tokens that sharing saved from being decoded again."""
  out = {k: float(sum(c[k] for c in counts)) for k in counts[0]}
  leaf = out["rollout/tree_leaf_tokens"]
  out["rollout/tree_token_saving"] = (
      1.0 - out["rollout/generated_tokens"] / leaf if leaf else 0.0)
  return out


__all__ = ["BRANCH_BY", "TreeConfig", "fork_parents", "gather_rows",
           "make_tree_sampler",
           "tree_counts", "tree_metrics"]
