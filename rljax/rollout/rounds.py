"""Sampled batches before the advantage chain: merged, stored and replayed.

A ``Sampled`` is one sampled and scored batch as ``Collector`` holds it
between scoring and the advantage chain. Prompt selection samples several
rounds and ``merge``s the groups its plan keeps (``rljax.data.selection``);
rollout replay keeps groups on the host (``host_groups``) and turns stored
groups back into a ``Sampled`` (``from_groups``) to merge after the fresh
ones. Prompts of different batches are left-padded to a common width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import rewards as rewards_lib
from rljax import sampling


def scored_rows(valid_NxR: np.ndarray, failed_rewards: str) -> np.ndarray:
  """``mask_N`` of the advantage chain: the rows with at least one reward
  (``failed_rewards="exclude"``, TRL since PR #5902), or every row
  (``"zero"``: a row whose every reward failed scores 0 in the statistics,
  as TRL's earlier ``nansum``)."""
  if failed_rewards == "zero":
    return np.ones(valid_NxR.shape[0], bool)
  return np.asarray(valid_NxR).any(axis=1)


class Sampled(NamedTuple):
  """One sampled and scored batch, before the advantage chain."""

  rollout: Any
  examples: Mapping[str, Sequence[Any]]
  completions: list[str]
  result: rewards_lib.RewardResult
  rewards_NxR: Any      # the chain's input: this process's block, global
  valid_N: Any
  lengths: np.ndarray   # every row's (all processes)
  finished: np.ndarray
  prompt_tokens_N: np.ndarray
  completion_tokens_N: np.ndarray
  token_versions: np.ndarray | None
  spec_metrics: dict[str, float]
  seconds_sample: float
  seconds_reward: float


def distinct_completions(completions: Sequence[str], g: int) -> float:
  """The distinct completions of each group of ``g`` consecutive rows of
  the batch (every process's rows), summed."""
  return float(sum(len(set(completions[i:i + g]))
                   for i in range(0, len(completions), g)))


def left_pad(x: Any, name: str, width: int, pad_id: int, xp: Any = np) -> Any:
  """A ``prompt_*`` array of a rollout left-padded to ``width`` columns
  (``pad_id`` tokens, False mask); other fields as they are."""
  if not name.startswith("prompt_") or x.ndim != 2 or x.shape[1] == width:
    return x
  value = pad_id if name == "prompt_tokens" else False
  return xp.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)


@functools.partial(jax.jit, static_argnames=("width", "pad_id",
                                             "tree_rows"))
def _take_rows(parts: Mapping[str, tuple[Any, ...]], index: Any, *,
               width: int, pad_id: int, tree_rows: int | None
               ) -> dict[str, Any]:
  """The rows ``index`` of every field's rounds stacked one after another
  (prompts left-padded to ``width``): one program for all the fields, whose
  shapes depend on the rounds' row counts only, where a ``jnp.take`` per
  field and round compiled a program for every field and every count of
  rows a round kept. With ``tree_rows``, tree nodes are numbered apart per
  tree of that many rows (``tree_nodes_apart``)."""
  out = {}
  for name, xs in parts.items():
    x = jnp.concatenate([left_pad(x, name, width, pad_id, jnp) for x in xs],
                        0)
    if name == "tree_nodes" and tree_rows:
      x = tree_nodes_apart(x, tree_rows, jnp)
    out[name] = jnp.take(x, index, axis=0)
  return out


def tree_nodes_apart(nodes_NxD: Any, tree_rows: int, xp: Any = np) -> Any:
  """``Rollout.tree_nodes`` of a batch of trees of ``tree_rows`` consecutive
  rows each, numbered apart: a node of the tree in rows ``[k R, (k + 1) R)``
  becomes ``node mod R + k R``. A tree's own nodes are below ``R`` (its
  leaves), so trees that merging puts into one group (rollout allocation's
  entries of a prompt, ``rollout/allocated.py``) share no node, and a batch
  numbered apart is numbered the same again by the same ``R``. (Other
  merges keep the nodes: a group's rows that come from one tree, or that
  were numbered apart when allocation merged them, stay distinct.)"""
  rows = xp.arange(nodes_NxD.shape[0], dtype=nodes_NxD.dtype)[:, None]
  return nodes_NxD % tree_rows + rows // tree_rows * tree_rows


def merge(rounds: Sequence[Sampled], plan: Any, *, group_rows: int,
          pad_id: int, failed_rewards: str,
          trees_apart: bool = False) -> Sampled:
  """The planned groups of every round (``selection.Plan``) as one batch,
  round by round, prompts left-padded to the widest round's bucket.
  ``group_rows``: rows per group (per prompt entry: ``trees_apart``, rollout
  allocation's entries, which it merges into groups of several, each a
  tree numbered apart from the others: ``tree_nodes_apart``)."""
  g = group_rows
  rows = [(np.asarray(groups)[:, None] * g + np.arange(g)).reshape(-1)
          for groups in plan.rounds]
  width = max(r.rollout.prompt_tokens.shape[1] for r in rounds)
  parts = {name: tuple(getattr(r.rollout, name) for r in rounds)
           for name in sampling.Rollout._fields
           if getattr(rounds[0].rollout, name) is not None}
  starts = np.cumsum([0] + [r.rollout.prompt_tokens.shape[0]
                            for r in rounds[:-1]])
  index = np.concatenate([start + idx for start, idx in zip(starts, rows)])
  fields = dict.fromkeys(sampling.Rollout._fields)
  fields.update(_take_rows(parts, index, width=width, pad_id=pad_id,
                           tree_rows=g if trees_apart else None))

  def cat(get):  # the host arrays' rows, by the same index
    return np.concatenate([np.asarray(get(r)) for r in rounds], 0)[index]

  result = rewards_lib.merge_results(
      rounds[0].result.names, cat(lambda r: r.result.rewards_NxR),
      cat(lambda r: r.result.valid_NxR), cat(lambda r: r.result.total_N),
      [r.result.metrics for r in rounds])
  examples = {f: [r.examples[f][i] for r, groups in zip(rounds, plan.rounds)
                  for i in groups] for f in rounds[0].examples}
  completions = [r.completions[j] for r, idx in zip(rounds, rows)
                 for j in idx]
  spec = merge_metrics([r.spec_metrics for r in rounds],
                       [len(r.lengths) for r in rounds])
  has_versions = [r.token_versions is not None for r in rounds]
  if any(has_versions) and not all(has_versions):
    raise ValueError("rounds.merge: some rounds carry token_versions and "
                     "others do not; give each round's (the collector fills "
                     "a round of one version).")
  return Sampled(
      sampling.Rollout(**fields), examples, completions, result,
      result.rewards_NxR, scored_rows(result.valid_NxR, failed_rewards),
      cat(lambda r: r.lengths), cat(lambda r: r.finished),
      cat(lambda r: r.prompt_tokens_N), cat(lambda r: r.completion_tokens_N),
      cat(lambda r: r.token_versions) if all(has_versions) else None, spec,
      sum(r.seconds_sample for r in rounds),
      sum(r.seconds_reward for r in rounds))


# Metrics of a round that count its work: a merged batch's are the sums.
_SUMMED = ("spec/drafted_rows", "rollout/decode_steps", "rollout/prefills",
           "rollout/prefilled_rows", "rollout/tree_leaf_tokens",
           "rollout/distinct_completions", "rollout/kv_cut_rows",
           "rollout/kv_blocks_left",
           "rollout/tree_copies",
           "rollout/generated_tokens", "env/failed_episodes", "env/errors",
           "env/timeouts", "env/observation_tokens",
           "env/observation_truncated", "env/turn_limit", "time/env")
# Means over a round's rows, and over its decode steps; maxima.
_ROW_MEANS = ("env/turns/mean", "spec/accept_rate",
              "spec/accepted_tokens/mean", "spec/full_accept_fraction")
_STEP_MEANS = ("rollout/slot_utilization",)
_MAXIMA = ("env/turns/max", "rollout/kv_blocks_peak")


def merge_metrics(metrics: Sequence[Mapping[str, float]],
                  rows: Sequence[int]) -> dict[str, float]:
  """The sampling metrics of rounds of ``rows`` rows each, as one batch's:
  counts add up, means are weighted by rows (by decode steps for slot
  utilization), maxima are the largest; anything else (a state, such as
  the worker restarts so far) is the last round's."""
  out: dict[str, float] = {}
  for k in dict.fromkeys(k for m in metrics for k in m):
    present = [(m[k], n, m.get("rollout/decode_steps", 0.0))
               for m, n in zip(metrics, rows) if k in m]
    values = [v for v, _, _ in present]
    if k in _SUMMED:
      out[k] = float(sum(values))
    elif k in _MAXIMA:
      out[k] = float(max(values))
    elif k in _ROW_MEANS or k in _STEP_MEANS:
      weights = [n if k in _ROW_MEANS else steps for _, n, steps in present]
      out[k] = (float(np.dot(values, weights) / sum(weights)) if sum(weights)
                else float(values[-1]))
    else:
      out[k] = float(values[-1])
  if out.get("rollout/tree_leaf_tokens"):  # a ratio of two sums
    out["rollout/tree_token_saving"] = 1.0 - (
        out["rollout/generated_tokens"] / out["rollout/tree_leaf_tokens"])
  return out


# The Rollout fields a batch may lack; a replayed group has those of its
# batch.
_OPTIONAL = ("policy_logprobs", "observation_mask", "turn_rewards",
             "tree_nodes")


def host_groups(sampled: Sampled, groups: Sequence[Any],
                group_rows: int, to_host: Any = np.asarray
                ) -> list[dict[str, np.ndarray]]:
  """Host copies of the given groups' rows, the fields a replay buffer
  keeps (``selection.ReplayBuffer``): group ``i`` is rows ``[i G, (i + 1)
  G)``, or, given as an array of row indices, those rows. ``to_host``:
  every row of a batch array on the host (with several processes,
  gathered from their blocks)."""
  r, result = sampled.rollout, sampled.result
  rows = {"prompt_tokens": r.prompt_tokens, "prompt_mask": r.prompt_mask,
          "completion_tokens": r.completion_tokens,
          "completion_mask": r.completion_mask, "lengths": sampled.lengths,
          "finished": sampled.finished, "sampler_logprobs": r.sampler_logprobs,
          "rewards_NxR": result.rewards_NxR, "valid_NxR": result.valid_NxR,
          "total_N": result.total_N, "prompt_tokens_N": sampled.prompt_tokens_N,
          "completion_tokens_N": sampled.completion_tokens_N}
  for name in _OPTIONAL:  # recorded logprobs, an environment's fields
    if getattr(r, name) is not None:
      rows[name] = getattr(r, name)
  if sampled.token_versions is not None:  # each token's policy version
    rows["token_versions"] = sampled.token_versions
  host = {k: to_host(v) for k, v in rows.items()}
  g = group_rows
  return [{k: v[i * g:(i + 1) * g] if np.ndim(i) == 0 else v[np.asarray(i)]
           for k, v in host.items()} for i in groups]


def from_groups(groups: Sequence[Mapping[str, np.ndarray]], like: Sampled, *,
                pad_id: int, failed_rewards: str) -> Sampled:
  """Stored groups (``host_groups``) as a ``Sampled`` to merge after
  ``like``, the fresh batch (same reward names and example fields)."""
  width = max(x["prompt_tokens"].shape[1] for x in groups)

  def stack(name):
    return np.concatenate([left_pad(x[name], name, width, pad_id)
                           for x in groups], 0)

  rollout = sampling.Rollout(
      stack("prompt_tokens"), stack("prompt_mask"),
      stack("completion_tokens"), stack("completion_mask"),
      stack("lengths"), stack("finished"), None, stack("sampler_logprobs"))
  rollout = rollout._replace(**{name: stack(name) for name in _OPTIONAL
                                if name in groups[0]})
  for name in _OPTIONAL:
    if (getattr(rollout, name) is None) != (
        getattr(like.rollout, name) is None):
      raise ValueError(
          f"the replay buffer's groups and this batch disagree on "
          f"Rollout.{name} (rl.old_logprobs or env.name changed?).")
  result = rewards_lib.RewardResult(
      like.result.names, stack("rewards_NxR"), stack("valid_NxR"),
      stack("total_N"), {k: 0.0 for k in like.result.metrics}, ())
  n = len(result.total_N)
  return Sampled(
      rollout, {f: [None] * len(groups) for f in like.examples}, [""] * n,
      result, result.rewards_NxR,
      scored_rows(result.valid_NxR, failed_rewards), stack("lengths"),
      stack("finished"), stack("prompt_tokens_N"),
      stack("completion_tokens_N"),
      stack("token_versions") if "token_versions" in groups[0] else None,
      {}, 0.0, 0.0)


__all__ = ["Sampled", "distinct_completions", "from_groups", "host_groups",
           "left_pad", "merge",
           "merge_metrics", "scored_rows", "tree_nodes_apart"]
