"""Held-out evaluation: accuracy, pass@k, avg@k and maj@k.

With ``n`` samples per prompt and ``c`` of them correct:
  * avg@n = mean over prompts of ``c / n`` (the expected single-sample
    accuracy);
  * pass@k, for ``k`` in ``{1, 2, 4, ..., n}`` (powers of two up to ``n``,
    plus ``n``) = mean over prompts of the unbiased estimate of the chance
    that at least one of ``k`` samples drawn without replacement from the
    ``n`` is correct, ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021); so
    pass@1 = avg@n and pass@n = fraction of prompts with ``c >= 1``;
  * maj@n = fraction of prompts whose most frequent final answer is correct;
    among answers tied for most frequent, the one sampled first wins.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rljax import distributed
from rljax import rewards as rewards_lib
from rljax import sampling
from rljax import tokenizers as tok_lib
from rljax.tokenizers import Tokenizer


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one prompt from ``n`` samples with ``c`` correct.

  ``pass@k = 1 - C(n - c, k) / C(n, k)``: one minus the chance that ``k``
  samples drawn without replacement from the ``n`` are all incorrect. The
  ratio of binomials is evaluated as ``prod_{i=n-c+1}^{n} (1 - k / i)``, which
  neither overflows nor loses precision for large ``n``; it is 1 when
  ``n - c < k`` (every ``k``-subset holds a correct sample).

  Args:
    n: samples drawn, ``n >= k``.
    c: correct samples, ``0 <= c <= n``.
    k: the budget, ``1 <= k <= n``.

  Returns:
    The estimate in ``[0, 1]``.

  Examples:
    >>> pass_at_k(4, 1, 2)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    0.5

  References:
    Chen et al., "Evaluating Large Language Models Trained on Code", 2021,
    section 2.1, https://arxiv.org/abs/2107.03374
  """
  if not 1 <= k <= n:
    raise ValueError(f"k={k!r}: 1 <= k <= n={n} is required.")
  if not 0 <= c <= n:
    raise ValueError(f"c={c!r}: 0 <= c <= n={n} is required.")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> list[int]:
  """The budgets reported: powers of two up to ``n``, plus ``n``."""
  ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
  return ks if ks[-1] == n else ks + [n]


def prompt_figures(correct_NxK: np.ndarray,
                   answers_NxK: Sequence[Sequence[str]]
                   ) -> tuple[np.ndarray, np.ndarray]:
  """``(num_correct_N int, majority_correct_N bool)`` of each prompt: what
  ``group_metrics`` averages (per prompt, so blocks of prompts scored by
  different processes combine exactly)."""
  correct = np.asarray(correct_NxK, bool)
  maj = []
  for row_correct, row_answers in zip(correct, answers_NxK):
    counts = collections.Counter(row_answers)
    best = max(counts.values())
    winner = next(a for a in row_answers if counts[a] == best)
    maj.append(row_correct[list(row_answers).index(winner)])
  return correct.sum(1), np.asarray(maj, bool)


def metrics_from_figures(k: int, num_correct_N: np.ndarray,
                         majority_N: np.ndarray) -> dict[str, float]:
  """``group_metrics`` from ``prompt_figures`` (``k`` samples per prompt)."""
  num_correct_N = np.asarray(num_correct_N)
  out = {f"avg@{k}": float(num_correct_N.sum() / (len(num_correct_N) * k))}
  for budget in pass_ks(k):
    out[f"pass@{budget}"] = float(np.mean(
        [pass_at_k(k, int(c), budget) for c in num_correct_N]))
  out[f"maj@{k}"] = float(np.mean(majority_N))
  return out


