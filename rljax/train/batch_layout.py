"""The trainer's batch from a scored rollout (jitted by ``Collector``).

``postprocess`` runs the advantage chain, MC-GRPO's pivot drop (or ReMax's
greedy-row drop) and lays the rows out as ``RLBatch`` (``[N, P + T]``,
advantages 0 on the prompt); ``rljax.rollout.collector`` documents the
conventions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rljax.advantages import advantage_metrics
from rljax.advantages.gae import terminal_rewards
from rljax.advantages import grouping
from rljax.train.algorithm import Algorithm, advantage_extra_args
from rljax.train.steps import RLBatch, batch_shardings


def pivot_rows(rewards_N: jax.Array, valid_N: jax.Array,
               group_size: int) -> jax.Array:
  """Row indices that keep all but each group's median pivot (MC-GRPO).

  The pivot of a group of ``group_size = G + 1`` rows is the valid row at the
  lower-median position of a stable sort of the valid rewards (the row that
  ``advantages.center_by_group_median`` gives advantage exactly 0, and
  ``advantages.group_median_pivot_mask`` marks); a group with no valid row
  drops its last row. Returns ``[num_groups * G]`` int32 indices, in order.

  References:
    Kim, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning", https://arxiv.org/abs/2601.22582.
  """
  x = rewards_N.reshape(-1, group_size)
  valid = valid_N.reshape(-1, group_size)
  order = jnp.argsort(jnp.where(valid, x, jnp.inf), axis=-1, stable=True)
  n = jnp.sum(valid, -1, keepdims=True)
  pivot = jnp.take_along_axis(order, jnp.maximum((n - 1) // 2, 0), axis=-1)
  pivot = jnp.where(n > 0, pivot, group_size - 1)
  is_pivot = jnp.arange(group_size)[None] == pivot
  keep = jnp.argsort(is_pivot, axis=-1, stable=True)[:, :group_size - 1]
  groups = jnp.arange(x.shape[0])[:, None] * group_size
  return (groups + keep).reshape(-1).astype(jnp.int32)


def _weighted_total(rewards_NxR, weights_R):
  return jnp.sum(jnp.where(jnp.isfinite(rewards_NxR), rewards_NxR, 0.0)
                 * weights_R, axis=-1)


def token_rewards(rewards_N: jax.Array, turn_rewards_NxT: jax.Array,
                  env_N: jax.Array, env_weight: jax.Array | float,
                  mask_NxT: jax.Array) -> jax.Array:
  """Per-token rewards ``[N, T]`` (verl's ``token_level_rewards``) of a
  multi-turn batch.

  Each row's reward ``rewards_N`` (the weighted sum of its reward
  functions, the environment's ``env`` among them) sits on its last trained
  token, except the environment's share, which sits where it was earned:

      r_NxT = last(rewards_N) + env_weight * (turn_rewards_NxT - last(env_N))

  ``last(x)`` puts ``x[i]`` on row ``i``'s last ``mask_NxT`` token.
  ``env_N`` is the ``env`` column (the sum of the row's turn rewards; NaN,
  a failed episode, counts 0, as its turn rewards are 0). A row's tokens
  therefore sum to ``rewards_N``, and a turn's reward reaches only the
  tokens up to that turn through the discounted returns of GAE,
  REINFORCE++ (``whiten_by_tokens``) and ReMax. Without an ``env`` reward
  (``env_weight`` 0) the turn rewards are not counted, as the row reward
  does not count them.
  """
  last = functools.partial(terminal_rewards, mask_NxT=mask_NxT)
  env_N = jnp.nan_to_num(env_N.astype(jnp.float32), nan=0.0)
  shift = jnp.where(mask_NxT, turn_rewards_NxT.astype(jnp.float32), 0.0) \
      - last(env_N)
  return last(rewards_N) + jnp.asarray(env_weight, jnp.float32) * shift


def postprocess(rollout, rewards_NxR, valid_N, weights_R, adv_state,
                 trained_N=None, group_ids_N=None, *, algorithm: Algorithm,
                 group_size: int, groups: tuple[int, int] | None = None,
                 env_column: int | None = None):
  """Advantages, the pivot drop and the trainer's layout (jitted).

  ``trained_N``: False for rows kept in the batch with no loss (prompt
  selection's zero-variance fillers); None: every row.
  ``group_ids_N`` with ``groups = (K, G_max)``: groups of unequal size
  (rollout allocation): the chain (``advantages.by_group_ids``-wrapped)
  gets each row's group, and the ``adv/*`` metrics are taken on the padded
  ``[K, G_max]`` layout. A multi-turn rollout (``rollout.turn_rewards``)
  gives the chain ``token_rewards_NxT`` (``token_rewards``; ``env_column``:
  the ``env`` reward's column, None when the rewards do not list it), and a
  critic's batch ``token_rewards_NxL`` for the step's GAE."""
  sampled = group_size + algorithm.extra_samples
  by_ids = {} if group_ids_N is None else {"group_ids_N": group_ids_N}
  # The trained tokens: an environment's observations are inputs only.
  completion_mask = rollout.sampled_mask()
  if rollout.policy_logprobs is None:
    seq_log_ratio_N = jnp.zeros(rollout.lengths.shape, jnp.float32)
  else:  # log pi_old(y) / mu(y), masked positions are 0 in both.
    seq_log_ratio_N = jnp.sum(
        rollout.policy_logprobs - rollout.sampler_logprobs, axis=-1)
  total_N = _weighted_total(rewards_NxR, weights_R)
  env_token_args = None
  if rollout.turn_rewards is not None:
    if env_column is None:
      env_N, env_weight = jnp.zeros_like(total_N), 0.0
    else:
      env_N, env_weight = rewards_NxR[:, env_column], weights_R[env_column]
    env_token_args = (rollout.turn_rewards, env_N, env_weight,
                      completion_mask)
  advantages_N, adv_state = algorithm.advantage.update(
      rewards_NxR, adv_state, group_size=sampled, mask_N=valid_N,
      reward_weights_R=weights_R, **by_ids,
      **advantage_extra_args(
          rollout.lengths, seq_log_ratio_N, rollout.completion_tokens,
          completion_mask, None if env_token_args is None
          else token_rewards(total_N, *env_token_args),
          rollout.tree_nodes))
  per_token = advantages_N.ndim == 2  # KTAE: [N, T] on the completion.
  # Non-finite advantages never reach the update: their rows are out of the
  # loss (and counted), whatever the user's chain or optimizer.
  finite = jnp.isfinite(advantages_N)
  finite_N = (jnp.all(finite | ~completion_mask, -1) if per_token
              else finite)
  advantages_N = jnp.where(finite, advantages_N, 0.0)
  completion_mask = completion_mask & finite_N[:, None]
  if trained_N is not None:
    completion_mask = completion_mask & trained_N[:, None]
  row_advantages_N = advantages_N if not per_token else jnp.sum(
      advantages_N * completion_mask, -1) / jnp.maximum(
          rollout.lengths, 1)
  if group_ids_N is None:
    metrics = advantage_metrics(total_N, row_advantages_N,
                                group_size=sampled, mask_N=valid_N)
  else:  # the metrics' groups on the padded layout
    slot, kept = grouping.group_slots(group_ids_N, *groups)
    size = groups[0] * groups[1]

    def padded(x, fill):
      return jnp.full((size + 1,), fill, x.dtype).at[
          jnp.where(kept, slot, size)].set(x)[:size]
    metrics = advantage_metrics(
        padded(total_N, 0.0), padded(row_advantages_N, 0.0),
        group_size=groups[1], mask_N=padded(valid_N & kept, False))
  metrics["nonfinite_rows"] = jnp.sum(~finite_N).astype(jnp.float32)
  # Per-row figures for the run's histograms (``rows/*``; the collector
  # takes them out of the ``adv/*`` metrics).
  metrics["rows/advantage"] = jnp.where(finite_N, row_advantages_N, jnp.nan)
  if rollout.policy_logprobs is not None:
    metrics["rows/log_ratio"] = seq_log_ratio_N
  tokens, input_mask = rollout.sequences()
  zeros = jnp.zeros(rollout.prompt_mask.shape, jnp.float32)
  completion_advantages = (
      advantages_N if per_token else jnp.broadcast_to(
          advantages_N[:, None], completion_mask.shape))
  if algorithm.critic:  # the step's GAE turns the rewards into advantages
    completion_advantages = jnp.zeros_like(completion_advantages)
  layout = {
      "tokens_NxL": tokens, "input_mask_NxL": input_mask,
      "loss_mask_NxL": jnp.concatenate(
          [jnp.zeros_like(rollout.prompt_mask), completion_mask], 1),
      "advantages_NxL": jnp.concatenate(
          [zeros, completion_advantages], 1).astype(jnp.float32),
      "sampler_logprobs_NxL": jnp.concatenate(
          [zeros, rollout.sampler_logprobs], 1),
  }
  if rollout.policy_logprobs is not None:
    layout["old_logprobs_NxL"] = jnp.concatenate(
        [zeros, rollout.policy_logprobs], 1)
  if algorithm.critic:
    layout["rewards_N"] = advantages_N.astype(jnp.float32)
    if env_token_args is not None:  # GAE reads the turns' rewards
      layout["token_rewards_NxL"] = jnp.concatenate(
          [zeros, token_rewards(advantages_N, *env_token_args)], 1)
  if algorithm.drop_pivot:
    rows = pivot_rows(total_N, valid_N, sampled)
    layout = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), layout)
  elif algorithm.greedy_baseline:  # ReMax: the last row of a group is greedy.
    rows = jnp.arange(total_N.shape[0]).reshape(-1, sampled)[:, :-1]
    layout = jax.tree.map(lambda x: jnp.take(x, rows.reshape(-1), axis=0),
                          layout)
  return RLBatch(**layout), adv_state, metrics


@dataclasses.dataclass(frozen=True)
class Postprocessor:
  """The trainer's half of a batch, handed to ``rljax.rollout.Collector``
  (which imports nothing of ``rljax.train``): the algorithm's sampling
  needs (``extra_samples``, ``failed_rewards``) and, called, the jitted
  ``postprocess`` with its outputs sharded as ``rl_step`` takes them.

  Attributes:
    algorithm: its advantage chain, extra samples, pivot or greedy-row drop
      and critic are used.
  """

  algorithm: Algorithm

  @property
  def extra_samples(self) -> int:
    return self.algorithm.extra_samples

  @property
  def failed_rewards(self) -> str:
    return self.algorithm.failed_rewards

  @property
  def name(self) -> str:
    return self.algorithm.name

  def __call__(self, *, group_size: int, mesh: jax.sharding.Mesh | None,
               has_old_logprobs: bool, groups: tuple[int, int] | None,
               env_column: int | None, episodes: bool) -> Callable:
    """``fn(rollout, rewards_NxR, valid_N, weights_R, adv_state, trained_N,
    group_ids_N) -> (RLBatch, adv_state, metrics)``, jitted (``postprocess``
    documents the arguments; ``episodes``: a multi-turn batch, whose turn
    rewards reach a critic's GAE)."""
    fn = functools.partial(postprocess, algorithm=self.algorithm,
                           group_size=group_size, groups=groups,
                           env_column=env_column)
    if mesh is None:
      return jax.jit(fn)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, out_shardings=(
        batch_shardings(mesh, has_old_logprobs, self.algorithm.critic,
                        token_rewards=bool(self.algorithm.critic) and episodes),
        replicated, replicated))


__all__ = ["Postprocessor", "pivot_rows", "postprocess"]
