"""Prompt selection's rounds and replay's groups (``docs/selection.md``).

Mixed into ``Collector``: DAPO, GRESO and DOTS sample rounds until the
batch has enough informative groups (``selection.plan_batch`` forms it),
and replay stores informative groups and trains them again with the fresh
ones, each token tagged with the policy version that drew it. Rollout
allocation's rounds are ``allocated.py``'s.
"""

from __future__ import annotations


import jax
import numpy as np

from rljax.data import selection as selection_lib
from rljax.rollout import rounds as rounds_lib
from rljax.rollout.rounds import Sampled


class SelectionAndReplay:
  """Mixed into ``Collector`` (its ``selection``, ``replay``,
  ``samples_per_prompt``, ``correct_column``, ``sample_global``,
  ``merge_rounds``, ``_scored`` and ``_host_rows``)."""

  def _sample_selected(self, params, examples, key, version, on_dispatch,
                       more_examples):
    """Prompt selection (``rljax.data.selection``): GRESO picks the
    prompts, then rounds are sampled until the batch has ``B`` informative
    groups or ``max_rounds`` ran, and DAPO's plan forms the batch from
    them. Returns ``(merged batch, trained_B, select/* metrics)``."""
    sel, g = self.selection, self.samples_per_prompt
    # ``examples`` and ``more_examples`` are the global batch's (``collect``):
    # the decisions are the same on every process.
    more = more_examples
    batch_size = len(examples["prompt"])
    metrics: dict[str, float] = {}
    skipped = draws = 0.0
    rounds: list[Sampled] = []
    kinds: list[np.ndarray] = []
    while True:
      if sel.greso is not None:
        examples, m = sel.greso.select(examples, more,
                                       (version, len(rounds)))
        skipped += m.pop("select/skipped_prompts")
        draws += m.pop("select/prompt_draws")
        metrics.update(m)
      round_key = key if not rounds else jax.random.fold_in(key, len(rounds))
      # No on_dispatch here: an asynchronous schedule's update donates the
      # params a refill round still samples with; it is dispatched after the
      # last round.
      sampled = self.sample_global(params, examples, round_key, version)
      rounds.append(sampled)
      kinds.append(selection_lib.group_kinds(
          sampled.result.total_N, self._scored(sampled),
          np.nan_to_num(sampled.result.rewards_NxR[:, self.correct_column],
                        nan=0.0) >= 1.0, g))
      informative = sum(int(np.sum(k == selection_lib.INFORMATIVE))
                        for k in kinds)
      if (informative >= batch_size or len(rounds) >= sel.max_rounds
          or more is None):
        break
      examples = more()
    if on_dispatch is not None:
      on_dispatch()
    plan = selection_lib.plan_batch(kinds, batch_size)
    if sel.greso is not None:
      sel.greso.update([p for r in rounds for p in r.examples["prompt"]],
                       np.concatenate(kinds))
    merged = self.merge_rounds(rounds, plan)
    first = kinds[0]
    metrics.update({
        "select/zero_variance_before": float(np.mean(first != 0)),
        "select/zero_variance_after": float(np.mean(~plan.trained)),
        "select/masked_groups": float(np.sum(~plan.trained)),
        "select/rounds": float(len(rounds)),
        "select/rollouts": float(sum(len(r.lengths) for r in rounds)),
        # Every round's sampled tokens, the dropped groups' included.
        "num_generated_tokens": float(sum(r.lengths.sum() for r in rounds)),
    })
    if sel.greso is not None:
      metrics["select/skipped_prompts"] = skipped
      metrics["select/prompt_draws"] = draws
    return merged, plan.trained, metrics

  def _kinds(self, sampled: Sampled) -> np.ndarray:
    """Each group's ``selection.group_kinds``."""
    correct = np.nan_to_num(
        sampled.result.rewards_NxR[:, self.correct_column], nan=0.0) >= 1.0
    return selection_lib.group_kinds(sampled.result.total_N,
                                     self._scored(sampled), correct,
                                     self.samples_per_prompt)

  def _store(self, sampled: Sampled, trained_B, version: int,
             group_ids_N: np.ndarray | None = None) -> None:
    """Pushes the fresh batch's informative, trained groups to the replay
    buffer (host copies). Groups of unequal size (rollout allocation's
    ``group_ids_N``) are stored as ``G`` of their rows, the first drawn,
    where the group has that many and they are informative themselves."""
    if group_ids_N is not None:
      self._store_allocated(sampled, group_ids_N, version)
      return
    keep = self._kinds(sampled) == selection_lib.INFORMATIVE
    if trained_B is not None:
      keep &= np.asarray(trained_B, bool)
    if keep.any():  # every process stores every group (one buffer)
      self.replay.push(rounds_lib.host_groups(
          sampled, np.flatnonzero(keep), self.samples_per_prompt,
          to_host=self._host_rows), version)

  def _store_allocated(self, sampled: Sampled, group_ids_N: np.ndarray,
                       version: int) -> None:
    g = self.samples_per_prompt
    rows = [np.flatnonzero(group_ids_N == i)[:g]
            for i in range(int(group_ids_N.max()) + 1)]
    rows = [r for r in rows if len(r) == g]
    if not rows:
      return
    idx = np.concatenate(rows)
    correct = np.nan_to_num(sampled.result.rewards_NxR[idx, self.correct_column],
                            nan=0.0) >= 1.0
    kinds = selection_lib.group_kinds(sampled.result.total_N[idx],
                                      self._scored(sampled)[idx], correct, g)
    keep = [r for r, k in zip(rows, kinds) if k == selection_lib.INFORMATIVE]
    if keep:  # every process stores every group (one buffer)
      self.replay.push(rounds_lib.host_groups(
          sampled, keep, g, to_host=self._host_rows), version)

  def _with_replay(self, sampled: Sampled, trained_B, replayed,
                   version: int):
    """The fresh batch followed by the replayed groups, each row's tokens
    tagged with the policy version that drew them."""
    g = self.samples_per_prompt
    n_fresh = len(sampled.lengths) // g
    metrics = {"replay/stored_groups": float(len(self.replay))}
    if replayed is None:
      metrics.update({"replay/fraction": 0.0, "replay/mean_age": 0.0})
      return sampled, trained_B, metrics
    groups, versions = replayed
    old = rounds_lib.from_groups(
        groups, sampled, pad_id=self.tokenizer.pad_id,
        failed_rewards=self.failed_rewards)
    r = len(groups)
    trained = (np.ones(n_fresh, bool) if trained_B is None
               else np.asarray(trained_B, bool))
    plan = selection_lib.Plan((np.arange(n_fresh), np.arange(r)),
                              np.concatenate([trained, np.ones(r, bool)]))
    # Each token's version: the rows' own where they carry them (slots,
    # partial rollouts' carried tokens), else the version that drew the row.
    sampled = self._with_versions(sampled, np.full(n_fresh * g, version))
    old = self._with_versions(old, np.repeat(versions, g))
    merged = self.merge_rounds([sampled, old], plan)
    metrics.update({"replay/fraction": r / (n_fresh + r),
                    "replay/mean_age": float(np.mean(
                        version - np.asarray(versions)))})
    return merged, plan.trained, metrics

  def _with_versions(self, sampled: Sampled, row_version_N: np.ndarray
                     ) -> Sampled:
    """``sampled`` with ``token_versions``: its own, or each sampled token
    tagged with its row's ``row_version_N`` (-1 elsewhere)."""
    if sampled.token_versions is not None:
      return sampled
    mask = self._host_rows(sampled.rollout.sampled_mask())
    return sampled._replace(token_versions=np.where(
        mask, np.asarray(row_version_N)[:, None], -1).astype(np.int32))


__all__ = ["SelectionAndReplay"]
