"""The critic of PPO with a value model: a separate value model, its clipped
value loss and its optimizer.

Which model. The critic is a separate model: a copy of the policy's decoder
(initialised from the policy's params after the SFT warm-up, as verl and
OpenRLHF initialise the critic from the actor's checkpoint) with a linear
value head ``[D] -> 1`` on its final hidden states (zero-initialised, so
``V = 0`` at the start). A head on the policy's own decoder would be
cheaper, but its loss would then move the policy's weights through the
shared trunk (needing a value-loss weight to balance the two, as in
single-network PPO), and the policy's params tree, which the sampler,
checkpoints, ``load_policy`` and HF export all read, would change. A separate
tree keeps every one of them as it is and costs one more forward and
backward pass of the model per microbatch.

Where it runs. ``rl_step`` (``rljax.train.steps``) evaluates the values
``V_old`` of the batch with the critic's params at the start of the step,
turns the rewards into token-level GAE advantages and returns
(``rljax.advantages.gae_advantages``), and then, in the same jitted step and
the same microbatch loop as the policy, minimises the clipped value loss
below and applies the critic's own optimizer (``CriticState``).

    V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

aggregated like the policy loss (``rl.aggregation``, the minibatch's
normalisers). References: Schulman et al., "Proximal Policy Optimization
Algorithms", https://arxiv.org/abs/1707.06347 (the clipped value loss is in
the OpenAI baselines ``ppo2`` code that accompanied it); verl
``trainer/ppo/core_algos.py`` ``compute_value_loss`` (``cliprange_value``,
default 0.5) and ``workers/critic/dp_critic.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import models
from rljax.models import lora as lora_lib
from rljax.models import packing as packing_lib
from rljax import objectives as obj_lib


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """Static settings of the critic (``critic.*`` in a config).

  Attributes:
    gamma: GAE discount.
    lam: GAE lambda.
    value_clip: ``cliprange_value``: the new value stays within this of the
      old one in the loss (None: no clipping).
    whiten: whiten the advantages over the batch's completion tokens (verl's
      GAE does).
  """

  gamma: float = 1.0
  lam: float = 1.0
  value_clip: float | None = 0.5
  whiten: bool = True


class CriticState(NamedTuple):
  """The critic's part of ``TrainState.critic``.

  Attributes:
    params: ``{"decoder": <the policy's params tree>, "head": {"kernel": [D],
      "bias": []}}`` (with LoRA the decoder holds adapters only:
      ``with_base``).
    opt_state: the critic optimizer's state.
  """

  params: Any
  opt_state: Any


def init_params(policy_params: Any, model_config: models.ModelConfig
                ) -> dict[str, Any]:
  """Critic params: a copy of the policy's decoder and a zero value head.

  The decoder leaves are copied (``jnp.copy``), so the train state never
  holds one buffer twice (it is donated to ``rl_step``). Call under
  ``jax.jit`` to keep the leaves' shardings. With LoRA (``model_config.lora``)
  the decoder is a copy of the policy's adapters alone: the critic shares
  the policy's frozen base (``with_base``) and trains its own adapters.
  """
  d = model_config.d_model
  if model_config.lora is not None:
    policy_params = lora_lib.adapters_of(policy_params)
  return {"decoder": jax.tree.map(jnp.copy, policy_params),
          "head": {"kernel": jnp.zeros((d,), jnp.float32),
                   "bias": jnp.zeros((), jnp.float32)}}


def with_base(params: Any, base: Any) -> dict[str, Any]:
  """Critic params whose decoder holds adapters only, completed with the
  policy's frozen ``base`` (a LoRA run; ``base`` None: as they are)."""
  if base is None:
    return params
  return {"decoder": lora_lib.merge(base, params["decoder"]),
          "head": params["head"]}


