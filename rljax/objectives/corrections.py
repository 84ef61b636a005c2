"""Behaviour-policy corrections: multiply the coefficient by a weight from the
old (trainer) and sampler logprobs; and OPSM, which masks an objective's
coefficient by the current policy's distance from the sampler."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from rljax import types
from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_level, _check_positive, _logprobs,
    _mask, _out, _stateless)


def _behaviour_weight(fn, level, shape, old, sampler, mask, max_log_ratio):
  old = _logprobs(fn, "old_logprobs_BxT", old, shape)
  sampler = _logprobs(fn, "sampler_logprobs_BxT", sampler, shape)
  mask = _mask(fn, mask, shape)
  delta = jnp.where(mask, old - sampler, 0.0)
  if level == "sequence":
    delta = jnp.broadcast_to(jnp.sum(delta, -1, keepdims=True), shape)
  return jnp.exp(jnp.clip(delta, -max_log_ratio, max_log_ratio))


def _correction(fn: str, level: str, max_log_ratio: float, weight,
                batch_normalize: bool = False) -> _Tx:
  """The transform ``c = c_in * weight(w)``, ``w`` the behaviour IS weight;
  with ``batch_normalize`` the weights are divided by their mean first."""

  def update_fn(coef_BxT, state, params=None, *, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, mask_BxT=None, **extra_args):
    del params, extra_args
    coef_BxT = _check_bxt(fn, "coef_BxT", coef_BxT)
    w = weight(_behaviour_weight(fn, level, coef_BxT.shape, old_logprobs_BxT,
                                 sampler_logprobs_BxT, mask_BxT,
                                 max_log_ratio))
    if batch_normalize:
      w = w / _batch_mean(w, _mask(fn, mask_BxT, coef_BxT.shape), level)
    return _out(coef_BxT.astype(jnp.float32) * w, coef_BxT), state

  return _stateless(update_fn)


def _batch_mean(w, mask, level):
  """verl's `rollout_is_batch_normalize`: the mean over valid tokens
  (token level) or over non-empty sequences (sequence level); 1 if it is
  not above 1e-8."""
  if level == "sequence":
    valid = jnp.any(mask, -1)
    per_seq = w[:, 0]
    mean = (jnp.sum(jnp.where(valid, per_seq, 0.0))
            / jnp.maximum(jnp.sum(valid, dtype=jnp.float32), 1.0))
  else:
    mean = (jnp.sum(jnp.where(mask, w, 0.0))
            / jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0))
  return jnp.where(mean > 1e-8, mean, 1.0)


def truncated_is(cap: float = 2.0, level: types.ImportanceLevel = "token",
                 max_log_ratio: float = 20.0, floor: float | None = None,
                 batch_normalize: bool = False) -> _Tx:
  """Truncated importance sampling (TIS) for sampler/trainer mismatch.

      w = exp(clip(old_logprobs - sampler_logprobs, +-max_log_ratio))
          (level="sequence": the sum over the sequence's valid tokens)
      c = c_in * clip(w, floor, cap)          (no floor: min(w, cap))
      batch_normalize: w_clipped / mean(w_clipped) over the valid tokens
                       (token level) or the non-empty sequences (sequence)

  verl's rollout correction (`decoupled_token_is` / `decoupled_seq_is`,
  C = 2; `rollout_is_batch_normalize`, whose mean is over the whole
  rollout batch while this one is over the tokens the transform receives:
  one microbatch in `rljax.train`). `floor` is TRL's `*_truncate` lower
  bound (`vllm_importance_sampling_clip_min`). Chain
  after the trust region.

  References:
    Yao et al., "On the Rollout-Training Mismatch in Modern RL Systems"
    (NeurIPS 2025 workshop; blog "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl);
    verl `trainer/ppo/rollout_corr_helper.py`
    (`compute_rollout_correction_weights`).
  """
  fn = "truncated_is"
  _check_level(fn, level)
  _check_positive(fn, "cap", cap)
  if floor is not None:
    _check_positive(fn, "floor", floor)
    if isinstance(floor, (int, float)) and isinstance(cap, (int, float)) \
        and floor > cap:
      raise ValueError(f"{fn}: floor={floor!r} must be <= cap={cap!r}.")
  clip = ((lambda w: jnp.minimum(w, cap)) if floor is None
          else (lambda w: jnp.clip(w, floor, cap)))
  return _correction(fn, level, max_log_ratio, clip, batch_normalize)


def masked_is(high: float = 2.0, low: float = 0.0,
              level: types.ImportanceLevel = "token",
              max_log_ratio: float = 20.0) -> _Tx:
  """Masked importance sampling (MIS): IS weight, zeroed outside `[low, high]`.

      w = as in `truncated_is`
      c = c_in * w * [low <= w <= high]

  Rejected tokens (or whole sequences) keep their place in the loss
  normaliser, as in TRL's `token_mask` / `sequence_mask` modes. verl's
  IS weights never leave the mask either; only its separate rejection
  sampling (`rollout_rs`) removes tokens from the mask, and with it from
  the normaliser: that is `rejection_mask` (`rl.rejection`).

  References:
    Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (2025),
    https://richardli.xyz/rl-collapse; TRL `trainer/grpo_trainer.py`
    (`vllm_importance_sampling_mode`).
  """
  fn = "masked_is"
  _check_level(fn, level)
  _check_positive(fn, "high", high)

  return _correction(fn, level, max_log_ratio,
                     lambda w: jnp.where((w >= low) & (w <= high), w, 0.0))


def off_policy_sequence_mask(objective: optax.GradientTransformation,
                             delta: float) -> _Tx:
  """Off-policy sequence masking (OPSM): drop negative-advantage sequences
  that the current policy has moved far from the sampler on.

      kl_b  = sum_t mask * (sampler_logprobs - logp) / max(|y_b|, 1)
      logp  = log ratio + old_logprobs   (ratio = this transform's input)
      keep  = (A >= 0) or (kl_b <= delta)
      c     = objective(ratio) * keep

  `logp` is the current policy's (no gradient): the mask is recomputed at
  every update. Without `sampler_logprobs_BxT` the old logprobs stand in
  for the sampler's (TRL's fallback without vLLM), so `kl_b` is
  `-mean_t log ratio`. A per-token advantage `[B, T]` masks the tokens
  with `A < 0` of such a sequence. Masked tokens keep their place in the
  loss normaliser (TRL multiplies the per-token loss by the mask).

  The mask needs `log pi_theta`, which a link after the objective does not
  see (it receives the coefficient), so OPSM wraps the objective: pass the
  objective chain (trust region and any behaviour correction) and it
  receives the ratio and every extra argument. Its state is the wrapped
  chain's state.

  Args:
    objective: the coefficient transform (or chain) to mask.
    delta: the KL threshold (> 0; TRL's `off_policy_mask_threshold`, no
      default there, "e.g. 0.5").

  References:
    DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large
    Language Models", https://arxiv.org/abs/2512.02556 (Eq. 9); TRL v1.9.0
    `trl/trainer/grpo_trainer.py` (`GRPOTrainer.get_off_policy_mask`, and
    `_compute_loss`, `off_policy_mask_threshold`).
  """
  fn = "off_policy_sequence_mask"
  _check_positive(fn, "delta", delta)
  objective = optax.with_extra_args_support(objective)

  def init_fn(params):
    return objective.init(params)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, **extra_args):
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    shape = ratio_BxT.shape
    a = _advantages(fn, advantages_BxT, shape)
    mask = _mask(fn, mask_BxT, shape)
    log_r = jnp.log(ratio_BxT.astype(jnp.float32))
    if sampler_logprobs_BxT is None:
      kl = -log_r
    else:
      old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, shape)
      mu = _logprobs(fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, shape)
      kl = mu - (log_r + old)
    length = jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1)
    mean_kl = jnp.sum(jnp.where(mask, kl, 0.0), -1, keepdims=True) / length
    keep = (a >= 0) | (mean_kl <= delta)
    coef_BxT, state = objective.update(
        ratio_BxT, state, params, advantages_BxT=advantages_BxT,
        mask_BxT=mask_BxT, old_logprobs_BxT=old_logprobs_BxT,
        sampler_logprobs_BxT=sampler_logprobs_BxT, **extra_args)
    c = jnp.where(keep, coef_BxT.astype(jnp.float32), 0.0)
    return _out(c, coef_BxT), state

  return _Tx(init_fn, update_fn)
