"""The policy loss in coefficient form, its aggregation, and extra loss terms
(FeynRL's ESS-weighted KL pull, the entropy bonus)."""

from __future__ import annotations

import typing
from typing import Any

import jax
import jax.numpy as jnp

from rljax import types
from rljax.objectives._common import (
    _advantages, _check_bxt, _logprobs, _mask, _sg)

AGGREGATIONS = typing.get_args(types.Aggregation)


def aggregate_loss(loss_BxT: jax.Array, mask_BxT: jax.Array,
                   aggregation: types.Aggregation = "token_mean", *,
                   num_tokens: Any = None, num_sequences: Any = None,
                   max_length: Any = None, dp_size: int = 1) -> jax.Array:
  """Reduces a per-token loss to a scalar over the global batch.

      token_mean:                   sum(mask * l) / num_tokens
      token_sum:                    sum(mask * l)
      sequence_mean_token_mean:     sum_b (sum_t mask * l) / |y_b|
                                    / num_sequences
      sequence_mean_token_sum:      sum(mask * l) / num_sequences
      sequence_mean_token_sum_norm: sum(mask * l) / (num_sequences * max_length)
      sequence_mean_token_scale:    the same as sequence_mean_token_sum_norm

  The normalisers default to this batch's values: `num_tokens` = valid tokens,
  `num_sequences` = sequences with at least one valid token, `max_length` =
  `T`; a normaliser computed here from the mask is at least 1, so an
  all-padding batch gives 0. A passed normaliser is used as given (0 gives a
  non-finite loss: guard it where it is computed).

  `dp_size` (default 1: every result above, bitwise) reproduces one
  data-parallel rank's loss of a peer whose wrapper then averages the ranks'
  gradients: the loss is multiplied by `dp_size` (a passed normaliser is
  divided by it; `token_sum` is multiplied by it), so the average over ranks
  of the per-rank losses is the global loss. verl v0.9.0's `agg_loss` does
  this in every mode (`token-sum` included), and TRL divides its global token
  count by `num_processes`. rljax's jitted step computes the loss of the
  global (sharded) batch in one program, so there is no average over ranks
  to undo: its loss and gradient with `dp_size=1` equal verl's after verl's
  all-reduce mean. Pass the peer's `dp_size` (a Python number) only to
  compute one rank's value from that rank's rows with the global
  normalisers; as in verl, a normaliser that would be computed here from the
  (per-rank) mask is then rejected: `dp_size != 1` needs `num_tokens` for
  `token_mean` and `num_sequences` for the sequence means.

  For gradient accumulation pass the whole batch's values: the sum of the
  minibatch losses is then the whole-batch loss. `sequence_mean_token_sum_norm`
  is Dr.GRPO's constant normaliser (pass the generation budget as
  `max_length`). verl v0.9.0's `seq-mean-token-sum-norm` is the same formula:
  the token sum over rows with a valid token, divided by `global_batch_size`
  (default: the number of such rows), multiplied by `dp_size`, divided by
  `loss_scale_factor` (default: the padded width `T`); here
  `num_sequences=global_batch_size`, `max_length=loss_scale_factor` (the
  defaults agree). Tunix names the same formula `sequence-mean-token-scale`
  (sum of `sum_t l / width` over non-empty rows, divided by their count;
  Tunix's own `sequence-mean-token-sum-norm` is rljax's
  `sequence_mean_token_sum`). Padding tokens are excluded with `where`, so a
  non-finite value there does not leak into the loss (its gradient stays
  finite if the ops producing `loss_BxT` have finite derivatives at the
  padding, which `policy_gradient_loss` ensures by masking its inputs).

  Args:
    loss_BxT: per-token loss `[B, T]`.
    mask_BxT: bool, the valid tokens.
    aggregation: one of `AGGREGATIONS`.
    num_tokens: `token_mean`'s normaliser (None: this batch's valid tokens).
    num_sequences: the sequence means' row count (None: this batch's rows
      with a valid token).
    max_length: `sequence_mean_token_sum_norm`'s length (None: `T`).
    dp_size: data-parallel size of the peer whose per-rank loss to
      reproduce (> 0; 1: rljax's global loss).

  References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783; verl v0.9.0
    `trainer/ppo/core_algos.py` (`agg_loss`); TRL `trainer/grpo_trainer.py`
    (`_compute_loss`); google/tunix `rl/common.py` (`aggregate_loss`).
  """
  fn = "aggregate_loss"
  loss_BxT = _check_bxt(fn, "loss_BxT", loss_BxT)
  mask = _mask(fn, mask_BxT, loss_BxT.shape)
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"{fn}: aggregation={aggregation!r}; accepted: "
                     f"{AGGREGATIONS}.")
  if isinstance(dp_size, (int, float)) and dp_size <= 0:
    raise ValueError(f"{fn}: dp_size={dp_size!r} must be > 0.")
  per_rank = not (isinstance(dp_size, (int, float)) and dp_size == 1)
  if per_rank and isinstance(dp_size, (int, float)):
    missing = ("num_tokens" if aggregation == "token_mean"
               and num_tokens is None else
               "num_sequences" if aggregation.startswith("sequence_mean")
               and num_sequences is None else None)
    if missing:
      raise ValueError(
          f"{fn}: dp_size={dp_size!r} with aggregation={aggregation!r} needs "
          f"the global {missing} (as verl's agg_loss); one rank's own count "
          "would not give the peer's loss.")
  loss = jnp.where(mask, loss_BxT.astype(jnp.float32), 0.0)
  if aggregation == "token_sum":
    return jnp.sum(loss) * dp_size if per_rank else jnp.sum(loss)
  if aggregation == "token_mean":
    n = (jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
         if num_tokens is None else num_tokens / dp_size)
    return jnp.sum(loss) / n
  lengths_B = jnp.sum(mask, -1, dtype=jnp.float32)
  if num_sequences is None:
    num_sequences = jnp.maximum(jnp.sum(lengths_B > 0, dtype=jnp.float32), 1.0)
  else:
    num_sequences = num_sequences / dp_size
  if aggregation == "sequence_mean_token_mean":
    per_seq = jnp.sum(loss, -1) / jnp.maximum(lengths_B, 1.0)
    return jnp.sum(per_seq) / num_sequences
  if aggregation == "sequence_mean_token_sum":
    return jnp.sum(loss) / num_sequences
  t = loss_BxT.shape[1] if max_length is None else max_length
  return jnp.sum(loss) / (num_sequences * t)


