"""Preference pairs: read, checked, encoded and laid out as rows, and the
online pairs sampled from the policy (``rljax/train/preference.py`` trains
on them; ``docs/preference.md``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from rljax import metrics as metrics_lib
from rljax import tokenizers as tok_lib
from rljax.train import session


# Pairs.


class EncodedPairs(NamedTuple):
  """Token ids of each pair's prompt and sides (completion + EOS). A side's
  ``*_trained`` mask (None: every token) leaves a multi-turn episode's
  observation tokens out of the loss."""
  prompts: list[list[int]]
  chosen: list[list[int]]
  rejected: list[list[int]]
  chosen_trained: list[list[bool]] | None = None
  rejected_trained: list[list[bool]] | None = None


def clean_pairs(pairs: Sequence[dict[str, Any]], where: str
                ) -> tuple[list[dict[str, Any]], int]:
  """``(pairs to train, identical pairs skipped)``.

  Raises:
    ValueError: naming ``where`` and the pair (1-based: the line of a JSONL
      file without blank lines) whose chosen side is empty.
  """
  kept, identical = [], 0
  for i, pair in enumerate(pairs):
    if not pair["chosen"].strip():
      raise ValueError(f"{where}: pair {i + 1}: field 'chosen' is empty; a "
                       "preferred completion is required.")
    if pair["chosen"] == pair["rejected"]:
      identical += 1
      continue
    kept.append(pair)
  if not kept:
    raise ValueError(f"{where}: every one of its {len(pairs)} pairs has "
                     "equal chosen and rejected sides; nothing to learn.")
  return kept, identical


def encode(tokenizer: Any, pairs: Sequence[dict[str, Any]], width: int,
           where: str) -> EncodedPairs:
  """The pairs' ids; each side ends with EOS.

  Raises:
    ValueError: naming the pair when prompt + side + EOS exceeds ``width``
      (``preference.max_length``).
  """
  prompts = tok_lib.encode_prompts(tokenizer, [p["prompt"] for p in pairs])
  out = EncodedPairs(prompts, [], [])
  for i, (pair, ids) in enumerate(zip(pairs, prompts)):
    for side in ("chosen", "rejected"):
      c = tokenizer.encode(pair[side]) + [tokenizer.eos_id]
      if len(ids) + len(c) > width:
        raise ValueError(
            f"{where}: pair {i + 1}'s prompt and {side} side are "
            f"{len(ids) + len(c)} tokens with EOS; preference.max_length="
            f"{width} is shorter (accepted: >= {len(ids) + len(c)}).")
      getattr(out, side).append(c)
  return out


def rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
         width: int, pad_id: int,
         trained: Sequence[Sequence[bool] | None] | None = None
         ) -> tuple[np.ndarray, ...]:
  """Right-padded ``(tokens, input_mask, loss_mask)`` ``[R, width]``; the
  loss mask covers each completion (its EOS included), or where given its
  ``trained`` tokens. A row longer than ``width`` (KTO's mismatched KL rows
  only) is cut."""
  n = len(prompts)
  tokens = np.full((n, width), pad_id, np.int32)
  input_mask = np.zeros((n, width), bool)
  loss_mask = np.zeros((n, width), bool)
  trained = trained or [None] * n
  for i, (p, c, t) in enumerate(zip(prompts, completions, trained)):
    row = (list(p) + list(c))[:width]
    tokens[i, :len(row)] = row
    input_mask[i, :len(row)] = True
    loss_mask[i, len(p):len(row)] = (True if t is None
                                     else list(t)[:len(row) - len(p)])
  return tokens, input_mask, loss_mask


def batch_rows(pairs: EncodedPairs, idx: np.ndarray, unpaired: bool,
               width: int, pad_id: int) -> tuple[np.ndarray, ...]:
  """The rows of pairs ``idx``: ``[chosen; rejected]`` (``2P`` rows), and
  with ``unpaired`` (KTO) then the same ``2P`` completions each after the
  prompt of the row before it (the KL estimate's mismatched rows, TRL's
  ``_get_kl_dataset``)."""
  prompts = [pairs.prompts[i] for i in idx] * 2
  answers = ([pairs.chosen[i] for i in idx]
             + [pairs.rejected[i] for i in idx])
  trained = None
  if pairs.chosen_trained is not None:
    trained = ([pairs.chosen_trained[i] for i in idx]
               + [pairs.rejected_trained[i] for i in idx])
  if unpaired:
    shifted = answers[-1:] + answers[:-1]
    prompts, answers = prompts + prompts, answers + shifted
    if trained is not None:
      trained = trained + trained[-1:] + trained[:-1]
  return rows(prompts, answers, width, pad_id, trained)


def draw(seed: int, step: int, num_pairs: int, batch_size: int) -> np.ndarray:
  """The pairs of step ``step`` (0-based): with replacement, from ``(seed,
  step)`` alone, so a resumed run draws what the whole run drew."""
  return np.random.default_rng((seed, 0x50524546, step)).integers(
      0, num_pairs, batch_size)


# ----------------------------------------------------------------------------
# Online pairs: sampled from the current policy, labelled by the rewards.


def pairs_from_groups(totals: np.ndarray, valid: np.ndarray, group: int,
                      top_fraction: float = 1.0
                      ) -> tuple[list[tuple[int, int]], int]:
  """``([(chosen row, rejected row)], tied groups)`` of ``G``-row groups:
  each group's best-scored row over its worst (the first of equals), as
  online DPO's labeller picks (Guo et al. 2024, "Direct Language Model
  Alignment from Online AI Feedback"; Xiong et al. 2024, "Iterative
  Preference Learning from Human Feedback", best-of-n against
  worst-of-n). A group whose valid rows all score the same, or that has
  fewer than two, gives no pair.

  ``top_fraction < 1`` keeps only the ``ceil(top_fraction * pairs)`` pairs
  whose score gap (best - worst) is largest, in group order (ties of equal
  gaps: the earlier group): a learned reward's ranking of two completions
  it scores alike is the one most likely wrong, so the pairs it separates
  most are the cleanest labels (margin-based pair selection)."""
  out, gaps, tied = [], [], 0
  for g in range(len(totals) // group):
    rows_ = [r for r in range(g * group, (g + 1) * group) if valid[r]]
    if len(rows_) < 2:
      tied += 1
      continue
    scores = np.asarray([totals[r] for r in rows_])
    best, worst = int(np.argmax(scores)), int(np.argmin(scores))
    if scores[best] == scores[worst]:
      tied += 1
      continue
    out.append((rows_[best], rows_[worst]))
    gaps.append(float(scores[best] - scores[worst]))
  if top_fraction < 1.0 and out:
    keep = math.ceil(top_fraction * len(out))
    order = np.argsort(-np.asarray(gaps), kind="stable")[:keep]
    out = [out[i] for i in sorted(order)]
  return out, tied


def to_host(c: Any, x: Any) -> np.ndarray:
  if c.group.single:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def online_batch(c: Any, run: session.Session, params: Any, step: int
                 ) -> tuple[EncodedPairs | None, dict[str, float]]:
  """This step's pairs: ``rl.prompts_per_step`` prompts from the run's
  iterator, ``rl.group_size`` samples each from ``params`` (the training
  sampler), scored by the run's rewards (``rewards.names``: verifiers,
  reward models, judges, an environment), each group's best over its worst
  (``pairs_from_groups``). Groups without a pair are filled by the other
  pairs in turn, so the batch keeps its shape; with no pair at all the
  step trains nothing (None). Completions are the sampled token ids, not
  re-encoded text."""
  collector = run.collector
  examples = next(run.iterator)
  if not c.group.single:
    examples = collector.gathered(examples)
  key = jax.random.fold_in(jax.random.fold_in(run.state_key, 0x4f4e4c),
                           step)
  sampled = collector.sample_global(params, examples, key, step)
  r = sampled.rollout
  prompt_tokens, prompt_mask, tokens, mask = (
      to_host(c, x) for x in (r.prompt_tokens, r.prompt_mask,
                               r.completion_tokens, r.completion_mask))
  observed = (None if r.observation_mask is None
              else to_host(c, r.observation_mask))
  n = len(tokens)
  prompt_ids = [list(prompt_tokens[i][prompt_mask[i]]) for i in range(n)]
  completion_ids = [list(tokens[i][mask[i]]) for i in range(n)]
  trained = (None if observed is None else
             [list(~observed[i][mask[i]]) for i in range(n)])
  result = sampled.result
  valid = np.asarray(result.valid_NxR).all(axis=1) & np.isfinite(
      np.asarray(result.total_N))
  g = collector.samples_per_prompt
  top = float(c.config.preference.online_top_fraction)
  chosen_rejected, tied = pairs_from_groups(np.asarray(result.total_N),
                                            valid, g, top)
  groups = n // g
  totals = np.asarray(result.total_N, np.float64)
  metrics = {**metrics_lib.to_floats(sampled.spec_metrics),
             **metrics_lib.to_floats(result.metrics),
             "pref/online/tied_groups": tied / max(groups, 1),
             "pref/online/reward_mean": float(np.nanmean(np.where(
                 valid, totals, np.nan))) if valid.any() else float("nan"),
             "num_generated_tokens": float(np.sum(sampled.lengths)),
             "time/sample": sampled.seconds_sample,
             "time/reward": sampled.seconds_reward}
  if not chosen_rejected:
    return None, metrics
  metrics["pref/online/kept_pairs"] = len(chosen_rejected) / groups
  metrics["pref/online/reward_gap"] = float(np.mean(
      [totals[a] - totals[b] for a, b in chosen_rejected]))
  metrics["pref/online/reward_chosen"] = float(np.mean(
      [totals[a] for a, _ in chosen_rejected]))
  metrics["pref/online/reward_rejected"] = float(np.mean(
      [totals[b] for _, b in chosen_rejected]))
  full = [chosen_rejected[i % len(chosen_rejected)] for i in range(groups)]
  pick = lambda lists, side: [lists[pair[side]] for pair in full]  # noqa: E731
  return EncodedPairs(
      pick(prompt_ids, 0), pick(completion_ids, 0), pick(completion_ids, 1),
      None if trained is None else pick(trained, 0),
      None if trained is None else pick(trained, 1)), metrics


# ----------------------------------------------------------------------------


__all__ = ["EncodedPairs", "batch_rows", "clean_pairs", "draw", "encode",
           "online_batch", "pairs_from_groups", "rows", "to_host"]
