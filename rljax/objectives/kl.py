"""Per-token estimators of KL(pi || pi_ref) from sampled-token logprobs.

`kl_penalty(logprobs, ref, estimator)` selects one by name (`KL_ESTIMATORS`);
the train step adds `kl_coef * aggregate(kl_penalty(...))` to the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives._common import _check_bxt, _logprobs, _sg

# "k3" is rljax's default (GRPO's term); "low_var_kl" is verl's k3 (value
# clamped to +-10); "k1+"/"k3+" are verl's straight-through variants;
# "k3_is" is TRL's `use_bias_correction_kl=True`.
KL_ESTIMATORS = ("k3", "k1", "k2", "abs", "low_var_kl", "k1+", "k3+", "k3_is")


def _log_ratio(fn, logprobs_BxT, ref_logprobs_BxT):
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT).astype(jnp.float32)
  return lp - _logprobs(fn, "ref_logprobs_BxT", ref_logprobs_BxT, lp.shape)


def kl_k1(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
  """k1 = logprobs - ref_logprobs, per token `[B, T]`.

  Unbiased for KL(pi || pi_ref) under samples of pi, but its expected
  gradient as a loss is 0: use it as a reward penalty, not a loss (or as
  `kl_straight_through`'s value).

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


def kl_abs(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array) -> jax.Array:
  """|logprobs - ref_logprobs| per token (verl's `kl_penalty="abs"`,
  `core_algos.kl_penalty_forward`). A distance, not an unbiased KL. Its
  gradient is `sign(d)`, 0 at `d = 0` as torch's `abs` (`jnp.abs` gives 1).
  """
  d = _log_ratio("kl_abs", logprobs_BxT, ref_logprobs_BxT)
  return d * _sg(jnp.sign(d))


def kl_k3(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array, *,
          max_log_ratio: float = 20.0,
          max_value: float | None = None) -> jax.Array:
  """k3 = exp(d) - d - 1 with d = ref - logprobs (GRPO's KL term).

  Unbiased for KL(pi || pi_ref) and >= 0; as a loss its expected gradient is
  that of KL(pi_ref || pi). `d` is clipped to `+-max_log_ratio` in the
  exponent only (`- d` is not clipped, so the gradient never vanishes).
  With `max_value`, the value is clipped to `[-max_value, max_value]` and its
  gradient is 0 where the clip binds.

  verl's `low_var_kl` (`core_algos.kl_penalty_forward`) clips `d` to +-20
  in both places and the value to +-10 (`max_value=10`), so its gradient is
  0 wherever `|d| > 20` or the value exceeds 10; `estimator="low_var_kl"`
  of `kl_penalty` reproduces it exactly. TRL computes k3 unclipped.

  Reference: Schulman (2020), see `kl_k1`.
  """
  d = -_log_ratio("kl_k3", logprobs_BxT, ref_logprobs_BxT)
  k3 = jnp.exp(jnp.clip(d, -max_log_ratio, max_log_ratio)) - d - 1.0
  return k3 if max_value is None else jnp.clip(k3, -max_value, max_value)


def _verl_low_var_kl(logprobs_BxT, ref_logprobs_BxT):
  d = jnp.clip(-_log_ratio("kl_penalty", logprobs_BxT, ref_logprobs_BxT),
               -20.0, 20.0)
  return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def kl_straight_through(value_BxT: jax.Array, logprobs_BxT: jax.Array,
                        ref_logprobs_BxT: jax.Array) -> jax.Array:
  """The value of `value_BxT` with the gradient of k2 (verl's `"k1+"`/`"k3+"`).

      out = k2 - sg(k2) + sg(value)

  As a loss its expected gradient is that of KL(pi || pi_ref) (k2's),
  while the logged value is the unbiased estimate. verl's
  `core_algos.kl_penalty` documents this trick for a `"+"` suffix (at
  commit b178a3c its forward call receives the suffixed name and fails on
  it; what is built here is the documented intent).
  """
  k2 = kl_k2(logprobs_BxT, ref_logprobs_BxT)
  return k2 - _sg(k2) + _sg(jnp.asarray(value_BxT, jnp.float32))


def kl_k3_bias_corrected(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
                         old_logprobs_BxT: jax.Array, *,
                         max_log_ratio: float = 20.0) -> jax.Array:
  """TRL's bias-corrected KL: `exp(logprobs - old_logprobs) * k3`.

  The samples come from `pi_old`, so k3 is reweighted by the importance
  ratio to estimate KL(pi || pi_ref); the ratio carries the gradient (TRL
  multiplies by `coef_1`, which is not detached). TRL's
  `use_bias_correction_kl` defaults to False (TRL 1.x `grpo_config.py`);
  the DeepSeek-V3.2 report motivates it.

  References:
    DeepSeek-AI, "DeepSeek-V3.2" (2025), https://arxiv.org/abs/2512.02556;
    huggingface/trl `trainer/grpo_trainer.py` (`use_bias_correction_kl`).
  """
  lp = _check_bxt("kl_k3_bias_corrected", "logprobs_BxT", logprobs_BxT)
  old = _logprobs("kl_k3_bias_corrected", "old_logprobs_BxT",
                  old_logprobs_BxT, lp.shape)
  ratio = jnp.exp(jnp.clip(lp.astype(jnp.float32) - old, -max_log_ratio,
                           max_log_ratio))
  return ratio * kl_k3(lp, ref_logprobs_BxT, max_log_ratio=max_log_ratio)


def kl_penalty(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
               estimator: str = "k3", *,
               old_logprobs_BxT: jax.Array | None = None) -> jax.Array:
  """The per-token KL estimate `[B, T]` named by `estimator`.

  `KL_ESTIMATORS`: `k3` (rljax's default: `kl_k3`), `k1`, `k2`, `abs`,
  `low_var_kl` (verl: k3 with `d` clipped to +-20 and the value to +-10),
  `k1+` and `k3+` (value k1 / verl's k3, gradient k2's:
  `kl_straight_through`), `k3_is` (TRL's bias-corrected k3; needs
  `old_logprobs_BxT`). Gradients flow through `logprobs_BxT` only.

  References:
    Schulman (2020), http://joschu.net/blog/kl-approx.html; verl
    `trainer/ppo/core_algos.py` (`kl_penalty`, `kl_penalty_forward`); TRL
    `trainer/grpo_trainer.py` (`_compute_loss`).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_penalty: estimator={estimator!r}; accepted: "
                     f"{KL_ESTIMATORS}.")
  lp, ref = logprobs_BxT, ref_logprobs_BxT
  if estimator == "k3":
    return kl_k3(lp, ref)
  if estimator == "k1":
    return kl_k1(lp, ref)
  if estimator == "k2":
    return kl_k2(lp, ref)
  if estimator == "abs":
    return kl_abs(lp, ref)
  if estimator == "low_var_kl":
    return _verl_low_var_kl(lp, ref)
  if estimator == "k1+":
    return kl_straight_through(kl_k1(lp, ref), lp, ref)
  if estimator == "k3+":
    return kl_straight_through(_verl_low_var_kl(lp, ref), lp, ref)
  if old_logprobs_BxT is None:
    raise ValueError("kl_penalty: estimator='k3_is' needs old_logprobs_BxT "
                     "(log pi_old of the sampled tokens).")
  return kl_k3_bias_corrected(lp, ref, old_logprobs_BxT)