def group_metrics(correct_NxK: np.ndarray, answers_NxK: Sequence[Sequence[str]],
                  ) -> dict[str, float]:
  """avg@n, pass@k (``k`` in ``pass_ks(n)``) and maj@n of ``N`` prompts.

  Args:
    correct_NxK: bool, whether sample ``j`` of prompt ``i`` is correct; ``K``
      is the samples per prompt (``n`` in the module docstring).
    answers_NxK: the final answer of each sample, in sampling order; a tie
      for the most frequent answer goes to the one that occurs first.

  Returns:
    ``{"avg@K", "pass@1", "pass@2", ..., "pass@K", "maj@K"}``.
  """
  return metrics_from_figures(np.asarray(correct_NxK).shape[1],
                              *prompt_figures(correct_NxK, answers_NxK))


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
    group: distributed.ProcessGroup | None = None,
    mesh: jax.sharding.Mesh | None = None,
    episodes: Any = None,
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
    group, mesh: with several processes, each samples and scores its block
      of ``examples`` (the mesh's batch split) and the per-prompt figures
      are gathered, so the metrics are those of all ``examples``.
    episodes: a multi-turn environment (``rollout.MultiTurnSampler`` with
      ``num_samples`` per example) instead of ``sample_fn``: each example is
      an episode, scored as the ``Collector`` scores it (``env_reward``).

  Returns:
    ``{prefix + name}`` for ``name`` in ``"accuracy"``,
    ``"completion_length"`` and the names of ``group_metrics`` (``avg@k``,
    ``pass@1``, ``pass@2``, ..., ``pass@k``, ``maj@k``).
  """
  group = group or distributed.ProcessGroup()
  if not group.single:
    examples = examples[group.rows(mesh, len(examples))]
  names = sorted({k for e in examples for k in e})  # optional fields: None
  env_reward = None
  if episodes is not None:
    run = episodes.run(params, {k: [e.get(k) for e in examples]
                                for k in names}, key)
    rollout = run.rollout
    prompts, env_reward_N = run.prompts, run.env_reward  # every process's
    if not group.single:  # this process's block
      prompts = prompts[group.rows(mesh, len(prompts))]
      env_reward_N = env_reward_N[group.rows(mesh, len(env_reward_N))]
    examples = [dict(e, prompt=p) for e, p in zip(examples, prompts)]
    env_reward = [None if np.isnan(r) else float(r) for r in env_reward_N]
  else:
    encoded = tok_lib.encode_prompts(tokenizer,
                                     [e["prompt"] for e in examples])
    tokens, mask = sampling.pad_prompts(
        encoded, buckets, tokenizer.pad_id,
        longest=group.max_int(max(len(p) for p in encoded)))
    rollout = sample_fn(params, group.global_array(tokens, mesh),
                        group.global_array(mask, mesh), key)
  completion_tokens, completion_mask, lengths = distributed.local_rows_many(
      group, rollout.completion_tokens, rollout.completion_mask,
      rollout.lengths)
  completions = tok_lib.decode_completions(
      tokenizer, completion_tokens, completion_mask, eos_ids)
  fields = {k: [e.get(k) for e in examples for _ in range(num_samples)]
            for k in names}
  if env_reward is not None:
    fields["env_reward"] = env_reward
  result = evaluator.evaluate(fields["prompt"], completions, fields,
                              tokens=rollout)
  column = list(result.names).index(correctness_reward)
  scores = np.nan_to_num(result.rewards_NxR[:, column], nan=0.0)
  correct = (scores >= 1.0).reshape(len(examples), num_samples)
  answers = [rewards_lib.extract_final_answer(c) or "" for c in completions]
  answers = [answers[i * num_samples:(i + 1) * num_samples]
             for i in range(len(examples))]
  num_correct, majority = prompt_figures(correct, answers)
  if not group.single:
    num_correct, majority = distributed.gather_rows_many(
        group, mesh, num_correct, majority)
    lengths = group.gather_rows(lengths, mesh)
  out = {"accuracy": float(num_correct.sum() / (len(num_correct)
                                                * num_samples)),
         "completion_length": float(np.mean(lengths))}
  out.update(metrics_from_figures(num_samples, num_correct, majority))
  return {prefix + k: v for k, v in out.items()}


def heldout_metrics(params: Any, key: jax.Array, *, sampler: Callable,
                    greedy_sampler: Callable | None, tokenizer: Tokenizer,
                    examples: Sequence[Mapping[str, Any]],
                    evaluator: rewards_lib.RewardEvaluator, num_samples: int,
                    buckets: Sequence[int], eos_ids: Sequence[int],
                    correctness_reward: str,
                    mesh: jax.sharding.Mesh,
                    group: distributed.ProcessGroup | None = None,
                    episodes: bool = False) -> dict[str, float]:
  """The loop's held-out figures: ``evaluate`` at the sampling temperature
  and, with ``greedy_sampler``, ``eval/greedy_accuracy``. ``episodes``: the
  two samplers are ``rollout.MultiTurnSampler``s (a run with an environment)."""
  kwargs = dict(buckets=buckets, eos_ids=eos_ids,
                correctness_reward=correctness_reward, group=group, mesh=mesh)
  with jax.set_mesh(mesh):
    out = evaluate(params, sampler, tokenizer, examples, evaluator, key,
                   num_samples=num_samples,
                   episodes=sampler if episodes else None, **kwargs)
    if greedy_sampler is not None:
      greedy = evaluate(params, greedy_sampler, tokenizer, examples,
                        evaluator, key, num_samples=1, prefix="eval/greedy_",
                        episodes=greedy_sampler if episodes else None,
                        **kwargs)
      out["eval/greedy_accuracy"] = greedy["eval/greedy_accuracy"]
  return out
