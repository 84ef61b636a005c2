"""The jitted RL step: prepared inputs, then a sum of loss terms.

Its data types are in ``step_inputs.py`` and its loss terms in
``loss_terms.py`` (both re-exported here).

``rl_step(state, batch, ref_params, teacher_params)`` runs ``num_epochs``
passes over one rollout batch; each pass is shuffled and split into
``num_minibatches`` optimizer updates, and each minibatch into
``num_microbatches`` gradient-accumulation chunks. All of it is one
``lax.scan`` over updates with an inner ``lax.scan`` over microbatches, so a
step is one compiled program. Loss normalisers (token and sequence counts)
are those of the whole minibatch, so accumulation gives exactly the
minibatch gradient (``rljax.objectives``).

A step reads (docs/architecture.md, "One RL step"):

1. ``prepare_inputs``: the batch's scored columns (the last
   ``completion_length``) as ``StepInputs``, with what no-gradient passes
   give once per step: ``pi_old`` when it is recomputed, the reference and
   teacher logprobs, the critic's values and GAE advantages, and the
   rejection mask.
2. Per microbatch, ``forward``: the policy's logprobs (and entropy), the
   ratio, FeynRL's token ESS and the advantages after distillation.
   The coefficient chain turns the ratio into ``c`` here.
3. The loss terms, each ``(loss, metrics)``: ``policy_gradient_term``
   (``objectives.policy_gradient_loss``), then those the settings switch on
   (``loss_terms``: ``entropy_term``, ``kl_term``, ``ess_kl_term``,
   ``kl_cov_term``, ``dro_term``) and, with a critic, ``critic.value_loss``.

Three policies meet in a step:

* ``pi_theta``: the params being trained (carries the gradient);
* ``pi_old``: the policy the ratio is taken against. ``old_logprobs=
  "recompute"`` evaluates it with the trainer at the start of the step (with
  one update per step it is ``sg(pi_theta)`` of the same forward pass, so no
  extra pass runs); ``"sampler"`` takes the sampler's ``policy_logprobs``
  (verl's bypass mode: no recomputation at all);
* ``mu``: the distribution the sampler actually drew from
  (``sampler_logprobs``), the behaviour policy of every off-policy
  correction.

From these the step computes, every microbatch, FeynRL's token-level ESS of
``pi_theta / mu`` (pooled per microbatch, or per minibatch with
``ess_pooling="minibatch"``), passed to the coefficient chain as ``ess=``
and weighting the ``(1 - ESS)`` pull toward ``mu`` (``ess_kl_coef``); and,
per minibatch, VCPO's sequence-level ESS of ``pi_old(y) / mu(y)``, passed
to the optimizer as ``ess=`` (``optim.scale_by_ess``). Both are
``objectives.EssStatistics`` sums, so pooling is addition.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from rljax import models, sharding
from rljax import objectives as obj_lib
from rljax import optim as optim_lib
from rljax.models import lora as lora_lib
from rljax.advantages import gae as gae_lib
from rljax.train import critic as critic_lib
from rljax.train import distill as distill_lib
from rljax.train.loss_terms import (  # noqa: F401  (re-exported)
    LossTerm, dro_term, entropy_term, ess_kl_term, kl_cov_term, kl_term,
    loss_terms, policy_gradient_term)
from rljax.train.step_inputs import (  # noqa: F401  (re-exported)
    ESS_POOLINGS, OLD_LOGPROBS, Forward, Normalizers, RLBatch, RLStepConfig,
    StepInputs, StepPlan, TrainState, check_batch)


def _scored_logprobs(params, model_config, tokens, input_mask,
                     cfg: RLStepConfig, with_entropy=False, packing=None):
  """``(logp, entropy or None)`` of the scored columns (padding-free with
  ``packing``)."""
  return models.sequence_logprobs(params, model_config, tokens, input_mask,
                                  temperature=cfg.training_temperature,
                                  chunk_size=cfg.logprob_chunk_size,
                                  num_scored=cfg.scored_columns,
                                  with_entropy=with_entropy,
                                  remat=cfg.logprob_remat, packing=packing)


def update_order(cfg: RLStepConfig, key_data: jax.Array | None, n: int
                 ) -> tuple[jax.Array | None, jax.Array]:
  """``(key, order_UxKxM)``: the step's next key and the rows of each
  update's microbatches (a fresh permutation per epoch; in order with one
  update). ``train/packing.py`` computes the same order on the host."""
  key = None
  if key_data is not None:
    key, shuffle_key = jax.random.split(jax.random.wrap_key_data(key_data))
  if cfg.num_updates == 1:
    order = jnp.arange(n)[None]
  else:
    keys = jax.random.split(shuffle_key, cfg.num_epochs)
    order = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
  return key, order.reshape(cfg.num_updates, cfg.num_microbatches,
                            n // (cfg.num_minibatches * cfg.num_microbatches))


def _map_rows(fn, chunks: int, tokens, input_mask, plan):
  """``fn(tokens, input_mask, packing)`` over the batch in ``chunks`` row
  chunks, no gradient, rows back in order: padded chunks of consecutive rows
  (``models.map_row_chunks``) or, with a ``StepPlan``, its first epoch's
  packed microbatches (every row once)."""
  if plan is None:
    return models.map_row_chunks(lambda x, m: fn(x, m, None), chunks, tokens,
                                 input_mask)
  rows = plan.order_UxKxM.reshape(-1, plan.order_UxKxM.shape[-1])[:chunks]
  packs = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:chunks],
                       plan.packing)
  out = jax.lax.map(lambda a: fn(jnp.take(tokens, a[0], axis=0),
                                 jnp.take(input_mask, a[0], axis=0), a[1]),
                    (rows, packs))
  out = out.reshape(-1, *out.shape[2:])
  return jax.lax.stop_gradient(
      jnp.take(out, jnp.argsort(rows.reshape(-1)), axis=0))


def _token_ess_stats(lp, sampler_lp, mask, max_log_ratio):
  """FeynRL: EssStatistics of the token weights ``pi_theta / mu``."""
  log_w = jnp.clip(jax.lax.stop_gradient(lp) - sampler_lp, -max_log_ratio,
                   max_log_ratio)
  return obj_lib.ess_statistics(jnp.exp(jnp.where(mask, log_w, 0.0)), mask)


def _sequence_ess_stats(old_lp, sampler_lp, mask):
  """VCPO: EssStatistics of the trajectory weights ``pi_old(y) / mu(y)``."""
  w = obj_lib.sequence_importance_weights(old_lp, sampler_lp, mask)
  return obj_lib.ess_statistics(w, jnp.any(mask, -1))


def mismatch_statistics(trainer_lp, sampler_lp, mask):
  """Additive sums of the sampler-vs-trainer logprob mismatch.

  ``d = trainer_lp - sampler_lp`` over the completion tokens. Returns sums
  (``abs``: ``sum |d|``; ``k3``: ``sum exp(d) - 1 - d``, whose mean under
  the sampler's tokens estimates KL(mu || pi); ``large``: tokens with
  ``|d| > 0.1``; ``count``) and ``max_abs`` (``max |d|``).
  """
  d = jnp.where(mask, jax.lax.stop_gradient(trainer_lp) - sampler_lp, 0.0)
  k3 = jnp.exp(jnp.clip(d, -20.0, 20.0)) - 1.0 - d
  return {"abs": jnp.sum(jnp.abs(d)), "k3": jnp.sum(jnp.where(mask, k3, 0.0)),
          "large": jnp.sum(mask & (jnp.abs(d) > 0.1), dtype=jnp.float32),
          "count": jnp.sum(mask, dtype=jnp.float32),
          "max_abs": jnp.max(jnp.abs(d))}


def _mismatch_metrics(s):
  n = jnp.maximum(s["count"], 1.0)
  return {"mismatch/abs_logp_mean": s["abs"] / n,
          "mismatch/abs_logp_max": s["max_abs"],
          "mismatch/kl_k3": s["k3"] / n,
          "mismatch/frac_abs_gt_0.1": s["large"] / n}


def _accumulate(acc, new):
  """Sums, except maxima (keys ending in ``max_abs``)."""
  return {k: (jnp.maximum if k.endswith("max_abs") else jnp.add)(acc[k], new[k])
          for k in acc}


# ----------------------------------------------------------------------------
# Trained and frozen params.


def trainable(model_config: models.ModelConfig, params: Any) -> Any:
  """What the optimizer updates: the adapters with LoRA
  (``models/lora.py``), else every param."""
  return lora_lib.adapters_of(params) if model_config.lora else params


def frozen_base(model_config: models.ModelConfig, params: Any) -> Any:
  """The frozen rest of ``params`` with LoRA, else None."""
  return lora_lib.split(params)[1] if model_config.lora else None


# ----------------------------------------------------------------------------
# Step inputs.


def prepare_inputs(cfg: RLStepConfig, model_config: models.ModelConfig,
                   state: TrainState, batch: RLBatch, ref_params: Any = None,
                   teacher_params: Any = None,
                   teacher_config: models.ModelConfig | None = None
                   ) -> tuple[StepInputs, jax.Array | None]:
  """The batch's scored columns and the once-per-step no-gradient passes.

  Returns:
    ``(inputs, rejected, old)``: ``rejected`` is the fraction of completion
    tokens that ``cfg.rejection`` removed (None without rejection); ``old``
    is ``pi_old`` ``[N, T]`` when it was recomputed or recorded by the
    sampler (None when each update's own forward pass gives it).

  Raises:
    ValueError: the batch's rows are not longer than ``completion_length``,
      or ``old_logprobs="sampler"`` without ``batch.old_logprobs_NxL``.
  """
  check_batch(batch)
  n, length = batch.tokens_NxL.shape
  t = cfg.scored_columns
  if cfg.completion_length is not None and cfg.completion_length >= length:
    raise ValueError(
        f"rl_step: completion_length={cfg.completion_length} must be below "
        "the batch's row "
        f"length L={length} (L = prompt + completion).")

  def scored(x):
    return x if t is None else x[:, length - t:]

  tokens, input_mask = batch.tokens_NxL, batch.input_mask_NxL
  loss_mask = scored(batch.loss_mask_NxL)
  adv = batch.advantages_NxL
  adv = (jnp.broadcast_to(adv[:, None], loss_mask.shape) if adv.ndim == 1
         else scored(adv)).astype(jnp.float32)
  plan = batch.plan
  # The no-gradient passes run over the first epoch's microbatches (with
  # rl.microbatch_tokens the plan's count, not the config's).
  chunks = cfg.num_minibatches * (cfg.num_microbatches if plan is None
                                  else plan.order_UxKxM.shape[1])

  def no_grad_logprobs(params, config=model_config):
    return _map_rows(
        lambda x, m, p: _scored_logprobs(params, config, x, m, cfg,
                                         packing=p)[0],
        chunks, tokens, input_mask, plan)

  old = None
  if cfg.old_logprobs == "sampler":
    if batch.old_logprobs_NxL is None:
      raise ValueError(
          "rl_step: RLStepConfig.old_logprobs='sampler' needs "
          "RLBatch.old_logprobs_NxL (the sampler's policy_logprobs); build "
          "the sampler with record_policy_logprobs=True.")
    old = scored(batch.old_logprobs_NxL)
  elif not cfg.reuses_current_as_old or cfg.rejection:
    old = no_grad_logprobs(state.params)
  sampler_lp = scored(batch.sampler_logprobs_NxL)
  rejected = None
  if cfg.rejection:
    kept = obj_lib.rejection_mask(old, sampler_lp, loss_mask, cfg.rejection)
    rejected = (jnp.sum(loss_mask & ~kept, dtype=jnp.float32)
                / jnp.maximum(jnp.sum(loss_mask, dtype=jnp.float32), 1.0))
    loss_mask = kept
  width = loss_mask.shape[1]

  def last(x):  # full-row arrays -> the loss mask's columns
    return x[:, x.shape[1] - width:]

  teacher = None
  if cfg.distill_coef:
    teacher_config = teacher_config or model_config
    teacher = last(_map_rows(
        lambda x, m, p: models.sequence_logprobs(
            teacher_params, teacher_config, x, m,
            temperature=cfg.teacher_temperature,
            chunk_size=cfg.logprob_chunk_size, packing=p)[0], chunks, tokens,
        input_mask, plan))
  old_values = returns = None
  if cfg.critic is not None:
    if batch.rewards_N is None:
      raise ValueError("rl_step: RLStepConfig.critic is set but "
                       "RLBatch.rewards_N is None: GAE needs each row's "
                       "reward.")
    # verl's order: V_old of the whole batch, then GAE, then the updates.
    critic_params = critic_lib.with_base(state.critic.params,
                                         frozen_base(model_config,
                                                     state.params))
    old_values = last(_map_rows(
        lambda x, m, p: critic_lib.values(critic_params, model_config,
                                          x, m, p), chunks, tokens,
        input_mask, plan))
    rewards = (batch.rewards_N if batch.token_rewards_NxL is None
               else last(batch.token_rewards_NxL))
    adv, returns = gae_lib.gae_advantages(rewards, old_values, loss_mask,
                                          cfg.critic.gamma, cfg.critic.lam)
    if cfg.critic.whiten:
      adv = gae_lib.whiten_advantages(adv, loss_mask)
  ref = None
  kl = cfg.kl_coef or cfg.log_kl
  if kl and ref_params is None and model_config.lora is not None:
    # LoRA: the reference is the frozen base, read from the same params.
    ref = no_grad_logprobs(state.params, model_config.base_config())
  elif kl:
    ref = no_grad_logprobs(ref_params)
  inputs = StepInputs(
      tokens, input_mask, loss_mask, adv, sampler_lp,
      old_logprobs_NxT=None if cfg.reuses_current_as_old else old,
      ref_logprobs_NxT=ref,
      teacher_logprobs_NxT=teacher, old_values_NxT=old_values,
      returns_NxT=returns, kl_coef_N=batch.kl_coef_N)
  return inputs, rejected, old


# ----------------------------------------------------------------------------
# The step.


def make_rl_step(model_config: models.ModelConfig, cfg: RLStepConfig,
                 optimizer: optax.GradientTransformation,
                 coef_tx: optax.GradientTransformationExtraArgs,
                 critic_optimizer: optax.GradientTransformation | None = None,
                 teacher_config: models.ModelConfig | None = None):
  """Returns the pure function ``rl_step(state, batch, ref_params,
  teacher_params)``.

  The caller jits it (``jit_rl_step`` states the shardings). ``ref_params``
  is only read when ``cfg.kl_coef > 0`` (with LoRA pass None: the reference
  is the frozen base), ``teacher_params`` only when
  ``cfg.distill_coef > 0`` (pass None otherwise). With ``cfg.critic``,
  ``critic_optimizer`` updates ``state.critic`` (``critic.make_optimizer``);
  ``teacher_config`` is the teacher's model config (default: the policy's).
  """
  if cfg.critic is not None and critic_optimizer is None:
    raise ValueError("make_rl_step: RLStepConfig.critic is set but "
                     "critic_optimizer=None: pass the critic's optimizer "
                     "(rljax.train.critic.make_optimizer).")
  optimizer = optax.with_extra_args_support(optimizer)
  with_entropy = bool(cfg.entropy_coef) or cfg.entropy_metric
  terms = loss_terms(cfg)

  def forward(params, mb: StepInputs, coef_state, pooled_ess):
    """The microbatch's ``Forward`` and the coefficient chain's new state."""
    lp, ent = _scored_logprobs(params, model_config, mb.tokens_NxL,
                               mb.input_mask_NxL, cfg, with_entropy,
                               mb.packing)
    mask, sampler_lp = mb.loss_mask_NxT, mb.sampler_logprobs_NxT
    old = (jax.lax.stop_gradient(lp) if mb.old_logprobs_NxT is None
           else mb.old_logprobs_NxT)
    ratio = obj_lib.importance_ratio(lp, old, mask,
                                     max_log_ratio=cfg.max_log_ratio)
    ess = (obj_lib.ess_from_statistics(
        _token_ess_stats(lp, sampler_lp, mask, cfg.max_log_ratio))
           if pooled_ess is None else pooled_ess)
    adv, reverse_kl = mb.advantages_NxT, None
    if mb.teacher_logprobs_NxT is not None:
      adv, reverse_kl = distill_lib.distill_advantages(
          adv, old, mb.teacher_logprobs_NxT, mask, cfg.distill_coef)
    coef, coef_state = coef_tx.update(
        ratio, coef_state, advantages_BxT=adv, mask_BxT=mask,
        old_logprobs_BxT=old, sampler_logprobs_BxT=sampler_lp, ess=ess)
    # A user coefficient chain's NaN/inf never reaches the update: those
    # tokens weigh 0 (``c`` carries no gradient) and are counted.
    finite = jnp.isfinite(coef)
    nonfinite = jnp.sum(mask & ~finite, dtype=jnp.float32)
    coef = jnp.where(finite, coef, 0.0)
    return Forward(lp, ent, old, ratio, coef, adv, reverse_kl, ess, mask,
                   sampler_lp), coef_state, nonfinite

  def loss_fn(trained, mb: StepInputs, coef_state, norm: Normalizers,
              pooled_ess, base):
    """``trained``: what carries the gradient (with LoRA the adapters; the
    frozen ``base`` completes them and gets none)."""
    params, critic_params = trained if cfg.critic is not None else (trained,
                                                                     None)
    if base is not None:
      params = lora_lib.merge(base, params)
      if critic_params is not None:
        critic_params = critic_lib.with_base(critic_params, base)
    fwd, coef_state, nonfinite = forward(params, mb, coef_state, pooled_ess)
    loss, metrics = policy_gradient_term(fwd, mb, cfg, norm)
    # Summed over microbatches: the count per update (nonzero means the
    # coefficient chain returned NaN/inf there; those tokens weighed 0).
    metrics["coef/nonfinite_tokens"] = nonfinite
    for term in terms:
      term_loss, term_metrics = term(fwd, mb, cfg, norm)
      loss = loss + term_loss
      metrics.update(term_metrics)
    if critic_params is not None:  # its own params tree: no policy gradient
      value_loss, critic_metrics = critic_lib.value_loss(
          critic_params, model_config, mb.tokens_NxL, mb.input_mask_NxL,
          mb.loss_mask_NxT, mb.old_values_NxT, mb.returns_NxT, cfg.critic,
          cfg.aggregation, norm._asdict(), mb.packing)
      loss = loss + value_loss
      metrics.update(critic_metrics)
    sums = {"seq_ess": _sequence_ess_stats(fwd.old_logprobs,
                                           fwd.sampler_logprobs, fwd.mask),
            "mismatch": mismatch_statistics(fwd.logprobs, fwd.sampler_logprobs,
                                            fwd.mask)}
    return loss, (metrics, sums, coef_state)

  grad_fn = jax.grad(loss_fn, has_aux=True)

  def minibatch_token_ess(params, micro: StepInputs):
    """FeynRL's ESS pooled over the whole minibatch (one no-grad pass)."""
    def stats(mb):
      lp, _ = _scored_logprobs(params, model_config, mb.tokens_NxL,
                               mb.input_mask_NxL, cfg, packing=mb.packing)
      return _token_ess_stats(lp, mb.sampler_logprobs_NxT, mb.loss_mask_NxT,
                              cfg.max_log_ratio)
    return obj_lib.ess_from_statistics(
        jax.tree.map(jnp.sum, jax.lax.map(stats, micro)))

  def update(carry, xs, inputs: StepInputs):
    indices_KxM, packing_K = xs
    params, opt_state, coef_state, critic = carry
    base = frozen_base(model_config, params)
    own = trainable(model_config, params)
    trained = own if critic is None else (own, critic.params)
    k, m = indices_KxM.shape
    minibatch = jax.tree.map(
        lambda x: jnp.take(x, indices_KxM.reshape(-1), axis=0), inputs)
    mask = minibatch.loss_mask_NxT
    # At least 1, so an all-masked minibatch (e.g. all rejected) gives 0.
    num_sequences = (float(mask.shape[0]) if cfg.count_empty_sequences
                     else jnp.sum(jnp.any(mask, -1), dtype=jnp.float32))
    norm = Normalizers(jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0),
                       jnp.maximum(num_sequences, 1.0), cfg.completion_length)
    micro = jax.tree.map(lambda x: x.reshape(k, m, *x.shape[1:]), minibatch)
    micro = micro._replace(packing=packing_K)
    pooled = (minibatch_token_ess(params, micro)
              if cfg.ess_pooling == "minibatch" else None)

    def accumulate(acc, mb):
      grads_acc, metrics_acc, sums_acc, coef_state = acc
      grads, (metrics, sums, coef_state) = grad_fn(trained, mb, coef_state,
                                                   norm, pooled, base)
      return (jax.tree.map(jnp.add, grads_acc, grads),
              jax.tree.map(jnp.add, metrics_acc, metrics),
              {"seq_ess": jax.tree.map(jnp.add, sums_acc["seq_ess"],
                                       sums["seq_ess"]),
               "mismatch": _accumulate(sums_acc["mismatch"], sums["mismatch"])},
              coef_state), None

    zeros = jax.tree.map(jnp.zeros_like, trained)
    shapes = jax.eval_shape(
        lambda: grad_fn(trained, jax.tree.map(lambda x: x[0], micro),
                        coef_state, norm, pooled, base)[1][:2])
    metric_zeros, sums_zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, metrics, sums, coef_state), _ = jax.lax.scan(
        accumulate, (zeros, metric_zeros, sums_zeros, coef_state), micro)
    # Summed over microbatches: the losses use the minibatch's normalisers
    # and the ratio statistics are token-weighted, so sums are means.
    seq_ess = obj_lib.ess_from_statistics(sums["seq_ess"])
    if critic is not None:  # the critic's own update, in the same step
      grads, critic_grads = grads
      critic_updates, critic_opt_state = critic_optimizer.update(
          critic_grads, critic.opt_state, critic.params)
      critic = critic._replace(
          params=optax.apply_updates(critic.params, critic_updates),
          opt_state=critic_opt_state)
      metrics["critic/grad_norm"] = optax.tree.norm(critic_grads)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["ess/sequence"] = seq_ess
    updates, opt_state = optimizer.update(grads, opt_state, own, ess=seq_ess)
    own = optax.apply_updates(own, updates)
    params = own if base is None else lora_lib.merge(base, own)
    return (params, opt_state, coef_state, critic), (metrics, sums["mismatch"])

  def rl_step(state: TrainState, batch: RLBatch, ref_params=None,
              teacher_params=None):
    inputs, rejected, old = prepare_inputs(cfg, model_config, state, batch,
                                           ref_params, teacher_params,
                                           teacher_config)
    n = batch.tokens_NxL.shape[0]
    key, indices = update_order(cfg, state.key, n)
    packing = None
    if batch.plan is not None:  # the same order, computed on the host
      indices, packing = batch.plan.order_UxKxM, batch.plan.packing
    (params, opt_state, coef_state, critic), (metrics, mismatch) = (
        jax.lax.scan(lambda carry, xs: update(carry, xs, inputs),
                     (state.params, state.opt_state, state.coef_state,
                      state.critic), (indices, packing)))
    metrics = jax.tree.map(jnp.mean, metrics)
    if old is not None and cfg.old_logprobs == "recompute":
      # The recomputed pi_old is the trainer at the sampler's params.
      mismatch = mismatch_statistics(old, inputs.sampler_logprobs_NxT,
                                     inputs.loss_mask_NxT)
      # Each row's log pi_old(y) / mu(y), for the run's histograms (NaN: a
      # row with no trained token).
      trained = inputs.loss_mask_NxT
      metrics["rows/log_ratio"] = jnp.where(
          jnp.any(trained, -1), jnp.sum(jnp.where(
              trained, old - inputs.sampler_logprobs_NxT, 0.0), -1), jnp.nan)
    else:
      # The first update's forward ran at the sampler's params.
      mismatch = jax.tree.map(lambda x: x[0], mismatch)
    metrics.update(_mismatch_metrics(mismatch))
    if rejected is not None:
      metrics["rejection/frac_tokens"] = rejected
    metrics.update(optim_lib.optimizer_metrics(opt_state))
    new_state = state._replace(params=params, opt_state=opt_state,
                               coef_state=coef_state, step=state.step + 1,
                               key=jax.random.key_data(key), critic=critic)
    return new_state, metrics

  return rl_step


