"""The train state and the jitted RL and SFT steps.

``rl_step(state, batch, ref_params)`` runs ``num_epochs`` passes over one
rollout batch; each pass is shuffled and split into ``num_minibatches``
optimizer updates, and each minibatch into ``num_microbatches`` gradient-
accumulation chunks. All of it is one ``lax.scan`` over updates with an inner
``lax.scan`` over microbatches, so a step is one compiled program. Loss
normalisers (token and sequence counts) are those of the whole minibatch, so
accumulation gives exactly the minibatch gradient (``rljax.objectives``).

Three policies meet in a step (DESIGN.md section 4, research/formulas.md
sections 1, 2 and 8):

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

Two more models can join a step, each off unless configured, so the
program without them is unchanged: a critic (``RLStepConfig.critic``, PPO
with a value model; ``rljax.train.critic``), whose values at the start of
the step give token-level GAE advantages and which is trained by its own
optimizer in the same microbatch loop; and a teacher
(``RLStepConfig.distill_coef``, on-policy distillation;
``rljax.train.distill``), whose logprobs add a per-token reverse-KL term to
the advantages, evaluated once per step like the reference's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import models, sharding
from rljax import objectives as obj_lib
from rljax import optim as optim_lib
from rljax.advantages import gae as gae_lib
from rljax.train import critic as critic_lib
from rljax.train import distill as distill_lib

OLD_LOGPROBS = ("recompute", "sampler")


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
    critic: the value model's ``critic.CriticState`` with
      ``RLStepConfig.critic`` (PPO with a critic); None otherwise.
  """

  params: Any
  opt_state: Any
  adv_state: Any
  coef_state: Any
  step: jax.Array
  key: jax.Array
  critic: Any = None


