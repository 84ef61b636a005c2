"""SPEC-RL on the static batch (``sampler.speculative``), for the
``Collector``: a batch's prompts that have an earlier rollout in the draft
store (``sampling.DraftStore``) are sampled speculatively from it, and
every rollout is stored as the next draft. The slots verify drafts
themselves (``rollout/partial.py``).
"""

from __future__ import annotations

import jax
import numpy as np

from rljax import distributed
from rljax import sampling


class Speculated:
  """Mixed into ``Collector``: needs ``sampler``, ``speculation``,
  ``allocation_sampler``, ``allocation_speculation``, ``samples_per_prompt``,
  ``group`` and ``mesh``."""

  def _sample(self, params, prompts, tokens, mask, key, sampler=None,
              where=None, samples=None, real=None):
    """The rollout of ``samples`` rows per prompt (default the training
    rows'), speculative when the store has drafts (SPEC-RL), on the mesh
    ``where`` (the sampler's; default the trainer's). ``real``: the global
    batch's first ``real`` prompts are its own, the others copies of the
    last one that pad it to the mesh (``sample_global``; None: none):
    they look nothing up and store nothing, and their drafts are copies of
    the last prompt's, as a sampler pads its own batch."""
    sampler = sampler or self.sampler
    spec = (self.speculation if sampler is self.sampler
            else self.allocation_speculation
            if sampler is self.allocation_sampler else None)
    where = where or self.mesh
    if spec is None:
      return _plain(sampler, params, tokens, mask, key)
    g, group = samples or self.samples_per_prompt, self.group
    # The store is replicated: every process looks up and stores every
    # prompt of the batch, in the order of the rows (the same drafts, the
    # same LRU order and, in a frozen step, the same entry counts on each),
    # and drafts its own block of the rows.
    all_prompts = prompts
    if not group.single:
      blocks = group.gather_blocks([[int(t) for t in p] for p in prompts],
                                   where)
      all_prompts = [p for block in blocks for p in block]
    real = len(all_prompts) if real is None else real
    draft = spec.store.lookup(all_prompts[:real], g, spec.max_new_tokens)
    if draft is None:
      rollout, metrics = _plain(sampler, params, tokens, mask, key)
      metrics["spec/drafted_rows"] = 0.0
    else:
      if spec.draft_slots is not None:  # the rows that take no draft
        draft = draft._replace(mask=draft.mask & np.tile(
            spec.draft_slots, real)[:, None])
      drafted_N = draft.mask.sum(1)
      extra = len(all_prompts) - real
      mine = (slice(None) if group.single
              else group.rows(where, len(all_prompts) * g))
      draft = sampling.Draft(*(group.global_array(np.concatenate(
          [x, np.tile(x[-g:], (extra, 1))])[mine], where) for x in draft))
      # A paged cache's sampler also returns its pool's figures.
      rollout, accepted_N, *pool = spec.sampler(params, tokens, mask, draft,
                                                key)
      accepted_N = group.gather_rows(group.local_rows(accepted_N),
                                     where)[:real * g]
      has = drafted_N > 0
      metrics = {
          "spec/drafted_rows": float(has.sum()),
          "spec/accepted_tokens/mean": float(accepted_N[has].mean()),
          "spec/accept_rate": float(accepted_N.sum() / max(drafted_N.sum(), 1)),
          "spec/full_accept_fraction": float(
              (accepted_N[has] == drafted_N[has]).mean()),
      }
      for figures in pool:
        metrics.update({k: float(v) for k, v in
                        jax.device_get(figures).items()})
    rows = distributed.local_rows_many(
        group, rollout.completion_tokens, rollout.completion_mask,
        rollout.sampler_logprobs)
    spec.store.update(all_prompts[:real], *(
        x[:real * g] for x in distributed.gather_rows_many(group, where,
                                                           *rows)))
    return rollout, metrics


def _plain(sampler, params, tokens, mask, key):
  """``(rollout, metrics)`` of the plain sampler: a paged pool's figures
  (``with_metrics``), or none."""
  with_metrics = getattr(sampler, "with_metrics", None)
  if with_metrics is not None:
    return with_metrics(params, tokens, mask, key)
  return sampler(params, tokens, mask, key), {}


__all__ = ["Speculated"]
