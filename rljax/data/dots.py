"""DOTS: difficulty-targeted online data selection.

Sun et al., "Improving Data Efficiency for LLM Reinforcement Fine-tuning
Through Difficulty-targeted Online Data Selection and Rollout Replay",
https://arxiv.org/abs/2506.05316 (NeurIPS 2025); reference code:
github.com/ASTRAL-Group/data-efficient-llm-rl (``ray_trainer.py``'s
selection round, ``adaptive_difficulty_prediction/model.py``).

A prompt teaches most when the current policy solves it about half the
time (its *adaptive difficulty* is moderate). Rolling out the whole pool to
find those prompts would cost more than training on them, so every
``rl.selection.dots_every`` steps a selection round:

1. rolls out a small random *reference set* of ``rl.selection.dots_reference``
   prompts (``G`` samples each) and takes each one's success rate;
2. predicts every pool prompt's success rate by attention over the
   reference set: ``p_hat(q) = sum_k softmax_k(cos(e_q, e_k) / tau) p_k``,
   ``e`` the policy's mean-pooled final hidden states over the prompt
   (``predict_success``);
3. draws the next ``dots_every * B`` prompts without replacement with
   probabilities ``softmax(-|p_hat - alpha| / temperature)``, ``alpha`` the
   target success rate (0.5), and trains them ``B`` per step.

The paper trains a small attention head (projections, LayerNorm and Platt
calibration) on an offline set of rolled-out prompts first; rljax uses the
policy's own embeddings with cosine similarity and no trained head, so no
offline pass or extra model is needed (the issue's suggestion), at the
price of a coarser prediction (``dots/prediction_error`` measures it on
every trained batch). The reference rollouts' tokens count as sampled.

State (checkpointed): the queue of drawn prompts, the position in it and
the round number; draws come from ``np.random.default_rng((seed, round))``,
so a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np


def predict_success(query_QxD: np.ndarray, reference_KxD: np.ndarray,
                    reference_success_K: np.ndarray, temperature: float
                    ) -> np.ndarray:
  """``[Q]``: each query's attention-weighted mean of the reference success
  rates, weights ``softmax(cos(q, k) / temperature)`` over the reference."""
  def unit(x):
    x = np.asarray(x, np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  logits = unit(query_QxD) @ unit(reference_KxD).T / temperature
  logits -= logits.max(-1, keepdims=True)
  weights = np.exp(logits)
  weights /= weights.sum(-1, keepdims=True)
  return weights @ np.asarray(reference_success_K, np.float64)


def leave_one_out_error(reference_KxD: np.ndarray,
                        reference_success_K: np.ndarray,
                        temperature: float) -> float:
  """Mean ``|p_hat - p|`` over the reference set, each predicted from the
  others: how well the attention predicts success rates this round, at no
  extra rollout."""
  k = len(reference_success_K)
  if k < 2:
    return float("nan")
  errors = []
  for i in range(k):
    others = np.arange(k) != i
    p_hat = predict_success(reference_KxD[i:i + 1], reference_KxD[others],
                            np.asarray(reference_success_K)[others],
                            temperature)[0]
    errors.append(abs(p_hat - reference_success_K[i]))
  return float(np.mean(errors))


def sampling_probabilities(predicted: np.ndarray, target: float,
                           temperature: float) -> np.ndarray:
  """DOTS's ``softmax(-|p_hat - target| / temperature)`` over the pool."""
  logits = -np.abs(np.asarray(predicted, np.float64) - target) / temperature
  logits -= logits.max()
  p = np.exp(logits)
  return p / p.sum()


def draw(probabilities: np.ndarray, count: int,
         rng: np.random.Generator) -> np.ndarray:
  """``count`` distinct indices drawn with these probabilities, without
  replacement (Gumbel top-k: the same law as successive draws)."""
  p = np.asarray(probabilities, np.float64)
  keys = np.log(np.maximum(p, 1e-300)) + rng.gumbel(size=len(p))
  return np.argsort(-keys, kind="stable")[:count]


class DotsState(NamedTuple):
  """The drawn prompts (pool indices) in training order, the position in
  them and the number of selection rounds run."""

  queue: np.ndarray
  cursor: np.ndarray
  round: np.ndarray