class RLBatch(NamedTuple):
  """One rollout batch for ``rl_step``; ``N`` rows, ``L = P + T`` columns.

  Attributes:
    tokens_NxL: int32, prompt then completion.
    input_mask_NxL: bool, real tokens.
    loss_mask_NxL: bool, completion tokens that are trained on.
    advantages_N: fp32 ``[N]``, or ``[N, L]`` per token (KTAE; 0 on the
      prompt columns).
    sampler_logprobs_NxL: fp32, ``log mu`` of the sampled tokens (0 elsewhere).
    old_logprobs_NxL: fp32 ``log pi_old`` from the sampler (its
      ``policy_logprobs``) with ``old_logprobs="sampler"``; None otherwise.
  """

  tokens_NxL: jax.Array
  input_mask_NxL: jax.Array
  loss_mask_NxL: jax.Array
  advantages_N: jax.Array
  sampler_logprobs_NxL: jax.Array
  old_logprobs_NxL: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
  """Static settings of ``rl_step``.

  Attributes:
    num_epochs, num_minibatches, num_microbatches: see the module docstring.
    aggregation: loss aggregation (``objectives.AGGREGATIONS``).
    max_length: the generation budget (Dr.GRPO's constant normaliser).
    kl_coef: weight of the k3 KL to the reference params.
    entropy_coef: weight of the entropy bonus.
    training_temperature: logits are divided by it.
    logprob_chunk_size: time chunk of the logprob computation.
    completion_length: the last ``T`` columns of a row, the only ones that
      can carry loss (``RLBatch``'s completion, ``sampler.max_new_tokens``):
      only they are scored, so the output projection and log-softmax run on
      ``T`` positions, not ``L - 1``. None scores every column.
    logprob_remat: rematerialise the logprob chunks in the backward pass
      (``logprobs.token_logprobs``); None chooses by the size of the logits.
    entropy_metric: report the ``entropy`` metric. The entropy is computed
      only when it is reported or ``entropy_coef > 0``.
    old_logprobs: ``"recompute"`` or ``"sampler"`` (module docstring).
    ess_kl_coef: weight of FeynRL's ``(1 - ESS)`` pull toward ``mu``.
    ess_pooling: ``"microbatch"`` or ``"minibatch"``.
    critic: PPO with a value model (``critic.CriticConfig``): the batch's
      ``advantages_N`` are then the sequences' rewards, turned into
      token-level GAE advantages with the critic's values, and the critic
      is trained in the same step (``make_rl_step``'s ``critic_optimizer``,
      ``TrainState.critic``). None: no critic.
    distill_coef: weight of on-policy distillation's per-token reverse KL
      to a teacher (``distill.distill_advantages``; ``rl_step``'s
      ``teacher_params``); 0 turns it off.
    teacher_temperature: the teacher's logits are divided by it.
    kl_estimator: the KL term's estimator (``objectives.KL_ESTIMATORS``,
      default ``"k3"``; ``"k3_is"`` reweights by ``pi_theta / pi_old``).
    rejection: ``objectives.Rejection`` criteria (verl's rollout
      rejection): before the minibatch normalisers are computed, tokens or
      sequences whose ``pi_old`` vs ``mu`` statistic fails a criterion leave
      the loss mask, so they also leave the normaliser (unlike
      ``masked_is``). ``pi_old`` is the recomputed one (the recompute pass
      then always runs, even with one update per step) or, with
      ``old_logprobs="sampler"``, the sampler's ``policy_logprobs``.
    kl_cov_coef, kl_cov_ratio: KL-Cov's penalty
      (``objectives.kl_cov_penalty``), added when ``kl_cov_coef > 0``.
    max_log_ratio: clamp of ``log pi_theta - log pi_old`` in the ratio
      (verl: 20; TRL: none).
    count_empty_sequences: the sequence normaliser counts every row of the
      minibatch (TRL's ``grpo`` / ``dr_grpo``), not only rows with a valid
      token (verl, rljax's default).
  """

  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1
  aggregation: str = "token_mean"
  max_length: int | None = None
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  training_temperature: float = 1.0
  logprob_chunk_size: int = 128
  completion_length: int | None = None
  logprob_remat: bool | None = None
  entropy_metric: bool = True
  old_logprobs: str = "recompute"
  ess_kl_coef: float = 0.0
  ess_pooling: str = "microbatch"
  critic: critic_lib.CriticConfig | None = None
  distill_coef: float = 0.0
  teacher_temperature: float = 1.0
  kl_estimator: str = "k3"
  rejection: tuple[obj_lib.Rejection, ...] = ()
  kl_cov_coef: float = 0.0
  kl_cov_ratio: float = 2e-4
  max_log_ratio: float = 20.0
  count_empty_sequences: bool = False

  def __post_init__(self):
    if self.kl_estimator not in obj_lib.KL_ESTIMATORS:
      raise ValueError(f"rl.kl_estimator={self.kl_estimator!r}; accepted: "
                       f"{obj_lib.KL_ESTIMATORS}.")
    if self.old_logprobs not in OLD_LOGPROBS:
      raise ValueError(f"rl.old_logprobs={self.old_logprobs!r}; accepted: "
                       f"{OLD_LOGPROBS}.")
    if self.ess_pooling not in ("microbatch", "minibatch"):
      raise ValueError(f"ess_pooling={self.ess_pooling!r}; accepted: "
                       "('microbatch', 'minibatch').")
    if self.aggregation not in obj_lib.AGGREGATIONS:
      raise ValueError(f"rl.aggregation={self.aggregation!r}; accepted: "
                       f"{obj_lib.AGGREGATIONS}.")
    if self.completion_length is not None and self.completion_length < 1:
      raise ValueError(f"completion_length={self.completion_length}: a "
                       "positive integer or None is accepted.")


def _logprobs(params, model_config, tokens, input_mask, cfg,
              with_entropy=False):
  """``(logp, entropy or None)`` of the scored columns (the last
  ``cfg.completion_length``, or all)."""
  return models.sequence_logprobs(params, model_config, tokens, input_mask,
                                  temperature=cfg.training_temperature,
                                  chunk_size=cfg.logprob_chunk_size,
                                  num_scored=cfg.completion_length,
                                  with_entropy=with_entropy,
                                  remat=cfg.logprob_remat)


