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
    starting = [s for s in np.flatnonzero(slots_M) if slot_row[s] >= 0]
    latr = self.sampler.latr
    if latr is not None:  # LATR's tree rows force or branch: no drafts
      m = latr.tree_rows(self.g)
      starting = [s for s in starting if slot_row[s] % self.g >= m]
    for s in starting:
      r, c = slot_row[s], int(column[s])
      if c >= t:
        continue
      if self.sampler.tree is not None:
        j = self._tree_source(s, c, starting, slot_row, host)
      else:
        j = r if self._follows(r, c, b_tokens[s], b_observed[s]) else -1
      if j < 0:
        continue  # no stored turn starts from this history
      end = self._turn_end(j, c)
      k = min(end - c, d)
      tokens[s, :k] = s_tokens[j, c:c + k]
      logprobs[s, :k] = s_lp[j, c:c + k]
      length[s] = k
    return tokens, length, logprobs

  def _follows(self, j, c, tokens_T, observed_T) -> bool:
    """Whether stored episode ``j`` has a model turn at column ``c`` after
    the history ``tokens_T[:c]`` (its observation mask ``observed_T``)."""
    s_tokens, s_mask, _, s_observed = self.stored
    if not s_mask[j, c] or s_observed[j, c]:
      return False  # the stored episode has no model turn here
    return not c or bool(s_mask[j, :c].all()
                         and np.array_equal(tokens_T[:c], s_tokens[j, :c])
                         and np.array_equal(observed_T[:c],
                                            s_observed[j, :c]))

  def _turn_end(self, j, c) -> int:
    """The column where stored episode ``j``'s model turn from ``c`` ends."""
    _, s_mask, _, s_observed = self.stored
    end, t = c, s_mask.shape[1]
    while end < t and s_mask[j, end] and not s_observed[j, end]:
      end += 1
    return end

  def _tree_source(self, s, c, starting, slot_row, host) -> int:
    """Tree episodes (``episode_tree``): the stored episode that slot
    ``s``'s turn drafts from, or -1. A fork's children share their history,
    so the ``k``-th of the rows that start a turn from the same history
    takes the ``k``-th distinct turn that the prompt's stored episodes
    played from it (in row order): siblings draft different branches, and
    a tree drafted from a tree of the same policy is that tree again."""
    b_tokens, b_observed, column = host
    g, r = self.g, slot_row[s]
    same = lambda o: (slot_row[o] // g == r // g and int(column[o]) == c
                      and np.array_equal(b_tokens[o, :c], b_tokens[s, :c])
                      and np.array_equal(b_observed[o, :c],
                                         b_observed[s, :c]))
    k = sum(1 for o in starting if slot_row[o] < r and same(o))
    turns = []
    for j in range((r // g) * g, (r // g + 1) * g):
      if self._follows(j, c, b_tokens[s], b_observed[s]):
        turn = self.stored[0][j, c:self._turn_end(j, c)].tobytes()
        if turn not in turns:
          turns.append(turn)
          if len(turns) == k + 1:
            return j
    return -1

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
