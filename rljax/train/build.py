"""Config -> components: the only module that reads an ml_collections ConfigDict
(with ``_build_inputs.py``, its part for rewards, data, tokenizer and model,
whose names it re-exports).

``build(config)`` checks the config (``validate``, before anything is
compiled) and turns it into ``Components``: the mesh, the task's examples,
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
import logging
import math
import os
from typing import Any

import jax

from rljax import data as data_lib
from rljax import models, sampling, sharding
from rljax import objectives as obj_lib
from rljax import optim as optim_lib
from rljax import rewards as rewards_lib
from rljax import tokenizers as tok_lib
from rljax.train import algorithm as alg_lib
from rljax.train import critic as critic_lib
# Rewards, data, tokenizer and model: split off for length, public here.
from rljax.train._build_inputs import (  # noqa: F401  (re-exported)
    DATA_CHECKS, HF_DIR, HF_FILES, HF_OVERRIDES, check_data,
    correctness_reward, eos_ids, hf_model_config, hf_overrides, hf_tokenizer,
    load_task, make_evaluator, make_tokenizer, preset_model_config, reward_fn,
    reward_specs, run_model_and_tokenizer, save_hf_files)
from rljax.train._checks import check_range
from rljax.train.sft import SFTConfig
from rljax.train.steps import OLD_LOGPROBS, RLStepConfig

log = logging.getLogger("rljax")



# ----------------------------------------------------------------------------
# Validation.


# Every numeric field -> its rule (``_checks.check_range``). A field absent
# from a config is not checked here.
RANGES = {
    **{f"rl.{f}": "int>=1" for f in (
        "num_steps", "prompts_per_step", "group_size", "num_epochs",
        "num_minibatches", "num_microbatches")},
    **{f: "int>=1" for f in (
        "eval.every", "checkpoint.every", "eval.num_examples",
        "eval.num_samples", "sampler.max_new_tokens", "sft.batch_size",
        "sft.num_examples", "sft.max_length", "tokenizer.vocab_size",
        "tokenizer.corpus_size", "task.num_train", "rewards.failure_patience")},
    **{f: "int>=0" for f in ("sft.num_steps", "optimizer.warmup_steps",
                             "rewards.num_workers")},
    **{f: ">0" for f in (
        "optimizer.learning_rate", "rl.training_temperature", "rl.clip_eps_low",
        "rl.clip_eps_high", "rl.is_cap", "sampler.temperature",
        "sft.learning_rate", "rewards.timeout_s")},
    **{f: ">=0" for f in ("rl.kl_coef", "rl.entropy_coef",
                          "optimizer.weight_decay")},
    **{f: ">0?" for f in ("rl.advantage_clip", "optimizer.max_grad_norm",
                          "rewards.clip")},
    **{f: "int>=1?" for f in ("checkpoint.max_to_keep", "sampler.top_k",
                              "optimizer.max_consecutive_nonfinite",
                              "rewards.memory_limit_mb")},
    "rl.ess_kl_coef": ">=0?", "sampler.top_p": "(0,1]?", "sampler.min_p": "[0,1)?",
    # Length segments and SPEC-RL drafts (issue 14).
    "sampler.segment_slots": "int>=1", "sampler.spec_store_prompts": "int>=1",
    "sampler.spec_log_lenience": ">=0",
  # Objectives, rollout corrections and KL of issue 10.
  **{f"rl.{f}": ">0" for f in ("sapo_tau_pos", "sapo_tau_neg", "gmpo_eps",
                               "max_log_ratio", "dcpo_clip_c", "band_delta",
                               "bapo_target", "dual_clip_c", "gspo_eps_low",
                               "gspo_eps_high", "cispo_cap")},
  **{f"rl.{f}": ">0?" for f in ("is_floor", "gspo_max_log_ratio")},
  **{f"rl.{f}": "(0,1]" for f in ("clip_cov_ratio", "kl_cov_ratio",
                                   "sat_quantile")},
  "rl.kl_cov_coef": ">=0",
    "sft.label_noise": "[0,1)", "rewards.max_failure_fraction": "[0,1]",
    # Advantage conventions and the length-aware advantages (issue 10).
    "rl.std_eps": ">=0?", "rl.pass_k": "int>=1", "rl.overlong_buffer": "int>=1?",
    "rl.overlong_penalty_factor": ">=0", "rl.pass_threshold": ">=0",
    # PPO with a critic (rl.advantage="gae") and on-policy distillation.
    "critic.gamma": "[0,1]", "critic.lam": "[0,1]", "critic.value_clip": ">0?",
    "critic.learning_rate": ">0", "critic.max_grad_norm": ">0?",
    "rl.distill_coef": ">=0", "teacher.temperature": ">0",
    "teacher.step": "int>=0?",
}
def _finite(field: str, value: Any) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value)):
    raise ValueError(f"{field}={value!r}: a finite number is required.")


def _validate_critic_and_teacher(config: Any) -> None:
  """The critic's and the teacher's settings that ranges cannot express."""
  rl = config.rl
  if rl.advantage in alg_lib.CRITIC_ADVANTAGES:
    if "critic" not in config:
      raise ValueError(f"rl.advantage={rl.advantage!r} trains a value model "
                       "but the config has no critic section: start from "
                       "configs/common.base() (or configs/arithmetic_ppo.py).")
    if not isinstance(config.critic.whiten, bool):
      raise ValueError(f"critic.whiten={config.critic.whiten!r}: True or "
                       "False is required.")
    if rl.get("advantage_clip"):
      raise ValueError(
          f"rl.advantage_clip={rl.advantage_clip!r} with rl.advantage="
          f"{rl.advantage!r}: GAE's advantages are token-level and computed "
          "in the train step, so the clip would only clip the rewards; "
          "accepted: rl.advantage_clip=None (or rewards.clip for rewards).")
  coef = rl.get("distill_coef", 0.0)
  path = config.teacher.path if "teacher" in config else ""
  if coef and not path:
    raise ValueError(f"rl.distill_coef={coef!r} > 0 needs a teacher: set "
                     "teacher.path to an rljax run directory or a Hugging "
                     "Face checkpoint directory.")
  if path and not coef:
    raise ValueError(f"teacher.path={path!r} is set but rl.distill_coef="
                     f"{coef!r}: the teacher would be loaded and unused; "
                     "accepted: rl.distill_coef > 0, or teacher.path=''.")
  if path and not os.path.isdir(path):
    raise ValueError(f"teacher.path={path!r} is not a directory: accepted an "
                     "rljax run directory or a Hugging Face checkpoint "
                     "directory.")


def _validate_advantage_conventions(config: Any) -> None:
  """The advantage conventions and settings that ranges cannot express."""
  rl = config.rl
  links = rl.advantage.split("+")
  alg_lib.check_choice("rl.singleton_groups",
                       rl.get("singleton_groups", "zero"),
                       alg_lib.SINGLETON_GROUPS)
  alg_lib.check_choice("rl.failed_rewards", rl.get("failed_rewards", "exclude"),
                       alg_lib.FAILED_REWARDS)
  if "pass_at_k" in links and rl.get("pass_k", 2) > rl.group_size:
    raise ValueError(f"rl.pass_k={rl.pass_k} with rl.advantage='pass_at_k': "
                     f"k must be at most rl.group_size={rl.group_size}.")
  if "remax" in links and config.eval.num_samples == rl.group_size + 1:
    raise ValueError(
        f"eval.num_samples={config.eval.num_samples} with rl.advantage="
        "'remax': the training sampler of rl.group_size + 1 samples per "
        "prompt decodes its last row greedily (ReMax's baseline), and the "
        "evaluation sampler must not share that count; accepted: any other "
        "eval.num_samples.")
  budget = config.sampler.max_new_tokens
  buffer = rl.get("overlong_buffer")
  if "overlong_penalty" in links and buffer is not None and buffer > budget:
    raise ValueError(
        f"rl.overlong_buffer={buffer} with rl.advantage={rl.advantage!r}: the "
        "penalty ramp must fit in the generation budget; accepted: an integer "
        f"in [1, sampler.max_new_tokens={budget}], or None (a fifth of it).")


def validate(config: Any, mesh: jax.sharding.Mesh | None = None) -> None:
  """Checks the config before anything is compiled; errors name the field."""
  rl = config.rl
  for field, rule in RANGES.items():
    section, name = field.split(".")
    if section in config and name in config[section]:
      check_range(field, config[section][name], rule)
  advantage = rl.advantage
  if "+" in advantage:
    for link in advantage.split("+"):
      alg_lib.check_choice("rl.advantage (a link of a '+' chain)", link,
                           alg_lib.ADVANTAGE_TRANSFORMS)
  else:
    alg_lib.check_choice("rl.advantage", advantage,
                         alg_lib.ADVANTAGE_PRESETS + alg_lib.ADVANTAGE_TRANSFORMS)
  alg_lib.check_choice("rl.objective", rl.objective, alg_lib.OBJECTIVES)
  alg_lib.check_choice("rl.is_correction", rl.is_correction,
                       alg_lib.IS_CORRECTIONS)
  alg_lib.check_choice("rl.is_level", rl.get("is_level", "token"),
                       obj_lib.LEVELS)
  alg_lib.check_choice("rl.aggregation", rl.aggregation, obj_lib.AGGREGATIONS)
  alg_lib.check_choice("rl.kl_estimator", rl.get("kl_estimator", "k3"),
                       obj_lib.KL_ESTIMATORS)
  obj_lib.parse_rejection(rl.get("rejection", ""))
  if rl.get("dual_clip_c", 3.0) <= 1:
    raise ValueError(f"rl.dual_clip_c={rl.dual_clip_c!r}: a number > 1 is "
                     "required (the dual clip bounds r from above).")
  if rl.get("is_floor") is not None and rl.is_floor > rl.is_cap:
    raise ValueError(f"rl.is_floor={rl.is_floor!r} > rl.is_cap={rl.is_cap!r}: "
                     "the truncation interval is empty.")
  alg_lib.check_choice("rl.old_logprobs", rl.get("old_logprobs", "recompute"),
                       OLD_LOGPROBS)
  alg_lib.check_choice("rl.ess_pooling", rl.get("ess_pooling", "microbatch"),
                       alg_lib.ESS_POOLINGS)
  alg_lib.check_choice("optimizer.name", config.optimizer.name,
                       optim_lib.OPTIMIZERS)
  alg_lib.check_choice("optimizer.ess_scaling",
                       config.optimizer.get("ess_scaling"),
                       (None,) + optim_lib.ESS_RULES)
  if "rank_weights" in advantage.split("+"):
    alg_lib.parse_rank_weights(rl.get("rank_weights") or "median:3",
                               rl.group_size)
  _validate_critic_and_teacher(config)
  _validate_advantage_conventions(config)
  singleton_raw = (rl.get("singleton_groups") == "raw" and all(
      n in alg_lib.SINGLETON_ADVANTAGES for n in advantage.split("+")))
  if rl.group_size < 2 and not singleton_raw and any(
      n in alg_lib.GROUP_STATISTIC_ADVANTAGES for n in advantage.split("+")):
    raise ValueError(
        f"rl.group_size={rl.group_size} with rl.advantage={advantage!r}: "
        "a group baseline needs at least 2 samples per prompt; use "
        "rl.group_size >= 2, or rl.advantage='batch_std' (or, for "
        f"{alg_lib.SINGLETON_ADVANTAGES}, rl.singleton_groups='raw').")
  n = rl.prompts_per_step * rl.group_size
  if n % (rl.num_minibatches * rl.num_microbatches):
    raise ValueError(
        f"rl.prompts_per_step x rl.group_size = {n} rows do not split into "
        f"rl.num_minibatches={rl.num_minibatches} x rl.num_microbatches="
        f"{rl.num_microbatches}: use counts whose product divides {n}.")
  if config.task.name not in data_lib.TASKS and not config.task.get("path"):
    raise ValueError(f"task.name={config.task.name!r} is unknown; accepted: "
                     f"{tuple(data_lib.TASKS)} (or set task.path to a JSONL file).")
  if not config.rewards.names:
    raise ValueError("rewards.names=(): at least one reward function is "
                     "required (a built-in name or 'package.module:function').")
  for name in config.rewards.names:
    reward_fn(name)
  if len(config.rewards.weights) != len(config.rewards.names):
    raise ValueError(
        f"rewards.weights has {len(config.rewards.weights)} entries for "
        f"{len(config.rewards.names)} rewards.names: give one weight each.")
  for i, w in enumerate(config.rewards.weights):
    _finite(f"rewards.weights[{i}]", w)
  correctness = config.eval.get("reward")
  labels = [reward_fn(n)[0] for n in config.rewards.names]
  if correctness and correctness not in labels:
    raise ValueError(f"eval.reward={correctness!r} is not a reward of "
                     f"rewards.names; accepted: {tuple(labels)}.")
  if config.model.get("path"):
    hf_overrides(config)
    if config.tokenizer.get("path"):
      raise ValueError(
          f"tokenizer.path={config.tokenizer.path!r} is set with model.path="
          f"{config.model.path!r}: a Hugging Face run uses the checkpoint's "
          "tokenizer files; accepted: tokenizer.path=''.")
  if mesh is not None:
    sharding.check_batch_divisible(rl.prompts_per_step, mesh,
                                   "rl.prompts_per_step")
    sharding.check_batch_divisible(config.eval.num_examples, mesh,
                                   "eval.num_examples")
    micro = n // (rl.num_minibatches * rl.num_microbatches)
    sharding.check_batch_divisible(micro, mesh, "rows per microbatch "
                                   "(rl.prompts_per_step x rl.group_size / "
                                   "(rl.num_minibatches x rl.num_microbatches))")


def sampler_config(config: Any, tokenizer: Any, num_samples: int, *,
                   greedy: bool = False,
                   record_policy_logprobs: bool = False,
                   greedy_every: int = 0) -> sampling.SamplerConfig:
  """The ``SamplerConfig`` of ``sampler.*`` for ``num_samples`` per prompt
  (``greedy_every``: ReMax's greedy row, ``SamplingMethod.greedy_every``)."""
  s = config.sampler
  method = (sampling.SamplingMethod(greedy=True) if greedy else
            sampling.SamplingMethod(temperature=s.temperature,
                                    top_k=s.get("top_k"), top_p=s.get("top_p"),
                                    min_p=s.get("min_p"),
                                    greedy_every=greedy_every))
  return sampling.SamplerConfig(
      num_samples=num_samples, max_new_tokens=s.max_new_tokens, method=method,
      training_temperature=config.rl.training_temperature,
      eos_ids=eos_ids(tokenizer), pad_id=tokenizer.pad_id,
      cache_dtype=s.cache_dtype, prompt_buckets=tuple(s.prompt_buckets),
      share_prefix=s.share_prefix, segment_slots=s.get("segment_slots", 64),
      record_policy_logprobs=record_policy_logprobs)


def algorithm(config: Any) -> alg_lib.Algorithm:
  """The ``Algorithm`` named by ``rl.*`` and ``optimizer.*``."""
  return alg_lib.from_config(config.rl, config.optimizer,
                             config.sampler.max_new_tokens, seed=config.seed)


def step_config(config: Any) -> RLStepConfig:
  """The ``RLStepConfig`` of ``rl.*`` (the algorithm's ESS settings are added
  by ``build``)."""
  rl = config.rl
  teacher = config.get("teacher", {})
  return RLStepConfig(
      critic=critic_config(config),
      distill_coef=float(rl.get("distill_coef", 0.0)),
      teacher_temperature=float(teacher.get("temperature", 1.0)),
      num_epochs=rl.num_epochs, num_minibatches=rl.num_minibatches,
      num_microbatches=rl.num_microbatches, aggregation=rl.aggregation,
      max_length=config.sampler.max_new_tokens, kl_coef=float(rl.kl_coef),
      entropy_coef=float(rl.entropy_coef),
      training_temperature=float(rl.training_temperature),
      old_logprobs=rl.get("old_logprobs", "recompute"),
      kl_estimator=rl.get("kl_estimator", "k3"),
      rejection=obj_lib.parse_rejection(rl.get("rejection", "")),
      kl_cov_coef=(float(rl.get("kl_cov_coef", 1.0))
                   if rl.objective == "kl_cov" else 0.0),
      kl_cov_ratio=float(rl.get("kl_cov_ratio", 2e-4)),
      max_log_ratio=float(rl.get("max_log_ratio", 20.0)),
      count_empty_sequences=bool(rl.get("count_empty_sequences", False)),
      # The rollout's completion is the last max_new_tokens columns of a row.
      completion_length=config.sampler.max_new_tokens)


def critic_config(config: Any) -> critic_lib.CriticConfig | None:
  """The ``CriticConfig`` of ``critic.*`` with ``rl.advantage="gae"``, else None."""
  if config.rl.advantage not in alg_lib.CRITIC_ADVANTAGES:
    return None
  c = config.critic
  clip = c.get("value_clip")
  return critic_lib.CriticConfig(
      gamma=float(c.gamma), lam=float(c.lam),
      value_clip=None if clip is None else float(clip), whiten=bool(c.whiten))


def critic_optimizer(config: Any):
  """The critic's optimizer (``critic.learning_rate``, ``critic.max_grad_norm``),
  or None without a critic."""
  if critic_config(config) is None:
    return None
  return critic_lib.make_optimizer(float(config.critic.learning_rate),
                                   config.critic.get("max_grad_norm"))


def sft_config(config: Any) -> SFTConfig:
  """The ``SFTConfig`` of ``sft.*``."""
  s = config.sft
  return SFTConfig(num_steps=s.num_steps, batch_size=s.batch_size,
                   learning_rate=float(s.learning_rate),
                   num_examples=s.num_examples, max_length=s.max_length,
                   label_noise=float(s.get("label_noise", 0.0)),
                   seed=config.seed)


def checkpoint_options(config: Any) -> dict[str, Any]:
  """Keyword arguments of ``checkpoint.CheckpointManager``."""
  c = config.checkpoint
  return {"max_to_keep": c.max_to_keep,
          "best_metric": c.get("best_metric") or None,
          "best_mode": c.get("best_mode", "max")}


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """The host loop's settings, read from the config once.

  Attributes:
    seed: the run's seed.
    num_steps: RL steps.
    prompts_per_step: prompts per RL step (B).
    group_size: trained rows per prompt (G).
    num_rewards: reward functions (R).
    eval_every, checkpoint_every: cadences in RL steps.
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


def loop_settings(config: Any) -> LoopSettings:
  """The ``LoopSettings`` of a config."""
  rl = config.rl
  return LoopSettings(
      seed=config.seed, num_steps=rl.num_steps,
      prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
      num_rewards=len(config.rewards.names), eval_every=config.eval.every,
      checkpoint_every=config.checkpoint.every,
      eval_num_samples=config.eval.num_samples,
      eval_greedy=bool(config.eval.get("greedy", True)),
      best_metric=config.checkpoint.get("best_metric") or "",
      max_consecutive_nonfinite=config.optimizer.get(
          "max_consecutive_nonfinite"),
      sampling_temperature=float(config.sampler.temperature),
      task_name=config.task.name,
      max_reward_failure_fraction=float(
          config.rewards.get("max_failure_fraction", 0.99)),
      reward_failure_patience=int(config.rewards.get("failure_patience", 5)))


# ----------------------------------------------------------------------------
# Everything at once.


@dataclasses.dataclass
class Components:
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
    initial_params: a Hugging Face checkpoint's params (``model.path``), or
      None (initialise ``model_config``).
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
  initial_params: Any
  evaluator: rewards_lib.RewardEvaluator
  correctness: str
  algorithm: alg_lib.Algorithm
  step_config: RLStepConfig
  sft: SFTConfig
  buckets: tuple[int, ...]
  eos_ids: tuple[int, ...]
  hf_path: str
  critic_optimizer: Any = None

  def sampler(self, num_samples: int, *, greedy: bool = False,
              record_policy_logprobs: bool | None = None):
    """A jitted sampler with explicit shardings (``sampling.make_sampler``).

    ``record_policy_logprobs`` None (the default) records them when the step
    takes ``pi_old`` from the sampler (``rl.old_logprobs="sampler"``), so a
    Collector built from this sampler feeds ``rl_step`` what it needs.
    With a ReMax algorithm (``greedy_baseline``), the sampler of the
    training rows (``group_size + 1`` per prompt) decodes the last row of
    each prompt greedily; ``validate`` keeps ``eval.num_samples`` off that
    count.
    """
    alg = self.algorithm
    if record_policy_logprobs is None:
      record_policy_logprobs = (not greedy
                                and self.step_config.old_logprobs == "sampler")
    greedy_every = num_samples if (
        alg.greedy_baseline and not greedy
        and num_samples == self.settings.group_size + alg.extra_samples) else 0
    return sampling.make_sampler(
        self.model_config,
        sampler_config(self.config, self.tokenizer, num_samples, greedy=greedy,
                       record_policy_logprobs=record_policy_logprobs,
                       greedy_every=greedy_every),
        self.mesh, self.param_shardings)

  def speculation(self, *, record_policy_logprobs: bool | None = None
                  ) -> sampling.Speculation | None:
    """SPEC-RL drafts for the training rollouts (``sampler.speculative``):
    the speculative twin of ``sampler(group_size + extra_samples)`` and a
    draft store; None when off. ``record_policy_logprobs`` as ``sampler``'s."""
    s, alg = self.config.sampler, self.algorithm
    if not s.get("speculative", False):
      return None
    if record_policy_logprobs is None:
      record_policy_logprobs = self.step_config.old_logprobs == "sampler"
    num_samples = self.settings.group_size + alg.extra_samples
    config = sampler_config(
        self.config, self.tokenizer, num_samples,
        record_policy_logprobs=record_policy_logprobs,
        greedy_every=num_samples if alg.greedy_baseline else 0)
    return sampling.Speculation(
        sampler=sampling.make_speculative_sampler(
            self.model_config, config, self.mesh, self.param_shardings,
            log_lenience=float(s.spec_log_lenience)),
        store=sampling.DraftStore(int(s.spec_store_prompts)),
        max_new_tokens=config.max_new_tokens)


def build(config: Any, *, algorithm_override: alg_lib.Algorithm | None = None
          ) -> Components:
  """Validates ``config`` and builds its components (no compile).

  Args:
    config: an ml_collections config (``configs/*.py``).
    algorithm_override: a user-built ``Algorithm`` used instead of the one
      ``rl.advantage`` / ``rl.objective`` / ``optimizer`` name.
  """
  mesh = sharding.mesh_from_config(config.mesh)
  validate(config, mesh)
  alg = algorithm_override if algorithm_override is not None else algorithm(config)
  if not isinstance(alg, alg_lib.Algorithm):
    raise TypeError(f"algorithm={alg!r}: an rljax.train.Algorithm is required.")
  rl = config.rl
  num_rewards = len(config.rewards.names)
  alg.check_advantage_shapes(rl.prompts_per_step * (rl.group_size
                                                    + alg.extra_samples),
                             num_rewards, rl.group_size + alg.extra_samples)
  task, train_examples, heldout = load_task(config)
  check_data(config, train_examples, heldout, mesh)
  hf_path = config.model.get("path") or ""
  initial_params = None
  if hf_path:
    overrides = hf_overrides(config)
    model_config, initial_params = models.load_hf_pretrained(
        hf_path, mesh, param_dtype=overrides.get("param_dtype"),
        dtype=overrides.get("dtype"))
    if overrides.get("remat"):
      model_config = model_config.replace(remat=overrides["remat"])
    tokenizer = hf_tokenizer(hf_path, config)
  else:
    tokenizer = make_tokenizer(config, task, train_examples)
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
  return Components(
      config=config, settings=loop_settings(config), mesh=mesh, task=task, train_examples=train_examples,
      heldout=heldout, tokenizer=tokenizer, model_config=model_config,
      param_shardings=models.param_shardings(model_config, mesh),
      initial_params=initial_params, evaluator=make_evaluator(config),
      correctness=correctness_reward(config), algorithm=alg,
      step_config=step, sft=sft_config(config), buckets=buckets,
      eos_ids=eos_ids(tokenizer), hf_path=hf_path,
      critic_optimizer=critic_optimizer(config))
