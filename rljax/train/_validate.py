"""``validate``: every config field against its rule, every name against the
algorithm table, and what spans sections, before anything is compiled. Part
of ``build`` (which re-exports it), split off for length."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import jax

from rljax import data as data_lib
from rljax import objectives as obj_lib
from rljax import sharding, tracking
from rljax.train import algorithm as alg_lib
from rljax.train import combinations, preference_losses
from rljax.train import schema, table
from rljax.train._build_inputs import hf_overrides, lora_config, reward_fn
from rljax.train._build_rollouts import _validate_rollout
from rljax.train._checks import check_range


def _finite(field: str, value: Any) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value)):
    raise ValueError(f"{field}={value!r}: a finite number is required.")


def _validate_critic_and_teacher(config: Any, critic: bool) -> None:
  """The critic's and the teacher's settings that ranges cannot express."""
  rl = config.rl
  if critic:
    if not isinstance(config.critic.whiten, bool):
      raise ValueError(f"critic.whiten={config.critic.whiten!r}: True or "
                       "False is required.")
    if rl.advantage_clip:
      raise ValueError(
          f"rl.advantage_clip={rl.advantage_clip!r} with rl.advantage="
          f"{rl.advantage!r}: GAE's advantages are token-level and computed "
          "in the train step, so the clip would only clip the rewards; "
          "accepted: rl.advantage_clip=None (or rewards.clip for rewards).")
  coef, path = rl.distill_coef, config.teacher.path
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


def _validate_algorithm(config: Any) -> None:
  """The names of ``rl.*`` against the table, and each entry's own checks."""
  rl = config.rl
  links = table.advantage_links(rl.advantage)
  for axis in ("rl.objective", "rl.is_correction", "rl.kl_estimator",
               "rl.aggregation"):
    table.check_choice(axis, rl[axis.split(".")[1]], table.AXES[axis])
  obj_lib.parse_rejection(rl.rejection)
  ctx = table.Context(rl.group_size, config.sampler.max_new_tokens,
                      config.seed, alg_lib.sampling_needs(rl.advantage)[
                          "extra_samples"])
  entries = ([table.ADVANTAGES[n] for n in links]
             + [table.OBJECTIVES[rl.objective],
                table.IS_CORRECTIONS[rl.is_correction]])
  rl_values = rl.to_dict()
  for entry in entries:
    if entry.check is not None:
      entry.check(rl_values, ctx, config.eval.num_samples)
  adv_entries = entries[:len(links)]
  singleton = tuple(n for n, e in table.ADVANTAGES.items() if e.singleton_ok)
  ignores = [n for n, e in zip(links, adv_entries)
             if e.needs_groups and not e.singleton_ok]
  if rl.singleton_groups == "raw" and ignores:
    raise ValueError(
        f"rl.singleton_groups='raw' with rl.advantage={rl.advantage!r}: "
        f"{tuple(ignores)} give a group with one valid sample advantage 0 "
        f"whatever the setting; 'raw' is honoured by {singleton}; accepted: "
        "rl.singleton_groups='zero' with this chain.")
  singleton_raw = rl.singleton_groups == "raw" and all(
      e.singleton_ok for e in adv_entries)
  if rl.group_size < 2 and not singleton_raw and any(
      e.needs_groups for e in adv_entries):
    raise ValueError(
        f"rl.group_size={rl.group_size} with rl.advantage={rl.advantage!r}: "
        "a group baseline needs at least 2 samples per prompt; use "
        "rl.group_size >= 2, or rl.advantage='batch_std' (or, for "
        f"{singleton}, rl.singleton_groups='raw').")
  _validate_critic_and_teacher(
      config, any(e.needs_critic for e in adv_entries))


LOW_TEMPERATURE = 0.05


def _validate_always(config: Any) -> None:
  """Fields checked whether or not the run uses them (they are part of the
  resume check), and temperatures that are legal but almost surely wrong."""
  from rljax.train.advantage_entries import parse_rank_weights  # pylint: disable=g-import-not-at-top
  if "rank_weights" in config.rl:  # its form; k against G where it is used
    parse_rank_weights(config.rl.rank_weights, 1 << 20)
  for field, value in (("rl.training_temperature",
                        config.rl.training_temperature),
                       ("sampler.temperature", config.sampler.temperature)):
    if 0 < value < LOW_TEMPERATURE:
      logging.getLogger("rljax").warning(
          "%s=%g is below %g: logits are divided by it, so losses and "
          "logprobs grow as 1/%s (greedy decoding is sampler.temperature "
          "with eval.greedy, not a tiny temperature).", field, value,
          LOW_TEMPERATURE, field)


