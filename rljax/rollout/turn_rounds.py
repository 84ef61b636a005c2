"""The rounds of a multi-turn rollout's host loop (``multi_turn.py``).

Mixed into ``MultiTurnSampler``: the decode of a round on a static batch
that shrinks as its rows end (``sampler.shrink_batch_to``), and the figures
of the rounds (the paged pool's, the model tokens decoded).
"""

from __future__ import annotations

import numpy as np

from rljax.models import paged_cache as pc
from rljax.sampling.paged import pool_stats


class Rounds:
  """Mixed into ``MultiTurnSampler`` (its ``_decode``, ``_decode_rows`` and
  ``_host``)."""

  def _decode_shrinking(self, params, state, clear, min_waiting, decoding,
                        levels, prompt_width):
    """One round's decode on the smallest of ``levels`` that holds the rows
    that decode (``decoding``), padded with rows that do not; it returns
    once no more rows decode than the next smaller level holds, so the next
    round shrinks. Returns ``(state, rows decoded)``."""
    live = np.flatnonzero(decoding)
    k = max(i for i, size in enumerate(levels) if size >= len(live))
    fits = np.int32(levels[k + 1] if k + 1 < len(levels) else 0)
    if k == 0:
      return self._decode(params, state, clear, min_waiting, fits,
                          prompt_width=prompt_width), levels[0]
    rows = np.concatenate([live, np.flatnonzero(~decoding)[
        :levels[k] - len(live)]]).astype(np.int32)
    return self._decode_rows(params, state, clear, min_waiting, rows, fits,
                             prompt_width=prompt_width), levels[k]

  def _pool_metrics(self, state) -> dict[str, float]:
    """The paged pool's figures (``sampling.paged.pool_stats``): blocks
    at the peak, the pool, episodes cut for want of a block, and blocks
    still held once every episode is over (0). Episodes a partial step
    carries are restored next step (``turns.restore``): their blocks go
    back with the step's, as continuous slots' do."""
    cache = pc.release(state.cache, ~state.done)
    return {k: float(v) for k, v in self._host(pool_stats(
        cache, cache.num_blocks, state.peak, state.cut)).items()}

  def _model_tokens(self, state) -> int:
    mask, observed = self._host((state.mask, state.observed))
    return int(np.sum(np.asarray(mask) & ~np.asarray(observed)))


__all__ = ["Rounds"]
