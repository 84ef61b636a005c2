"""Generalised advantage estimation (GAE) over completion tokens.

The critic path of PPO (``rl.advantage="gae"``): a value model scores every
completion token, the sequence's scalar reward arrives at its last token, and
GAE turns rewards and values into token-level advantages ``[N, T]`` that
flow into the coefficient transforms (``advantages_BxT``) like any other
advantage. Arrays in, arrays out: the values come from ``rljax.train.critic``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.advantages._common import _last_token_rewards


def _check(rewards_N, values_NxT, mask_NxT):
  if rewards_N.ndim not in (1, 2):
    raise ValueError(f"gae_advantages: rewards_N must have shape [N] or "
                     f"[N, T]; got shape {rewards_N.shape}.")
  if rewards_N.ndim == 2 and rewards_N.shape != values_NxT.shape:
    raise ValueError(f"gae_advantages: per-token rewards {rewards_N.shape} "
                     f"must have values_NxT's shape {values_NxT.shape}.")
  if values_NxT.ndim != 2 or values_NxT.shape[0] != rewards_N.shape[0]:
    raise ValueError(f"gae_advantages: values_NxT must have shape [N="
                     f"{rewards_N.shape[0]}, T]; got {values_NxT.shape}.")
  if mask_NxT.shape != values_NxT.shape:
    raise ValueError(f"gae_advantages: mask_NxT shape {mask_NxT.shape} must "
                     f"equal values_NxT's {values_NxT.shape}.")


def terminal_rewards(rewards_N: jax.Array, mask_NxT: jax.Array) -> jax.Array:
  """``[N, T]`` rewards: ``rewards_N[i]`` at row ``i``'s last masked token, 0 elsewhere."""
  return _last_token_rewards(rewards_N, mask_NxT)


def gae_advantages(rewards_N: jax.Array, values_NxT: jax.Array,
                   mask_NxT: jax.Array, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE advantages and returns, the reward at the last token.

  With ``r_t`` the terminal reward (``terminal_rewards``) and ``t'`` the next
  masked token after ``t`` (``V_{t'} = 0`` past the last one):

      delta_t = r_t + gamma * V_{t'} - V_t
      A_t     = delta_t + gamma * lam * A_{t'}
      R_t     = A_t + V_t              (the critic's regression target)

  computed by one backward ``lax.scan`` over time. Unmasked positions
  (prompt, padding, holes) are skipped: they neither read nor pass on a
  value, and their advantage and return are 0. This is verl's
  ``compute_gae_advantage_return`` (which skips padded tokens the same way)
  without its whitening (``masked_whiten``). No gradient flows (values are
  stopped).

  Per-token rewards (verl's ``token_level_rewards``, e.g. process rewards or
  a per-token KL penalty) may be passed instead of ``rewards_N``: an
  ``[N, T]`` array is used as ``r_t`` directly (0 outside ``mask_NxT``).

  Args:
    rewards_N: ``[N]`` scalar reward of each sequence (on its last masked
      token), or ``[N, T]`` per-token rewards.
    values_NxT: ``[N, T]`` fp32 ``V_t``: the value of the state before token
      ``t`` is emitted (``rljax.train.critic.values``).
    mask_NxT: ``[N, T]`` bool, the completion tokens.
    gamma: discount (verl's default 1.0).
    lam: GAE lambda (verl's default 1.0: Monte Carlo return minus value).

  Returns:
    ``(advantages_NxT, returns_NxT)`` in fp32, 0 outside ``mask_NxT``.

  References:
    Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", https://arxiv.org/abs/1506.02438. Ouyang et al.,
    "Training language models to follow instructions with human feedback",
    https://arxiv.org/abs/2203.02155 (PPO with a value model on tokens).
    Reference code: verl ``trainer/ppo/core_algos.py``
    (``compute_gae_advantage_return``).
  """
  _check(rewards_N, values_NxT, mask_NxT)
  mask = mask_NxT.astype(jnp.bool_)
  values = jax.lax.stop_gradient(values_NxT).astype(jnp.float32)
  if rewards_N.ndim == 1:
    rewards = terminal_rewards(rewards_N, mask)
  else:
    rewards = jnp.where(mask, rewards_N.astype(jnp.float32), 0.0)
  rewards = jax.lax.stop_gradient(rewards)

  def step(carry, x):
    next_value, next_adv = carry
    r, v, m = x
    adv = r + gamma * next_value - v + gamma * lam * next_adv
    carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
    return carry, jnp.where(m, adv, 0.0)

  zeros = jnp.zeros(values.shape[:1], jnp.float32)
  _, adv_TxN = jax.lax.scan(step, (zeros, zeros),
                            (rewards.T, values.T, mask.T), reverse=True)
  advantages = adv_TxN.T
  return advantages, jnp.where(mask, advantages + values, 0.0)


def whiten_advantages(advantages_NxT: jax.Array, mask_NxT: jax.Array,
                      eps: float = 1e-8) -> jax.Array:
  """``(A - mean) / sqrt(var + eps)`` over the masked tokens, 0 elsewhere.

  The variance is unbiased (``n / (n - 1)``), as verl's ``masked_whiten``
  (``utils/torch_functional.py``), which its GAE applies by default.
  """
  mask = mask_NxT.astype(jnp.bool_)
  a = advantages_NxT.astype(jnp.float32)
  n = jnp.sum(mask, dtype=jnp.float32)
  mean = jnp.sum(jnp.where(mask, a, 0.0)) / jnp.maximum(n, 1.0)
  var = jnp.sum(jnp.where(mask, (a - mean) ** 2, 0.0)) / jnp.maximum(n - 1.0,
                                                                    1.0)
  return jnp.where(mask, (a - mean) * jax.lax.rsqrt(var + eps), 0.0)