def _forward_logprobs(params, model_config, tokens, input_mask, cfg, chunks):
  """Logprobs without gradient, in ``chunks`` row chunks (bounded memory)."""
  n = tokens.shape[0]
  t = tokens.reshape(chunks, n // chunks, -1)
  m = input_mask.reshape(chunks, n // chunks, -1)
  lp = jax.lax.map(lambda x: _logprobs(params, model_config, x[0], x[1],
                                       cfg)[0], (t, m))
  return jax.lax.stop_gradient(lp.reshape(n, -1))


def _token_ess_stats(lp, sampler_lp, mask, max_log_ratio=20.0):
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


def make_rl_step(model_config: models.ModelConfig, cfg: RLStepConfig,
                 optimizer: optax.GradientTransformation,
                 coef_tx: optax.GradientTransformationExtraArgs,
                 critic_optimizer: optax.GradientTransformation | None = None,
                 teacher_config: models.ModelConfig | None = None):
  """Returns the pure function ``rl_step(state, batch, ref_params,
  teacher_params)``.

  The caller jits it (``jit_rl_step`` states the shardings). ``ref_params``
  is only read when ``cfg.kl_coef > 0``, ``teacher_params`` only when
  ``cfg.distill_coef > 0`` (pass None otherwise). With ``cfg.critic``,
  ``critic_optimizer`` updates ``state.critic`` (``critic.make_optimizer``);
  ``teacher_config`` is the teacher's model config (default: the policy's).
  """
  if cfg.critic is not None and critic_optimizer is None:
    raise ValueError("make_rl_step: RLStepConfig.critic is set but "
                     "critic_optimizer=None: pass the critic's optimizer "
                     "(rljax.train.critic.make_optimizer).")
  teacher_config = teacher_config or model_config
  optimizer = optax.with_extra_args_support(optimizer)
  num_updates = cfg.num_epochs * cfg.num_minibatches
  with_entropy = bool(cfg.entropy_coef) or cfg.entropy_metric
  sampler_old = cfg.old_logprobs == "sampler"
  reuse_current_as_old = num_updates == 1 and not sampler_old

  def microbatch_loss(params, mb, coef_state, normalizers, pooled_ess,
                      critic_params=None):
    lp, ent = _logprobs(params, model_config, mb["tokens"], mb["input_mask"],
                        cfg, with_entropy)
    mask = mb["loss_mask"]
    sampler_lp = mb["sampler_logprobs"]
    old = jax.lax.stop_gradient(lp) if reuse_current_as_old else mb["old_logprobs"]
    ratio = obj_lib.importance_ratio(lp, old, mask,
                                     max_log_ratio=cfg.max_log_ratio)
    token_ess_stats = _token_ess_stats(lp, sampler_lp, mask)
    ess = (obj_lib.ess_from_statistics(token_ess_stats) if pooled_ess is None
           else pooled_ess)
    adv = mb["advantages"]
    if cfg.distill_coef:
      adv, reverse_kl = distill_lib.distill_advantages(
          adv, old, mb["teacher_logprobs"], mask, cfg.distill_coef)
    coef, coef_state = coef_tx.update(
        ratio, coef_state, advantages_BxT=adv, mask_BxT=mask,
        old_logprobs_BxT=old, sampler_logprobs_BxT=sampler_lp, ess=ess)
    pg = obj_lib.policy_gradient_loss(coef, adv, lp, mask, cfg.aggregation,
                                      **normalizers)
    loss = pg
    weight = jnp.sum(mask) / jnp.maximum(normalizers["num_tokens"], 1.0)
    metrics = {"pg_loss": pg, "ess/token": ess * weight}
    if cfg.entropy_metric:
      metrics["entropy"] = obj_lib.aggregate_loss(
          jax.lax.stop_gradient(ent), mask, "token_mean",
          num_tokens=normalizers["num_tokens"])
    if cfg.entropy_coef:
      loss = loss + cfg.entropy_coef * obj_lib.entropy_loss(
          ent, mask, cfg.aggregation, **normalizers)
    if cfg.kl_coef:
      kl = obj_lib.aggregate_loss(
          obj_lib.kl_penalty(lp, mb["ref_logprobs"], cfg.kl_estimator,
                             old_logprobs_BxT=old), mask, cfg.aggregation,
          **normalizers)
      loss = loss + cfg.kl_coef * kl
      metrics["kl"] = kl
    if cfg.ess_kl_coef:
      pull = obj_lib.aggregate_loss(
          obj_lib.ess_kl_penalty(lp, sampler_lp, ess), mask, cfg.aggregation,
          **normalizers)
      loss = loss + cfg.ess_kl_coef * pull
      metrics["ess_kl"] = pull
    if cfg.kl_cov_coef:
      penalty = obj_lib.aggregate_loss(
          obj_lib.kl_cov_penalty(lp, old, adv, mask, kl_ratio=cfg.kl_cov_ratio,
                                 kl_coef=cfg.kl_cov_coef), mask,
          cfg.aggregation, **normalizers)
      loss = loss + penalty
      metrics["kl_cov_penalty"] = penalty
    rm = obj_lib.ratio_metrics(ratio, mask, advantages_BxT=jnp.broadcast_to(
        adv if adv.ndim == 2 else adv[:, None], mask.shape))
    for k in ("ratio_mean", "clip_frac", "clip_frac_low", "clip_frac_high"):
      metrics[k] = rm[k] * weight  # token-weighted across microbatches
    metrics["coef_mean"] = obj_lib.coefficient_metrics(coef, mask)[
        "coef_mean"] * weight
    if cfg.distill_coef:  # token mean over the minibatch (summed over micro)
      metrics["distill/reverse_kl"] = jnp.sum(reverse_kl) / jnp.maximum(
          normalizers["num_tokens"], 1.0)
    if critic_params is not None:  # its own params tree: no policy gradient
      value_loss, critic_metrics = critic_lib.value_loss(
          critic_params, model_config, mb, cfg.critic, cfg.aggregation,
          normalizers)
      loss = loss + value_loss
      metrics.update(critic_metrics)
    sums = {"seq_ess": _sequence_ess_stats(old, sampler_lp, mask),
            "mismatch": mismatch_statistics(lp, sampler_lp, mask)}
    return loss, (metrics, sums, coef_state)

  def trained_loss(trained, mb, coef_state, normalizers, pooled_ess):
    """The loss of the trained trees: the policy's, or (policy, critic)."""
    if cfg.critic is None:
      return microbatch_loss(trained, mb, coef_state, normalizers, pooled_ess)
    return microbatch_loss(trained[0], mb, coef_state, normalizers,
                           pooled_ess, trained[1])

  grad_fn = jax.grad(trained_loss, has_aux=True)

  def minibatch_token_ess(params, micro):
    """FeynRL's ESS pooled over the whole minibatch (one no-grad pass)."""
    def stats(mb):
      lp, _ = _logprobs(params, model_config, mb["tokens"], mb["input_mask"],
                        cfg)
      return _token_ess_stats(lp, mb["sampler_logprobs"], mb["loss_mask"])
    per_micro = jax.lax.map(stats, micro)
    return obj_lib.ess_from_statistics(jax.tree.map(jnp.sum, per_micro))

  def update(carry, indices_KxM, batch):
    params, opt_state, coef_state, critic = carry
    trained = params if critic is None else (params, critic.params)
    k, m = indices_KxM.shape
    mb_all = jax.tree.map(lambda x: jnp.take(x, indices_KxM.reshape(-1), axis=0),
                          batch)
    mask = mb_all["loss_mask"]
    # At least 1, so an all-masked minibatch (e.g. all rejected) gives 0.
    num_sequences = (float(mask.shape[0]) if cfg.count_empty_sequences
                     else jnp.sum(jnp.any(mask, -1), dtype=jnp.float32))
    normalizers = {
        "num_tokens": jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0),
        "num_sequences": jnp.maximum(num_sequences, 1.0),
        "max_length": cfg.max_length,
    }
    micro = jax.tree.map(lambda x: x.reshape(k, m, *x.shape[1:]), mb_all)
    pooled = (minibatch_token_ess(params, micro)
              if cfg.ess_pooling == "minibatch" else None)

    def accumulate(acc, mb):
      grads_acc, metrics_acc, sums_acc, coef_state = acc
      grads, (metrics, sums, coef_state) = grad_fn(trained, mb, coef_state,
                                                   normalizers, pooled)
      return (jax.tree.map(jnp.add, grads_acc, grads),
              jax.tree.map(jnp.add, metrics_acc, metrics),
              {"seq_ess": jax.tree.map(jnp.add, sums_acc["seq_ess"],
                                       sums["seq_ess"]),
               "mismatch": _accumulate(sums_acc["mismatch"], sums["mismatch"])},
              coef_state), None

    zeros = jax.tree.map(jnp.zeros_like, trained)
    shapes = jax.eval_shape(
        lambda: grad_fn(trained, jax.tree.map(lambda x: x[0], micro), coef_state,
                        normalizers, pooled)[1][:2])
    metric_zeros, sums_zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (grads, metrics, sums, coef_state), _ = jax.lax.scan(
        accumulate, (zeros, metric_zeros, sums_zeros, coef_state), micro)
    # Summed over microbatches: pg_loss/kl/entropy use the minibatch's global
    # normalisers and the ratio statistics are token-weighted, so sums are means.
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
    updates, opt_state = optimizer.update(grads, opt_state, params, ess=seq_ess)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, coef_state, critic), (metrics, sums["mismatch"])

  def rl_step(state: TrainState, batch: RLBatch, ref_params=None,
              teacher_params=None):
    n, length = batch.tokens_NxL.shape
    if cfg.completion_length is not None and cfg.completion_length >= length:
      raise ValueError(
          f"rl_step: completion_length={cfg.completion_length} must be below "
          f"the batch's row length L={length} (L = prompt + completion).")
    # Per-token arrays keep only the scored columns (``_logprobs``).
    scored = ((lambda x: x) if cfg.completion_length is None
              else lambda x: x[:, length - cfg.completion_length:])
    key, shuffle_key = jax.random.split(jax.random.wrap_key_data(state.key))
    data = {
        "tokens": batch.tokens_NxL, "input_mask": batch.input_mask_NxL,
        "loss_mask": scored(batch.loss_mask_NxL),
        # [N], or [N, L] per token (KTAE).
        "advantages": (batch.advantages_N if batch.advantages_N.ndim == 1
                       else scored(batch.advantages_N)),
        "sampler_logprobs": scored(batch.sampler_logprobs_NxL),
    }
    chunks = cfg.num_minibatches * cfg.num_microbatches
    if sampler_old:
      if batch.old_logprobs_NxL is None:
        raise ValueError(
            "rl_step: RLStepConfig.old_logprobs='sampler' needs "
            "RLBatch.old_logprobs_NxL (the sampler's policy_logprobs); build "
            "the sampler with record_policy_logprobs=True.")
      data["old_logprobs"] = scored(batch.old_logprobs_NxL)
    elif not reuse_current_as_old:
      data["old_logprobs"] = _forward_logprobs(
          state.params, model_config, batch.tokens_NxL, batch.input_mask_NxL,
          cfg, chunks)
    if cfg.rejection:
      if "old_logprobs" not in data:
        data["old_logprobs"] = _forward_logprobs(
            state.params, model_config, batch.tokens_NxL, batch.input_mask_NxL,
            cfg, chunks)
      full_mask = data["loss_mask"]
      data["loss_mask"] = obj_lib.rejection_mask(
          data["old_logprobs"], data["sampler_logprobs"], full_mask,
          cfg.rejection)
      rejected = (jnp.sum(full_mask & ~data["loss_mask"], dtype=jnp.float32)
                  / jnp.maximum(jnp.sum(full_mask, dtype=jnp.float32), 1.0))
    if cfg.kl_coef:
      data["ref_logprobs"] = _forward_logprobs(
          ref_params, model_config, batch.tokens_NxL, batch.input_mask_NxL,
          cfg, chunks)
    # Teacher logprobs and values cover every column; keep those of loss_mask.
    width = data["loss_mask"].shape[1]

    def last(x):
      return x[:, x.shape[1] - width:]

    if cfg.distill_coef:
      data["teacher_logprobs"] = last(distill_lib.teacher_logprobs(
          teacher_params, teacher_config, batch.tokens_NxL,
          batch.input_mask_NxL, temperature=cfg.teacher_temperature,
          chunk_size=cfg.logprob_chunk_size, chunks=chunks))
    if cfg.critic is not None:
      # verl's order: V_old of the whole batch, then GAE, then the updates.
      data["old_values"] = last(critic_lib.forward_values(
          state.critic.params, model_config, batch.tokens_NxL,
          batch.input_mask_NxL, chunks))
      adv, data["returns"] = gae_lib.gae_advantages(
          batch.advantages_N, data["old_values"], data["loss_mask"],
          cfg.critic.gamma, cfg.critic.lam)
      data["advantages"] = (gae_lib.whiten_advantages(adv, data["loss_mask"])
                            if cfg.critic.whiten else adv)
    if num_updates == 1:
      order = jnp.arange(n)[None]
    else:
      keys = jax.random.split(shuffle_key, cfg.num_epochs)
      order = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
    indices = order.reshape(num_updates, cfg.num_microbatches,
                            n // (cfg.num_minibatches * cfg.num_microbatches))
    (params, opt_state, coef_state, critic), (metrics, mismatch) = (
        jax.lax.scan(lambda carry, idx: update(carry, idx, data),
                     (state.params, state.opt_state, state.coef_state,
                      state.critic), indices))
    metrics = jax.tree.map(jnp.mean, metrics)
    if "old_logprobs" in data and not sampler_old:
      # The recomputed pi_old is the trainer at the sampler's params.
      mismatch = mismatch_statistics(data["old_logprobs"],
                                     data["sampler_logprobs"], data["loss_mask"])
    else:
      # The first update's forward ran at the sampler's params.
      mismatch = jax.tree.map(lambda x: x[0], mismatch)
    metrics.update(_mismatch_metrics(mismatch))
    if cfg.rejection:
      metrics["rejection/frac_tokens"] = rejected
    metrics.update(optim_lib.optimizer_metrics(opt_state))
    new_state = state._replace(params=params, opt_state=opt_state,
                               coef_state=coef_state, step=state.step + 1,
                               key=jax.random.key_data(key), critic=critic)
    return new_state, metrics

  return rl_step


def batch_shardings(mesh: jax.sharding.Mesh, old_logprobs: bool) -> RLBatch:
  """``RLBatch`` of shardings: rows split over the mesh's batch axes."""
  b2, b1 = sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 1)
  return RLBatch(b2, b2, b2, b1, b2, b2 if old_logprobs else None)


