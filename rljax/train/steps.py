"""The train state and the jitted RL and SFT steps.

``rl_step(state, batch, ref_params)`` runs ``num_epochs`` passes over one
rollout batch; each pass is shuffled and split into ``num_minibatches``
optimizer updates, and each minibatch into ``num_microbatches`` gradient-
accumulation chunks. All of it is one ``lax.scan`` over updates with an inner
``lax.scan`` over microbatches, so a step is one compiled program. Loss
normalisers (token and sequence counts) are those of the whole minibatch, so
accumulation gives exactly the minibatch gradient (``rljax.objectives``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import models
from rljax import objectives as obj_lib
from rljax import optim as optim_lib


class TrainState(NamedTuple):
  """Everything that changes during training (one pytree, checkpointed whole).

  Attributes:
    params: policy params.
    opt_state: optimizer state.
    adv_state: advantage-chain state.
    coef_state: coefficient-chain state.
    step: ``[]`` int32, completed RL steps.
    key: ``[2]`` uint32 raw PRNG key data (``jax.random.key_data``), split
      at every use.
  """

  params: Any
  opt_state: Any
  adv_state: Any
  coef_state: Any
  step: jax.Array
  key: jax.Array


class RLBatch(NamedTuple):
  """One rollout batch for ``rl_step``; ``N`` rows, ``L = P + T`` columns.

  Attributes:
    tokens: ``[N, L]`` int32, prompt then completion.
    input_mask: ``[N, L]`` bool, real tokens.
    loss_mask: ``[N, L]`` bool, completion tokens that are trained on.
    advantages: ``[N]`` fp32.
    sampler_logprobs: ``[N, L]`` fp32, the sampler's logprobs (0 elsewhere).
  """

  tokens: jax.Array
  input_mask: jax.Array
  loss_mask: jax.Array
  advantages: jax.Array
  sampler_logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
  """Static settings of ``rl_step``."""

  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1
  aggregation: str = "token_mean"
  max_length: int | None = None
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  training_temperature: float = 1.0
  logprob_chunk_size: int = 128
  ess_kl_coef: bool = False


def _sequence_logprobs(params, model_config, tokens, input_mask, temperature,
                       chunk_size):
  return models.sequence_logprobs(params, model_config, tokens, input_mask,
                                  temperature=temperature, chunk_size=chunk_size)


def _forward_logprobs(params, model_config, tokens, input_mask, cfg, chunks):
  """Logprobs without gradient, in ``chunks`` row chunks (bounded memory)."""
  n = tokens.shape[0]
  t = tokens.reshape(chunks, n // chunks, -1)
  m = input_mask.reshape(chunks, n // chunks, -1)
  lp = jax.lax.map(lambda x: _sequence_logprobs(
      params, model_config, x[0], x[1], cfg.training_temperature,
      cfg.logprob_chunk_size)[0], (t, m))
  return jax.lax.stop_gradient(lp.reshape(n, -1))


def make_rl_step(model_config: models.ModelConfig, cfg: RLStepConfig,
                 optimizer: optax.GradientTransformationExtraArgs,
                 coef_tx: optax.GradientTransformationExtraArgs):
  """Returns the pure function ``rl_step(state, batch, ref_params)``.

  The caller jits it (with shardings and donation at the call site).
  ``ref_params`` is only read when ``cfg.kl_coef > 0`` (pass None otherwise).
  """
  num_updates = cfg.num_epochs * cfg.num_minibatches
  reuse_current_as_old = num_updates == 1

  def microbatch_loss(params, mb, coef_state, normalizers):
    lp, ent = _sequence_logprobs(params, model_config, mb["tokens"],
                                 mb["input_mask"], cfg.training_temperature,
                                 cfg.logprob_chunk_size)
    mask = mb["loss_mask"]
    old = jax.lax.stop_gradient(lp) if reuse_current_as_old else mb["old_logprobs"]
    ratio = obj_lib.importance_ratio(lp, old, mask)
    adv = mb["advantages"]
    coef, coef_state = coef_tx.update(
        ratio, coef_state, advantages_BxT=adv, mask_BxT=mask,
        old_logprobs_BxT=old, sampler_logprobs_BxT=mb["sampler_logprobs"])
    pg = obj_lib.policy_gradient_loss(coef, adv, lp, mask, cfg.aggregation,
                                      **normalizers)
    loss = pg
    ent_mean = obj_lib.aggregate_loss(jax.lax.stop_gradient(ent), mask,
                                      "token_mean",
                                      num_tokens=normalizers["num_tokens"])
    metrics = {"pg_loss": pg, "entropy": ent_mean}
    if cfg.entropy_coef:
      loss = loss + cfg.entropy_coef * obj_lib.entropy_loss(
          ent, mask, cfg.aggregation, **normalizers)
    if cfg.kl_coef:
      kl = obj_lib.aggregate_loss(obj_lib.kl_k3(lp, mb["ref_logprobs"]), mask,
                                  cfg.aggregation, **normalizers)
      loss = loss + cfg.kl_coef * kl
      metrics["kl"] = kl
    weight = jnp.sum(mask) / jnp.maximum(normalizers["num_tokens"], 1.0)
    rm = obj_lib.ratio_metrics(ratio, mask, advantages_BxT=jnp.broadcast_to(
        adv[:, None], mask.shape))
    for k in ("ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high", "ess"):
      if k in rm:
        metrics[k] = rm[k] * weight  # token-weighted across microbatches
    return loss, (metrics, coef_state)

  grad_fn = jax.grad(microbatch_loss, has_aux=True)

  def update(carry, indices_KxM, batch):
    params, opt_state, coef_state = carry
    k, m = indices_KxM.shape
    mb_all = jax.tree.map(lambda x: jnp.take(x, indices_KxM.reshape(-1), axis=0),
                          batch)
    mask = mb_all["loss_mask"]
    normalizers = {
        "num_tokens": jnp.sum(mask, dtype=jnp.float32),
        "num_sequences": jnp.sum(jnp.any(mask, -1), dtype=jnp.float32),
        "max_length": cfg.max_length,
    }
    micro = jax.tree.map(lambda x: x.reshape(k, m, *x.shape[1:]), mb_all)

    def accumulate(acc, mb):
      grads_acc, metrics_acc, coef_state = acc
      grads, (metrics, coef_state) = grad_fn(params, mb, coef_state, normalizers)
      return (jax.tree.map(jnp.add, grads_acc, grads),
              jax.tree.map(jnp.add, metrics_acc, metrics), coef_state), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    metric_shapes = jax.eval_shape(
        lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro), coef_state,
                        normalizers)[1][0])
    metric_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)
    (grads, metrics, coef_state), _ = jax.lax.scan(
        accumulate, (zeros, metric_zeros, coef_state), micro)
    # Summed over microbatches: pg_loss/kl/entropy use the minibatch's global
    # normalisers and the ratio statistics are token-weighted, so sums are means.
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params,
                                          ess=metrics.get("ess", 1.0))
    params = optax.apply_updates(params, updates)
    return (params, opt_state, coef_state), metrics

  def rl_step(state: TrainState, batch: RLBatch, ref_params=None):
    n = batch.tokens.shape[0]
    key, shuffle_key = jax.random.split(jax.random.wrap_key_data(state.key))
    data = {
        "tokens": batch.tokens, "input_mask": batch.input_mask,
        "loss_mask": batch.loss_mask, "advantages": batch.advantages,
        "sampler_logprobs": batch.sampler_logprobs,
    }
    chunks = cfg.num_minibatches * cfg.num_microbatches
    if not reuse_current_as_old:
      data["old_logprobs"] = _forward_logprobs(
          state.params, model_config, batch.tokens, batch.input_mask, cfg, chunks)
    if cfg.kl_coef:
      data["ref_logprobs"] = _forward_logprobs(
          ref_params, model_config, batch.tokens, batch.input_mask, cfg, chunks)
    if num_updates == 1:
      order = jnp.arange(n)[None]
    else:
      keys = jax.random.split(shuffle_key, cfg.num_epochs)
      order = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
    indices = order.reshape(num_updates, cfg.num_microbatches,
                            n // (cfg.num_minibatches * cfg.num_microbatches))
    (params, opt_state, coef_state), metrics = jax.lax.scan(
        lambda carry, idx: update(carry, idx, data),
        (state.params, state.opt_state, state.coef_state), indices)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics.update(optim_lib.optimizer_metrics(opt_state))
    new_state = state._replace(params=params, opt_state=opt_state,
                               coef_state=coef_state, step=state.step + 1,
                               key=jax.random.key_data(key))
    return new_state, metrics

  return rl_step


def make_sft_step(model_config: models.ModelConfig,
                  optimizer: optax.GradientTransformation,
                  chunk_size: int = 128):
  """``sft_step(params, opt_state, tokens, input_mask, loss_mask)``:
  token-mean cross-entropy on the completion tokens only."""

  def loss_fn(params, tokens, input_mask, loss_mask):
    lp, _ = models.sequence_logprobs(params, model_config, tokens, input_mask,
                                     chunk_size=chunk_size)
    return obj_lib.aggregate_loss(-lp, loss_mask, "token_mean")

  def sft_step(params, opt_state, tokens, input_mask, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, input_mask,
                                              loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "sft_loss": loss, "grad_norm": optax.tree.norm(grads)}

  return sft_step
