"""Trust regions that reshape the coefficient instead of cutting it:
SAPO's soft gate, GMPO's geometric mean, PNPO's prefix ratio, VESPO's
Gamma kernel of the sequence ratio."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _advantages, _check_bxt, _check_positive, _logprobs, _mask, _out,
    _stateless)


def sapo(tau_pos: float = 1.0, tau_neg: float = 1.05) -> _Tx:
  """SAPO: a sigmoid gate of the ratio in place of the hard clip.

  Surrogate per token: `f(r) * A` with `f(r) = sigmoid(tau * (r - 1)) * 4 /
  tau`, `tau = tau_pos` if `A > 0` else `tau_neg`. Its gradient is
  `f'(r) * r * A * grad logp`, so

      s = sigmoid(tau * (r - 1)),   c = 4 * s * (1 - s) * r

  (`c = 1` on-policy; it decays smoothly as `r` leaves 1, faster for
  negative advantages). verl and TRL aggregate it with
  `sequence_mean_token_mean` (TRL `loss_type="sapo"`, verl forces it).

  References:
    Gao et al., "Soft Adaptive Policy Optimization",
    https://arxiv.org/abs/2511.20347; verl `core_algos.py`
    (`compute_policy_loss_sapo`), TRL `grpo_trainer.py` (`loss_type="sapo"`,
    `sapo_temperature_pos=1.0`, `sapo_temperature_neg=1.05`).
  """
  fn = "sapo"
  _check_positive(fn, "tau_pos", tau_pos)
  _check_positive(fn, "tau_neg", tau_neg)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    r = ratio_BxT.astype(jnp.float32)
    tau = jnp.where(a > 0, tau_pos, tau_neg)
    s = jax.nn.sigmoid(tau * (r - 1.0))
    return _out(4.0 * s * (1.0 - s) * r, ratio_BxT), state

  return _stateless(update_fn)


def _clipped_log_ratio(log_r, a, eps_low, eps_high):
  """GMPO's per-token log-ratio clip, sign-selected by the advantage; and
  where it binds (no gradient there)."""
  pos, neg = a > 0, a < 0
  clipped = (pos & (log_r > eps_high)) | (neg & (log_r < -eps_low))
  log_r = jnp.where(pos, jnp.minimum(log_r, eps_high), log_r)
  log_r = jnp.where(neg, jnp.maximum(log_r, -eps_low), log_r)
  return jnp.where(pos | neg, log_r, 0.0), clipped


def gmpo(eps_low: float = 0.4, eps_high: float = 0.4) -> _Tx:
  """GMPO: the geometric mean of the token ratios, clipped in log space.

      l_t = min(log r_t, eps_high)    if A > 0
            max(log r_t, -eps_low)    if A < 0      (0 if A = 0)
      s_b = exp(sum_t mask * l_t / |y_b|)
      surrogate_b = s_b * A_b

  Gradient: `s_b * A_b * (1 / |y_b|) * sum_t [l_t not clipped] grad logp_t`,
  so `c_t = s_b * [not clipped_t]` aggregated with
  `sequence_mean_token_mean` (verl divides by all rows, `torch.mean`, and by
  `|y_b| + 1e-8`; rljax by the non-empty rows and `max(|y_b|, 1)`). The clip
  range is in log space: the paper's `(e^-0.4, e^0.4)` is `eps = 0.4`.

  References:
    Zhao et al., "Geometric-Mean Policy Optimization",
    https://arxiv.org/abs/2507.20673; callsys/GMPO
    `train_zero_math_gmpo.py`; verl `core_algos.py`
    (`compute_policy_loss_geo_mean`).
  """
  fn = "gmpo"
  _check_positive(fn, "eps_low", eps_low)
  _check_positive(fn, "eps_high", eps_high)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    log_r = jnp.log(ratio_BxT.astype(jnp.float32))
    l, clipped = _clipped_log_ratio(log_r, a, eps_low, eps_high)
    length = jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1)
    s = jnp.exp(jnp.sum(jnp.where(mask, l, 0.0), -1, keepdims=True) / length)
    return _out(jnp.where(clipped, 0.0, s), ratio_BxT), state

  return _stateless(update_fn)


def prefix_ratio(eps_low: float = 0.2, eps_high: float | None = None) -> _Tx:
  """PNPO: PPO clip on the prefix-normalised ratio.

      w_t = exp(sum_{s<=t} mask * log r_s / n_t),   n_t = sum_{s<=t} mask
      surrogate = sum_t mask * min(w_t * A, clip(w_t, 1-eps_low, 1+eps_high) * A)

  `w_t` depends on every earlier token, so `log r_s` receives gradient from
  every later unclipped `t`: with one advantage per sequence,

      c_s = sum_{t>=s} mask_t * [t not clipped] * w_t / n_t.

  Any aggregation then gives the surrogate's gradient under that
  aggregation. The advantage must be one per sequence (`[B]`, or `[B, T]`
  constant along `T`, as outcome rewards give): the transform reads the
  first column, so per-token advantages are not supported.

  References:
    PNPO, "Prefix-Normalized Policy Optimization" (2026); no reference
    code was available, so this follows the paper's stated ratio
    `w_t = exp(mean_{s<=t} log r_s)` inside PPO's clipped surrogate.
  """
  fn = "prefix_ratio"
  _check_positive(fn, "eps_low", eps_low)
  eps_high = eps_low if eps_high is None else eps_high
  _check_positive(fn, "eps_high", eps_high)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    a = _advantages(fn, advantages_BxT, ratio_BxT.shape)[:, :1]
    mask = _mask(fn, mask_BxT, ratio_BxT.shape)
    log_r = jnp.where(mask, jnp.log(ratio_BxT.astype(jnp.float32)), 0.0)
    n = jnp.maximum(jnp.cumsum(mask, -1), 1)
    w = jnp.exp(jnp.cumsum(log_r, -1) / n)
    clipped = (((a > 0) & (w > 1.0 + eps_high))
               | ((a < 0) & (w < 1.0 - eps_low)))
    g = jnp.where(mask & ~clipped, w / n, 0.0)
    c = jnp.flip(jnp.cumsum(jnp.flip(g, -1), -1), -1)
    return _out(c, ratio_BxT), state

  return _stateless(update_fn)


VESPO_IS_MODES = ("truncate", "mask")


def vespo(k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
          lambda_neg: float = 2.0, is_mode: str | None = "truncate",
          is_max: float | None = 3.0, is_min: float | None = None) -> _Tx:
  """VESPO: a Gamma-kernel weight of the sequence's full importance ratio.

      log W_b = clip(sum_t mask * log r_bt + sum_t mask * log rho_bt,
                     log 1e-8, 20)
      (k, lam) = (k_pos, lambda_pos) if A >= 0 else (k_neg, lambda_neg)
      phi_b = exp(lam + k * log W_b - lam * W_b)     (= W^k e^{lam (1 - W)},
                                                        phi(1) = 1)
      c_bt  = phi_b                                   (0 where not finite)

  `r = pi_theta / pi_old` is the input ratio (its log clamped at +-20, as
  TRL does here and `importance_ratio` does by default). `rho` is TRL's
  token-level sampler correction `pi_old / mu` of the same token, with
  `log rho = clip(log rho, log 1e-8, 20)` and

      is_mode="truncate": rho = clip(exp(old - sampler), is_min, is_max)
      is_mode="mask":     rho = exp(old - sampler), 0 outside
                          [is_min, is_max] (a zero gives log 1e-8)
      is_mode=None, or no sampler_logprobs_BxT: rho = 1 (W = pi_theta/pi_old)

  so `W` is the paper's `pi_theta(y) / mu(y)` with TRL's truncation. The
  surrogate is `-sg(phi) * A * logp` (no length normalisation; TRL
  aggregates with `token_mean` over the global token count, its
  `loss_type="vespo"` normaliser), and the sampler correction is inside
  `W`: chain no `truncated_is` / `masked_is` after it (TRL does not
  multiply VESPO's loss by its IS ratio). TRL only accepts the
  `token_truncate` / `token_mask` modes with VESPO (defaults
  `vllm_importance_sampling_clip_max=3.0`, `clip_min=None`). Padding
  tokens contribute 0 to both sums here; TRL sums `log rho` over padding
  too, where `rho = 1` unless `is_min > 1` or `is_max < 1`.

  Args:
    k_pos: power exponent for `A >= 0` (the paper's c1; TRL 2.0).
    lambda_pos: decay rate for `A >= 0` (c2; TRL 3.0; floored at 1e-4).
    k_neg: power exponent for `A < 0` (TRL 3.0).
    lambda_neg: decay rate for `A < 0` (TRL 2.0; floored at 1e-4).
    is_mode: "truncate", "mask" (`VESPO_IS_MODES`) or None.
    is_max: upper bound of `rho` (None: none).
    is_min: lower bound of `rho` (None: none).

  References:
    Shen, Zhao, Cheng, Huang, Yu, "VESPO: Variational Sequence-Level Soft
    Policy Optimization for Stable Off-Policy LLM Training",
    https://arxiv.org/abs/2602.10693 (code: FloyedShen/VESPO); TRL v1.9.0
    `trl/trainer/grpo_trainer.py` (`GRPOTrainer.get_gamma_weights`,
    `_compute_loss` with `loss_type="vespo"`; the IS ratio in
    `_generate_and_score_completions`).
  """
  fn = "vespo"
  if is_mode is not None and is_mode not in VESPO_IS_MODES:
    raise ValueError(f"{fn}: is_mode={is_mode!r}; accepted: "
                     f"{VESPO_IS_MODES} or None.")
  for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg),
                      ("is_max", is_max), ("is_min", is_min)):
    if value is not None:
      _check_positive(fn, name, value)
  if (isinstance(is_min, (int, float)) and isinstance(is_max, (int, float))
      and is_min > is_max):
    raise ValueError(f"{fn}: is_min={is_min!r} must be <= is_max={is_max!r}.")
  log_floor = math.log(1e-8)

  def update_fn(ratio_BxT, state, params=None, *, advantages_BxT=None,
                mask_BxT=None, old_logprobs_BxT=None,
                sampler_logprobs_BxT=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt(fn, "ratio_BxT", ratio_BxT)
    shape = ratio_BxT.shape
    a = _advantages(fn, advantages_BxT, shape)
    mask = _mask(fn, mask_BxT, shape)
    log_r = jnp.clip(jnp.log(ratio_BxT.astype(jnp.float32)), -20.0, 20.0)
    log_w = jnp.sum(jnp.where(mask, log_r, 0.0), -1, keepdims=True)
    if is_mode is not None and sampler_logprobs_BxT is not None:
      old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, shape)
      mu = _logprobs(fn, "sampler_logprobs_BxT", sampler_logprobs_BxT, shape)
      rho = jnp.exp(jnp.where(mask, old - mu, 0.0))
      if is_mode == "truncate":
        if is_min is not None:
          rho = jnp.maximum(rho, is_min)
        if is_max is not None:
          rho = jnp.minimum(rho, is_max)
      else:
        low = -jnp.inf if is_min is None else is_min
        high = jnp.inf if is_max is None else is_max
        rho = jnp.where((rho < low) | (rho > high), 0.0, rho)
      log_rho = jnp.clip(jnp.log(rho), log_floor, 20.0)
      log_w = log_w + jnp.sum(jnp.where(mask, log_rho, 0.0), -1,
                              keepdims=True)
    log_w = jnp.clip(log_w, log_floor, 20.0)
    nonneg = a >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return _out(phi, ratio_BxT), state

  return _stateless(update_fn)
