"""On-policy distillation: a per-token reverse-KL term against a teacher.

The student samples its own completions (on-policy); a teacher, a second
params tree evaluated in the trainer's forward pass, scores the same tokens;
each completion token's advantage gets the negative per-token reverse-KL
estimate

    A_t <- A_t - distill_coef * (log pi_old(y_t) - log pi_teacher(y_t))

before the coefficient chain (PPO clip, IS corrections) sees it. With one
on-policy update (``c_t = 1``) the loss gradient is then
``distill_coef * sum_t (log pi(y_t) - log pi_T(y_t)) grad log pi(y_t)``,
whose expectation over ``y ~ pi`` is ``distill_coef * grad KL(pi || pi_T)``
per position (the score-function gradient of the reverse KL with a
discount of 0: each token is credited only with its own KL term). The
reward's advantage, if any, is kept (``rl.distill_coef`` weighs the two);
pure distillation is an advantage chain that gives 0 (e.g. a constant
reward) plus this term.

The teacher is an HF checkpoint directory or an rljax run directory
(``teacher.path``; ``rljax.train.policy.load_teacher``) and must share the student's tokenizer
(its vocabulary is checked). Its logprobs are taken at ``teacher.temperature``
(1 by default: the teacher's own distribution).

References:
  Lu and Thinking Machines Lab, "On-Policy Distillation" (2025),
  https://thinkingmachines.ai/blog/on-policy-distillation; reference code:
  tinker-cookbook ``tinker_cookbook/distillation`` (advantages minus
  ``kl_penalty_coef * (sampler logprobs - teacher logprobs)``). Agarwal et
  al., "On-Policy Distillation of Language Models: Learning from
  Self-Generated Mistakes" (GKD), https://arxiv.org/abs/2306.13649 (TRL's
  ``GKDTrainer``; reverse KL is its ``beta=1``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp



def distill_advantages(advantages: jax.Array, old_logprobs_BxT: jax.Array,
                       teacher_logprobs_BxT: jax.Array, mask_BxT: jax.Array,
                       distill_coef: float) -> tuple[jax.Array, jax.Array]:
  """``A_t - distill_coef * (log pi_old - log pi_T)`` on the masked tokens.

  Args:
    advantages: ``[B]`` or ``[B, T]`` advantages (broadcast over time).
    old_logprobs_BxT: ``log pi_old`` of the sampled tokens (the policy that
      sampled them; gradient stopped).
    teacher_logprobs_BxT: ``log pi_T`` of the same tokens (gradient stopped).
    mask_BxT: bool, the completion tokens.
    distill_coef: weight of the reverse-KL term.

  Returns:
    ``(advantages_BxT, reverse_kl_BxT)``: fp32, the per-token estimate
    ``log pi_old - log pi_T`` is 0 outside the mask.
  """
  mask = mask_BxT.astype(jnp.bool_)
  a = advantages.astype(jnp.float32)
  a_BxT = a if a.ndim == 2 else jnp.broadcast_to(a[:, None], mask.shape)
  rkl = jnp.where(mask, jax.lax.stop_gradient(
      old_logprobs_BxT - teacher_logprobs_BxT), 0.0)
  return a_BxT - distill_coef * rkl, rkl


__all__ = ["distill_advantages"]
