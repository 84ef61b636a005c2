"""DPPO: a trust region on a divergence estimate instead of the ratio."""

from __future__ import annotations

import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _logprobs, _mask, _out,
    _stateless)

DPPO_DIVERGENCES = ("tv", "kl")
DPPO_ANCHORS = ("sampler", "old")


def dppo(divergence: str = "tv", delta_low: float = 0.2,
         delta_high: float | None = None, anchor: str = "sampler",
         cap: float = 10.0, ratio_base: str = "sampler") -> _Tx:
  """DPPO (binary approximation): mask tokens outside a divergence trust region.

  With `p = pi_theta(a_t)` and `q` the anchor's probability of the token
  (`anchor="sampler"`: `mu`, the paper's default; `"old"`: `pi_old`, its
  `*_recompute` variants and verl's `dppo_tv` / `dppo_kl`):

      tv:  out_pos = p - q > delta_high        out_neg = p - q < -delta_low
      kl:  D = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))
           out_pos = D > delta_high & p > q    out_neg = D > delta_low & p < q
      keep = not (out_pos if A > 0 else out_neg)
      ratio_base="sampler":  c = min(exp(min(logp - log mu, 20)), cap) * keep
      ratio_base="old":      c = min(ratio, cap) * keep

  With `ratio_base="sampler"` (the reference code) the coefficient is the
  ratio to the sampler's distribution (the surrogate is `sg(c) * A *
  logp`), so chain no other behaviour correction after it. With
  `ratio_base="old"` it is the input ratio `pi_theta / pi_old`
  (`importance_ratio` clamps its log at +-20 as verl does), and verl's
  rollout-correction weights, if any, are a `truncated_is` chained after.
  Needs `old_logprobs_BxT` (and `sampler_logprobs_BxT` unless both
  `anchor` and `ratio_base` are "old"); `logp` is recovered as
  `log ratio + old_logprobs`.

  `cap` is the peers' `clip_ratio_c`. Both peers read it with a fallback in
  the loss function (Stable-RL: 10; verl 0.9: 20), but the field exists in
  their `ActorConfig` with default 3.0 (shared with PPO's dual clip), so a
  run that does not set it caps at 3; verl's DPPO example script sets
  `clip_ratio_c=10000` (the paper's Section 5.4 recommends a large cap).
  rljax keeps 10 (the reference code's own value); pass `cap=3.0` to match
  a peer run on default settings.

  Args:
    divergence: "tv" or "kl" (`DPPO_DIVERGENCES`).
    delta_low: divergence threshold for `A <= 0` (the peers'
      `clip_ratio_low`; verl's example: 0.15 for TV, 0.05 for KL).
    delta_high: threshold for `A > 0` (default `delta_low`).
    anchor: the distribution `q` of the trust region (`DPPO_ANCHORS`).
    cap: upper truncation of the coefficient's ratio (> 0).
    ratio_base: "sampler" (`pi_theta / mu`) or "old" (`pi_theta / pi_old`).

  References:
    Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
    https://arxiv.org/abs/2602.04879; sail-sg/Stable-RL
    `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_with_mask`,
    `_compute_token_mask_for_policy_loss`, `dppo_binary_tv` /
    `dppo_binary_kl`); verl 0.9.0 (`release/v0.9.0`)
    `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_dppo_tv`,
    `compute_policy_loss_dppo_kl`).
  """
  fn = "dppo"
  if divergence not in DPPO_DIVERGENCES:
    raise ValueError(f"{fn}: divergence={divergence!r}; accepted: "
                     f"{DPPO_DIVERGENCES}.")
  if anchor not in DPPO_ANCHORS:
    raise ValueError(f"{fn}: anchor={anchor!r}; accepted: {DPPO_ANCHORS}.")
  if ratio_base not in DPPO_ANCHORS:
    raise ValueError(f"{fn}: ratio_base={ratio_base!r}; accepted: "
                     f"{DPPO_ANCHORS}.")
  _check_positive(fn, "delta_low", delta_low)
  delta_high = delta_low if delta_high is None else delta_high
  _check_positive(fn, "delta_high", delta_high)
  _check_positive(fn, "cap", cap)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    shape = ratio_BxT.shape
    a = _advantages(fn, advantages_BxT, shape)
    mask = _mask(fn, mask_BxT, shape)
    old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, shape)
    mu = (old if anchor == ratio_base == "old" else _logprobs(
        fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, shape))
    r = ratio_BxT.astype(jnp.float32)
    lp = jnp.log(r) + old
    lq = mu if anchor == "sampler" else old
    p, q = jnp.exp(lp), jnp.exp(lq)
    if divergence == "tv":
      out_pos, out_neg = p - q > delta_high, p - q < -delta_low
    else:
      d = q * (lq - lp) + (1 - q) * jnp.log((1 - q + 1e-8) / (1 - p + 1e-8))
      out_pos = (d > delta_high) & (p > q)
      out_neg = (d > delta_low) & (p < q)
    keep = ~jnp.where(a > 0, out_pos, out_neg)
    if ratio_base == "sampler":
      r = jnp.exp(jnp.minimum(jnp.where(mask, lp - mu, 0.0), 20.0))
    w = jnp.minimum(r, cap)
    return _out(jnp.where(keep, w, 0.0), ratio_BxT), state

  return _stateless(update_fn)
