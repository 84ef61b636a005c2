"""Held-out evaluation: accuracy, pass@k, avg@k and maj@k.

With ``k`` samples per prompt and ``c`` of them correct:
  * avg@k = mean over prompts of ``c / k`` (the expected single-sample accuracy);
  * pass@k = fraction of prompts with ``c >= 1``;
  * maj@k = fraction of prompts whose most frequent final answer is correct
    (ties broken by first occurrence).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rljax import rewards as rewards_lib
from rljax import sampling
from rljax import tokenizers as tok_lib
from rljax.tokenizers import Tokenizer


def group_metrics(correct_NxK: np.ndarray, answers_NxK: Sequence[Sequence[str]],
                  ) -> dict[str, float]:
  """avg@k, pass@k and maj@k from per-sample correctness and answers."""
  correct = np.asarray(correct_NxK, bool)
  k = correct.shape[1]
  maj = []
  for row_correct, row_answers in zip(correct, answers_NxK):
    counts = collections.Counter(row_answers)
    best = max(counts.values())
    winner = next(a for a in row_answers if counts[a] == best)
    maj.append(row_correct[list(row_answers).index(winner)])
  return {f"avg@{k}": float(correct.mean()),
          f"pass@{k}": float(correct.any(1).mean()),
          f"maj@{k}": float(np.mean(maj))}


def evaluate(
    params: Any,
    sample_fn: Callable,
    tokenizer: Tokenizer,
    examples: Sequence[Mapping[str, Any]],
    evaluator: rewards_lib.RewardEvaluator,
    key: jax.Array,
    *,
    num_samples: int,
    buckets: Sequence[int],
    eos_ids: Sequence[int],
    correctness_reward: str,
    prefix: str = "eval/",
) -> dict[str, float]:
  """Samples ``num_samples`` completions per held-out prompt and scores them.

  Args:
    params: policy params.
    sample_fn: ``fn(params, prompt_tokens, prompt_mask, key) -> Rollout``,
      built with ``num_samples`` samples per prompt.
    tokenizer: the tokenizer.
    examples: held-out examples (dicts with ``prompt`` and reward fields).
    evaluator: reward evaluator holding ``correctness_reward``.
    key: PRNG key.
    num_samples: samples per prompt (k).
    buckets: prompt buckets.
    eos_ids: ids that end a completion.
    correctness_reward: the reward whose value >= 1 means "correct".
    prefix: metric name prefix.

  Returns:
    ``{prefix + "accuracy", prefix + "avg@k", "pass@k", "maj@k",
    "completion_length"}``.
  """
  prompts = [e["prompt"] for e in examples]
  tokens, mask = sampling.pad_prompts(
      tok_lib.encode_prompts(tokenizer, prompts), buckets, tokenizer.pad_id)
  rollout = jax.device_get(sample_fn(params, tokens, mask, key))
  completions = tok_lib.decode_completions(
      tokenizer, rollout.completion_tokens, rollout.completion_mask, eos_ids)
  names = sorted({k for e in examples for k in e})  # optional fields: None
  fields = {k: [e.get(k) for e in examples for _ in range(num_samples)]
            for k in names}
  result = evaluator.evaluate(fields["prompt"], completions, fields)
  column = list(result.names).index(correctness_reward)
  scores = np.nan_to_num(result.rewards_NxR[:, column], nan=0.0)
  correct = (scores >= 1.0).reshape(len(examples), num_samples)
  answers = [rewards_lib.extract_final_answer(c) or "" for c in completions]
  answers = [answers[i * num_samples:(i + 1) * num_samples]
             for i in range(len(examples))]
  out = {"accuracy": float(correct.mean()),
         "completion_length": float(np.mean(rollout.lengths))}
  out.update(group_metrics(correct, answers))
  return {prefix + k: v for k, v in out.items()}