def init_state(params: Any, key: jax.Array, *, algorithm: Any,
               cfg: RLStepConfig, model_config: models.ModelConfig,
               num_prompts: int, group_size: int, num_rewards: int,
               row_length: int | None = None,
               critic_optimizer: optax.GradientTransformation | None = None
               ) -> TrainState:
  """A fresh ``TrainState`` around ``params`` (call under ``jax.jit`` to keep
  the params' shardings).

  The advantage chain is initialised for rewards ``[B * (G + extra), R]``
  and the coefficient chain for ratios ``[microbatch rows, T]``: the shapes
  their ``update`` receives.

  Args:
    params: the policy params (with LoRA the optimizer state covers the
      adapters only).
    key: the state's PRNG key (stored as raw key data).
    algorithm: the ``Algorithm`` (its chains' and optimizer's states).
    cfg: the step's settings (``T = cfg.completion_length``).
    model_config: the policy's (the critic starts as its copy).
    num_prompts, group_size, num_rewards: ``B``, ``G`` and ``R``.
    row_length: ``L``, the scored width when ``cfg.completion_length`` is
      None.
    critic_optimizer: with ``cfg.critic``.
  """
  width = cfg.scored_columns or row_length
  if width is None:
    raise ValueError("init_state: RLStepConfig scores every column; pass "
                     "row_length (the rows' L).")
  rows = num_prompts * (group_size + algorithm.extra_samples)
  micro = num_prompts * group_size // (cfg.num_minibatches
                                       * cfg.num_microbatches)
  critic = None
  if cfg.critic is not None:  # the value model starts from the policy
    critic_params = critic_lib.init_params(params, model_config)
    critic = critic_lib.CriticState(critic_params,
                                    critic_optimizer.init(critic_params))
  return TrainState(
      params, algorithm.optimizer.init(trainable(model_config, params)),
      algorithm.advantage.init(jnp.zeros((rows, num_rewards), jnp.float32)),
      algorithm.coefficient.init(jnp.zeros((micro, width), jnp.float32)),
      jnp.zeros((), jnp.int32), jax.random.key_data(key), critic)


