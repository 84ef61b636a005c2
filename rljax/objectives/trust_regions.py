"""Trust regions: transforms that read their input as the importance ratio."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _logprobs, _mask, _out,
    _sg, _stateless)
from rljax.objectives.ratios import normalized_ess


def reinforce() -> _Tx:
  """Plain REINFORCE: the coefficient is 1 on every token.

  The loss is then ``-sum_t A_t log pi(a_t)`` (aggregated), the score-function
  gradient of the expected reward.

  References:
    Williams, "Simple Statistical Gradient-Following Algorithms for
    Connectionist Reinforcement Learning", Machine Learning 8 (1992),
    https://doi.org/10.1007/BF00992696.
  """

  def update_fn(ratio_BxT, state, params=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt("reinforce", "ratio_BxT", ratio_BxT)
    return jnp.ones_like(ratio_BxT), state

  return _stateless(update_fn)


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


def sequence_ratio(max_log_ratio: float | None = None) -> _Tx:
  """GSPO's length-normalised sequence ratio, broadcast to every token.

      s_b = exp(sum_t mask * log r_bt / max(|y_b|, 1))

  `max_log_ratio=None` (default, as the paper and TRL) does not clamp.
  verl's `compute_policy_loss_gspo` clamps `log s_b` at 10 from above,
  which makes the sequence's gradient 0 where it binds (whatever the sign
  of A, since the unclipped branch of its min is the clamped one); with
  `max_log_ratio` set, `s_b` is output as 0 there, so any `ppo_clip` after
  it gives `c = 0` as verl does.

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
    log_s = jnp.sum(log_r, -1, keepdims=True) / length
    s = jnp.exp(log_s)
    if max_log_ratio is not None:
      s = jnp.where(log_s > max_log_ratio, 0.0, s)
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


def ess_trust_region(max_log_ratio: float = 20.0) -> _Tx:
  """FeynRL/P3O batch-adaptive trust region: cap the weight at the batch ESS.

      w   = pi_theta / mu = ratio * exp(old_logprobs - sampler_logprobs)
      ESS = (sum w)^2 / (n * sum w^2)   over the valid tokens, no gradient
      c   = min(w, ESS)

  The behaviour policy `mu` is the sampler (its recorded logprobs, as
  FeynRL's `pred_old_logprobs` from vLLM): with `old_logprobs_BxT` and
  `sampler_logprobs_BxT` given, the input ratio `pi_theta / pi_old` is
  turned into `pi_theta / mu`; without them the input is taken as `w`.
  There is no epsilon: when the weights are nearly uniform ESS ~ 1 and the
  update is the on-policy score-function update; when they concentrate the
  cap tightens but every token keeps a non-zero gradient. Add
  `ess_kl_penalty(...)`, weighted by `1 - ESS`, to the loss for the paper's
  pull toward the behaviour policy, and aggregate with `token_mean` over the
  global token count as FeynRL does.

  The ESS is computed from the weights this call receives (FeynRL pools per
  micro-batch), unless the extra argument `ess` gives a value pooled
  elsewhere (`ess_from_statistics` of summed `ess_statistics`, e.g. over a
  whole minibatch): `rljax.train`'s step passes it.

  References:
    Fakoor et al., "Trust the Batch, On- or Off-Policy: Adaptive Policy
    Optimization for RL Post-Training", https://arxiv.org/abs/2605.12380;
    reference code FeynRL-project/FeynRL `algs/P3O/p3o.py`.
  """
  fn = "ess_trust_region"

  def update_fn(ratio_BxT, state, params=None, *, mask_BxT=None, ess=None,
                old_logprobs_BxT=None, sampler_logprobs_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    w = ratio_BxT.astype(jnp.float32)
    if old_logprobs_BxT is not None and sampler_logprobs_BxT is not None:
      old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, w.shape)
      mu = _logprobs(fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, w.shape)
      w = w * jnp.exp(jnp.clip(jnp.where(mask, old - mu, 0.0), -max_log_ratio,
                               max_log_ratio))
    cap = normalized_ess(w, mask) if ess is None else _sg(
        jnp.asarray(ess, jnp.float32))
    return _out(jnp.minimum(w, cap), ratio_BxT), state

  return _stateless(update_fn)


def gspo(eps_low: float = 3e-4, eps_high: float = 4e-4,
         max_log_ratio: float | None = None) -> _Tx:
  """GSPO: `chain(sequence_ratio(max_log_ratio), ppo_clip(eps_low,
  eps_high))`; aggregate with `sequence_mean_token_mean`. See
  `sequence_ratio` (verl: `max_log_ratio=10`)."""
  return optax.chain(sequence_ratio(max_log_ratio), ppo_clip(eps_low, eps_high))
