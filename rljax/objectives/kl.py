"""Per-token estimators of KL(pi || pi_ref) from sampled-token logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives._common import _check_bxt, _logprobs


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