class Dots:
  """DOTS's selection rounds and queue (host side; ``rollout/allocated.py``
  rolls out the reference set and embeds the pool).

  Args:
    batch_size: ``B``.
    pool_size: the training prompts.
    every: steps per selection round (``dots_every * B`` prompts drawn).
    reference: reference prompts rolled out per round.
    target: the success rate aimed at (``alpha``).
    temperature: of the selection softmax.
    attention_temperature: of the attention over the reference set.
    seed: the config's seed.
  """

  def __init__(self, *, batch_size: int, pool_size: int, every: int = 8,
               reference: int = 64, target: float = 0.5,
               temperature: float = 0.1, attention_temperature: float = 0.05,
               seed: int = 0):
    if every * batch_size > pool_size:
      raise ValueError(
          f"rl.selection.dots_every={every} x rl.prompts_per_step="
          f"{batch_size} prompts per round exceed the {pool_size} training "
          "prompts; accepted: at most the pool per round.")
    if reference < 1 or reference > pool_size or reference % batch_size:
      raise ValueError(
          f"rl.selection.dots_reference={reference}: a multiple of "
          f"rl.prompts_per_step={batch_size} (the sampler's batch) of at "
          f"most the {pool_size} training prompts is accepted.")
    self.batch_size, self.pool_size, self.every = batch_size, pool_size, every
    self.reference, self.target = reference, target
    self.temperature = temperature
    self.attention_temperature = attention_temperature
    self.seed = seed
    self.state = DotsState(np.zeros(0, np.int64), np.zeros(1, np.int64),
                           np.zeros(1, np.int64))
    self.pool: Any = None
    self.longest: int | None = None
    self.embed: Any = None

  def attach(self, pool: Any, longest: int, embed: Any) -> None:
    """The training examples, their longest prompt's token count and
    ``embed(params, tokens_BxP, mask_BxP) -> [B, D]`` (the policy's
    mean-pooled final hidden states)."""
    if len(pool) != self.pool_size:
      raise ValueError(f"DOTS: a pool of {len(pool)} prompts for "
                       f"pool_size={self.pool_size}.")
    self.pool, self.longest, self.embed = pool, int(longest), embed

  def needs_round(self) -> bool:
    """The queue is used up: the next step runs a selection round."""
    return int(self.state.cursor[0]) >= len(self.state.queue)

  def _rng(self, stream: int) -> np.random.Generator:
    return np.random.default_rng((self.seed, 0x444f5453,
                                  int(self.state.round[0]), stream))

  def reference_prompts(self) -> np.ndarray:
    """This round's reference set (pool indices)."""
    return self._rng(0).choice(self.pool_size, self.reference, replace=False)

  def select(self, predicted: np.ndarray) -> np.ndarray:
    """Draws the next round's queue from every prompt's predicted success
    rate; returns the queue."""
    rng = self._rng(1)
    probabilities = sampling_probabilities(predicted, self.target,
                                           self.temperature)
    queue = draw(probabilities, self.every * self.batch_size, rng)
    self.state = DotsState(queue.astype(np.int64), np.zeros(1, np.int64),
                           self.state.round + 1)
    return queue

  def next_prompts(self) -> np.ndarray:
    """The next ``B`` prompts of the queue."""
    cursor = int(self.state.cursor[0])
    out = self.state.queue[cursor:cursor + self.batch_size]
    self.state = self.state._replace(
        cursor=np.asarray([cursor + self.batch_size], np.int64))
    return out

  def arrays(self) -> dict[str, np.ndarray]:
    """The state as named host arrays (a checkpoint item)."""
    return dict(self.state._asdict())

  def load_arrays(self, arrays: Mapping[str, Any]) -> None:
    """Restores ``arrays()``; a missing or malformed field is named."""
    missing = [f for f in DotsState._fields if f not in arrays]
    if missing:
      raise ValueError(f"the checkpoint's DOTS state lacks {missing}.")
    state = DotsState(*(np.asarray(arrays[f], np.int64)
                        for f in DotsState._fields))
    if (state.cursor.shape != (1,) or state.round.shape != (1,)
        or state.queue.ndim != 1 or (len(state.queue) and (
            state.queue.min() < 0 or state.queue.max() >= self.pool_size))):
      raise ValueError("the checkpoint's DOTS state is inconsistent with "
                       f"{self.pool_size} training prompts: "
                       f"{[np.shape(x) for x in state]}.")
    self.state = state


__all__ = ["Dots", "DotsState", "draw", "leave_one_out_error",
           "predict_success", "sampling_probabilities"]
