"""DRO: the plain policy gradient plus a quadratic pull on the log-ratio.

verl's `dro` policy loss, per token,

    loss_t = -(logp_t * A_t - 0.5 * beta * (logp_t - old_logprobs_t)^2)

has the gradient `-(A_t - beta * (logp_t - old_logprobs_t)) * grad logp_t`.
The penalty does not scale with the advantage (it acts where `A = 0` too),
so it is not a coefficient `c_t * A_t`: DRO is the coefficient `c = 1`
(`dro()`) plus an extra per-token loss term (`dro_penalty(...)`),
aggregated like the policy loss and added to it.

References:
  Richemond et al., "Offline Regularised Reinforcement Learning for Large
  Language Models Alignment", https://arxiv.org/abs/2405.19107 (the method
  the name refers to; its value-function form is not this loss); verl 0.9.0
  (`release/v0.9.0`, PR #7245) `verl/trainer/ppo/core_algos.py`
  (`compute_policy_loss_dro`, `register_policy_loss("dro")`) and
  its documentation page (`dro.md` under verl's `docs/algo`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives._common import (
    _Tx, _check_bxt, _check_positive, _logprobs, _out, _stateless)


def dro() -> _Tx:
  """DRO's policy-gradient part: `c = 1` on every token.

  verl's `-logp * A` term: its gradient is `A * grad logp` whatever the
  ratio, so the coefficient ignores its input (plain REINFORCE's). Add
  `aggregate(dro_penalty(...))` to the loss for the quadratic pull (see the
  module docstring).
  Behaviour corrections chained after it (`truncated_is`, `masked_is`)
  multiply `c`, as verl's `rollout_is_weights` multiply its loss: then pass
  the chain's coefficient as `dro_penalty`'s `weights_BxT`, since verl
  weights the penalty too.
  """

  def update_fn(ratio_BxT, state, params=None, **extra_args):
    del params, extra_args
    ratio_BxT = _check_bxt("dro", "ratio_BxT", ratio_BxT)
    return _out(jnp.ones(ratio_BxT.shape, jnp.float32), ratio_BxT), state

  return _stateless(update_fn)


def dro_penalty(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array, *,
                beta: float, weights_BxT: jax.Array | None = None
                ) -> jax.Array:
  """DRO's per-token penalty `[B, T]`.

      penalty_t = 0.5 * beta * (logp_t - old_logprobs_t)^2 * weights_t

  (`weights` = 1 when not given; gradient stopped). Its gradient is
  `beta * (logp - old_logprobs) * weights * grad logp`. verl's log-ratio
  is not clamped, and neither is this one. Aggregate it like the policy
  loss (same mask, aggregation and normalisers) and add it; `rljax.train`
  would do so for `rl.objective="dro"`. verl requires `dro_beta > 0`
  (no default; its PR's example uses 0.05).

  Args:
    logprobs_BxT: `log pi_theta` of the sampled tokens; carries the gradient.
    old_logprobs_BxT: `log pi_old` of the same tokens.
    beta: penalty strength (> 0).
    weights_BxT: optional per-token weights, e.g. the coefficient of
      `chain(dro(), truncated_is(...))` (verl's `rollout_is_weights`).
  """
  fn = "dro_penalty"
  _check_positive(fn, "beta", beta)
  lp = _check_bxt(fn, "logprobs_BxT", logprobs_BxT).astype(jnp.float32)
  old = _logprobs(fn, "old_logprobs_BxT", old_logprobs_BxT, lp.shape)
  d = lp - old
  penalty = 0.5 * beta * d * d
  if weights_BxT is not None:
    penalty = penalty * _logprobs(fn, "weights_BxT", weights_BxT, lp.shape)
  return penalty
