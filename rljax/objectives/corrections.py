"""Behaviour-policy corrections: multiply the coefficient by a weight from the
old (trainer) and sampler logprobs."""

from __future__ import annotations

import jax.numpy as jnp

from rljax import types
from rljax.objectives._common import (
    _Tx, _check_bxt, _check_level, _check_positive, _logprobs, _mask, _out,
    _stateless)


def _behaviour_weight(fn, level, shape, old, sampler, mask, max_log_ratio):
  old = _logprobs(fn, "old_logprobs_BxT", old, shape)
  sampler = _logprobs(fn, "sampler_logprobs_BxT", sampler, shape)
  mask = _mask(fn, mask, shape)
  delta = jnp.where(mask, old - sampler, 0.0)
  if level == "sequence":
    delta = jnp.broadcast_to(jnp.sum(delta, -1, keepdims=True), shape)
  return jnp.exp(jnp.clip(delta, -max_log_ratio, max_log_ratio))


def _correction(fn: str, level: str, max_log_ratio: float, weight) -> _Tx:
  """The transform ``c = c_in * weight(w)``, ``w`` the behaviour IS weight."""

  def update_fn(coef_BxT, state, params=None, *, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, mask_BxT=None, **extra_args):
    del params, extra_args
    coef_BxT = _check_bxt(fn, "coef_BxT", coef_BxT)
    w = _behaviour_weight(fn, level, coef_BxT.shape, old_logprobs_BxT,
                          sampler_logprobs_BxT, mask_BxT, max_log_ratio)
    return _out(coef_BxT.astype(jnp.float32) * weight(w), coef_BxT), state

  return _stateless(update_fn)


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

  return _correction(fn, level, max_log_ratio, lambda w: jnp.minimum(w, cap))


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

  return _correction(fn, level, max_log_ratio,
                     lambda w: jnp.where((w >= low) & (w <= high), w, 0.0))