def _validate_env(config: Any) -> None:
  """A multi-turn environment's settings and what it cannot run with."""
  e = config.env
  uses_env_reward = "env" in tuple(config.rewards.names)
  if not e.name:
    if uses_env_reward:
      raise ValueError("rewards.names contains 'env' but env.name is empty: "
                       "the environment's reward needs an environment; set "
                       "env.name (e.g. 'calculator') or drop 'env'.")
    return
  if not isinstance(e.name, str):
    raise ValueError(f"env.name={e.name!r}: a string is required.")
  if not isinstance(e.observation_role, str) or not e.observation_role:
    raise ValueError(f"env.observation_role={e.observation_role!r}: a chat "
                     "role such as 'user' or 'tool' is required.")
  from rljax import envs  # pylint: disable=g-import-not-at-top
  envs.get_env(e.name, **dict(e.kwargs or {}))  # a clear error, no compile


_PREPARE_DATA = "python -m launch.prepare_data --input=FILE --output={path}"

_HF_CHECKPOINT = (
    "a Hugging Face checkpoint directory with config.json, *.safetensors and "
    "tokenizer files (tokenizer.json or tokenizer.model), e.g. from "
    "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir "
    "/ckpt/Qwen2.5-0.5B-Instruct`")


def _validate_task_files(config: Any) -> None:
  """The JSONL files of ``task.path`` and ``task.heldout_path`` exist."""
  for field in ("task.path", "task.heldout_path"):
    path = config.task[field.split(".")[1]]
    if not path or os.path.isfile(path):
      continue
    problem = ("is a directory, not a file" if os.path.isdir(path)
               else "does not exist")
    raise ValueError(
        f"{field}={path!r}: the file {problem} ({os.path.abspath(path)}). "
        "A JSONL task holds one {\"prompt\": ..., \"answer\": ...} object "
        "per line; make it from a dataset file you have (FILE: .parquet, "
        f".jsonl or .json) with `{_PREPARE_DATA.format(path=path)}` (add "
        "--format=gsm8k for GSM8K's question/answer files).")


def _validate_model_path(config: Any) -> None:
  """``model.path`` is a checkpoint directory, or empty where none is needed.

  Without ``model.path`` a sentencepiece tokenizer is trained on the prompts
  and ``model.preset`` starts from random weights. A chat template exists
  only in a checkpoint, so ``tokenizer.chat_template=True`` says that the
  config starts from one (``configs/gsm8k_grpo.py``): it needs model.path.
  """
  path = config.model.path
  if not path:
    if config.tokenizer.chat_template:
      raise ValueError(
          "model.path='' with tokenizer.chat_template=True: the chat template "
          "is a checkpoint's, and without model.path a sentencepiece "
          f"tokenizer is trained and model.preset={config.model.preset!r} "
          "starts from random weights. Set model.path (--config.model.path="
          f"DIR) to {_HF_CHECKPOINT}; or set tokenizer.chat_template=False to "
          "train from scratch.")
    return
  where = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ValueError(f"model.path={path!r}: no such directory ({where}); "
                     f"accepted: {_HF_CHECKPOINT}.")
  names = os.listdir(path)
  missing = [what for what, present in (
      ("config.json", "config.json" in names),
      ("*.safetensors", any(n.endswith(".safetensors") for n in names)),
      ("tokenizer.json or tokenizer.model",
       "tokenizer.json" in names or "tokenizer.model" in names)) if not present]
  if missing:
    raise ValueError(f"model.path={path!r} ({where}) has no "
                     f"{' and no '.join(missing)}; accepted: {_HF_CHECKPOINT}.")


