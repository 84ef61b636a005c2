"""A step's rows sampled in rounds by a rollout allocator.

``rl.allocation`` (``rljax/data/allocation.py``, ``docs/selection.md``):
the ``Collector`` samples round by round, each round's prompts chosen by
the reward variance of everything their samples scored so far, and merges
the rounds into one batch of ``B * G`` rows whose groups have unequal
sizes; ``group_ids_N`` tells the advantage chain which rows share a prompt.

With DAPO's dynamic sampling (``rl.selection.name`` ``"dapo"``, or
``"greso"``, which also skips prompts before they are sampled) the unit of
a refill is a whole allocation: a pass of the schedule's rounds on ``B``
prompts. A group whose scored rows all have the same reward after its
pass is dropped, and passes on new prompts (``fold_in(key, _PASS_FOLD +
k)``) follow until the kept groups fill the step's ``B * G`` rows (to less
than the smallest group), or ``rl.selection.max_rounds`` passes ran.
Informative groups are kept in the order drawn while they fit (at most
``B`` groups, ``B * G`` rows); the rows left are masked fillers from the
dropped groups (group id -1: no group, advantage 0, loss cleared), as
DAPO's batch keeps zero-variance groups masked when the rounds run out.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from rljax import sampling
from rljax import tokenizers as tok_lib
from rljax.data import allocation as allocation_lib
from rljax.data import dots as dots_lib
from rljax.data import selection as selection_lib
from rljax.rollout import rounds as rounds_lib


def sample(collector: Any, params: Any, examples: Mapping[str, Sequence[Any]],
           key: jax.Array, version: int, on_dispatch: Callable[[], Any] | None,
           more_examples: Callable[[], Mapping[str, Sequence[Any]]] | None
           = None) -> tuple[rounds_lib.Sampled, np.ndarray, dict[str, float],
                            np.ndarray | None]:
  """``(merged batch, group_ids_N, alloc/* metrics, trained_N)`` of one
  step (``trained_N``: None, or False for a masked filler row).

  Round ``t`` samples with ``fold_in(key, t)`` (the first with ``key``);
  every round's prompts are padded to the batch's longest, so the rounds of
  a step share the sampler's shapes. sGPO (``allocation.Sgpo``) samples
  one round of its own prompts, as many as ``examples`` holds (``B``, or
  ``B - R`` in a step that replays ``R`` groups; their fields are not
  read), after profiling the pool at its first step. With SPEC-RL the rounds draft from earlier
  steps' rows only (``DraftStore.frozen``)."""
  spec = collector.speculation
  with spec.store.frozen() if spec is not None else contextlib.nullcontext():
    return _sample(collector, params, examples, key, version, on_dispatch,
                   more_examples)


def _sample(collector, params, examples, key, version, on_dispatch,
            more_examples):
  schedule = collector.allocation
  if isinstance(schedule, allocation_lib.Sgpo):
    # With replay the step's fresh prompts are fewer (B - R): sGPO sizes
    # that many from their share of the budget.
    sampled, ids, metrics = _sample_sgpo(collector, params, key, version,
                                         on_dispatch,
                                         len(examples["prompt"]))
    return sampled, ids, metrics, None
  # ``examples`` is the global batch (``Collector.collect``): the rounds are
  # the same on every process, each sampling its block of a round's entries.
  batch_size = len(examples["prompt"])
  fresh = collector.allocation_fresh
  if fresh is not None and batch_size == fresh.prompts[0]:
    schedule = fresh  # a step that replays groups: its fresh prompts
  if batch_size != schedule.prompts[0]:
    raise ValueError(f"rollout allocation: a batch of {batch_size} prompts "
                     f"for a schedule of {schedule.prompts[0]} "
                     "(rl.prompts_per_step).")
  sel = collector.selection
  refills = sel is not None and sel.dots is None  # DAPO's, GRESO's
  passes: list[_Pass] = []
  metrics: dict[str, float] = {}
  skipped = draws = 0.0
  while True:
    if refills and sel.greso is not None:
      examples, m = sel.greso.select(examples, more_examples,
                                     (version, len(passes)))
      skipped += m.pop("select/skipped_prompts")
      draws += m.pop("select/prompt_draws")
      metrics.update(m)
    pass_key = (key if not passes
                else jax.random.fold_in(key, _PASS_FOLD + len(passes)))
    passes.append(_allocate(collector, params, examples, pass_key, version,
                            schedule))
    if not refills:  # every group, as allocated
      kept = [(0, i) for i in range(batch_size)]
      break
    kept, used = _keep(passes, batch_size, schedule.rows)
    if (schedule.rows - used < schedule.samples[0] or len(kept) == batch_size
        or len(passes) >= sel.max_rounds or more_examples is None):
      break
    examples = {f: list(v)[:batch_size] for f, v in more_examples().items()}
  # No on_dispatch before: an asynchronous schedule's update donates the
  # params that a refill pass still samples with.
  if on_dispatch is not None:
    on_dispatch()
  plan, group_ids, trained = _plan(passes, kept, schedule)
  rounds = [r for p in passes for r in p.rounds]
  merged = collector.merge_rounds(rounds, plan,
                                  group_rows=schedule.sampler_samples,
                                  trees_apart=True)
  sizes = np.asarray([passes[p].sizes[i] for p, i in kept], np.int64)
  zero = np.asarray([passes[p].kinds[i] != selection_lib.INFORMATIVE
                     for p, i in kept], bool)
  metrics.update({
      "alloc/rounds": float(len(schedule.prompts)),
      "alloc/max_group": float(sizes.max()) if len(sizes) else 0.0,
      "alloc/zero_variance_first": passes[0].first_zero,
      "alloc/zero_variance_prompts": float(np.mean(zero)) if len(zero)
                                     else 1.0,
      "alloc/zero_variance_rows": float(np.sum(sizes[zero]) / schedule.rows),
      "num_generated_tokens": float(sum(r.lengths.sum() for r in rounds)),
  })
  if refills:
    if sel.greso is not None:
      sel.greso.update([p for pa in passes for p in pa.prompts],
                       np.concatenate([pa.kinds for pa in passes]))
      metrics["select/skipped_prompts"] = skipped
      metrics["select/prompt_draws"] = draws
    metrics.update({
        "select/rounds": float(len(passes)),
        "select/rollouts": float(sum(len(r.lengths) for r in rounds)),
        "select/zero_variance_before": float(
            np.mean(passes[0].kinds != selection_lib.INFORMATIVE)),
        "select/masked_rows": float(np.sum(~trained)),
        "select/zero_variance_after": float(np.mean(~trained)),
    })
  return (merged, group_ids, metrics,
          trained if refills else None)


# "REFI": refill pass k samples with fold_in(key, _PASS_FOLD + k).
_PASS_FOLD = 0x52454649


class _Pass(NamedTuple):
  """One allocation of ``B`` prompts: its rounds, each round's entries (the
  prompt of each), each prompt's group size, kind and text."""

  rounds: list[rounds_lib.Sampled]
  entries: list[np.ndarray]
  sizes: np.ndarray
  kinds: np.ndarray
  prompts: list[Any]
  first_zero: float  # the prompts' share of zero variance after round 0


def _allocate(collector, params, examples, key, version, schedule) -> _Pass:
  """The schedule's rounds on ``examples``: round ``t`` samples with
  ``fold_in(key, t)`` (the first with ``key``), its prompts chosen by the
  variance of everything their samples scored so far; every round's
  prompts are padded to the batch's longest, so the rounds share the
  sampler's shapes."""
  batch_size = len(examples["prompt"])
  per_entry = schedule.sampler_samples
  longest = max(len(p) for p in tok_lib.encode_prompts(
      collector.tokenizer, examples["prompt"]))
  totals: list[list[float]] = [[] for _ in range(batch_size)]
  correct = np.ones(batch_size, bool)
  active = np.arange(batch_size)
  rounds, entries, first_zero = [], [], 0.0
  for t, (count, samples) in enumerate(zip(schedule.prompts,
                                           schedule.samples)):
    if t:
      active = allocation_lib.choose(allocation_lib.variances(totals),
                                     active, count)
    round_entries = allocation_lib.entries(active, samples, per_entry)
    round_examples = {f: [v[i] for i in round_entries]
                      for f, v in examples.items()}
    sampled = collector.sample_global(
        params, round_examples, jax.random.fold_in(key, t) if t else key,
        version, sampler=collector.allocation_sampler,
        samples=per_entry, longest=longest)
    rows = np.repeat(round_entries, per_entry)
    valid = rounds_lib.scored_rows(sampled.result.valid_NxR,
                                   collector.failed_rewards)
    for prompt, total, ok in zip(rows, sampled.result.total_N, valid):
      if ok:
        totals[prompt].append(float(total))
    np.logical_and.at(correct, rows, _correct(collector, sampled))
    if not t:
      first_zero = float(np.mean(allocation_lib.variances(totals) == 0))
    rounds.append(sampled)
    entries.append(round_entries)
  sizes = np.bincount(np.concatenate(entries),
                      minlength=batch_size) * per_entry
  informative = allocation_lib.variances(totals) > 0
  kinds = np.where(informative, selection_lib.INFORMATIVE,
                   np.where(correct, selection_lib.EASY, selection_lib.HARD))
  return _Pass(rounds, entries, sizes, kinds.astype(np.int8),
               list(examples["prompt"]), first_zero)


def _keep(passes: Sequence[_Pass], batch_size: int, budget: int
          ) -> tuple[list[tuple[int, int]], int]:
  """DAPO's filter on allocated groups: ``((pass, prompt) of the kept
  groups, their rows)``. Informative groups, in the order drawn, are kept
  while they fit the step's ``budget`` rows and ``batch_size`` groups (a
  group too large for the rows left is passed over for a later, smaller
  one)."""
  kept, used = [], 0
  for p, pa in enumerate(passes):
    for i, (kind, size) in enumerate(zip(pa.kinds, pa.sizes)):
      if (kind == selection_lib.INFORMATIVE and len(kept) < batch_size
          and used + size <= budget):
        kept.append((p, i))
        used += int(size)
  return kept, used


def _plan(passes: Sequence[_Pass], kept: Sequence[tuple[int, int]],
          schedule: Any) -> tuple[selection_lib.Plan, np.ndarray, np.ndarray]:
  """The batch of ``schedule.rows`` rows: every entry of the kept groups,
  then as many entries of the others (in the order drawn) as the rows left
  take, as masked fillers (group id -1: no group, advantage 0, loss
  cleared). Returns ``(plan over every pass's rounds, group_ids_N,
  trained_N)``, rows round by round."""
  per_entry = schedule.sampler_samples
  group = {pi: j for j, pi in enumerate(kept)}
  filler_entries = (schedule.rows - sum(
      int(passes[p].sizes[i]) for p, i in kept)) // per_entry
  taken, ids, trained = [], [], []
  for p, pa in enumerate(passes):
    for entries in pa.entries:
      idx = []
      for e, prompt in enumerate(entries):
        j = group.get((p, int(prompt)))
        if j is None and filler_entries:
          filler_entries -= 1
          j = -1
        elif j is None:
          continue
        idx.append(e)
        ids.append(j)
        trained.append(j >= 0)
      taken.append(np.asarray(idx, np.int64))
  ids_n = np.repeat(np.asarray(ids, np.int32), per_entry)
  trained_n = np.repeat(np.asarray(trained, bool), per_entry)
  return (selection_lib.Plan(tuple(taken), np.ones(len(ids), bool)), ids_n,
          trained_n)


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
