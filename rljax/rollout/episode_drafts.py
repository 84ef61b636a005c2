"""SPEC-RL's drafts of a multi-turn rollout (``multi_turn.MultiTurnSampler``):
each turn drafts from the stored episode of its prompt where the row's history
so far is the stored one's to the token (``multi_turn``'s docstring).

References:
  Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning via
  Speculative Rollouts", https://arxiv.org/abs/2509.23232.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rljax.rollout.episodes import EpisodeLog


class Speculation:
  """One ``run``'s SPEC-RL drafts (the module docstring): the stored
  episodes of its prompts, each turn's draft, and the ``spec/*`` figures.
  Every process holds the same (the prompts and the buffers are global)."""

  def __init__(self, sampler: Any, encoded, g: int,
               ep: EpisodeLog):
    self.sampler, self.encoded, self.g, self.ep = sampler, encoded, g, ep
    t = sampler.config.max_new_tokens
    self.stored = sampler.drafts.lookup_turns(encoded, g, t)
    n = len(encoded) * g
    self.drafted_rows = np.zeros(n, bool)
    self.turns = self.full = 0
    self.drafted_tokens = self.accepted_tokens = 0

  def drafts(self, slots_M, slot_row, host) -> tuple[np.ndarray, ...]:
    """``[M, D]`` draft tokens and logprobs and ``[M]`` lengths of the
    slots ``slots_M`` about to decode a turn (0 where no draft)."""
    d = self.sampler._draft_width  # pylint: disable=protected-access
    m = len(slots_M)
    tokens = np.zeros((m, d), np.int32)
    logprobs = np.zeros((m, d), np.float32)
    length = np.zeros(m, np.int32)
    if self.stored is None:
      return tokens, length, logprobs
    s_tokens, s_mask, s_lp, s_observed = self.stored
    b_tokens, b_observed, column = host
    t = s_tokens.shape[1]
    for s in np.flatnonzero(slots_M):
      r, c = slot_row[s], int(column[s])
      if r < 0 or c >= t or not s_mask[r, c] or s_observed[r, c]:
        continue  # the stored episode has no model turn here
      if c and not (s_mask[r, :c].all()
                    and np.array_equal(b_tokens[s, :c], s_tokens[r, :c])
                    and np.array_equal(b_observed[s, :c], s_observed[r, :c])):
        continue  # the history differs from the stored episode's
      end = c
      while end < t and s_mask[r, end] and not s_observed[r, end]:
        end += 1
      k = min(end - c, d)
      tokens[s, :k] = s_tokens[r, c:c + k]
      logprobs[s, :k] = s_lp[r, c:c + k]
      length[s] = k
    return tokens, length, logprobs

  def verify(self, params, state, slots_M, slot_row, prompt_width):
    """``turns.verify`` of the slots ``slots_M``' drafts (those with one)."""
    if self.stored is None or not slots_M.any():
      return state
    sampler = self.sampler
    # pylint: disable=protected-access
    host = sampler._host((state.tokens, state.observed, state.column))
    before = np.asarray(host[2])
    tokens, length, logprobs = self.drafts(slots_M, slot_row, host)
    if not length.any():
      return state
    state = sampler._verify(params, state, tokens, length, logprobs,
                            prompt_width=prompt_width)
    accepted = np.asarray(sampler._host(state.column)) - before
    has = length > 0
    self.drafted_rows[slot_row[has]] = True
    self.turns += int(has.sum())
    self.full += int(np.sum(accepted[has] == length[has]))
    self.drafted_tokens += int(length.sum())
    self.accepted_tokens += int(accepted[has].sum())
    return state

  def store(self, buffers, examples=None) -> None:
    """Each episode of the run as its prompt's next draft (the prompts whose
    reset failed are left out); ``examples``: those examples' only (partial
    rollouts: the trained groups), None: every one."""
    tokens, mask, logprobs, observed = (np.asarray(x) for x in buffers)
    g = self.g
    ok = [int(i) for i in (range(len(self.encoded)) if examples is None
                           else examples)
          if not self.ep.failed[i * g:(i + 1) * g].all()]
    rows = np.concatenate([np.arange(i * g, (i + 1) * g) for i in ok]
                          ) if ok else np.zeros(0, np.int64)
    if ok:
      self.sampler.drafts.update([self.encoded[i] for i in ok], tokens[rows],
                                 mask[rows], logprobs[rows], observed[rows])

  def metrics(self) -> dict[str, float]:
    out = {"spec/drafted_rows": float(self.drafted_rows.sum()),
           "spec/drafted_turns": float(self.turns)}
    if self.turns:
      out.update({
          "spec/accepted_tokens/mean": self.accepted_tokens / self.turns,
          "spec/accept_rate": self.accepted_tokens / max(
              self.drafted_tokens, 1),
          "spec/full_accept_fraction": self.full / self.turns})
    return out


__all__ = ["Speculation"]
