"""A step's rows sampled in rounds by a rollout allocator.

``rl.allocation`` (``rljax/data/allocation.py``, ``docs/selection.md``):
the ``Collector`` samples round by round, each round's prompts chosen by
the reward variance of everything their samples scored so far, and merges
the rounds into one batch of ``B * G`` rows whose groups have unequal
sizes; ``group_ids_N`` tells the advantage chain which rows share a prompt.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from rljax import tokenizers as tok_lib
from rljax.data import allocation as allocation_lib
from rljax.data import selection as selection_lib
from rljax.train import rounds as rounds_lib


def sample(collector: Any, params: Any, examples: Mapping[str, Sequence[Any]],
           key: jax.Array, version: int, on_dispatch: Callable[[], Any] | None
           ) -> tuple[rounds_lib.Sampled, np.ndarray, dict[str, float]]:
  """``(merged batch, group_ids_N, alloc/* metrics)`` of one step.

  Round ``t`` samples with ``fold_in(key, t)`` (the first with ``key``);
  every round's prompts are padded to the batch's longest, so the rounds of
  a step share the sampler's shapes."""
  schedule = collector.allocation
  per_entry = schedule.sampler_samples
  batch_size = len(examples["prompt"])
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
    sampled = collector._round(  # pylint: disable=protected-access
        params, round_examples, jax.random.fold_in(key, t) if t else key,
        version, None, None, sampler=collector.allocation_sampler,
        samples=per_entry, longest=longest)
    rows = np.repeat(entries, per_entry)
    valid = np.asarray(sampled.valid_N, bool)
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
  merged = collector._merge(rounds, plan, group_rows=per_entry)  # pylint: disable=protected-access
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


__all__ = ["sample"]
