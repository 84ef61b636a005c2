"""Rollout rejection: drop tokens or sequences whose sampler/trainer
mismatch exceeds a threshold, from the loss mask itself.

Unlike `masked_is`, which zeroes a coefficient and keeps the token in the
loss normaliser (TRL's `*_mask` modes, verl's IS weights), a rejected token
leaves the mask, so it also leaves the normaliser: apply `rejection_mask` to
the loss mask before the normalisers are computed (`rljax.train` does so for
`rl.rejection`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax.objectives._common import _check_bxt, _logprobs, _mask

REJECTION_STATISTICS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3")


class Rejection(NamedTuple):
  """One rejection criterion (hashable: it sits in static step settings).

  Attributes:
    statistic: one of `REJECTION_STATISTICS`.
    upper: keep if the statistic is <= `upper` (k2, k3); for k1, the upper
      bound of the ratio `mu / pi_old` (keep if `k1 <= log(upper)`).
    lower: k1 only: keep if `k1 >= log(lower)`.
  """
  statistic: str
  upper: float
  lower: float | None = None


def parse_rejection(spec: str) -> tuple[Rejection, ...]:
  """Criteria from `"stat:upper"` / `"stat:lower:upper"` (k1), comma-joined.

  E.g. `"seq_sum_k1:0.5:2.0"` (verl's `decoupled_seq_is_rs` rejection) or
  `"token_k3:0.1,seq_max_k2:0.5"`. An empty string gives no criterion.

  Raises:
    ValueError: naming the part that is wrong and the accepted form.
  """
  field = "rl.rejection"
  out = []
  for part in (p.strip() for p in str(spec).split(",")):
    if not part:
      continue
    bits = part.split(":")
    stat = bits[0]
    if stat not in REJECTION_STATISTICS:
      raise ValueError(f"{field}={spec!r}: statistic {stat!r} is unknown; "
                       f"accepted: {REJECTION_STATISTICS}.")
    k1 = stat.endswith("k1")
    form = f"'{stat}:lower:upper'" if k1 else f"'{stat}:upper'"
    if len(bits) != (3 if k1 else 2):
      raise ValueError(f"{field}={spec!r}: {part!r} must have the form {form}.")
    try:
      values = [float(b) for b in bits[1:]]
    except ValueError as e:
      raise ValueError(f"{field}={spec!r}: {part!r}: thresholds must be "
                       "numbers.") from e
    if not all(math.isfinite(v) and v > 0 for v in values):
      raise ValueError(f"{field}={spec!r}: {part!r}: thresholds must be "
                       "finite and > 0.")
    if k1 and values[0] > values[1]:
      raise ValueError(f"{field}={spec!r}: {part!r}: lower > upper.")
    out.append(Rejection(stat, values[-1], values[0] if k1 else None))
  return tuple(out)


def rejection_mask(old_logprobs_BxT: jax.Array, sampler_logprobs_BxT: jax.Array,
                   mask_BxT: jax.Array | None,
                   criteria: tuple[Rejection, ...],
                   max_log_ratio: float = 20.0) -> jax.Array:
  """The tokens kept: bool `[B, T]`, `mask` and every criterion passed.

  With `d = clip(old - sampler, +-max_log_ratio)` per valid token (verl's
  `SAFETY_BOUND = 20`):

      k1 = -d = log(mu / pi_old),   k2 = d^2 / 2,   k3 = exp(d) - 1 - d

  `token_*` tests each token; `seq_sum_*`, `seq_mean_*` and `seq_max_*` test
  the sum / mean / max over the sequence's valid tokens and keep or reject
  the whole sequence. k1 keeps `log(lower) <= k1 <= log(upper)` (bounds on
  `mu / pi_old`, the inverse of the IS ratio, as in verl); k2 and k3 keep
  `stat <= upper`. Without gradient.

  References:
    verl `trainer/ppo/rollout_corr_helper.py`
    (`compute_rollout_rejection_mask`, `rollout_rs`, `rollout_rs_threshold`);
    Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (2025),
    https://richardli.xyz/rl-collapse.
  """
  fn = "rejection_mask"
  old = _check_bxt(fn, "old_logprobs_BxT", old_logprobs_BxT)
  old = _logprobs(fn, "old_logprobs_BxT", old, old.shape)
  mu = _logprobs(fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, old.shape)
  mask = _mask(fn, mask_BxT, old.shape)
  d = jnp.where(mask, jnp.clip(old - mu, -max_log_ratio, max_log_ratio), 0.0)
  stats = {"k1": -d, "k2": 0.5 * d * d, "k3": jnp.exp(d) - 1.0 - d}
  n = jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1)
  keep = mask
  for c in criteria:
    if c.statistic not in REJECTION_STATISTICS:
      raise ValueError(f"{fn}: statistic={c.statistic!r}; accepted: "
                       f"{REJECTION_STATISTICS}.")
    level, kind = c.statistic.rsplit("_", 1)
    x = stats[kind]
    if level == "seq_sum":
      x = jnp.sum(jnp.where(mask, x, 0.0), -1, keepdims=True)
    elif level == "seq_mean":
      x = jnp.sum(jnp.where(mask, x, 0.0), -1, keepdims=True) / n
    elif level == "seq_max":
      x = jnp.max(jnp.where(mask, x, -jnp.inf), -1, keepdims=True)
    if kind == "k1":
      ok = (x >= math.log(c.lower)) & (x <= math.log(c.upper))
    else:
      ok = x <= c.upper
    keep = keep & ok
  return keep