def make_optimizer(learning_rate: float, max_grad_norm: float | None = 1.0,
                   ) -> optax.GradientTransformation:
  """Adam on the critic (verl's critic optimizer is AdamW, lr 1e-5), clipped
  by global norm first when ``max_grad_norm`` is set."""
  links = ([optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else [])
  return optax.chain(*links, optax.adam(learning_rate))


def values(params: Any, model_config: models.ModelConfig, tokens_BxT: jax.Array,
           input_mask_BxT: jax.Array,
           packing: packing_lib.Packing | None = None) -> jax.Array:
  """``V_t`` aligned like ``sequence_logprobs``: ``[B, T]`` fp32.

  Entry ``t`` is the value of the state before token ``t`` is emitted: the
  head on the hidden state at ``t - 1`` (which also gives the logits of
  token ``t``). Column 0 is 0, and so is every column where token ``t`` or
  ``t - 1`` is padding (as ``sequence_logprobs``). Gradients flow into
  ``params``. With ``packing`` the decoder runs padding-free
  (``models/packing.py``; the same values).
  """
  t = tokens_BxT.shape[1]
  if packing is None:
    positions = models.positions_from_mask(input_mask_BxT)
    hidden, _ = models.Decoder(model_config).apply(
        {"params": params["decoder"]}, tokens_BxT, positions,
        input_mask_BxT=input_mask_BxT)
    hidden = hidden[:, :-1]
  else:
    hidden = packing_lib.hidden_states(params["decoder"], model_config,
                                       tokens_BxT, packing, (0, t - 1))
  head = params["head"]
  v = jnp.einsum("btd,d->bt", hidden.astype(jnp.float32),
                 head["kernel"].astype(jnp.float32)) + head["bias"]
  mask = input_mask_BxT.astype(jnp.bool_)
  v = jnp.where(mask[:, 1:] & mask[:, :-1], v, 0.0)
  return jnp.concatenate([jnp.zeros_like(v[:, :1]), v], 1)


def clipped_value_loss(values_BxT: jax.Array, old_values_BxT: jax.Array,
                       returns_BxT: jax.Array, value_clip: float | None
                       ) -> tuple[jax.Array, jax.Array]:
  """Per-token clipped value loss and where the clipped branch is larger.

  ``loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old +
  clip(V - V_old, -value_clip, value_clip)`` (module docstring); without
  ``value_clip``, ``0.5 * (V - R)^2``. Gradients flow into ``values_BxT``
  only. Returns ``(loss_BxT, clipped_BxT)``, ``clipped`` as fp32 0/1
  (verl's ``vf_clipfrac`` indicator).
  """
  old = jax.lax.stop_gradient(old_values_BxT)
  ret = jax.lax.stop_gradient(returns_BxT)
  unclipped = (values_BxT - ret) ** 2
  if value_clip is None:
    return 0.5 * unclipped, jnp.zeros_like(unclipped)
  v_clip = old + jnp.clip(values_BxT - old, -value_clip, value_clip)
  clipped = (v_clip - ret) ** 2
  return (0.5 * jnp.maximum(unclipped, clipped),
          (clipped > unclipped).astype(jnp.float32))


def value_loss(params: Any, model_config: models.ModelConfig,
               tokens_BxL: jax.Array, input_mask_BxL: jax.Array,
               mask_BxT: jax.Array, old_values_BxT: jax.Array,
               returns_BxT: jax.Array, config: CriticConfig,
               aggregation: str, normalizers: dict[str, Any],
               packing: packing_lib.Packing | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The critic's loss on one microbatch and its metrics.

  ``mask_BxT``, ``old_values_BxT`` and ``returns_BxT`` cover the last ``T``
  columns of the rows (``T <= L``). The loss uses the minibatch's
  ``normalizers``, so summing microbatches gives the minibatch loss; the
  metrics are token-weighted the same way (sums over microbatches are
  means).
  """
  mask = mask_BxT
  v = values(params, model_config, tokens_BxL, input_mask_BxL, packing)
  v = v[:, v.shape[1] - mask.shape[1]:]  # the columns the loss mask covers
  loss_BxT, clipped_BxT = clipped_value_loss(v, old_values_BxT, returns_BxT,
                                             config.value_clip)
  loss = obj_lib.aggregate_loss(loss_BxT, mask, aggregation, **normalizers)
  n = jnp.maximum(normalizers["num_tokens"], 1.0)

  def token_sum(x):
    return jnp.sum(jnp.where(mask, jax.lax.stop_gradient(x), 0.0)) / n

  return loss, {"critic/value_loss": loss,
                "critic/clip_frac": token_sum(clipped_BxT),
                "critic/values_mean": token_sum(v),
                "critic/returns_mean": token_sum(returns_BxT)}


__all__ = ["CriticConfig", "CriticState", "clipped_value_loss",
           "init_params", "make_optimizer", "value_loss", "values"]
