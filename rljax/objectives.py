"""Per-token policy-gradient coefficients, the policy loss, KL and aggregation.

Every policy-gradient objective of the GRPO family has the gradient

    grad loss = -(1 / normaliser) * sum_{b,t} mask * c_bt * A_bt * grad logp_bt

for a stop-gradient coefficient `c_BxT` computed from importance ratios. Here
`c` is produced by optax-protocol transforms whose "updates" start as the
importance ratio and are refined link by link, and the loss is one function:

    ratio_BxT = importance_ratio(logprobs_BxT, old_logprobs_BxT, mask_BxT)
    tx = optax.chain(ppo_clip(0.2, 0.28), truncated_is(cap=2.0))
    coef_BxT, tx_state = tx.update(
        ratio_BxT, tx_state, advantages_BxT=adv_B, mask_BxT=mask_BxT,
        old_logprobs_BxT=old_lp, sampler_logprobs_BxT=sampler_lp)
    loss = policy_gradient_loss(coef_BxT, adv_B, logprobs_BxT, mask_BxT,
                                "token_mean", num_tokens=global_tokens)

Order in a chain: `sequence_ratio` (if any) comes first, then one trust
region that reads its input as the ratio (`ppo_clip`, optionally followed by
`dual_clip`; or `cispo`; or `ess_trust_region`), then behaviour-policy
corrections that multiply by a weight computed from the extra arguments
(`truncated_is`, `masked_is`).

Extra arguments (keyword-only; unknown ones are ignored):
  advantages_BxT: `[B, T]`, or `[B]` for one advantage per sequence.
  mask_BxT: bool `[B, T]`, valid completion tokens (default: all valid).
  old_logprobs_BxT: `log pi_old` of the sampled tokens, the trainer's
    recomputation at rollout time (the base of the ratio).
  sampler_logprobs_BxT: `log mu`, the sampler's logprobs of the same tokens.
  ess: a precomputed normalised ESS for `ess_trust_region` (see there).

All transforms compute in float32, return the coefficient in the input's
dtype and stop its gradient. Gradients reach the parameters only through the
`logprobs_BxT` argument of the loss functions.
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import types

_Tx = optax.GradientTransformationExtraArgs
_sg = jax.lax.stop_gradient
AGGREGATIONS = typing.get_args(types.Aggregation)
LEVELS = typing.get_args(types.ImportanceLevel)


# ----------------------------------------------------------------------------
# Argument checks.


def _check_bxt(fn: str, name: str, x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"{fn}: {name} must have shape [B, T]; got {x.shape}.")
  return x


def _mask(fn: str, mask_BxT: Any, shape: tuple[int, ...]) -> jax.Array:
  if mask_BxT is None:
    return jnp.ones(shape, bool)
  mask_BxT = jnp.asarray(mask_BxT)
  if mask_BxT.shape != shape:
    raise ValueError(
        f"{fn}: mask_BxT must have shape {shape}; got {mask_BxT.shape}.")
  return mask_BxT.astype(bool)


def _advantages(fn: str, advantages_BxT: Any, shape: tuple[int, ...]):
  if advantages_BxT is None:
    raise ValueError(
        f"{fn}: advantages_BxT is required ([B, T] or [B]); got None.")
  a = jnp.asarray(advantages_BxT)
  if a.shape == shape[:1]:
    a = a[:, None]
  elif a.shape != shape:
    raise ValueError(
        f"{fn}: advantages_BxT must have shape {shape} or ({shape[0]},); got "
        f"{a.shape}.")
  return jnp.broadcast_to(_sg(a).astype(jnp.float32), shape)


def _logprobs(fn: str, name: str, x: Any, shape: tuple[int, ...]):
  if x is None:
    raise ValueError(f"{fn}: the keyword extra argument {name} is required.")
  x = jnp.asarray(x)
  if x.shape != shape:
    raise ValueError(f"{fn}: {name} must have shape {shape}; got {x.shape}.")
  return _sg(x).astype(jnp.float32)


def _check_level(fn: str, level: str) -> None:
  if level not in LEVELS:
    raise ValueError(f"{fn}: level={level!r}; accepted: {LEVELS}.")


def _check_positive(fn: str, name: str, value: Any) -> None:
  if isinstance(value, (int, float)) and value <= 0:
    raise ValueError(f"{fn}: {name}={value!r} must be > 0.")


def _stateless(update_fn) -> _Tx:
  return _Tx(lambda params: optax.EmptyState(), update_fn)


def _out(coef, like):
  return _sg(coef).astype(like.dtype)


# ----------------------------------------------------------------------------
# Ratios and effective sample size.


def importance_ratio(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                     mask_BxT: jax.Array | None = None, *,
                     max_log_ratio: float = 20.0) -> jax.Array:
  """`ratio = exp(clip(logprobs - old_logprobs, +-max_log_ratio))`, no gradient.

  Padding tokens get ratio 1. The clamp keeps `exp` finite (verl uses 20).
  """
  fn = "importance_ratio"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT)
  old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, lp.shape)
  mask = _mask(fn, mask_BxT, lp.shape)
  log_r = jnp.clip(_sg(lp).astype(jnp.float32) - old, -max_log_ratio,
                   max_log_ratio)
  return jnp.exp(jnp.where(mask, log_r, 0.0))


def sequence_importance_weights(logprobs_BxT: jax.Array,
                                base_logprobs_BxT: jax.Array,
                                mask_BxT: jax.Array | None = None, *,
                                max_log_ratio: float = 20.0) -> jax.Array:
  """`w_B = exp(clip(sum_t mask * (logprobs - base_logprobs), +-max))`.

  E.g. VCPO's per-trajectory staleness weight `pi_old(y) / mu(y)` with
  `logprobs = old_logprobs`, `base = sampler_logprobs`. VCPO does not clamp;
  the clamp keeps the weight (and the ESS computed from it) finite.
  """
  fn = "sequence_importance_weights"
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT)
  base = _logprobs(fn, "base_logprobs_BxT", base_logprobs_BxT, lp.shape)
  mask = _mask(fn, mask_BxT, lp.shape)
  log_w = jnp.sum(jnp.where(mask, _sg(lp).astype(jnp.float32) - base, 0.0), -1)
  return jnp.exp(jnp.clip(log_w, -max_log_ratio, max_log_ratio))


class EssStatistics(NamedTuple):
  """Additive sufficient statistics of the normalised ESS.

  Sum them over minibatches (`jax.tree.map(jnp.add, ...)`) to get the ESS of
  the whole batch.
  """
  sum_w: jax.Array  # [] float32: sum of the valid weights.
  sum_w_sq: jax.Array  # [] float32: sum of their squares.
  count: jax.Array  # [] float32: number of valid weights.


def ess_statistics(weights: jax.Array,
                   mask: jax.Array | None = None) -> EssStatistics:
  """`EssStatistics` of the valid entries of `weights` (any shape)."""
  w = _sg(jnp.asarray(weights)).astype(jnp.float32)
  m = jnp.ones(w.shape, bool) if mask is None else jnp.asarray(mask, bool)
  if m.shape != w.shape:
    raise ValueError(
        f"ess_statistics: mask shape {m.shape} must equal weights shape "
        f"{w.shape}.")
  w = jnp.where(m, w, 0.0)
  return EssStatistics(jnp.sum(w), jnp.sum(w * w),
                       jnp.sum(m, dtype=jnp.float32))


def ess_from_statistics(stats: EssStatistics) -> jax.Array:
  """Normalised ESS `(sum w)^2 / (n * sum w^2)`, in `[1/n, 1]`, no gradient.

  Falls back to 1.0 when there is no valid weight or the value is not finite
  (FeynRL's rule). Unlike FeynRL, no 1e-8 is added to `sum w^2`, so an
  on-policy batch has ESS exactly 1.
  """
  mean_w = stats.sum_w / jnp.maximum(stats.count, 1.0)
  mean_w_sq = stats.sum_w_sq / jnp.maximum(stats.count, 1.0)
  ess = mean_w * mean_w / mean_w_sq
  ok = (stats.count > 0.5) & jnp.isfinite(ess)
  return _sg(jnp.where(ok, ess, 1.0))


def normalized_ess(weights: jax.Array,
                   mask: jax.Array | None = None) -> jax.Array:
  """Normalised effective sample size of the valid `weights` (any shape)."""
  return ess_from_statistics(ess_statistics(weights, mask))


# ----------------------------------------------------------------------------
# Trust regions: the input is read as the importance ratio.


def ppo_clip(eps_low: float = 0.2, eps_high: float | None = None) -> _Tx:
  """PPO clipped surrogate; `eps_high > eps_low` is DAPO's clip-higher.

  Surrogate per token: `min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`.
  Its gradient is `r * A * grad logp` unless the clip is active, so

      c = 0  if (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low)
      c = r  otherwise.

  Args:
    eps_low: lower clip range.
    eps_high: upper clip range (default `eps_low`; DAPO: 0.2 / 0.28).

  References:
    Schulman et al., "Proximal Policy Optimization Algorithms",
    https://arxiv.org/abs/1707.06347; Yu et al., "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", https://arxiv.org/abs/2503.14476.
  """
  fn = "ppo_clip"
  _check_positive(fn, "eps_low", eps_low)
  eps_high = eps_low if eps_high is None else eps_high
  _check_positive(fn, "eps_high", eps_high)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    r = ratio_BxT.astype(jnp.float32)
    clipped = ((a > 0) & (r > 1.0 + eps_high)) | ((a < 0) & (r < 1.0 - eps_low))
    return _out(jnp.where(clipped, 0.0, r), ratio_BxT), state

  return _stateless(update_fn)


def dual_clip(clip_ratio_c: float = 3.0) -> _Tx:
  """Dual clip: for `A < 0` the loss is bounded by `-clip_ratio_c * A`.

  Surrogate for `A < 0`: `max(min(r A, clip(r) A), clip_ratio_c * A)`, whose
  gradient vanishes once `r > clip_ratio_c`. Chain it after `ppo_clip`:
  `c = 0 if (A < 0 and c_in > clip_ratio_c) else c_in`.

  References:
    Ye et al., "Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning", https://arxiv.org/abs/1912.09729.
  """
  fn = "dual_clip"
  if isinstance(clip_ratio_c, (int, float)) and clip_ratio_c <= 1:
    raise ValueError(f"{fn}: clip_ratio_c={clip_ratio_c!r} must be > 1.")

  def update_fn(coef_BxT, state, params=None, *, advantages_BxT=None,
                **extra_args):
    del params, extra_args
    coef_BxT = _check_bxt(fn, "coef_BxT", coef_BxT)
    a = _advantages(fn, advantages_BxT, coef_BxT.shape)
    c = coef_BxT.astype(jnp.float32)
    return _out(jnp.where((a < 0) & (c > clip_ratio_c), 0.0, c),
                coef_BxT), state

  return _stateless(update_fn)


def sequence_ratio() -> _Tx:
  """GSPO's length-normalised sequence ratio, broadcast to every token.

      s_b = exp(sum_t mask * log r_bt / max(|y_b|, 1))

  Chain first, then `ppo_clip` (GSPO: eps 3e-4 / 4e-4), and aggregate with
  `sequence_mean_token_mean`: the gradient is then GSPO's
  `s_b * A_b * mean_t grad logp_bt` for unclipped sequences. See `gspo()`.

  References:
    Zheng et al., "Group Sequence Policy Optimization",
    https://arxiv.org/abs/2507.18071.
  """
  fn = "sequence_ratio"

  def update_fn(ratio_BxT, state, params=None, *, mask_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    log_r = jnp.where(mask, jnp.log(ratio_BxT.astype(jnp.float32)), 0.0)
    length = jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1)
    s = jnp.exp(jnp.sum(log_r, -1, keepdims=True) / length)
    return _out(jnp.broadcast_to(s, ratio_BxT.shape), ratio_BxT), state

  return _stateless(update_fn)


def cispo(cap: float, floor: float | None = None) -> _Tx:
  """CISPO: clip the importance weight, never drop a token's gradient.

  `c = clip(r, floor, cap)`: the surrogate is `sg(clip(r)) * A * logp`. TRL
  uses an absolute cap (`epsilon_high`, 5.0 recommended) and no floor; the
  paper writes `clip(r, 1 - eps_low, 1 + eps_high)` with a large `eps_low`.

  References:
    MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention", https://arxiv.org/abs/2506.13585.
  """
  fn = "cispo"
  _check_positive(fn, "cap", cap)

  def update_fn(ratio_BxT, state, params=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    r = ratio_BxT.astype(jnp.float32)
    c = jnp.minimum(r, cap) if floor is None else jnp.clip(r, floor, cap)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)


def ess_trust_region() -> _Tx:
  """FeynRL/P3O batch-adaptive trust region: cap the ratio at the batch ESS.

      ESS = (sum w)^2 / (n * sum w^2)   over the valid tokens, no gradient
      c   = min(w, ESS)

  where `w` is the input ratio. There is no epsilon: when the ratios are
  nearly uniform ESS ~ 1 and the update is the on-policy score-function
  update; when they concentrate the cap tightens but every token keeps a
  non-zero gradient. Add `ess_kl_penalty(...)`, weighted by `1 - ESS`, to the
  loss for the paper's pull toward the behaviour policy, and aggregate with
  `token_mean` over the global token count as FeynRL does.

  The ESS is computed from the ratios this call receives. For gradient
  accumulation pass `ess=ess_from_statistics(sum of ess_statistics(...) over
  the minibatches)` so that every minibatch uses the whole batch's value
  (FeynRL recomputes it per micro-batch).

  References:
    Fakoor et al., "Trust the Batch, On- or Off-Policy: Adaptive Policy
    Optimization for RL Post-Training", https://arxiv.org/abs/2605.12380.
  """
  fn = "ess_trust_region"

  def update_fn(ratio_BxT, state, params=None, *, mask_BxT=None, ess=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    w = ratio_BxT.astype(jnp.float32)
    cap = normalized_ess(w, mask) if ess is None else _sg(
        jnp.asarray(ess, jnp.float32))
    return _out(jnp.minimum(w, cap), ratio_BxT), state

  return _stateless(update_fn)


# ----------------------------------------------------------------------------
# Behaviour-policy corrections: multiply by a weight from old/sampler logprobs.


def _behaviour_weight(fn, level, shape, old, sampler, mask, max_log_ratio):
  old = _logprobs(fn, "old_logprobs_BxT", old, shape)
  sampler = _logprobs(fn, "sampler_logprobs_BxT", sampler, shape)
  mask = _mask(fn, mask, shape)
  delta = jnp.where(mask, old - sampler, 0.0)
  if level == "sequence":
    delta = jnp.broadcast_to(jnp.sum(delta, -1, keepdims=True), shape)
  return jnp.exp(jnp.clip(delta, -max_log_ratio, max_log_ratio))


def truncated_is(cap: float = 2.0, level: types.ImportanceLevel = "token",
                 max_log_ratio: float = 20.0) -> _Tx:
  """Truncated importance sampling (TIS) for sampler/trainer mismatch.

      w = exp(clip(old_logprobs - sampler_logprobs, +-max_log_ratio))
          (level="sequence": the sum over the sequence's valid tokens)
      c = c_in * min(w, cap)

  verl's rollout correction (`decoupled_token_is` / `decoupled_seq_is`,
  C = 2). Chain after the trust region.

  References:
    Yao et al., "On the Rollout-Training Mismatch in Modern RL Systems"
    (NeurIPS 2025 workshop; blog "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl).
  """
  fn = "truncated_is"
  _check_level(fn, level)
  _check_positive(fn, "cap", cap)

  def update_fn(coef_BxT, state, params=None, *, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, mask_BxT=None, **extra_args):
    del params, extra_args
    coef_BxT = _check_bxt(fn, "coef_BxT", coef_BxT)
    w = _behaviour_weight(fn, level, coef_BxT.shape, old_logprobs_BxT,
                          sampler_logprobs_BxT, mask_BxT, max_log_ratio)
    return _out(coef_BxT.astype(jnp.float32) * jnp.minimum(w, cap),
                coef_BxT), state

  return _stateless(update_fn)


def masked_is(high: float = 2.0, low: float = 0.0,
              level: types.ImportanceLevel = "token",
              max_log_ratio: float = 20.0) -> _Tx:
  """Masked importance sampling (MIS): IS weight, zeroed outside `[low, high]`.

      w = as in `truncated_is`
      c = c_in * w * [low <= w <= high]

  Rejected tokens (or whole sequences) keep their place in the loss
  normaliser, as TRL's `*_mask` modes (verl removes them from the mask).

  References:
    Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (2025),
    https://richardli.xyz/rl-collapse.
  """
  fn = "masked_is"
  _check_level(fn, level)
  _check_positive(fn, "high", high)

  def update_fn(coef_BxT, state, params=None, *, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, mask_BxT=None, **extra_args):
    del params, extra_args
    coef_BxT = _check_bxt(fn, "coef_BxT", coef_BxT)
    w = _behaviour_weight(fn, level, coef_BxT.shape, old_logprobs_BxT,
                          sampler_logprobs_BxT, mask_BxT, max_log_ratio)
    keep = (w >= low) & (w <= high)
    return _out(coef_BxT.astype(jnp.float32) * jnp.where(keep, w, 0.0),
                coef_BxT), state

  return _stateless(update_fn)


def gspo(eps_low: float = 3e-4, eps_high: float = 4e-4) -> _Tx:
  """GSPO: `chain(sequence_ratio(), ppo_clip(eps_low, eps_high))`; aggregate
  with `sequence_mean_token_mean`. See `sequence_ratio`."""
  return optax.chain(sequence_ratio(), ppo_clip(eps_low, eps_high))


# ----------------------------------------------------------------------------
# Losses.


def aggregate_loss(loss_BxT: jax.Array, mask_BxT: jax.Array,
                   aggregation: types.Aggregation = "token_mean", *,
                   num_tokens: Any = None, num_sequences: Any = None,
                   max_length: Any = None) -> jax.Array:
  """Reduces a per-token loss to a scalar over the global batch.

      token_mean:                   sum(mask * l) / num_tokens
      sequence_mean_token_mean:     sum_b (sum_t mask * l) / |y_b|
                                    / num_sequences
      sequence_mean_token_sum:      sum(mask * l) / num_sequences
      sequence_mean_token_sum_norm: sum(mask * l) / (num_sequences * max_length)

  The normalisers default to this batch's values: `num_tokens` = valid tokens,
  `num_sequences` = sequences with at least one valid token, `max_length` =
  `T`. For gradient accumulation pass the whole batch's values: the sum of the
  minibatch losses is then the whole-batch loss. `sequence_mean_token_sum_norm`
  is Dr.GRPO's constant normaliser (pass the generation budget as
  `max_length`). Padding tokens are excluded with `where`, so a non-finite
  value there does not leak into the loss (its gradient stays finite if the
  ops producing `loss_BxT` have finite derivatives at the padding, which
  `policy_gradient_loss` ensures by masking its inputs); an all-padding batch
  gives 0.

  References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783.
  """
  fn = "aggregate_loss"
  loss_BxT = _check_bxt(fn, "loss_BxT", loss_BxT)
  mask = _mask(fn, mask_BxT, loss_BxT.shape)
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"{fn}: aggregation={aggregation!r}; accepted: "
                     f"{AGGREGATIONS}.")
  loss = jnp.where(mask, loss_BxT.astype(jnp.float32), 0.0)
  if aggregation == "token_mean":
    n = jnp.sum(mask, dtype=jnp.float32) if num_tokens is None else num_tokens
    return jnp.sum(loss) / jnp.maximum(n, 1.0)
  lengths_B = jnp.sum(mask, -1, dtype=jnp.float32)
  if num_sequences is None:
    num_sequences = jnp.sum(lengths_B > 0, dtype=jnp.float32)
  num_sequences = jnp.maximum(num_sequences, 1.0)
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
                         max_length: Any = None) -> jax.Array:
  """The policy loss in coefficient form.

      loss = aggregate(-sg(coef_BxT) * sg(advantages_BxT) * logprobs_BxT)

  so `grad loss = -aggregate(coef * A * grad logprobs)`: the gradient of
  every surrogate whose coefficient the transforms above produce. The value
  is not the surrogate's value (log it from the metrics instead).

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
                        max_length=max_length)


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


