"""Offline preference losses: the DPO family, on sequence log-probabilities.

Every loss here reads, per pair ``b``, the policy's summed log-probability
of the chosen and the rejected completion (``pi_c``, ``pi_r``), the
reference model's (``ref_c``, ``ref_r``) where the method has one, and the
completions' token counts (``n_c``, ``n_r``). With the log-ratios
``lr_c = pi_c - ref_c``, ``lr_r = pi_r - ref_r`` and ``h = lr_c - lr_r``:

* **DPO** (Rafailov et al. 2023, "Direct Preference Optimization: Your
  Language Model is Secretly a Reward Model", https://arxiv.org/abs/2305.18290)
  with conservative label smoothing ``eps`` (Mitchell 2023, "A note on DPO
  with noisy preferences", cDPO; TRL's ``loss_type="sigmoid"``)::

      loss_b = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

* **Robust DPO** (Chowdhury et al. 2024, "Provably Robust DPO: Aligning
  Language Models with Noisy Feedback", https://arxiv.org/abs/2403.00409;
  TRL's ``"robust"``), unbiased under label flips of rate ``eps < 1/2``::

      loss_b = (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h))
               / (1 - 2 eps)

* **IPO** (Azar et al. 2023, "A General Theoretical Paradigm to Understand
  Learning from Human Preferences", https://arxiv.org/abs/2310.12036, eq.
  17), on length-normalised log-probabilities as TRL's ``"ipo"``::

      loss_b = (h' - 1 / (2 beta))^2,   h' = h with each logp / its tokens

* **SimPO** (Meng et al. 2024, "SimPO: Simple Preference Optimization with
  a Reference-Free Reward", https://arxiv.org/abs/2405.14734), no
  reference; ``a_c = pi_c / n_c``, ``a_r = pi_r / n_r``, margin ``gamma``
  (TRL's ``CPOTrainer(loss_type="simpo")``)::

      z = beta (a_c - a_r) - gamma
      loss_b = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)

* **ORPO** (Hong et al. 2024, "ORPO: Monolithic Preference Optimization
  without Reference Model", https://arxiv.org/abs/2403.07691), no
  reference; the chosen side's token-mean NLL plus ``lambda`` (``beta``
  here, as TRL's ``ORPOConfig.beta``) times the log-odds-ratio term, on
  length-normalised log-probabilities::

      log_odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))
      loss = NLL_chosen - beta mean_b log sigmoid(log_odds)

* **KTO** (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect
  Theoretic Optimization", https://arxiv.org/abs/2402.01306; TRL's
  ``KTOTrainer``), unpaired: each completion is desirable or undesirable,
  and the reference point is the batch's KL estimate ``z0 = max(0,
  mean_j (pi_kl_j - ref_kl_j))`` from completions paired with another
  example's prompt, without gradient::

      desirable:   w_d (1 - sigmoid(beta (lr - z0)))
      undesirable: w_u (1 - sigmoid(beta (z0 - lr)))

``nll_coef`` adds the chosen side's token-mean NLL to DPO, IPO and SimPO
(RPO: Pang et al. 2024, "Iterative Reasoning Preference Optimization",
https://arxiv.org/abs/2404.19733; CPO's ``cpo_alpha``). Every function
returns ``(loss, metrics)`` with the implicit rewards ``beta * lr`` (or
``beta * a`` without a reference), their margin and the fraction of pairs
the policy ranks right. ``rljax/train/preference.py`` trains them; their
table is ``PREFERENCE_LOSSES`` there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SequenceLogprobs(NamedTuple):
  """Per-completion figures of one batch, each ``[P]`` float32.

  Attributes:
    policy_chosen, policy_rejected: summed log-probabilities under the
      policy (with gradient).
    ref_chosen, ref_rejected: the reference model's (zeros without one).
    chosen_tokens, rejected_tokens: each completion's trained tokens (the
      chosen side's token-mean NLL over the batch is
      ``-sum(policy_chosen) / sum(chosen_tokens)``).
  """

  policy_chosen: jax.Array
  policy_rejected: jax.Array
  ref_chosen: jax.Array
  ref_rejected: jax.Array
  chosen_tokens: jax.Array
  rejected_tokens: jax.Array


def _smoothed(z: jax.Array, eps: float) -> jax.Array:
  return (-(1.0 - eps) * jax.nn.log_sigmoid(z)
          - eps * jax.nn.log_sigmoid(-z))


def _nll(s: SequenceLogprobs) -> jax.Array:
  """The chosen side's token-mean NLL over the batch (TRL's cross-entropy
  over every chosen token)."""
  return -jnp.sum(s.policy_chosen) / jnp.maximum(jnp.sum(s.chosen_tokens), 1.0)


def _rewards(chosen: jax.Array, rejected: jax.Array) -> dict[str, jax.Array]:
  chosen, rejected = (jax.lax.stop_gradient(chosen),
                      jax.lax.stop_gradient(rejected))
  return {"rewards/chosen": jnp.mean(chosen),
          "rewards/rejected": jnp.mean(rejected),
          "rewards/margin": jnp.mean(chosen - rejected),
          "rewards/accuracy": jnp.mean((chosen > rejected).astype(
              jnp.float32))}


def _average(s: SequenceLogprobs) -> tuple[jax.Array, jax.Array]:
  return (s.policy_chosen / jnp.maximum(s.chosen_tokens, 1.0),
          s.policy_rejected / jnp.maximum(s.rejected_tokens, 1.0))


def dpo_loss(s: SequenceLogprobs, *, beta: float, label_smoothing: float = 0.0,
             nll_coef: float = 0.0):
  """DPO with conservative label smoothing (cDPO): the module docstring."""
  lr_c, lr_r = s.policy_chosen - s.ref_chosen, s.policy_rejected - s.ref_rejected
  loss = jnp.mean(_smoothed(beta * (lr_c - lr_r), label_smoothing))
  if nll_coef:
    loss = loss + nll_coef * _nll(s)
  return loss, _rewards(beta * lr_c, beta * lr_r)


def robust_dpo_loss(s: SequenceLogprobs, *, beta: float,
                    label_smoothing: float = 0.0, nll_coef: float = 0.0):
  """Robust DPO (Chowdhury et al. 2024): the module docstring."""
  lr_c, lr_r = s.policy_chosen - s.ref_chosen, s.policy_rejected - s.ref_rejected
  z = beta * (lr_c - lr_r)
  eps = label_smoothing
  loss = jnp.mean((-(1.0 - eps) * jax.nn.log_sigmoid(z)
                   + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * eps))
  if nll_coef:
    loss = loss + nll_coef * _nll(s)
  return loss, _rewards(beta * lr_c, beta * lr_r)


def ipo_loss(s: SequenceLogprobs, *, beta: float, nll_coef: float = 0.0,
             **unused):
  """IPO (Azar et al. 2023) on length-normalised log-ratios."""
  del unused
  n_c = jnp.maximum(s.chosen_tokens, 1.0)
  n_r = jnp.maximum(s.rejected_tokens, 1.0)
  lr_c = (s.policy_chosen - s.ref_chosen) / n_c
  lr_r = (s.policy_rejected - s.ref_rejected) / n_r
  loss = jnp.mean((lr_c - lr_r - 1.0 / (2.0 * beta)) ** 2)
  if nll_coef:
    loss = loss + nll_coef * _nll(s)
  return loss, _rewards(beta * lr_c, beta * lr_r)


def simpo_loss(s: SequenceLogprobs, *, beta: float, gamma: float = 0.5,
               label_smoothing: float = 0.0, nll_coef: float = 0.0):
  """SimPO (Meng et al. 2024): reference-free, length-normalised, with a
  target margin ``gamma``."""
  a_c, a_r = _average(s)
  loss = jnp.mean(_smoothed(beta * (a_c - a_r) - gamma, label_smoothing))
  if nll_coef:
    loss = loss + nll_coef * _nll(s)
  return loss, _rewards(beta * a_c, beta * a_r)


def orpo_loss(s: SequenceLogprobs, *, beta: float, **unused):
  """ORPO (Hong et al. 2024): NLL of the chosen side minus ``beta`` times
  the log-sigmoid of the log odds ratio."""
  del unused
  a_c, a_r = _average(s)
  # log(1 - e^a) for a < 0, stably (a -> 0 would be log 0: clamped).
  log1m = lambda a: jnp.log(-jnp.expm1(jnp.minimum(a, -1e-6)))  # noqa: E731
  log_odds = (a_c - a_r) - (log1m(a_c) - log1m(a_r))
  ratio = jax.nn.log_sigmoid(log_odds)
  nll = _nll(s)
  loss = nll - beta * jnp.mean(ratio)
  metrics = _rewards(beta * a_c, beta * a_r)
  metrics.update({"orpo/log_odds": jnp.mean(jax.lax.stop_gradient(log_odds)),
                  "orpo/nll": jax.lax.stop_gradient(nll)})
  return loss, metrics


def kto_loss(policy_B: jax.Array, ref_B: jax.Array, desirable_B: jax.Array,
             policy_kl_B: jax.Array, ref_kl_B: jax.Array, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
  """KTO (Ethayarajh et al. 2024): ``policy_B``, ``ref_B`` the summed
  log-probabilities of ``B`` completions, ``desirable_B`` their labels,
  ``policy_kl_B`` / ``ref_kl_B`` those of the mismatched completions of the
  KL estimate. The loss is the mean over the batch of the weighted
  per-completion losses (TRL's ``losses.nanmean()``)."""
  z0 = jax.lax.stop_gradient(jnp.maximum(jnp.mean(policy_kl_B - ref_kl_B),
                                         0.0))
  lr = policy_B - ref_B
  desirable = desirable_B.astype(jnp.bool_)
  losses = jnp.where(
      desirable, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (lr - z0))),
      undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - lr))))
  rewards = jax.lax.stop_gradient(beta * lr)
  d = desirable.astype(jnp.float32)
  nd, nu = jnp.maximum(jnp.sum(d), 1.0), jnp.maximum(jnp.sum(1.0 - d), 1.0)
  chosen = jnp.sum(rewards * d) / nd
  rejected = jnp.sum(rewards * (1.0 - d)) / nu
  return jnp.mean(losses), {
      "rewards/chosen": chosen, "rewards/rejected": rejected,
      "rewards/margin": chosen - rejected, "kto/kl": z0}


__all__ = ["SequenceLogprobs", "dpo_loss", "ipo_loss", "kto_loss",
           "orpo_loss", "robust_dpo_loss", "simpo_loss"]