def batch_shardings(mesh: jax.sharding.Mesh, old_logprobs: bool,
                    rewards: bool = False, packed: bool = False,
                    token_rewards: bool = False,
                    kl_coef: bool = False) -> RLBatch:
  """``RLBatch`` of shardings: rows split over the mesh's batch axes (a
  padding-free step's plan replicated: it is small)."""
  b2, b1 = sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 1)
  r = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  plan = StepPlan(r, models.Packing(r, r, r, r)) if packed else None
  return RLBatch(b2, b2, b2, b2, b2, b2 if old_logprobs else None,
                 b1 if rewards else None, plan,
                 b2 if token_rewards else None, b1 if kl_coef else None)


def jit_rl_step(rl_step, mesh: jax.sharding.Mesh, state_shardings: Any,
                ref_shardings: Any = None, *, old_logprobs: bool = False,
                teacher_shardings: Any = None, rewards: bool = False,
                packed: bool = False, token_rewards: bool = False,
                kl_coef: bool = False):
  """``jax.jit(rl_step)`` with explicit shardings and the state donated.

  Args:
    rl_step: from ``make_rl_step``.
    mesh: the device mesh.
    state_shardings: a ``TrainState`` of shardings (e.g.
      ``jax.tree.map(lambda x: x.sharding, state)``).
    ref_shardings: shardings of the reference params, or None.
    old_logprobs: whether batches carry ``old_logprobs_NxL``.
    teacher_shardings: shardings of the teacher's params (on-policy
      distillation); the jitted step then takes them as a fourth argument.
    rewards: whether batches carry ``rewards_N`` (a critic).
    packed: whether batches carry a ``StepPlan`` (padding-free;
      ``train/packing.py``).
    token_rewards: whether batches carry ``token_rewards_NxL`` (a critic on
      a multi-turn environment).
    kl_coef: whether batches carry ``kl_coef_N`` (an adaptive KL
      controller).
  """
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  teacher = () if teacher_shardings is None else (teacher_shardings,)
  return jax.jit(
      rl_step,
      in_shardings=(state_shardings,
                    batch_shardings(mesh, old_logprobs, rewards, packed,
                                    token_rewards, kl_coef),
                    ref_shardings) + teacher,
      out_shardings=(state_shardings, replicated),
      donate_argnums=(0,))