def _log_ratio(fn, logprobs_BxT, ref_logprobs_BxT):
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT).astype(jnp.float32)
  return lp - _logprobs(fn, "ref_logprobs_BxT", ref_logprobs_BxT, lp.shape)


def kl_k1(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
  """k1 = logprobs - ref_logprobs, per token `[B, T]`.

  Unbiased for KL(pi || pi_ref) under samples of pi, but its expected
  gradient as a loss is 0: use it as a reward penalty, not a loss.

  References:
    Schulman, "Approximating KL Divergence" (2020),
    http://joschu.net/blog/kl-approx.html.
  """
  return _log_ratio("kl_k1", logprobs_BxT, ref_logprobs_BxT)


def kl_k2(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
  """k2 = (logprobs - ref_logprobs)^2 / 2; as a loss its expected gradient
  is that of KL(pi || pi_ref). Reference: Schulman (2020), see `kl_k1`."""
  d = _log_ratio("kl_k2", logprobs_BxT, ref_logprobs_BxT)
  return 0.5 * d * d


def kl_k3(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array, *,
          max_log_ratio: float = 20.0) -> jax.Array:
  """k3 = exp(ref - logprobs) - (ref - logprobs) - 1 (GRPO's KL term).

  Unbiased for KL(pi || pi_ref) and >= 0; as a loss its expected gradient is
  that of KL(pi_ref || pi). The exponent is clipped to `+-max_log_ratio`
  (verl: 20). Reference: Schulman (2020), see `kl_k1`.
  """
  d = -_log_ratio("kl_k3", logprobs_BxT, ref_logprobs_BxT)
  return jnp.exp(jnp.clip(d, -max_log_ratio, max_log_ratio)) - d - 1.0


def entropy_loss(entropy_BxT: jax.Array, mask_BxT: jax.Array,
                 aggregation: types.Aggregation = "token_mean",
                 **normalizers) -> jax.Array:
  """`-aggregate(entropy)`: add `coef * entropy_loss(...)` for a bonus."""
  return -aggregate_loss(entropy_BxT, mask_BxT, aggregation, **normalizers)


# ----------------------------------------------------------------------------
# Metrics.


def _masked_mean(x, mask):
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(
      jnp.sum(mask, dtype=jnp.float32), 1.0)


def _masked_extreme(x, mask, reduce, fill):
  return jnp.where(jnp.any(mask), reduce(jnp.where(mask, x, fill)), 0.0)


def ratio_metrics(ratio_BxT: jax.Array, mask_BxT: jax.Array | None = None, *,
                  advantages_BxT: jax.Array | None = None,
                  eps_low: float = 0.2,
                  eps_high: float | None = None) -> types.Metrics:
  """Ratio mean/min/max and ESS over valid tokens; with advantages also the
  PPO clip fractions `clip_frac_low` (A < 0, r < 1 - eps_low),
  `clip_frac_high` (A > 0, r > 1 + eps_high) and `clip_frac`."""
  fn = "ratio_metrics"
  r = _check_bxt(fn, "ratio_BxT", ratio_BxT).astype(jnp.float32)
  mask = _mask(fn, mask_BxT, r.shape)
  out = {
      "ratio_mean": _masked_mean(r, mask),
      "ratio_min": _masked_extreme(r, mask, jnp.min, jnp.inf),
      "ratio_max": _masked_extreme(r, mask, jnp.max, -jnp.inf),
      "ess": normalized_ess(r, mask),
  }
  if advantages_BxT is not None:
    a = _advantages(fn, advantages_BxT, r.shape)
    eps_high = eps_low if eps_high is None else eps_high
    low = (a < 0) & (r < 1.0 - eps_low)
    high = (a > 0) & (r > 1.0 + eps_high)
    out["clip_frac_low"] = _masked_mean(low, mask)
    out["clip_frac_high"] = _masked_mean(high, mask)
    out["clip_frac"] = _masked_mean(low | high, mask)
  return out


def coefficient_metrics(coef_BxT: jax.Array,
                        mask_BxT: jax.Array | None = None) -> types.Metrics:
  """Mean and max coefficient, and the fraction of valid tokens whose
  coefficient is 0 (clipped away or rejected: they carry no gradient)."""
  c = _check_bxt("coefficient_metrics", "coef_BxT", coef_BxT).astype(
      jnp.float32)
  mask = _mask("coefficient_metrics", mask_BxT, c.shape)
  return {
      "coef_mean": _masked_mean(c, mask),
      "coef_max": _masked_extreme(c, mask, jnp.max, -jnp.inf),
      "frac_zero_coef": _masked_mean(c == 0, mask),
  }


def kl_metrics(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
               mask_BxT: jax.Array | None = None) -> types.Metrics:
  """Token means of the k1, k2 and k3 estimators against the reference."""
  mask = _mask("kl_metrics", mask_BxT, jnp.shape(logprobs_BxT))
  lp = _sg(jnp.asarray(logprobs_BxT))
  return {
      "kl_k1": _masked_mean(kl_k1(lp, ref_logprobs_BxT), mask),
      "kl_k2": _masked_mean(kl_k2(lp, ref_logprobs_BxT), mask),
      "kl_k3": _masked_mean(kl_k3(lp, ref_logprobs_BxT), mask),
  }
