"""The RL step's loss terms: each ``term(fwd, mb, cfg, norm) -> (loss, metrics)``.

``policy_gradient_term`` always runs; ``loss_terms(cfg)`` lists the others
the settings switch on. ``steps.make_rl_step`` sums them per microbatch
(docs/architecture.md, "One RL step").
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rljax import objectives as obj_lib
from rljax.train.step_inputs import (Forward, Normalizers, RLStepConfig,
                                     StepInputs)



def policy_gradient_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig,
                         norm: Normalizers):
  """``-sum_t c_t A_t log pi_t``, aggregated. The ratio statistics are
  token-weighted, so their sums over microbatches are minibatch means."""
  del mb
  coef = fwd.coefficient
  loss = obj_lib.policy_gradient_loss(coef, fwd.advantages, fwd.logprobs,
                                      fwd.mask, cfg.aggregation,
                                      **norm._asdict())
  weight = jnp.sum(fwd.mask) / jnp.maximum(norm.num_tokens, 1.0)
  rm = obj_lib.ratio_metrics(fwd.ratio, fwd.mask,
                             advantages_BxT=fwd.advantages)
  metrics = {"pg_loss": loss, "ess/token": fwd.ess * weight}
  for k in ("ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high"):
    metrics[k] = rm[k] * weight
  metrics["coef_mean"] = obj_lib.coefficient_metrics(
      coef, fwd.mask)["coef_mean"] * weight
  if fwd.reverse_kl is not None:
    metrics["distill/reverse_kl"] = jnp.sum(fwd.reverse_kl) / jnp.maximum(
        norm.num_tokens, 1.0)
  if cfg.entropy_metric:
    metrics["entropy"] = obj_lib.aggregate_loss(
        jax.lax.stop_gradient(fwd.entropy), fwd.mask, "token_mean",
        num_tokens=norm.num_tokens)
  return loss, metrics


def entropy_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig,
                 norm: Normalizers):
  """The entropy bonus, ``-entropy_coef * aggregate(H)``."""
  del mb
  return cfg.entropy_coef * obj_lib.entropy_loss(
      fwd.entropy, fwd.mask, cfg.aggregation, **norm._asdict()), {}


def kl_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig, norm: Normalizers):
  """``kl_coef * aggregate(KL(pi_theta || pi_ref))`` (``cfg.kl_estimator``;
  the coefficient is an adaptive controller's where the batch carries it:
  ``StepInputs.kl_coef_N``)."""
  kl = obj_lib.aggregate_loss(
      obj_lib.kl_penalty(fwd.logprobs, mb.ref_logprobs_NxT, cfg.kl_estimator,
                         old_logprobs_BxT=fwd.old_logprobs),
      fwd.mask, cfg.aggregation, **norm._asdict())
  if not cfg.kl_coef and mb.kl_coef_N is None:  # rl.log_kl: reported only
    return jnp.zeros((), kl.dtype), {"kl": jax.lax.stop_gradient(kl)}
  if mb.kl_coef_N is None:
    return cfg.kl_coef * kl, {"kl": kl}
  coef = jax.lax.stop_gradient(jnp.mean(mb.kl_coef_N))  # one value, N copies
  return coef * kl, {"kl": kl, "kl_coef": coef}


def ess_kl_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig,
                norm: Normalizers):
  """FeynRL's ``(1 - ESS)``-weighted pull toward ``mu``."""
  del mb
  pull = obj_lib.aggregate_loss(
      obj_lib.ess_kl_penalty(fwd.logprobs, fwd.sampler_logprobs, fwd.ess),
      fwd.mask, cfg.aggregation, **norm._asdict())
  return cfg.ess_kl_coef * pull, {"ess_kl": pull}


def kl_cov_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig,
                norm: Normalizers):
  """KL-Cov's penalty on the highest-covariance tokens."""
  del mb
  penalty = obj_lib.aggregate_loss(
      obj_lib.kl_cov_penalty(fwd.logprobs, fwd.old_logprobs, fwd.advantages,
                             fwd.mask, kl_ratio=cfg.kl_cov_ratio,
                             kl_coef=cfg.kl_cov_coef),
      fwd.mask, cfg.aggregation, **norm._asdict())
  return penalty, {"kl_cov_penalty": penalty}


def dro_term(fwd: Forward, mb: StepInputs, cfg: RLStepConfig,
             norm: Normalizers):
  """DRO's quadratic pull ``0.5 beta (log pi - log pi_old)^2``, weighted by
  the coefficient (the behaviour correction's weights, as verl's)."""
  del mb
  penalty = obj_lib.aggregate_loss(
      obj_lib.dro_penalty(fwd.logprobs, fwd.old_logprobs, beta=cfg.dro_beta,
                          weights_BxT=fwd.coefficient),
      fwd.mask, cfg.aggregation, **norm._asdict())
  return penalty, {"dro_penalty": penalty}


LossTerm = Callable[[Forward, StepInputs, RLStepConfig, Normalizers],
                    tuple[jax.Array, dict[str, jax.Array]]]


def loss_terms(cfg: RLStepConfig) -> tuple[LossTerm, ...]:
  """The terms besides the policy gradient that ``cfg`` switches on."""
  return tuple(term for term, on in (
      (entropy_term, cfg.entropy_coef), (kl_term, cfg.kl_coef or cfg.log_kl),
      (ess_kl_term, cfg.ess_kl_coef), (kl_cov_term, cfg.kl_cov_coef),
      (dro_term, cfg.dro_beta)) if on)
