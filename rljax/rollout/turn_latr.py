"""LATR's branching inside multi-turn episodes: the device side.

``turns.decode_turn`` calls ``branch`` before each decode step and
``prune`` after it when the state holds ``LatrRows`` (``rl.rollout="latr"``
with an environment; the host's side, and the method, are in
``rljax/rollout/episode_latr.py``). The rules are the token sampler's
(``rljax/sampling/latr.py``), on the rows that decode their turn:

* a live tree row whose two most likely next tokens pass the thresholds is
  a branch point; the ``k``-th of a group takes its ``k``-th empty slot,
  which becomes a copy of the row (``turns.fork``: buffers, cache rows or
  block table, and its place in the episode) that takes the second
  candidate while the row takes the first;
* until the group's tree is full, a tree row that does not branch takes its
  most likely token;
* a branch is compared with its parent ``k`` tokens after its birth (each
  ``k`` of ``lookahead``) while both still decode the turn it was born in,
  in step: within ``edit_distance x k`` edits, it is pruned (its slot
  empty again, its children compared with no one).

``origin`` tells the host, after a decode, which row's content (as it was
when the decode started) each row now holds: a branch of a branch born in
the same decode holds its grandparent's.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sampling.latr import (LatrConfig, edit_distance, last_tokens,
                                 spawn_slots)


class LatrRows(NamedTuple):
  tree: jax.Array       # [N] bool, one of its group's tree rows
  active: jax.Array     # [N] bool, holds an episode (else an empty slot)
  parent: jax.Array     # [N] int32, the row it branched from (-1: none)
  birth: jax.Array      # [N] int32, its completion column at its birth
  origin: jax.Array     # [N] int32, whose content it holds (module docstring)
  branches: jax.Array   # [] int32, counts over the rollout
  pruned: jax.Array
  branch_points: jax.Array


def init(n: int, g: int, m: int) -> LatrRows:
  """Every group's first ``m`` rows are its tree: the root active, the
  others empty; the other ``g - m`` rows are sampled as usual."""
  slot = np.arange(n) % g
  tree = slot < m
  zero = jnp.zeros((), jnp.int32)
  return LatrRows(
      tree=jnp.asarray(tree), active=jnp.asarray((slot == 0) | ~tree),
      parent=jnp.full((n,), -1, jnp.int32), birth=jnp.zeros((n,), jnp.int32),
      origin=jnp.arange(n, dtype=jnp.int32), branches=zero, pruned=zero,
      branch_points=zero)


def branch(s: Any, fork: Callable, cfg: LatrConfig, g: int
           ) -> tuple[Any, jax.Array, jax.Array]:
  """Before a decode step: branch points take empty slots. Returns the
  state, the rows whose token is forced and that token."""
  rows = s.latr
  probs = jax.nn.softmax(s.logits.astype(jnp.float32), -1)
  top_p, top_id = jax.lax.top_k(probs, 2)
  ok = (rows.tree & rows.active & s.live & (top_p[:, 1] > cfg.abs_threshold)
        & (top_p[:, 0] - top_p[:, 1] > cfg.rel_threshold))
  src, spawn, branched, full = spawn_slots(ok, rows.tree & ~rows.active, g)
  no = jnp.zeros_like(spawn)
  s = jax.lax.cond(jnp.any(spawn), lambda x: fork(x, src, spawn, no),
                   lambda x: x, s)
  top_id = top_id[src]  # a spawned row's candidates are its parent's
  s = s._replace(latr=s.latr._replace(
      active=rows.active | spawn, parent=jnp.where(spawn, src, rows.parent),
      birth=jnp.where(spawn, s.column, rows.birth),
      branches=rows.branches + jnp.sum(spawn).astype(jnp.int32),
      branch_points=rows.branch_points + jnp.sum(ok).astype(jnp.int32)))
  forced = rows.tree & s.live & (spawn | branched | ~full)
  return s, forced, jnp.where(spawn, top_id[:, 1], top_id[:, 0])


def prune(s: Any, cfg: LatrConfig) -> Any:
  """After a decode step: branches ``k`` tokens old that stayed within
  ``edit_distance x k`` edits of their parent are pruned (not live, over,
  their slot empty)."""
  rows = s.latr
  n, t = s.tokens.shape
  p = jnp.maximum(rows.parent, 0)
  out = jnp.zeros((n,), jnp.bool_)
  for k in sorted(set(cfg.lookahead)):
    if k > t:
      continue
    due = (rows.tree & rows.active & (rows.parent >= 0) & s.live & s.live[p]
           & rows.active[p] & (s.column == s.column[p])
           & (s.column - rows.birth == k)
           & (s.turn_start <= rows.birth))  # born in this turn

    def compare(due=due, k=k):
      return due & (edit_distance(last_tokens(s.tokens, s.column, k),
                                  last_tokens(s.tokens[p], s.column, k))
                    < cfg.edit_distance * k)

    out = out | jax.lax.cond(jnp.any(due), compare,
                             lambda: jnp.zeros((n,), jnp.bool_))
  parent = jnp.where(out[p] & (rows.parent >= 0), -1, rows.parent)
  return s._replace(
      live=s.live & ~out, done=s.done | out,
      ended_turn=s.ended_turn & ~out,
      latr=rows._replace(active=rows.active & ~out,
                         parent=jnp.where(out, -1, parent),
                         pruned=rows.pruned + jnp.sum(out).astype(jnp.int32)))


__all__ = ["LatrRows", "branch", "init", "prune"]
