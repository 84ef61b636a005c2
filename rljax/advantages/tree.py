"""TreePO's segment-level advantage: baselines from every subtree of a leaf.

A tree rollout (``rljax/sampling/tree.py``) samples a prompt's ``G`` leaves
as a tree whose nodes are segments; ``tree_nodes_NxD[i, d]`` is the node of
depth ``d`` that leaf ``i`` descends from. TreePO (Li et al. 2025,
arXiv:2508.17445, Sec. 3; its code's
``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``) centres a
leaf's reward on each subtree it belongs to, the whole group included, and
averages:

    S_i^0 = the valid leaves of i's group (the root)
    S_i^d = the valid leaves of i's group under i's node of depth d - 1,
            d = 1 .. D, kept only where |S_i^d| > 1
    A_i   = sum_d w_d (r_i - mean(S_i^d)) / sum_d w_d

with ``w_d = |S_i^d|`` (``weighting="group_size"``, TreePO's default) or 1
(``"average"``). The ``treepo`` preset then whitens over the batch's tokens
(``whiten_by_tokens``), as TreePO's REINFORCE++-style estimator does.
"""

from __future__ import annotations

import jax.numpy as jnp

import optax

from rljax.advantages._common import _grouped, _out, _stateless, _Tx
from rljax.advantages.length_aware import _token_whitening

WEIGHTINGS = ("group_size", "average")


def center_by_subtrees(weighting: str = "group_size") -> _Tx:
  """Centres each leaf's reward on the means of its subtrees (see the
  module docstring): TreePO's tree-based segment-level baseline.

  Reads the extra argument ``tree_nodes_NxD`` (``Rollout.tree_nodes``);
  without it every row is its own depth-0 leaf and the transform is
  ``center_by_group_mean``. A subtree whose valid rewards are all equal
  contributes exactly 0; invalid rows (``mask_N``) are in no subtree and
  get 0.

  Args:
    weighting: ``"group_size"`` (each subtree weighs its leaf count) or
      ``"average"`` (each subtree weighs 1).

  References:
    Li et al., "TreePO: Bridging the Gap of Policy Optimization and Efficacy
    and Inference Efficiency with Heuristic Tree-based Modeling",
    https://arxiv.org/abs/2508.17445.
  """
  fn = "center_by_subtrees"
  if weighting not in WEIGHTINGS:
    raise ValueError(f"{fn}: weighting={weighting!r}; accepted {WEIGHTINGS}.")

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, tree_nodes_NxD=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    k, g = x.shape
    if tree_nodes_NxD is None:
      nodes = jnp.zeros((k, g, 0), jnp.int32)
    else:
      if tree_nodes_NxD.ndim != 2 or tree_nodes_NxD.shape[0] != k * g:
        raise ValueError(f"{fn}: tree_nodes_NxD must be [N, D] with N={k * g}"
                         f" rows; got shape {tree_nodes_NxD.shape}.")
      nodes = tree_nodes_NxD.reshape(k, g, -1)
    pair = valid[:, :, None] & valid[:, None, :]  # [K, G, G]
    total = jnp.zeros_like(x)
    weights = jnp.zeros_like(x)
    for d in range(nodes.shape[2] + 1):
      same = pair if d == 0 else pair & (
          nodes[:, :, None, d - 1] == nodes[:, None, :, d - 1])
      size = jnp.sum(same, -1).astype(jnp.float32)
      mean = jnp.sum(jnp.where(same, x[:, None, :], 0.0), -1) / jnp.maximum(
          size, 1.0)
      hi = jnp.max(jnp.where(same, x[:, None, :], -jnp.inf), -1)
      lo = jnp.min(jnp.where(same, x[:, None, :], jnp.inf), -1)
      term = jnp.where(hi > lo, x - mean, 0.0)
      kept = valid & ((size > 1) if d else (size > 0))
      w = jnp.where(kept, size if weighting == "group_size" else 1.0, 0.0)
      total = total + w * term
      weights = weights + w
    adv = total / jnp.maximum(weights, 1.0)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def treepo(weighting: str = "group_size", eps: float = 1e-8) -> _Tx:
  """TreePO's advantage: ``center_by_subtrees(weighting)``, then
  ``whiten_by_tokens(eps)`` over the batch's completion tokens (TreePO's
  ``compute_tree_rfpp``-style estimator; the references of
  ``center_by_subtrees``). On rows with no ``tree_nodes_NxD`` it is verl's
  ``reinforce_plus_plus_baseline`` (``reinforce_pp_token``)."""
  return optax.chain(center_by_subtrees(weighting),
                     _token_whitening("treepo", eps, None, False))


__all__ = ["WEIGHTINGS", "center_by_subtrees", "treepo"]
