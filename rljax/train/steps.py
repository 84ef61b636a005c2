"""The train state and the jitted RL step: prepared inputs, then a sum of loss terms.

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

import dataclasses
from collections.abc import Callable
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
from rljax.train import schema

OLD_LOGPROBS = schema.fields()["rl.old_logprobs"].choices
ESS_POOLINGS = schema.fields()["rl.ess_pooling"].choices


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
    advantages_NxL: fp32 per-token advantages (0 on the prompt columns). An
      ``[N]`` array is taken as one advantage per row (broadcast over its
      columns). With a critic it is not read (GAE's advantages are computed
      in the step from ``rewards_N``).
    sampler_logprobs_NxL: fp32, ``log mu`` of the sampled tokens (0 elsewhere).
    old_logprobs_NxL: fp32 ``log pi_old`` from the sampler (its
      ``policy_logprobs``) with ``old_logprobs="sampler"``; None otherwise.
    rewards_N: fp32, each row's weighted reward: GAE's input with a critic
      (``RLStepConfig.critic``); None otherwise.
  """

  tokens_NxL: jax.Array
  input_mask_NxL: jax.Array
  loss_mask_NxL: jax.Array
  advantages_NxL: jax.Array
  sampler_logprobs_NxL: jax.Array
  old_logprobs_NxL: jax.Array | None = None
  rewards_N: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
  """Static settings of ``rl_step``.

  Attributes:
    num_epochs, num_minibatches, num_microbatches: see the module docstring.
    aggregation: loss aggregation (``objectives.AGGREGATIONS``).
    completion_length: ``T``, the generation budget: the last ``T``
      columns of a row, the only ones that can carry loss, and Dr.GRPO's
      constant normaliser. None: any column may carry loss (and the
      normaliser is the row length ``L``).
    score_completion_only: with ``completion_length``, only the last ``T``
      columns are scored (the output projection and log-softmax run on
      ``T`` positions, not ``L - 1``); False scores every column (the same
      loss, more work).
    kl_coef: weight of the KL to the reference params.
    entropy_coef: weight of the entropy bonus.
    training_temperature: logits are divided by it.
    logprob_chunk_size: time chunk of the logprob computation.
    logprob_remat: rematerialise the logprob chunks in the backward pass
      (``logprobs.token_logprobs``); None chooses by the size of the logits.
    entropy_metric: report the ``entropy`` metric. The entropy is computed
      only when it is reported or ``entropy_coef > 0``.
    old_logprobs: ``"recompute"`` or ``"sampler"`` (module docstring).
    ess_kl_coef: weight of FeynRL's ``(1 - ESS)`` pull toward ``mu``.
    ess_pooling: ``"microbatch"`` or ``"minibatch"``.
    critic: PPO with a value model (``critic.CriticConfig``): the batch's
      ``rewards_N`` are turned into token-level GAE advantages with the
      critic's values, and the critic is trained in the same step
      (``make_rl_step``'s ``critic_optimizer``, ``TrainState.critic``).
      None: no critic.
    distill_coef: weight of on-policy distillation's per-token reverse KL
      to a teacher (``distill.distill_advantages``; ``rl_step``'s
      ``teacher_params``); 0 turns it off.
    teacher_temperature: the teacher's logits are divided by it.
    kl_estimator: the KL term's estimator (``objectives.KL_ESTIMATORS``;
      ``"k3_is"`` reweights by ``pi_theta / pi_old``).
    rejection: ``objectives.Rejection`` criteria (verl's rollout
      rejection): before the minibatch normalisers are computed, tokens or
      sequences whose ``pi_old`` vs ``mu`` statistic fails a criterion leave
      the loss mask, so they also leave the normaliser (unlike
      ``masked_is``). ``pi_old`` is the recomputed one (the recompute pass
      then always runs, even with one update per step) or, with
      ``old_logprobs="sampler"``, the sampler's ``policy_logprobs``.
    kl_cov_coef, kl_cov_ratio: KL-Cov's penalty
      (``objectives.kl_cov_penalty``), added when ``kl_cov_coef > 0``.
    dro_beta: DRO's quadratic pull (``objectives.dro_penalty``), added
      when ``> 0``.
    max_log_ratio: clamp of ``log pi_theta - log pi_old`` in the ratio and
      of ``log pi_theta - log mu`` in the token ESS (verl: 20; TRL: none).
    count_empty_sequences: the sequence normaliser counts every row of the
      minibatch (TRL's ``grpo`` / ``dr_grpo``), not only rows with a valid
      token (verl, rljax's default).
  """

  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1
  aggregation: str = "token_mean"
  completion_length: int | None = None
  score_completion_only: bool = True
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  training_temperature: float = 1.0
  logprob_chunk_size: int = 128
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
  dro_beta: float = 0.0
  max_log_ratio: float = 20.0
  count_empty_sequences: bool = False

  def __post_init__(self):
    for field, value, accepted in (
        ("rl.kl_estimator", self.kl_estimator, obj_lib.KL_ESTIMATORS),
        ("rl.old_logprobs", self.old_logprobs, OLD_LOGPROBS),
        ("rl.ess_pooling", self.ess_pooling, ESS_POOLINGS),
        ("rl.aggregation", self.aggregation, obj_lib.AGGREGATIONS)):
      if value not in accepted:
        raise ValueError(f"{field}={value!r}; accepted: {tuple(accepted)}.")
    if self.completion_length is not None and self.completion_length < 1:
      raise ValueError(f"completion_length={self.completion_length}: a "
                       "positive integer or None is accepted.")

  @property
  def scored_columns(self) -> int | None:
    """The last columns the logprobs are computed for (None: all)."""
    return self.completion_length if self.score_completion_only else None

  @property
  def num_updates(self) -> int:
    """Optimizer updates per step."""
    return self.num_epochs * self.num_minibatches

  @property
  def reuses_current_as_old(self) -> bool:
    """One update per step from recomputed ``pi_old``: ``pi_old`` is
    ``sg(pi_theta)`` of the update's own forward pass."""
    return self.num_updates == 1 and self.old_logprobs == "recompute"