def validate(config: Any, mesh: jax.sharding.Mesh | None = None) -> None:
  """Checks the config before anything is compiled; errors name the field.

  Every field is checked against its ``schema.FIELDS`` rule and choices,
  every name against the algorithm table (``table.AXES``) and each named
  entry's own checks; then what spans sections (batch splits, rewards, the
  mesh) and the files the run reads (``task.path``, ``task.heldout_path``,
  ``model.path``), so that a missing one stops the run before the tokenizer
  is trained or the model built.
  """
  config = schema.complete_config(config)
  for name, field in schema.fields().items():
    *path, leaf = name.split(".")
    value = config
    for part in path:
      value = value[part]
    value = value[leaf]
    if field.rule is not None:
      check_range(name, value, field.rule)
    if field.choices is not None:
      table.check_choice(name, value, field.choices)
  tracking.check_writers(tuple(config.metrics.writers))
  for field in ("metrics.wandb.project", "metrics.wandb.entity",
                "metrics.wandb.name", "metrics.mlflow.tracking_uri",
                "metrics.mlflow.experiment", "metrics.mlflow.name"):
    section, tracker, leaf = field.split(".")
    if not isinstance(config[section][tracker][leaf], str):
      raise ValueError(f"{field}={config[section][tracker][leaf]!r}: a "
                       "string is required.")
  rl = config.rl
  if rl.kl_target is not None and not rl.kl_coef:
    raise ValueError(f"rl.kl_target={rl.kl_target!r} with rl.kl_coef=0: the "
                     "adaptive controller starts from rl.kl_coef and scales "
                     "it; accepted: rl.kl_coef > 0 (its starting value).")
  if rl.is_floor is not None and rl.is_floor > rl.is_cap:
    raise ValueError(f"rl.is_floor={rl.is_floor!r} > rl.is_cap={rl.is_cap!r}: "
                     "the truncation interval is empty.")
  _validate_algorithm(config)
  combinations.check(config)
  preference_losses.validate(config)
  n = rl.prompts_per_step * rl.group_size
  if n % (rl.num_minibatches * rl.num_microbatches):
    raise ValueError(
        f"rl.prompts_per_step x rl.group_size = {n} rows do not split into "
        f"rl.num_minibatches={rl.num_minibatches} x rl.num_microbatches="
        f"{rl.num_microbatches}: use counts whose product divides {n}.")
  default_buckets = schema.FIELDS["rl.packing_buckets"].default
  if rl.packing_buckets != default_buckets and not rl.padding_free:
    raise ValueError(
        f"rl.packing_buckets={rl.packing_buckets} needs rl.padding_free=True:"
        f" a padded step has no buffers to count; accepted: the default "
        f"{default_buckets} with rl.padding_free=False.")
  if rl.microbatch_tokens and not rl.padding_free:
    raise ValueError(
        f"rl.microbatch_tokens={rl.microbatch_tokens} needs "
        "rl.padding_free=True: a padded microbatch costs its rows' full "
        "length whatever their tokens; accepted: rl.microbatch_tokens=0 "
        "with rl.padding_free=False.")
  if config.task.name not in data_lib.TASKS and not config.task.path:
    raise ValueError(f"task.name={config.task.name!r} is unknown; accepted: "
                     f"{tuple(data_lib.TASKS)} (or set task.path to a JSONL file).")
  _validate_task_files(config)
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
  correctness = config.eval.reward
  labels = [reward_fn(n)[0] for n in config.rewards.names]
  if correctness and correctness not in labels:
    raise ValueError(f"eval.reward={correctness!r} is not a reward of "
                     f"rewards.names; accepted: {tuple(labels)}.")
  _validate_rollout(config)
  _validate_env(config)
  _validate_always(config)
  if config.model.path:
    hf_overrides(config)
    if config.tokenizer.path:
      raise ValueError(
          f"tokenizer.path={config.tokenizer.path!r} is set with model.path="
          f"{config.model.path!r}: a Hugging Face run uses the checkpoint's "
          "tokenizer files; accepted: tokenizer.path=''.")
  _validate_model_path(config)
  lora_config(config)
  if mesh is not None:
    sharding.check_batch_divisible(rl.prompts_per_step, mesh,
                                   "rl.prompts_per_step")
    sharding.check_batch_divisible(config.eval.num_examples, mesh,
                                   "eval.num_examples")
    micro = n // (rl.num_minibatches * rl.num_microbatches)
    sharding.check_batch_divisible(micro, mesh, "rows per microbatch "
                                   "(rl.prompts_per_step x rl.group_size / "
                                   "(rl.num_minibatches x rl.num_microbatches))")
