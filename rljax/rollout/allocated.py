"""A step's rows sampled in rounds by a rollout allocator.

``rl.allocation`` (``rljax/data/allocation.py``, ``docs/selection.md``):
the ``Collector`` samples round by round, each round's prompts chosen by
the reward variance of everything their samples scored so far, and merges
the rounds into one batch of ``B * G`` rows whose groups have unequal
sizes; ``group_ids_N`` tells the advantage chain which rows share a prompt.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rljax import sampling
from rljax import tokenizers as tok_lib
from rljax.data import allocation as allocation_lib
from rljax.data import dots as dots_lib
from rljax.data import selection as selection_lib
from rljax.rollout import rounds as rounds_lib


def sample(collector: Any, params: Any, examples: Mapping[str, Sequence[Any]],
           key: jax.Array, version: int, on_dispatch: Callable[[], Any] | None
           ) -> tuple[rounds_lib.Sampled, np.ndarray, dict[str, float]]:
  """``(merged batch, group_ids_N, alloc/* metrics)`` of one step.

  Round ``t`` samples with ``fold_in(key, t)`` (the first with ``key``);
  every round's prompts are padded to the batch's longest, so the rounds of
  a step share the sampler's shapes. sGPO (``allocation.Sgpo``) samples
  one round of its own prompts, as many as ``examples`` holds (``B``, or
  ``B - R`` in a step that replays ``R`` groups; their fields are not
  read), after profiling the pool at its first step. With SPEC-RL the rounds draft from earlier
  steps' rows only (``DraftStore.frozen``)."""
  spec = collector.speculation
  with spec.store.frozen() if spec is not None else contextlib.nullcontext():
    return _sample(collector, params, examples, key, version, on_dispatch)


def _sample(collector, params, examples, key, version, on_dispatch):
  schedule = collector.allocation
  if isinstance(schedule, allocation_lib.Sgpo):
    # With replay the step's fresh prompts are fewer (B - R): sGPO sizes
    # that many from their share of the budget.
    return _sample_sgpo(collector, params, key, version, on_dispatch,
                        len(examples["prompt"]))
  # ``examples`` is the global batch (``Collector.collect``): the rounds are
  # the same on every process, each sampling its block of a round's entries.
  batch_size = len(examples["prompt"])
  fresh = collector.allocation_fresh
  if fresh is not None and batch_size == fresh.prompts[0]:
    schedule = fresh  # a step that replays groups: its fresh prompts
  per_entry = schedule.sampler_samples
  if batch_size != schedule.prompts[0]:
    raise ValueError(f"rollout allocation: a batch of {batch_size} prompts "
                     f"for a schedule of {schedule.prompts[0]} "
                     "(rl.prompts_per_step).")
  longest = max(len(p) for p in tok_lib.encode_prompts(
      collector.tokenizer, examples["prompt"]))
  totals: list[list[float]] = [[] for _ in range(batch_size)]
  active = np.arange(batch_size)
  rounds, ids, first_zero = [], [], 0.0
  for t, (count, samples) in enumerate(zip(schedule.prompts,
                                           schedule.samples)):
    if t:
      active = allocation_lib.choose(allocation_lib.variances(totals),
                                     active, count)
    entries = allocation_lib.entries(active, samples, per_entry)
    round_examples = {f: [v[i] for i in entries] for f, v in examples.items()}
    sampled = collector.sample_global(
        params, round_examples, jax.random.fold_in(key, t) if t else key,
        version, sampler=collector.allocation_sampler,
        samples=per_entry, longest=longest)
    rows = np.repeat(entries, per_entry)
    valid = rounds_lib.scored_rows(sampled.result.valid_NxR,
                                   collector.failed_rewards)
    for prompt, total, ok in zip(rows, sampled.result.total_N, valid):
      if ok:
        totals[prompt].append(float(total))
    if not t:
      first_zero = float(np.mean(allocation_lib.variances(totals) == 0))
    rounds.append(sampled)
    ids.append(rows)
  if on_dispatch is not None:
    on_dispatch()
  plan = selection_lib.Plan(
      tuple(np.arange(len(r.lengths) // per_entry) for r in rounds),
      np.ones(sum(len(r.lengths) for r in rounds) // per_entry, bool))
  merged = collector.merge_rounds(rounds, plan, group_rows=per_entry)
  group_ids = np.concatenate(ids).astype(np.int32)
  sizes = np.bincount(group_ids, minlength=batch_size)
  zero = allocation_lib.variances(totals) == 0
  metrics = {
      "alloc/rounds": float(len(rounds)),
      "alloc/max_group": float(sizes.max()),
      "alloc/zero_variance_first": first_zero,
      "alloc/zero_variance_prompts": float(np.mean(zero)),
      "alloc/zero_variance_rows": float(np.sum(sizes[zero]) / sizes.sum()),
      "num_generated_tokens": float(sum(r.lengths.sum() for r in rounds)),
  }
  return merged, group_ids, metrics


def _columns(pool: Sequence[Mapping[str, Any]], idx: Sequence[int]
             ) -> dict[str, list[Any]]:
  return {f: [pool[i][f] for i in idx] for f in pool[0]}


def _correct(collector: Any, sampled: rounds_lib.Sampled) -> np.ndarray:
  column = collector.correct_column
  return np.nan_to_num(sampled.result.rewards_NxR[:, column], nan=0.0) >= 1.0


def profile(collector: Any, params: Any, key: jax.Array, version: int
            ) -> tuple[np.ndarray, float]:
  """sGPO's profiling pass: ``profile_samples`` completions of every
  prompt of the pool, in sampler calls of the step's shape (``B G``
  entries, one sample each). Returns ``(success rate per prompt, sampled
  tokens)``."""
  sgpo = collector.allocation
  pool, k = sgpo.pool, sgpo.profile_samples
  per_call = max(sgpo.rows // k, 1)
  correct = np.zeros(len(pool))
  tokens = 0.0
  for call, start in enumerate(range(0, len(pool), per_call)):
    idx = np.arange(start, min(start + per_call, len(pool)))
    entries = np.repeat(idx, k)
    real = len(entries)
    entries = np.resize(entries, sgpo.rows)  # the step's shape, repeats cut
    sampled = collector.sample_global(
        params, _columns(pool, entries), jax.random.fold_in(key, call),
        version, sampler=collector.allocation_sampler, samples=1,
        longest=sgpo.longest)
    ok = _correct(collector, sampled)[:real]
    np.add.at(correct, entries[:real], ok)
    tokens += float(np.sum(sampled.lengths[:real]))
  return correct / k, tokens


def _sample_sgpo(collector, params, key, version, on_dispatch, count):
  sgpo = collector.allocation
  metrics: dict[str, float] = {}
  generated = 0.0
  if not sgpo.profiled:  # the first step of a fresh run
    success, generated = profile(collector, params,
                                 jax.random.fold_in(key, 0x50524f46), version)
    sgpo.set_profile(success)
    metrics.update({
        "alloc/profile_trivial": float(np.mean(success >= 1.0)),
        "alloc/profile_unsolved": float(np.mean(success <= 0.0)),
        "alloc/pool": float(len(sgpo.state.order))})
  idx, sizes = sgpo.next_prompts(count)
  entries = np.repeat(np.arange(len(idx)), sizes)
  sampled = collector.sample_global(
      params, _columns(sgpo.pool, idx[entries]), key, version, on_dispatch,
      sampler=collector.allocation_sampler, samples=1, longest=sgpo.longest)
  metrics.update({
      "alloc/max_group": float(sizes.max()),
      "alloc/min_group": float(sizes.min()),
      "alloc/profiled_success": float(np.mean(sgpo.state.success[idx])),
      "alloc/curriculum_position": float(sgpo.state.cursor[0]
                                         / len(sgpo.state.order)),
      # The profiling pass's tokens count at the step that ran it.
      "num_generated_tokens": float(np.sum(sampled.lengths)) + generated,
  })
  return sampled, entries.astype(np.int32), metrics


def _embed_pool(dots: Any, params: Any, idx: np.ndarray, collector: Any,
                rows: int) -> np.ndarray:
  """``[len(idx), D]`` prompt embeddings, in calls of ``rows`` prompts
  padded to the pool's longest (one program)."""
  out = []
  for start in range(0, len(idx), rows):
    part = idx[start:start + rows]
    prompts = tok_lib.encode_prompts(
        collector.tokenizer, [dots.pool[i]["prompt"] for i in part])
    tokens, mask = sampling.pad_prompts(
        prompts + [prompts[-1]] * (rows - len(part)), collector.buckets,
        collector.tokenizer.pad_id, longest=dots.longest)
    out.append(dots.embed(params, tokens, mask)[:len(part)])
  return np.concatenate(out, 0)


def dots_examples(collector: Any, params: Any, key: jax.Array, version: int
                  ) -> tuple[dict[str, list[Any]], dict[str, float],
                             float | None]:
  """DOTS (``rljax/data/dots.py``): the step's prompts from the queue,
  after a selection round when the queue is used up (the reference set
  rolled out ``G`` times per prompt, the pool embedded, the next rounds'
  prompts drawn). Returns ``(examples, dots/* metrics, reference rollouts'
  tokens)``; the tokens are 0 on steps without a round."""
  dots = collector.selection.dots
  metrics: dict[str, float] = {}
  tokens = 0.0
  if dots.needs_round():
    b = dots.batch_size
    reference = dots.reference_prompts()
    success = np.zeros(len(reference))
    for call, start in enumerate(range(0, len(reference), b)):
      part = reference[start:start + b]
      sampled = collector.sample_global(
          params, _columns(dots.pool, part),
          jax.random.fold_in(jax.random.fold_in(key, 0x444f5453), call),
          version)
      g = collector.samples_per_prompt
      success[start:start + len(part)] = _correct(
          collector, sampled).reshape(-1, g).mean(1)
      tokens += float(np.sum(sampled.lengths))
    rows = collector.samples_per_prompt * b
    pool = np.arange(dots.pool_size)
    embedded = _embed_pool(dots, params, pool, collector, rows)
    ref_embedded = embedded[reference]
    predicted = dots_lib.predict_success(embedded, ref_embedded, success,
                                         dots.attention_temperature)
    queue = dots.select(predicted)
    metrics.update({
        "dots/reference_success": float(success.mean()),
        "dots/reference_informative": float(np.mean((success > 0)
                                                    & (success < 1))),
        "dots/prediction_error": dots_lib.leave_one_out_error(
            ref_embedded, success, dots.attention_temperature),
        "dots/selected_predicted_success": float(predicted[queue].mean()),
        "dots/pool_predicted_success": float(predicted.mean()),
    })
  idx = dots.next_prompts()
  metrics["dots/round"] = float(dots.state.round[0])
  return _columns(dots.pool, idx), metrics, tokens


__all__ = ["dots_examples", "profile", "sample"]