def jit_rl_step(rl_step, mesh: jax.sharding.Mesh, state_shardings: Any,
                ref_shardings: Any = None, *, old_logprobs: bool = False,
                teacher_shardings: Any = None):
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
  """
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  teacher = () if teacher_shardings is None else (teacher_shardings,)
  return jax.jit(
      rl_step,
      in_shardings=(state_shardings, batch_shardings(mesh, old_logprobs),
                    ref_shardings) + teacher,
      out_shardings=(state_shardings, replicated),
      donate_argnums=(0,))


def make_sft_step(model_config: models.ModelConfig,
                  optimizer: optax.GradientTransformation,
                  chunk_size: int = 128):
  """``sft_step(params, opt_state, tokens, input_mask, loss_mask)``:
  token-mean cross-entropy on the completion tokens only."""

  def loss_fn(params, tokens, input_mask, loss_mask):
    lp, _ = models.sequence_logprobs(params, model_config, tokens, input_mask,
                                     chunk_size=chunk_size, with_entropy=False)
    return obj_lib.aggregate_loss(-lp, loss_mask, "token_mean")

  def sft_step(params, opt_state, tokens, input_mask, loss_mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, input_mask,
                                              loss_mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "sft_loss": loss, "grad_norm": optax.tree.norm(grads)}

  return sft_step