class StepInputs(NamedTuple):
  """What the loss terms read, per row; ``T`` = the scored columns.

  Attributes:
    tokens_NxL, input_mask_NxL: the rows (the forward pass reads all ``L``).
    loss_mask_NxT: bool, the trained tokens (after rejection).
    advantages_NxT: fp32 advantages (GAE's with a critic).
    sampler_logprobs_NxT: fp32 ``log mu``.
    old_logprobs_NxT: fp32 ``log pi_old``; None when it is ``sg`` of the
      update's own logprobs (``RLStepConfig.reuses_current_as_old``).
    ref_logprobs_NxT: the reference policy's, with a KL term; else None.
    teacher_logprobs_NxT: the teacher's, with distillation; else None.
    old_values_NxT, returns_NxT: the critic's ``V_old`` and GAE's returns;
      None without a critic.
  """

  tokens_NxL: jax.Array
  input_mask_NxL: jax.Array
  loss_mask_NxT: jax.Array
  advantages_NxT: jax.Array
  sampler_logprobs_NxT: jax.Array
  old_logprobs_NxT: jax.Array | None = None
  ref_logprobs_NxT: jax.Array | None = None
  teacher_logprobs_NxT: jax.Array | None = None
  old_values_NxT: jax.Array | None = None
  returns_NxT: jax.Array | None = None


class Normalizers(NamedTuple):
  """The minibatch's loss normalisers (``objectives.aggregate_loss``)."""

  num_tokens: jax.Array
  num_sequences: jax.Array
  max_length: int | None


class Forward(NamedTuple):
  """One microbatch's forward pass, as every loss term reads it (``[B, T]``).

  Attributes:
    logprobs: ``log pi_theta`` (carries the gradient).
    entropy: the policy's entropy, or None when not needed.
    old_logprobs: ``log pi_old`` (no gradient).
    ratio: ``pi_theta / pi_old`` (``objectives.importance_ratio``).
    coefficient: the coefficient chain's ``c`` (no gradient).
    advantages: after distillation's reverse-KL term, if any.
    reverse_kl: distillation's per-token estimate, or None.
    ess: FeynRL's token ESS (pooled as configured).
    mask: the trained tokens.
    sampler_logprobs: ``log mu``.
  """

  logprobs: jax.Array
  entropy: jax.Array | None
  old_logprobs: jax.Array
  ratio: jax.Array
  coefficient: jax.Array
  advantages: jax.Array
  reverse_kl: jax.Array | None
  ess: jax.Array
  mask: jax.Array
  sampler_logprobs: jax.Array


def _scored_logprobs(params, model_config, tokens, input_mask,
                     cfg: RLStepConfig, with_entropy=False):
  """``(logp, entropy or None)`` of the scored columns."""
  return models.sequence_logprobs(params, model_config, tokens, input_mask,
                                  temperature=cfg.training_temperature,
                                  chunk_size=cfg.logprob_chunk_size,
                                  num_scored=cfg.scored_columns,
                                  with_entropy=with_entropy,
                                  remat=cfg.logprob_remat)


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
# Step inputs.


