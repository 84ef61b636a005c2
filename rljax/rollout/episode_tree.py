"""Tree episodes: a group's episodes grow as a tree that forks between turns.

``rl.rollout="tree"`` with an environment (``env.name``). TreePO (Li et
al. 2025, arXiv:2508.17445) samples a prompt's completions as a tree of
segments; in a multi-turn episode a segment is a model turn and the
environment's answer to it, as in tree search for agents (Tree-GRPO, Ji et
al. 2025, arXiv:2509.21240: a node is a whole agent step). So:

* each example starts ``roots`` episodes (``TreeConfig.roots``); the other
  rows of its group wait, dormant;
* after turn ``d + 1`` (``d = 0 .. D - 1``), once every episode of the
  group at depth ``d`` has had its environment's answer inserted or is
  over, the group forks to the next width (``TreeConfig.widths``): each
  episode keeps one child and the new children go to the episodes still
  playing, by the mean surprisal of the turn each just sampled
  (``branch_by="uncertainty"``) or equally (``"uniform"``), as the token
  tree's forks (``sampling.tree.fork_parents``); a group whose episodes are
  all over copies them (``rollout/tree_copies``);
* a child is its parent's row (``turns.fork``: its tokens, logprobs and
  cache rows; on a paged cache its block table, the blocks shared until a
  row writes into one) and its host records: rewards, turns, spans, and
  the environment's state, a JSON value copied (``Environment.step`` gets
  each child's own). It keeps its own key, so siblings diverge from the
  fork on;
* ``Rollout.tree_nodes`` records each leaf's ancestors for TreePO's
  segment-level advantage (``advantages.treepo``), and the figures count
  the model tokens decoded once for the leaves that share them
  (``rollout/tree_token_saving``).

The forks come after turns ``1 .. D``, so ``D < env.max_turns``
(``check``). ``TreeConfig.segment_tokens`` is the token tree's, unused here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sampling.tree import TreeConfig, fork_parents


def check(tree: TreeConfig, num_samples: int, max_turns: int, *,
          plain: bool = True) -> int:
  """The tree's fork count ``D``, checked against the episode's turns.

  Raises:
    ValueError: naming the fields, when the widths do not make
      ``num_samples`` or the ``D`` forks leave no turn after the last; and
      unless ``plain`` (the static batch, where tree episodes play:
      ``MultiTurnSampler``'s slots).
  """
  if not plain:
    raise ValueError("tree episodes play on the static batch: pass no "
                     "slots with tree.")
  forks = len(tree.widths(num_samples)) - 1
  if forks >= max_turns:
    raise ValueError(
        f"rl.tree: tree episodes fork after each of their first {forks} "
        f"turns (rl.tree.roots={tree.roots} x rl.tree.branch={tree.branch}^"
        f"{forks} = {num_samples} rows), and env.max_turns={max_turns} "
        f"leaves no turn after the last fork; accepted: env.max_turns >= "
        f"{forks + 1}, or fewer forks.")
  return forks


class EpisodeTree:
  """The host's side of one ``MultiTurnSampler.run``'s tree episodes (the
  module docstring): which rows wait for a fork, each group's depth, each
  row's ancestors, and what the forks copied."""

  def __init__(self, tree: TreeConfig, num_samples: int, rows: int):
    self.tree, self.g = tree, num_samples
    self.widths = tree.widths(num_samples)
    self.forks = len(self.widths) - 1
    self.depth = np.zeros(rows // num_samples, np.int64)
    self.held = np.zeros(rows, bool)
    self.nodes = np.zeros((rows, self.forks), np.int32)
    self.copied_tokens = 0  # model tokens a child got from its parent
    self.copies = 0  # children of an episode already over

  def dormant(self) -> np.ndarray:
    """``[N]``: the rows that wait for a fork (all but each group's roots)."""
    return np.tile(np.arange(self.g) >= self.widths[0], len(self.depth))

  def step(self, sampler: Any, state: Any, decoding, resumed, done,
           ep: Any, states: list) -> tuple[Any, np.ndarray]:
    """Holds the rows that ``resumed`` after their group's fork turn, and
    forks every group whose episodes are all held or over (``done``).
    Returns the state, the rows that decode next and those of them that
    start a turn now (resumed and not held, or forked): SPEC-RL drafts
    their turns after the fork (``episode_drafts``), so that a fork's
    children draft apart."""
    group = np.arange(len(decoding)) // self.g
    hold = resumed & (self.depth[group] < self.forks) & (
        ep.turns == self.depth[group] + 1)
    self.held |= hold
    decoding = decoding & ~hold
    src = np.arange(len(decoding))
    forked = np.zeros(len(decoding), bool)
    done = np.array(done, bool)
    surprisal = None
    for i in range(len(self.depth)):
      while self.depth[i] < self.forks:
        w = self.widths[self.depth[i]]
        rows = i * self.g + np.arange(w)
        if not np.all(done[rows] | self.held[rows]):
          break
        if surprisal is None:
          surprisal = self._surprisal(sampler._host(state.sampler_logp), ep)
        parents = np.asarray(jax.device_get(fork_parents(
            jnp.asarray(done[rows][None]), jnp.asarray(surprisal[rows][None]),
            self.widths[self.depth[i] + 1], self.tree.branch_by)))[0]
        self._fork(i, rows[parents], done, surprisal, src, forked, ep, states)
    started = resumed & ~hold
    if hold.any() or forked.any():
      state = sampler._fork(state, src, forked, hold)
      decoding = decoding | (forked & ~done)
      started = (started & ~forked) | (forked & ~done)
    return state, decoding, started

  def _fork(self, i, parent_L, done, surprisal, src, forked, ep, states):
    """Group ``i``'s next width: child ``j`` (row ``i * G + j``) a copy of
    row ``parent_L[j]``; the host's records gathered (``src`` composes the
    device's gather: the state still holds the rows before any fork of this
    step)."""
    d = self.depth[i]
    child = i * self.g + np.arange(len(parent_L))
    first = np.r_[True, parent_L[1:] != parent_L[:-1]]
    for p in parent_L[~first]:  # children beyond a parent's first
      self.copied_tokens += sum(e - s for s, e, kind in ep.spans[p]
                                if kind == "model")
      self.copies += int(done[p])
    ep.copy_rows(child, parent_L, states)
    self.nodes[child] = self.nodes[parent_L]
    self.nodes[child, d] = parent_L - i * self.g
    src[child] = src[parent_L]
    forked[child] = True
    for array in (done, surprisal):
      array[child] = array[parent_L]
    self.held[child] = False
    self.depth[i] += 1

  @staticmethod
  def _surprisal(sampler_logp_NxT, ep) -> np.ndarray:
    """``[N]``: each row's mean ``-log p`` over its last model turn."""
    logp = np.asarray(sampler_logp_NxT)
    out = np.zeros(len(logp), np.float32)
    for r, spans in enumerate(ep.spans):
      model = [(s, e) for s, e, kind in spans if kind == "model" and e > s]
      if model:
        s, e = model[-1]
        out[r] = -float(np.mean(logp[r, s:e]))
    return out

  def metrics(self, lengths_N: np.ndarray) -> dict[str, float]:
    """The forks' figures, as the token tree's (``sampling.tree``):
    tokens decoded, the leaves' tokens, copies of ended episodes, and the
    share of the leaves' model tokens that forks saved from decoding."""
    leaf = float(np.sum(lengths_N))
    return {"rollout/generated_tokens": leaf - self.copied_tokens,
            "rollout/tree_leaf_tokens": leaf,
            "rollout/tree_copies": float(self.copies),
            "rollout/tree_token_saving": (self.copied_tokens / leaf
                                          if leaf else 0.0)}

  def annotate(self, rollout: Any, on_devices: bool) -> Any:
    """``rollout`` with its ``tree_nodes``."""
    nodes = self.nodes.copy()
    return rollout._replace(tree_nodes=jnp.asarray(nodes) if on_devices
                            else nodes)


__all__ = ["EpisodeTree", "check"]
