"""LATR episodes: a group's episodes branch at uncertain tokens of any turn.

``rl.rollout="latr"`` with an environment (``env.name``). LATR (Xing et
al. 2025, "Lookahead Tree-Based Rollouts for Enhanced Trajectory-Level
Exploration in Reinforcement Learning with Verifiable Rewards",
arXiv:2510.24302) grows part of each prompt's group as a tree that forks at
single tokens and prunes branches that stay like their parent
(``rljax/sampling/latr.py``). In an episode a branch copies a row in the
middle of a model turn, so it also copies the episode so far: its turns,
rewards and spans, and the environment's state (a JSON value), which the
branch then steps on its own when its turn ends.

* ``m = round(G * mix_ratio)`` of each group's rows are its tree: one root
  episode and ``m - 1`` empty slots; the other rows play as usual.
* On the devices (``turn_latr``, inside ``turns.decode_turn``) a branch
  point of a live tree row takes an empty slot of its group; until the
  tree is full its rows take their most likely tokens; a branch is pruned
  when, ``k`` tokens after its birth (``lookahead``) and still in the turn
  it was born in, decoding in step with its parent, it is within
  ``edit_distance x k`` edits of it.
* On the host (``EpisodeLatr.after_decode``, after each round) each row
  that holds another's content (``LatrRows.origin``) takes that row's
  records as they were when the decode started, and each pruned row is an
  empty slot again; the host then goes on as for any row.
* The static batch decodes whole while a tree can still change (a group
  with an empty slot and a live tree row, or a branch younger than the
  longest lookahead); after that a shrinking batch
  (``sampler.shrink_batch_to``) applies.
* When every episode is over, a slot still empty takes a copy of its
  group's root episode (LATR's ``fill_return_sequences``; ``latr/copies``).

Each row's draws are its own (``row_keys``); the rollout is an ordinary
group of ``G`` episodes for every advantage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rljax.rollout import turn_latr
from rljax.sampling.latr import LatrConfig


def check(latr: LatrConfig, num_samples: int, *, plain: bool = True) -> int:
  """The tree's rows ``m`` of a group of ``num_samples`` episodes.

  Raises:
    ValueError: naming the fields, for fewer than 2 tree rows, and unless
      ``plain`` (the static batch, where LATR episodes play:
      ``MultiTurnSampler``'s slots).
  """
  if not plain:
    raise ValueError("LATR episodes play on the static batch: pass no "
                     "slots with latr.")
  return latr.tree_rows(num_samples)


class EpisodeLatr:
  """The host's side of one ``MultiTurnSampler.run``'s LATR episodes (the
  module docstring)."""

  def __init__(self, latr: LatrConfig, num_samples: int, rows: int):
    self.latr, self.g, self.n = latr, num_samples, rows
    self.m = latr.tree_rows(num_samples)
    slot = np.arange(rows) % num_samples
    self.tree = slot < self.m
    self.active = (slot == 0) | ~self.tree
    self.growing = True  # a tree may still branch or prune
    self.copies = 0

  def dormant(self) -> np.ndarray:
    """``[N]``: the empty slots at the start."""
    return ~self.active

  def rows(self) -> turn_latr.LatrRows:
    return turn_latr.init(self.n, self.g, self.m)

  def after_decode(self, sampler: Any, state: Any, decoding, ep: Any,
                   states: list) -> np.ndarray:
    """The host's records follow the branches and prunes of the decode just
    read; returns the rows that decoded in it (the branches born in it
    among them, the pruned ones not)."""
    r = state.latr
    origin, active, parent, birth, live, done, column, start = (
        np.asarray(x) for x in sampler._host((
            r.origin, r.active, r.parent, r.birth, state.live, state.done,
            state.column, state.turn_start)))
    born = origin != np.arange(self.n)  # holds another row's content
    ep.copy_rows(np.flatnonzero(born), origin[born], states)
    # Pruned in this decode (born in it or before): no episode.
    for i in np.flatnonzero(~active & (self.active | born)):
      ep.clear_row(i, states)
    self.active = active
    decoding = (decoding | (born & active)) & active
    groups = self.n // self.g
    empty = (self.tree & ~active).reshape(groups, self.g).any(1)
    # A tree row still playing (decoding, or waiting for its environment)
    # may branch again.
    playing = (self.tree & active & ~done).reshape(groups, self.g).any(1)
    young = (self.tree & active & (parent >= 0) & live & (start <= birth)
             & (column - birth < max(self.latr.lookahead)))
    self.growing = bool(np.any(empty & playing) or young.any())
    return decoding

  def fill(self, sampler: Any, state: Any, ep: Any, states: list) -> Any:
    """Every episode over: each slot still empty takes a copy of its
    group's root episode."""
    empty = self.tree & ~self.active
    root = np.arange(self.n) // self.g * self.g
    src = np.where(empty, root, np.arange(self.n)).astype(np.int32)
    self.copies = int(empty.sum())
    if not self.copies:
      return state
    ep.copy_rows(np.flatnonzero(empty), root[empty], states)
    return sampler._fork(state, src, empty, np.zeros(self.n, bool))

  def metrics(self, sampler: Any, state: Any) -> dict[str, float]:
    r = state.latr
    counts = sampler._host((r.branches, r.pruned, r.branch_points))
    return {"latr/branches": float(counts[0]), "latr/pruned": float(counts[1]),
            "latr/branch_points": float(counts[2]),
            "latr/copies": float(self.copies)}


__all__ = ["EpisodeLatr", "check"]
