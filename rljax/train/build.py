"""Config -> components: the only module that reads an ml_collections ConfigDict
(with ``_build_inputs.py``, its part for rewards, data, tokenizer and model,
whose names it re-exports).

``build(config)`` checks the config (``validate``, in ``_validate.py``,
before anything is compiled) and turns it into ``Components``: the mesh, the task's examples,
the tokenizer, the model config (and, with ``model.path``, the Hugging Face
checkpoint's params), the reward evaluator, the ``Algorithm`` and the step
settings. Everything below this module takes plain arguments or frozen
dataclasses, and the launchers call the public functions here (``load_task``,
``reward_specs``, ``sampler_config``, ...) instead of reading the config.

With ``model.path`` the run starts from a Hugging Face checkpoint: its
config, weights (``models.load_hf_pretrained``), tokenizer
(``tokenizers.load_hf_tokenizer``) and EOS ids, and, with
``tokenizer.chat_template``, its chat template around each prompt. Otherwise
a sentencepiece tokenizer is trained or read and ``model.preset`` is
initialised from scratch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any

import jax

from rljax import distributed
from rljax import envs as envs_lib
from rljax import models, sharding
from rljax import objectives as obj_lib
from rljax import rewards as rewards_lib
from rljax import tokenizers as tok_lib
from rljax.train import algorithm as alg_lib
from rljax.train import combinations
from rljax.train import schema, table
from rljax.train.schema import complete_config  # noqa: F401  (re-exported)
from rljax.train import critic as critic_lib
from rljax import rollout as rollout_lib
# Rewards, data, tokenizer and model: split off for length, public here.
from rljax.train._build_inputs import (  # noqa: F401  (re-exported)
    DATA_CHECKS, HF_DIR, HF_FILES, HF_OVERRIDES, check_data,
    correctness_reward, eos_ids, hf_model_config, hf_overrides, hf_tokenizer,
    load_task, make_evaluator, make_tokenizer, preset_model_config, reward_fn,
    reward_specs, run_model_and_tokenizer, save_hf_files)
from rljax.train._build_rollouts import (  # noqa: F401  (re-exported)
    allocation, fresh_allocation, max_group, meshes, partial_config,
    replay_buffer, selection, with_allocation)
from rljax.train._validate import validate  # noqa: F401  (re-exported)
# The samplers and rollout plans of a run: split off for length.
from rljax.train import _build_samplers
from rljax.train._build_samplers import sampler_config  # noqa: F401  (re-exported)
from rljax.train.sft import SFTConfig
from rljax.train import policy as policy_lib
from rljax.train import steps as steps_lib
from rljax.train.steps import RLStepConfig, TrainState

log = logging.getLogger("rljax")



# ----------------------------------------------------------------------------
# Validation: rljax/train/_validate.py (``validate``, re-exported here).


def algorithm(config: Any) -> alg_lib.Algorithm:
  """The ``Algorithm`` named by ``rl.*`` and ``optimizer.*``."""
  return alg_lib.from_config(config.rl, config.optimizer,
                             config.sampler.max_new_tokens, seed=config.seed)


def step_config(config: Any) -> RLStepConfig:
  """The ``RLStepConfig`` of ``rl.*`` (the algorithm's ESS settings are added
  by ``build``)."""
  rl = config.rl
  objective = table.OBJECTIVES[rl.objective]
  return RLStepConfig(
      critic=critic_config(config), distill_coef=float(rl.distill_coef),
      teacher_temperature=float(config.teacher.temperature),
      num_epochs=rl.num_epochs, num_minibatches=rl.num_minibatches,
      num_microbatches=rl.num_microbatches, aggregation=rl.aggregation,
      kl_coef=float(rl.kl_coef), log_kl=bool(rl.log_kl),
      entropy_coef=float(rl.entropy_coef),
      training_temperature=float(rl.training_temperature),
      old_logprobs=rl.old_logprobs, kl_estimator=rl.kl_estimator,
      rejection=obj_lib.parse_rejection(rl.rejection),
      max_log_ratio=float(rl.max_log_ratio),
      count_empty_sequences=bool(rl.count_empty_sequences),
      microbatch_tokens=int(rl.microbatch_tokens),
      packing_buckets=int(rl.packing_buckets),
      # The rollout's completion is the last max_new_tokens columns of a row.
      completion_length=config.sampler.max_new_tokens,
      # The objective's own loss term, if any (KL-Cov's, DRO's penalty).
      **(objective.step_settings(rl.to_dict()) if objective.step_settings
         else {}))


def env_runner(config: Any) -> envs_lib.EnvRunner | None:
  """The environment of ``env.name`` on its worker processes (``env.*``),
  or None for single-turn rollouts. Close it when done."""
  e = config.env
  if not e.name:
    return None
  return envs_lib.EnvRunner(
      envs_lib.get_env(e.name, **dict(e.kwargs or {})),
      num_workers=e.num_workers, timeout_s=float(e.timeout_s),
      memory_limit_mb=e.memory_limit_mb)


def turn_config(config: Any, tokenizer: Any,
                stop_strings: tuple[str, ...]) -> rollout_lib.TurnConfig:
  """The ``TurnConfig`` of ``env.*``, the environment's stop strings
  encoded as they occur mid-sequence (``tokenizers.continuation_ids``).

  Raises:
    ValueError: a stop string that encodes to nothing or does not decode
      back to itself (it would never match).
  """
  e = config.env
  stops = []
  for text in stop_strings:
    ids = tok_lib.continuation_ids(tokenizer, text)
    if not ids or tokenizer.decode(ids) != text:
      raise ValueError(
          f"env.name={e.name!r}: its stop string {text!r} encodes to {ids}, "
          f"which decodes to {tokenizer.decode(ids)!r}: a stop string must "
          "be whole pieces of the tokenizer (e.g. a sentencepiece "
          "user-defined symbol).")
    stops.append(tuple(ids))
  return rollout_lib.TurnConfig(
      max_turns=e.max_turns, max_observation_tokens=e.max_observation_tokens,
      max_turn_tokens=e.max_turn_tokens, stop_sequences=tuple(stops),
      step_rows=e.step_rows)


def needs_critic(config: Any) -> bool:
  """Whether ``rl.advantage`` takes its advantages from a value model."""
  return any(table.ADVANTAGES[n].needs_critic
             for n in table.advantage_links(config.rl.advantage))


def critic_config(config: Any) -> critic_lib.CriticConfig | None:
  """The ``CriticConfig`` of ``critic.*`` with a critic entry (``gae``),
  else None."""
  if not needs_critic(config):
    return None
  c = config.critic
  return critic_lib.CriticConfig(
      gamma=float(c.gamma), lam=float(c.lam),
      value_clip=None if c.value_clip is None else float(c.value_clip),
      whiten=bool(c.whiten))


def critic_optimizer(config: Any):
  """The critic's optimizer (``critic.learning_rate``, ``critic.max_grad_norm``),
  or None without a critic."""
  if not needs_critic(config):
    return None
  return critic_lib.make_optimizer(float(config.critic.learning_rate),
                                   config.critic.max_grad_norm)


def sft_config(config: Any) -> SFTConfig:
  """The ``SFTConfig`` of ``sft.*``."""
  s = config.sft
  return SFTConfig(num_steps=s.num_steps, batch_size=s.batch_size,
                   learning_rate=float(s.learning_rate),
                   num_examples=s.num_examples, max_length=s.max_length,
                   label_noise=float(s.label_noise),
                   seed=config.seed, padding_free=bool(s.padding_free),
                   cache_dir=str(s.cache_dir))


def checkpoint_options(config: Any) -> dict[str, Any]:
  """Keyword arguments of ``checkpoint.CheckpointManager``."""
  c = config.checkpoint
  return {"max_to_keep": c.max_to_keep,
          "best_metric": c.best_metric or None, "best_mode": c.best_mode}


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """The host loop's settings, read from the config once.

  Attributes:
    seed: the run's seed.
    num_steps: RL steps.
    prompts_per_step: prompts per RL step (B).
    group_size: trained rows per prompt (G).
    num_rewards: reward functions (R).
    eval_every, checkpoint_every: cadences in RL steps (``eval_every=0``:
      no held-out evaluation, ``evaluates_at``).
    histogram_every: per-row histograms' cadence (0: never).
    eval_num_samples: samples per held-out prompt.
    eval_greedy: also evaluate greedy decoding.
    best_metric: the metric whose best checkpoint is kept ("" for none).
    max_consecutive_nonfinite: stop after this many skipped updates in a
      row (None: never).
    sampling_temperature: for the log line.
    task_name: for the plot title.
    max_reward_failure_fraction, reward_failure_patience: stop when the
      fraction of (sample, reward function) pairs without a reward exceeds
      the first for that many RL steps in a row.
  """

  seed: int
  num_steps: int
  prompts_per_step: int
  group_size: int
  num_rewards: int
  eval_every: int
  checkpoint_every: int
  eval_num_samples: int
  eval_greedy: bool
  best_metric: str
  max_consecutive_nonfinite: int | None
  sampling_temperature: float
  task_name: str
  max_reward_failure_fraction: float = 0.99
  reward_failure_patience: int = 5
  histogram_every: int = 0

  def evaluates_at(self, step: int) -> bool:
    """Whether held-out metrics are computed at ``step`` (0: before RL):
    every ``eval_every`` steps and at the last, never with ``eval_every=0``."""
    return bool(self.eval_every) and (step % self.eval_every == 0
                                      or step == self.num_steps)


def loop_settings(config: Any) -> LoopSettings:
  """The ``LoopSettings`` of a config."""
  rl = config.rl
  return LoopSettings(
      seed=config.seed, num_steps=rl.num_steps,
      prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
      num_rewards=len(config.rewards.names), eval_every=config.eval.every,
      checkpoint_every=config.checkpoint.every,
      eval_num_samples=config.eval.num_samples,
      eval_greedy=bool(config.eval.greedy),
      best_metric=config.checkpoint.best_metric or "",
      max_consecutive_nonfinite=config.optimizer.max_consecutive_nonfinite,
      sampling_temperature=float(config.sampler.temperature),
      task_name=config.task.name,
      max_reward_failure_fraction=float(config.rewards.max_failure_fraction),
      reward_failure_patience=int(config.rewards.failure_patience),
      histogram_every=int(config.metrics.histogram_every))


# ----------------------------------------------------------------------------
# Everything at once.


@dataclasses.dataclass
class Components(_build_samplers.Samplers):
  """What a training run is made of, built from its config by ``build``.

  Attributes:
    config: the config (kept for ``sampler`` and for saving).
    settings: the host loop's settings.
    mesh: the device mesh.
    task: the built-in task, or None for a JSONL task.
    train_examples, heldout: the examples.
    tokenizer: encodes prompts (through a chat template if asked).
    model_config: the model's config.
    param_shardings: shardings of the params on ``mesh``.
    evaluator: the reward functions (close it when done).
    correctness: the reward that counts as correct.
    algorithm: advantage chain, coefficient chain, optimizer.
    step_config: the RL step's static settings.
    sft: the SFT warm-up's settings.
    buckets: prompt length buckets.
    eos_ids: ids that end a completion.
    hf_path: ``model.path`` or "".
    critic_optimizer: the critic's optimizer with ``rl.advantage="gae"``,
      else None.
    teacher: ``(model_config, params)`` of the distillation teacher
      (``teacher.path``), loaded before anything is compiled; else None.
    checkpoint_options: keyword arguments of the checkpoint manager.
    config_json: the config as JSON (saved with the run and its
      checkpoints).
    group: the run's processes (``distributed.ProcessGroup``).
    sample_mesh, sample_param_shardings: where the training rollouts are
      sampled (``rl.sampler_devices``; else ``mesh`` and its shardings).
    env: the environment's runner (``env.name``), else None; ``close``
      closes it with the reward workers.
    turns: its ``TurnConfig`` (stop strings encoded).
  """

  config: Any
  settings: LoopSettings
  mesh: jax.sharding.Mesh
  task: Any
  train_examples: list[dict[str, Any]]
  heldout: list[dict[str, Any]]
  tokenizer: Any
  model_config: models.ModelConfig
  param_shardings: Any
  evaluator: rewards_lib.RewardEvaluator
  correctness: str
  algorithm: alg_lib.Algorithm
  step_config: RLStepConfig
  sft: SFTConfig
  buckets: tuple[int, ...]
  eos_ids: tuple[int, ...]
  hf_path: str
  critic_optimizer: Any = None
  teacher: tuple[models.ModelConfig, Any] | None = None
  checkpoint_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  config_json: dict[str, Any] = dataclasses.field(default_factory=dict)
  group: distributed.ProcessGroup = dataclasses.field(
      default_factory=distributed.ProcessGroup)
  sample_mesh: jax.sharding.Mesh | None = None
  sample_param_shardings: Any = None
  env: envs_lib.EnvRunner | None = None
  turns: rollout_lib.TurnConfig | None = None

  def close(self) -> None:
    """Stops the reward and environment worker processes."""
    self.evaluator.close()
    if self.env is not None:
      self.env.close()

  @property
  def lora(self) -> bool:
    """Whether the run trains LoRA adapters on a frozen base."""
    return self.model_config.lora is not None

  @property
  def lora_base_from_hf(self) -> bool:
    """Whether a LoRA run's frozen base is ``model.path``'s weights as they
    are (no SFT warm-up), so its checkpoints can name it instead of holding
    it."""
    return bool(self.lora and self.hf_path and not self.sft.num_steps)

  @property
  def base_param_shardings(self) -> Any:
    """Shardings of the float params without adapters (``init_params``,
    the SFT warm-up); ``param_shardings`` without LoRA."""
    if not self.lora:
      return self.param_shardings
    return models.param_shardings(self.model_config.without_lora(), self.mesh)

  def init_params(self, key: jax.Array) -> Any:
    """The run's initial params on the mesh: the Hugging Face checkpoint's
    (``model.path``, read now) or ``model_config`` initialised from ``key``.
    With LoRA, the float base alone (``attach_adapters`` adds the rest)."""
    if self.hf_path:
      overrides = hf_overrides(self.config)
      return models.load_hf_pretrained(
          self.hf_path, self.mesh, param_dtype=overrides.get("param_dtype"),
          dtype=overrides.get("dtype"))[1]
    return models.init_params(self.model_config.without_lora(), key, self.mesh)

  def attach_adapters(self, base: Any, key: jax.Array) -> Any:
    """With LoRA, ``base`` (float, from ``init_params`` or the warm-up) in
    the frozen layout plus fresh adapters from ``key``; else ``base``."""
    return models.attach_base(base, self.model_config, key, self.mesh)

  def init_state(self, params: Any, key: jax.Array) -> TrainState:
    """A fresh ``TrainState`` around ``params`` (``steps.init_state``,
    jitted; every leaf that mirrors a param is sharded as it,
    ``sharding.init_like_params``)."""
    s = self.settings
    fn = functools.partial(
        steps_lib.init_state, algorithm=self.algorithm, cfg=self.step_config,
        model_config=self.model_config, num_prompts=s.prompts_per_step,
        group_size=s.group_size, num_rewards=s.num_rewards,
        critic_optimizer=self.critic_optimizer)
    # Each optimizer moment sharded as its param; counts and keys replicate.
    return sharding.init_like_params(fn, params, self.mesh, key)

def build(config: Any, *, algorithm_override: alg_lib.Algorithm | None = None,
          group: distributed.ProcessGroup | None = None) -> Components:
  """Validates ``config`` and builds its components (no compile).

  Args:
    config: an ml_collections config (``configs/*.py``).
    algorithm_override: a user-built ``Algorithm`` used instead of the one
      ``rl.advantage`` / ``rl.objective`` / ``optimizer`` name.
    group: the run's processes (default: ``jax.distributed``'s); with
      several, the mesh must give each process its own block of rows
      (``ProcessGroup.block``) and a trained tokenizer is process 0's.
  """
  config = schema.complete_config(config)
  group = group or distributed.ProcessGroup()
  mesh, sample_mesh = meshes(config)
  validate(config, mesh)
  if not group.single:
    group.block(mesh)  # a clear error for a mesh that splits no rows by host
    combinations.check(config, group.count)
    if config.sft.num_steps:
      sharding.check_batch_divisible(config.sft.batch_size, mesh,
                                     "sft.batch_size")
  alg = algorithm_override if algorithm_override is not None else algorithm(config)
  if not isinstance(alg, alg_lib.Algorithm):
    raise TypeError(f"algorithm={alg!r}: an rljax.train.Algorithm is required.")
  rl = config.rl
  num_rewards = len(config.rewards.names)
  alg.check_advantage_shapes(rl.prompts_per_step * (rl.group_size
                                                    + alg.extra_samples),
                             num_rewards, rl.group_size + alg.extra_samples)
  alg = with_allocation(config, alg)  # groups of unequal size
  task, train_examples, heldout = load_task(config)
  check_data(config, train_examples, heldout, mesh)
  stops = (tuple(envs_lib.get_env(config.env.name, **dict(
      config.env.kwargs or {})).stop_strings) if config.env.name else ())
  hf_path = config.model.path
  if hf_path:
    model_config = hf_model_config(hf_path, config)
    tokenizer = hf_tokenizer(hf_path, config)
  else:
    tokenizer = make_tokenizer(
        config, task, train_examples, group,
        symbols=stops)
    model_config = preset_model_config(config, tokenizer.vocab_size)
  tok_lib.check_tokenizer_vocab(
      tokenizer, model_config.vocab_size,
      hf_path or f"model.preset={config.model.preset!r}")
  buckets = tuple(config.sampler.prompt_buckets)
  tok_lib.check_prompt_lengths(
      tokenizer, [e["prompt"] for e in train_examples + heldout], buckets)
  step = dataclasses.replace(step_config(config),
                             ess_kl_coef=alg.ess_kl_coef,
                             ess_pooling=alg.ess_pooling)
  turns = (turn_config(config, tokenizer, stops) if config.env.name
           else None)
  teacher = None
  if step.distill_coef:
    teacher = policy_lib.load_teacher(
        config.teacher.path, mesh, model_config.vocab_size,
        step=config.teacher.step,
        tokenizer=getattr(tokenizer, "tokenizer", tokenizer))
    log.info("teacher for on-policy distillation: %s (%s params)",
             config.teacher.path, f"{models.count_params(teacher[1]):,}")
  # Worker processes last, once nothing else can fail.
  evaluator = make_evaluator(config, mesh=mesh, tokenizer=tokenizer,
                             group=group, load_judge=policy_lib.load_judge)
  runner = env_runner(config)
  return Components(
      config=config, settings=loop_settings(config), mesh=mesh, task=task,
      train_examples=train_examples, heldout=heldout, tokenizer=tokenizer,
      model_config=model_config,
      param_shardings=models.param_shardings(model_config, mesh),
      sample_mesh=sample_mesh,
      sample_param_shardings=models.param_shardings(model_config,
                                                    sample_mesh),
      evaluator=evaluator,
      correctness=correctness_reward(config), algorithm=alg,
      step_config=step, sft=sft_config(config), buckets=buckets,
      eos_ids=eos_ids(tokenizer), hf_path=hf_path,
      critic_optimizer=critic_optimizer(config), teacher=teacher,
      checkpoint_options=checkpoint_options(config),
      config_json=json.loads(config.to_json_best_effort()), group=group,
      env=runner, turns=turns)
