"""The RL step's data: its state, batch, settings and what the loss terms read.

``TrainState`` (the checkpointed pytree), ``RLBatch`` (a rollout batch and
its shape contract, ``check_batch``), ``RLStepConfig`` (the step's static
settings), ``StepInputs`` (the batch's scored columns and the once-per-step
passes), ``Forward`` (one microbatch's forward pass) and ``Normalizers``.
The step itself is ``steps.py``; the loss terms ``loss_terms.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from rljax import objectives as obj_lib
from rljax.train import critic as critic_lib
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


class StepPlan(NamedTuple):
  """A padding-free step's plan, built on the host (``train/packing.py``).

  Attributes:
    order_UxKxM: int32, the rows of each update's microbatches (the step's
      own shuffle, ``steps.update_order``, computed ahead).
    packing: a ``models.Packing`` of each microbatch's rows, every leaf with
      leading ``[U, K]``.
  """

  order_UxKxM: Any
  packing: Any


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
    plan: a ``StepPlan``: every forward pass of the step runs padding-free
      on packed rows (``train/packing.py`` adds it); None: padded rows.
    token_rewards_NxL: fp32 per-token rewards (0 on the prompt columns):
      with a critic, GAE's input instead of ``rewards_N`` (a multi-turn
      batch, whose environment rewards sit on their turns:
      ``batch_layout.token_rewards``); None otherwise.
    kl_coef_N: fp32, the step's KL coefficient on every row (an adaptive
      KL controller's value: ``rljax/train/kl_control.py``); None: the
      config's ``RLStepConfig.kl_coef``.
  """

  tokens_NxL: jax.Array
  input_mask_NxL: jax.Array
  loss_mask_NxL: jax.Array
  advantages_NxL: jax.Array
  sampler_logprobs_NxL: jax.Array
  old_logprobs_NxL: jax.Array | None = None
  rewards_N: jax.Array | None = None
  plan: StepPlan | None = None
  token_rewards_NxL: jax.Array | None = None
  kl_coef_N: jax.Array | None = None


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
    log_kl: with ``kl_coef = 0``, the KL to the reference params is still
      computed and reported (``kl``), with no penalty: the loss and its
      gradient are unchanged (over-optimisation curves, ``rl.log_kl``).
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
    microbatch_tokens: 0 splits each minibatch into ``num_microbatches``
      microbatches of consecutive rows; ``> 0`` splits it by tokens: the
      fewest microbatches (at least ``num_microbatches``) that keep each
      one's real tokens within this budget, tokens balanced across them
      (verl's dynamic batch size). Read by the host's ``StepPlan``
      (``train/packing.py``), so it needs a padding-free step.
    packing_buckets: how many buffer counts a padding-free microbatch may
      compile (``train/packing.py``, ``bucket``): more fill the buffers
      closer to the real tokens and compile more step programs.
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
  log_kl: bool = False
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
  microbatch_tokens: int = 0
  packing_buckets: int = 8

  def __post_init__(self):
    for field, value, accepted in (
        ("rl.kl_estimator", self.kl_estimator, obj_lib.KL_ESTIMATORS),
        ("rl.old_logprobs", self.old_logprobs, OLD_LOGPROBS),
        ("rl.ess_pooling", self.ess_pooling, ESS_POOLINGS),
        ("rl.aggregation", self.aggregation, obj_lib.AGGREGATIONS)):
      if value not in accepted:
        raise ValueError(f"{field}={value!r}; accepted: {tuple(accepted)}.")
    if self.microbatch_tokens < 0:
      raise ValueError(f"rl.microbatch_tokens={self.microbatch_tokens}: 0 "
                       "(split by rows) or a positive token budget is "
                       "accepted.")
    if isinstance(self.packing_buckets, bool) or not isinstance(
        self.packing_buckets, int) or self.packing_buckets < 1:
      raise ValueError(f"rl.packing_buckets={self.packing_buckets!r}: a "
                       "positive integer is accepted.")
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
    packing: a microbatch's ``models.Packing`` (padding-free forward
      passes); None: padded.
    kl_coef_N: ``RLBatch.kl_coef_N``'s rows.
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
  packing: Any = None
  kl_coef_N: jax.Array | None = None


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
               "old_logprobs_NxL", "token_rewards_NxL"):
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
  if batch.plan is not None:
    order = batch.plan.order_UxKxM
    if order.ndim != 3 or order.shape[0] * order.shape[1] * order.shape[2] \
        % n:
      raise ValueError(f"RLBatch.plan.order_UxKxM has shape {order.shape}; "
                       f"[U, K, M] covering the {n} rows is required "
                       "(train/packing.py builds it).")
    slot = batch.plan.packing.slot_BxL
    if slot.shape != order.shape + (length,):
      raise ValueError(f"RLBatch.plan.packing.slot_BxL has shape "
                       f"{slot.shape}; {order.shape + (length,)} is "
                       "required.")