def check_batch(batch: RLBatch) -> None:
  """Shape contract of ``RLBatch``, checked at trace time (no compile).

  Raises:
    ValueError: naming the field, its shape and the shape it must have.
  """
  if batch.tokens_NxL.ndim != 2:
    raise ValueError(f"RLBatch.tokens_NxL has shape {batch.tokens_NxL.shape}; "
                     "[N, L] is required.")
  n, length = batch.tokens_NxL.shape
  for name in ("input_mask_NxL", "loss_mask_NxL", "sampler_logprobs_NxL",
               "old_logprobs_NxL"):
    x = getattr(batch, name)
    if x is not None and x.shape != (n, length):
      raise ValueError(f"RLBatch.{name} has shape {x.shape}; the tokens' "
                       f"[N, L] = {(n, length)} is required.")
  if batch.advantages_NxL.shape not in ((n, length), (n,)):
    raise ValueError(
        f"RLBatch.advantages_NxL has shape {batch.advantages_NxL.shape}; "
        f"[N, L] = {(n, length)} or one per row, [N] = ({n},), is required.")
  if batch.rewards_N is not None and batch.rewards_N.shape != (n,):
    raise ValueError(f"RLBatch.rewards_N has shape {batch.rewards_N.shape}; "
                     f"[N] = ({n},) is required.")


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
  chunks = cfg.num_minibatches * cfg.num_microbatches

  def no_grad_logprobs(params):
    return models.map_row_chunks(
        lambda x, m: _scored_logprobs(params, model_config, x, m, cfg)[0],
        chunks, tokens, input_mask)

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
    teacher = last(models.map_row_chunks(
        lambda x, m: models.sequence_logprobs(
            teacher_params, teacher_config, x, m,
            temperature=cfg.teacher_temperature,
            chunk_size=cfg.logprob_chunk_size)[0], chunks, tokens, input_mask))
  old_values = returns = None
  if cfg.critic is not None:
    if batch.rewards_N is None:
      raise ValueError("rl_step: RLStepConfig.critic is set but "
                       "RLBatch.rewards_N is None: GAE needs each row's "
                       "reward.")
    # verl's order: V_old of the whole batch, then GAE, then the updates.
    old_values = last(models.map_row_chunks(
        lambda x, m: critic_lib.values(state.critic.params, model_config, x,
                                       m), chunks, tokens, input_mask))
    adv, returns = gae_lib.gae_advantages(batch.rewards_N, old_values,
                                          loss_mask, cfg.critic.gamma,
                                          cfg.critic.lam)
    if cfg.critic.whiten:
      adv = gae_lib.whiten_advantages(adv, loss_mask)
  inputs = StepInputs(
      tokens, input_mask, loss_mask, adv, sampler_lp,
      old_logprobs_NxT=None if cfg.reuses_current_as_old else old,
      ref_logprobs_NxT=(no_grad_logprobs(ref_params) if cfg.kl_coef
                        else None),
      teacher_logprobs_NxT=teacher, old_values_NxT=old_values,
      returns_NxT=returns)
  return inputs, rejected, old