def policy_gradient_loss(coef_BxT: jax.Array, advantages_BxT: jax.Array,
                         logprobs_BxT: jax.Array, mask_BxT: jax.Array,
                         aggregation: types.Aggregation = "token_mean", *,
                         num_tokens: Any = None, num_sequences: Any = None,
                         max_length: Any = None, dp_size: int = 1
                         ) -> jax.Array:
  """The policy loss in coefficient form.

      loss = aggregate(-sg(coef_BxT) * sg(advantages_BxT) * logprobs_BxT)

  so `grad loss = -aggregate(coef * A * grad logprobs)`: the gradient of
  every surrogate whose coefficient the `trust_regions` and `corrections`
  transforms produce. The value is not the surrogate's value (log it from
  the metrics instead).

  Args:
    coef_BxT: coefficient from a transform chain (gradient stopped).
    advantages_BxT: `[B, T]` or `[B]` (gradient stopped).
    logprobs_BxT: `log pi_theta` of the sampled tokens; carries the gradient.
    mask_BxT: bool, valid tokens.
    aggregation: one of `AGGREGATIONS`; see `aggregate_loss`, which also
      documents the normaliser arguments.
  """
  fn = "policy_gradient_loss"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT)
  coef = jnp.asarray(coef_BxT)
  if coef.shape != lp.shape:
    raise ValueError(f"{fn}: coef_BxT must have shape {lp.shape}; got "
                     f"{coef.shape}.")
  mask = _mask(fn, mask_BxT, lp.shape)
  a = _advantages(fn, advantages_BxT, lp.shape)
  c = jnp.where(mask, _sg(coef).astype(jnp.float32), 0.0)
  lp = jnp.where(mask, lp.astype(jnp.float32), 0.0)
  return aggregate_loss(-(c * jnp.where(mask, a, 0.0)) * lp, mask, aggregation,
                        num_tokens=num_tokens, num_sequences=num_sequences,
                        max_length=max_length, dp_size=dp_size)


def ess_kl_penalty(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                   ess: jax.Array, *, max_log_ratio: float = 10.0) -> jax.Array:
  """FeynRL's per-token pull toward the behaviour policy, weighted `1 - ESS`.

      d = logprobs - old_logprobs
      penalty = (1 - ESS) * (d + exp(clip(-d, +-max_log_ratio)) - 1)

  Its gradient is `(1 - ESS) * (1 - pi_old / pi) * grad logprobs`. Aggregate
  it like the policy loss and add it. Returns `[B, T]`.

  References:
    Fakoor et al., https://arxiv.org/abs/2605.12380.
  """
  fn = "ess_kl_penalty"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT).astype(jnp.float32)
  old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, lp.shape)
  d = lp - old
  k = d + jnp.exp(jnp.clip(-d, -max_log_ratio, max_log_ratio)) - 1.0
  return (1.0 - _sg(jnp.asarray(ess, jnp.float32))) * k


def entropy_loss(entropy_BxT: jax.Array, mask_BxT: jax.Array,
                 aggregation: types.Aggregation = "token_mean",
                 **normalizers) -> jax.Array:
  """`-aggregate(entropy)`: add `coef * entropy_loss(...)` for a bonus."""
  return -aggregate_loss(entropy_BxT, mask_BxT, aggregation, **normalizers)