# ----------------------------------------------------------------------------
# Loss terms: each (loss, metrics) of one microbatch.


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
  """``kl_coef * aggregate(KL(pi_theta || pi_ref))`` (``cfg.kl_estimator``)."""
  kl = obj_lib.aggregate_loss(
      obj_lib.kl_penalty(fwd.logprobs, mb.ref_logprobs_NxT, cfg.kl_estimator,
                         old_logprobs_BxT=fwd.old_logprobs),
      fwd.mask, cfg.aggregation, **norm._asdict())
  return cfg.kl_coef * kl, {"kl": kl}


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
      (entropy_term, cfg.entropy_coef), (kl_term, cfg.kl_coef),
      (ess_kl_term, cfg.ess_kl_coef), (kl_cov_term, cfg.kl_cov_coef),
      (dro_term, cfg.dro_beta)) if on)


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
  is only read when ``cfg.kl_coef > 0``, ``teacher_params`` only when
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
                               mb.input_mask_NxL, cfg, with_entropy)
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
    return Forward(lp, ent, old, ratio, coef, adv, reverse_kl, ess, mask,
                   sampler_lp), coef_state

  def loss_fn(trained, mb: StepInputs, coef_state, norm: Normalizers,
              pooled_ess):
    params, critic_params = trained if cfg.critic is not None else (trained,
                                                                     None)
    fwd, coef_state = forward(params, mb, coef_state, pooled_ess)
    loss, metrics = policy_gradient_term(fwd, mb, cfg, norm)
    for term in terms:
      term_loss, term_metrics = term(fwd, mb, cfg, norm)
      loss = loss + term_loss
      metrics.update(term_metrics)
    if critic_params is not None:  # its own params tree: no policy gradient
      value_loss, critic_metrics = critic_lib.value_loss(
          critic_params, model_config, mb.tokens_NxL, mb.input_mask_NxL,
          mb.loss_mask_NxT, mb.old_values_NxT, mb.returns_NxT, cfg.critic,
          cfg.aggregation, norm._asdict())
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
                               mb.input_mask_NxL, cfg)
      return _token_ess_stats(lp, mb.sampler_logprobs_NxT, mb.loss_mask_NxT,
                              cfg.max_log_ratio)
    return obj_lib.ess_from_statistics(
        jax.tree.map(jnp.sum, jax.lax.map(stats, micro)))

  def update(carry, indices_KxM, inputs: StepInputs):
    params, opt_state, coef_state, critic = carry
    trained = params if critic is None else (params, critic.params)
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
    pooled = (minibatch_token_ess(params, micro)
              if cfg.ess_pooling == "minibatch" else None)

    def accumulate(acc, mb):
      grads_acc, metrics_acc, sums_acc, coef_state = acc
      grads, (metrics, sums, coef_state) = grad_fn(trained, mb, coef_state,
                                                   norm, pooled)
      return (jax.tree.map(jnp.add, grads_acc, grads),
              jax.tree.map(jnp.add, metrics_acc, metrics),
              {"seq_ess": jax.tree.map(jnp.add, sums_acc["seq_ess"],
                                       sums["seq_ess"]),
               "mismatch": _accumulate(sums_acc["mismatch"], sums["mismatch"])},
              coef_state), None

    zeros = jax.tree.map(jnp.zeros_like, trained)
    shapes = jax.eval_shape(
        lambda: grad_fn(trained, jax.tree.map(lambda x: x[0], micro),
                        coef_state, norm, pooled)[1][:2])
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
    updates, opt_state = optimizer.update(grads, opt_state, params, ess=seq_ess)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, coef_state, critic), (metrics, sums["mismatch"])

  def rl_step(state: TrainState, batch: RLBatch, ref_params=None,
              teacher_params=None):
    inputs, rejected, old = prepare_inputs(cfg, model_config, state, batch,
                                           ref_params, teacher_params,
                                           teacher_config)
    n = batch.tokens_NxL.shape[0]
    key, shuffle_key = jax.random.split(jax.random.wrap_key_data(state.key))
    if cfg.num_updates == 1:
      order = jnp.arange(n)[None]
    else:
      keys = jax.random.split(shuffle_key, cfg.num_epochs)
      order = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
    indices = order.reshape(cfg.num_updates, cfg.num_microbatches,
                            n // (cfg.num_minibatches * cfg.num_microbatches))
    (params, opt_state, coef_state, critic), (metrics, mismatch) = (
        jax.lax.scan(lambda carry, idx: update(carry, idx, inputs),
                     (state.params, state.opt_state, state.coef_state,
                      state.critic), indices))
    metrics = jax.tree.map(jnp.mean, metrics)
    if old is not None and cfg.old_logprobs == "recompute":
      # The recomputed pi_old is the trainer at the sampler's params.
      mismatch = mismatch_statistics(old, inputs.sampler_logprobs_NxT,
                                     inputs.loss_mask_NxT)
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
    params: the policy params.
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
      params, algorithm.optimizer.init(params),
      algorithm.advantage.init(jnp.zeros((rows, num_rewards), jnp.float32)),
      algorithm.coefficient.init(jnp.zeros((micro, width), jnp.float32)),
      jnp.zeros((), jnp.int32), jax.random.key_data(key), critic)


def batch_shardings(mesh: jax.sharding.Mesh, old_logprobs: bool,
                    rewards: bool = False) -> RLBatch:
  """``RLBatch`` of shardings: rows split over the mesh's batch axes."""
  b2, b1 = sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 1)
  return RLBatch(b2, b2, b2, b2, b2, b2 if old_logprobs else None,
                 b1 if rewards else None)


def jit_rl_step(rl_step, mesh: jax.sharding.Mesh, state_shardings: Any,
                ref_shardings: Any = None, *, old_logprobs: bool = False,
                teacher_shardings: Any = None, rewards: bool = False):
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
  """
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  teacher = () if teacher_shardings is None else (teacher_shardings,)
  return jax.jit(
      rl_step,
      in_shardings=(state_shardings,
                    batch_shardings(mesh, old_logprobs, rewards),
                    ref_shardings) + teacher,
      out_shardings=(state_shardings, replicated),
      donate_argnums=(0,))
