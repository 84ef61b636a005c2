"""The inputs of a run, read from its config: rewards, data, tokenizer, model.

Part of ``build`` (which re-exports every name here), split off for length:
with ``build.py`` the only code that reads a ConfigDict. With ``model.path``
the run starts from a Hugging Face checkpoint (its config, weights,
tokenizer, EOS ids and chat template); otherwise a sentencepiece tokenizer
is trained or read and ``model.preset`` is initialised from scratch.
"""

from __future__ import annotations

import base64
import dataclasses
import difflib
import functools
import importlib
import logging
import os
import re
from typing import Any

import jax

from rljax import data as data_lib
from rljax import distributed
from rljax import models, sharding
from rljax import rewards as rewards_lib
from rljax import tokenizers as tok_lib
from rljax.train import algorithm as alg_lib
from rljax.train import judges, model_rewards

log = logging.getLogger("rljax")

HF_DIR = "tokenizer"
"""The subdirectory of a run that holds a Hugging Face checkpoint's files."""

HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "generation_config.json", "tokenizer.model",
            "config.json")
"""The files ``save_hf_files`` copies (those that exist)."""

HF_OVERRIDES = ("param_dtype", "dtype", "remat")
"""The ``model.overrides`` accepted with ``model.path``: the checkpoint fixes
every other field."""



def reward_fn(name: str):
  """``(label, fn)``: a built-in reward by name, or ``"package.module:function"``.

  A reward model (``"model:<path>"``, ``rljax.train.model_rewards``) or a
  judge (``"judge:<path>"``, ``rljax.train.judges``) gives ``(label, None)``
  once its path is checked: its weights are read by ``make_evaluator``,
  which has the mesh.
  """
  if model_rewards.is_model_reward(name):
    model_rewards.check(name)
    return model_rewards.label(name), None
  if model_rewards.is_ensemble(name):
    for member in model_rewards.ensemble_members(name):
      model_rewards.check(member)
    return "ensemble", None
  if judges.is_judge(name):
    judges.check(name)
    return judges.label(name), None
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"rewards.names contains {name!r}, which cannot be "
                       f"imported ({e}); accepted: a built-in name or "
                       "'package.module:function' or 'model:<path>'.") from e
    return attr, fn
  if name not in rewards_lib.REWARD_FNS:
    raise ValueError(f"rewards.names contains {name!r}; accepted: "
                     f"{tuple(sorted(rewards_lib.REWARD_FNS))} or "
                     "'package.module:function'.")
  return name, rewards_lib.get_reward_fn(name)


def reward_specs(config: Any, *, mesh: jax.sharding.Mesh | None = None,
                 tokenizer: Any = None,
                 group: distributed.ProcessGroup | None = None,
                 load_judge: Any = None) -> list[rewards_lib.RewardSpec]:
  """One ``RewardSpec`` per ``rewards.names`` entry, weighted by
  ``rewards.weights``; a reward model (``"model:<path>"``) is loaded onto
  ``mesh`` and scores in-process, reading the policy's tokens when it has
  the policy's ``tokenizer``; a judge (``"judge:<path>"``) is read by
  ``load_judge`` (``policy.load_judge``)."""
  if group is not None and not group.single:
    from rljax.train import combinations  # pylint: disable=g-import-not-at-top
    from rljax.train import schema  # pylint: disable=g-import-not-at-top
    combinations.check(schema.complete_config(config), group.count)
  specs = []
  for name, weight in zip(config.rewards.names, config.rewards.weights):
    label, fn = reward_fn(name)
    if fn is not None:
      specs.append(rewards_lib.RewardSpec(label, fn, weight=float(weight)))
      continue
    if judges.is_judge(name):
      if load_judge is None:
        raise ValueError(f"rewards.names entry {name!r}: a judge needs a "
                         "loader (make_evaluator(load_judge=policy."
                         "load_judge)).")
      fn = judges.load(name, model=load_judge(judges.check(name), mesh),
                       mesh=mesh, seed=config.seed,
                       settings=config.rewards.judges, group=group)
      log.info("judge %s: %s params", label,
               f"{models.count_params(fn.params):,}")
      specs.append(rewards_lib.RewardSpec(label, fn, weight=float(weight),
                                          in_process=True))
      continue
    if tokenizer is None:
      raise ValueError(f"rewards.names entry {name!r}: a reward model needs "
                       "the policy's tokenizer (make_evaluator(tokenizer=)).")
    m = config.rewards.models
    load = functools.partial(
        model_rewards.load, policy_tokenizer=tokenizer,
        policy_dir=config.model.path, mesh=mesh, tokens=m.tokens,
        chat_template=m.chat_template, param_dtype=m.param_dtype or None,
        group=group)
    if model_rewards.is_ensemble(name):
      e = config.rewards.ensemble
      fn = model_rewards.EnsembleReward(
          [load(member) for member in model_rewards.ensemble_members(name)],
          e.aggregation, float(e.k))
      log.info("reward-model ensemble of %d (%s): %s params, reads the %s",
               len(fn.members), e.aggregation,
               f"{models.count_params(fn.params):,}",
               "policy's tokens" if fn.reads_tokens else "text")
    else:
      fn = load(name)
      log.info("reward model %s: %s params, reads the %s", label,
               f"{models.count_params(fn.params):,}",
               "policy's tokens" if fn.reads_tokens else "text")
    specs.append(rewards_lib.RewardSpec(label, fn, weight=float(weight),
                                        in_process=True))
  return specs


def make_evaluator(config: Any, num_workers: int | None = None, *,
                   mesh: jax.sharding.Mesh | None = None, tokenizer: Any = None,
                   group: distributed.ProcessGroup | None = None,
                   load_judge: Any = None) -> rewards_lib.RewardEvaluator:
  """The reward evaluator of ``rewards.*`` (``num_workers`` overrides;
  ``mesh``, ``tokenizer``, ``group`` and ``load_judge`` are for reward
  models and judges: ``reward_specs``)."""
  return rewards_lib.RewardEvaluator(
      reward_specs(config, mesh=mesh, tokenizer=tokenizer, group=group,
                   load_judge=load_judge),
      num_workers=(config.rewards.num_workers if num_workers is None
                   else num_workers),
      timeout_s=config.rewards.timeout_s,
      clip=config.rewards.clip,
      memory_limit_mb=config.rewards.memory_limit_mb)


def correctness_reward(config: Any) -> str:
  """The reward whose value >= 1 counts as correct (``eval.reward``, or the first)."""
  return config.eval.reward or reward_fn(config.rewards.names[0])[0]


def load_task(config: Any):
  """``(task or None, train examples, held-out examples)``.

  A JSONL task (``task.path``) has no ``task`` object; its held-out split is
  ``task.heldout_path`` or the head of the training file.
  """
  t = config.task
  seed = config.seed
  if t.path:
    required = tuple(t.required_fields or ())
    train = list(data_lib.read_jsonl(t.path, required_fields=required))
    heldout = (list(data_lib.read_jsonl(t.heldout_path,
                                        required_fields=required))
               if t.heldout_path else train[:config.eval.num_examples])
    return None, train, heldout[:config.eval.num_examples]
  task = data_lib.get_task(t.name, **dict(t.kwargs or {}))
  train = task.examples("train", t.num_train, seed)
  heldout = task.examples("heldout", config.eval.num_examples, seed + 1)
  return task, train, heldout


DATA_CHECKS = ("error", "warn")


def check_data(config: Any, train_examples: list[dict[str, Any]],
               heldout: list[dict[str, Any]],
               mesh: jax.sharding.Mesh | None = None) -> None:
  """Checks the loaded examples before anything is compiled.

  * a JSONL task (``task.path``) in which no example has a non-empty
    ``answer``: the answer-checking verifiers would score 0 and training
    would run on zero reward;
  * fewer held-out examples than ``eval.num_examples`` (and, for a JSONL
    task without ``task.heldout_path``, a held-out set taken from the
    training file);
  * a held-out count that does not split over the mesh's batch axes.

  ``task.on_data_problem`` says whether the first two raise (``"error"``,
  the default) or log a warning (``"warn"``); the last always raises.
  """
  mode = config.task.on_data_problem
  alg_lib.check_choice("task.on_data_problem", mode, DATA_CHECKS)
  where = config.task.path or f"task.name={config.task.name!r}"
  problems = []
  if config.task.path and not data_lib.check_answers(
      train_examples, where):
    problems.append(
        f"no training example of {where} has a non-empty 'answer' field: the "
        "built-in verifiers would score every completion 0")
  want = config.eval.num_examples
  if len(heldout) < want:
    source = (config.task.heldout_path or
              (f"the head of {config.task.path} (training rows!)"
               if config.task.path else where))
    problems.append(
        f"eval.num_examples={want} but {source} holds only {len(heldout)} "
        f"held-out examples; accepted: eval.num_examples <= {len(heldout)}")
  for problem in problems:
    if mode == "error":
      raise ValueError(problem + " (task.on_data_problem='warn' only warns).")
    log.warning("DATA PROBLEM: %s.", problem)
  if mesh is not None and heldout:
    sharding.check_batch_divisible(
        len(heldout), mesh, f"the number of held-out examples loaded ({where})")


def make_tokenizer(config: Any, task: Any, train_examples: list[dict[str, Any]],
                   group: distributed.ProcessGroup | None = None,
                   symbols: tuple[str, ...] = ()):
  """The sentencepiece tokenizer of ``tokenizer.path``, or one trained on the
  task (by process 0 alone when there are several: the others receive its
  model, so every process encodes with the same one). ``symbols`` (an
  environment's stop strings) and the task's ``tokenizer_symbols`` become
  pieces of their own."""
  if config.tokenizer.path:
    return tok_lib.SentencePieceTokenizer(config.tokenizer.path)
  group = group or distributed.ProcessGroup()
  if not group.single:
    model = group.from_primary(base64.b64encode(make_tokenizer(
        config, task, train_examples, distributed.ProcessGroup(0, 1),
        symbols).serialized).decode() if group.primary else None)
    return tok_lib.SentencePieceTokenizer(base64.b64decode(model))
  if task is not None:
    corpus = task.tokenizer_corpus(config.tokenizer.corpus_size, config.seed)
  else:
    corpus = [e["prompt"] for e in train_examples]
  # A task's tool tags (``<calc>``) are pieces of their own, so that a stop
  # string encodes to the same ids wherever it occurs.
  wanted = tuple(getattr(task, "tokenizer_symbols", ())) + tuple(symbols)
  try:
    return tok_lib.train_sentencepiece(
        corpus, config.tokenizer.vocab_size,
        user_defined_symbols=tuple(dict.fromkeys(wanted)))
  except RuntimeError as e:  # sentencepiece's own words: "32 vs 35"
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
    if needed is None:
      raise
    raise ValueError(
        f"tokenizer.vocab_size={config.tokenizer.vocab_size}: the prompts "
        f"the tokenizer is trained on need {needed[1]} pieces for their "
        "characters and special tokens alone; accepted: tokenizer.vocab_size "
        f">= {needed[1]}, or model.path set to a Hugging Face checkpoint "
        "directory (its tokenizer is used, none is trained).") from e


def hf_overrides(config: Any) -> dict[str, Any]:
  """``model.overrides`` for a run with ``model.path``, checked.

  Raises:
    ValueError: naming a field the checkpoint fixes.
  """
  overrides = dict(config.model.overrides or {})
  for name in overrides:
    if name not in HF_OVERRIDES:
      raise ValueError(
          f"model.overrides.{name} is set with model.path="
          f"{config.model.path!r}: the checkpoint's config.json fixes the "
          f"model's shape; accepted overrides: {HF_OVERRIDES}.")
  return overrides


def hf_model_config(directory: str, config: Any) -> models.ModelConfig:
  """The model config of a checkpoint's ``config.json`` with the run's overrides."""
  overrides = hf_overrides(config)
  model_config = models.load_hf_config(directory,
                                       param_dtype=overrides.get("param_dtype"),
                                       dtype=overrides.get("dtype"))
  if overrides.get("remat"):
    model_config = model_config.replace(remat=overrides["remat"])
  return model_config.replace(lora=lora_config(config))


def preset_model_config(config: Any, vocab_size: int) -> models.ModelConfig:
  """``model.preset`` with ``model.overrides``, the tokenizer's vocab size
  and ``model.lora``."""
  overrides = dict(config.model.overrides or {})
  overrides.setdefault("vocab_size", vocab_size)
  known = [f.name for f in dataclasses.fields(models.ModelConfig)]
  for key in overrides:
    if key not in known:  # a flag adds any key under model.overrides
      close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
      hint = (f"; did you mean {', '.join(close)}?" if close else "")
      raise ValueError(
          f"model.overrides.{key}={overrides[key]!r}: the model config has "
          f"no field {key!r}{hint} (accepted: {', '.join(known)})")
  if "lora" in overrides:
    raise ValueError("model.overrides.lora is set: LoRA is configured by "
                     "model.lora.rank, model.lora.alpha, model.lora.targets "
                     "and model.lora.quantize_base.")
  overrides["lora"] = lora_config(config)
  return models.get_preset(config.model.preset, **overrides)


def lora_config(config: Any) -> models.LoraConfig | None:
  """``model.lora`` as a ``models.LoraConfig``, or None when its rank is 0.

  Raises:
    ValueError: naming the field: a quantized base without adapters, no
      targets, an unknown target (a rank larger than a projection is checked
      with the model's shape, by ``ModelConfig``).
  """
  lora = config.model.lora
  if not lora.rank:
    if lora.quantize_base != "none":
      raise ValueError(
          f"model.lora.quantize_base={lora.quantize_base!r} with "
          "model.lora.rank=0: a quantized base is frozen, so it needs "
          "adapters to train; set model.lora.rank >= 1, or "
          "model.lora.quantize_base='none'.")
    return None
  if isinstance(lora.targets, str) or not tuple(lora.targets):
    raise ValueError(
        f"model.lora.targets={lora.targets!r} with model.lora.rank="
        f"{lora.rank}: accepted a non-empty tuple of names from "
        f"{models.LORA_TARGETS}, e.g. ('q', 'v').")
  return models.LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha),
                           targets=tuple(lora.targets),
                           quantize_base=lora.quantize_base)


def hf_tokenizer(directory: str, config: Any):
  """A checkpoint's tokenizer, through its chat template if the config asks."""
  tokenizer = tok_lib.load_hf_tokenizer(directory)
  chat = bool(config.tokenizer.chat_template)
  if chat and getattr(tokenizer, "chat_template", None) is None:
    log.warning("tokenizer.chat_template=True, but %s has no chat template: "
                "prompts are encoded as plain text.", directory)
  return tok_lib.prompt_tokenizer(tokenizer, chat)


def save_hf_files(source: str, workdir: str) -> list[str]:
  """Copies a checkpoint's tokenizer files and config.json to ``workdir/tokenizer``."""
  return models.copy_files(source, os.path.join(workdir, HF_DIR), HF_FILES)


def run_model_and_tokenizer(config: Any, workdir: str):
  """``(model_config, tokenizer, description)`` of a finished run's directory."""
  hf_dir = os.path.join(workdir, HF_DIR)
  if os.path.isdir(hf_dir):
    return (hf_model_config(hf_dir, config), hf_tokenizer(hf_dir, config),
            f"{config.model.path} (config.json in {hf_dir})")
  tokenizer = tok_lib.SentencePieceTokenizer(
      os.path.join(workdir, "tokenizer.model"))
  return (preset_model_config(config, tokenizer.vocab_size), tokenizer,
          config.model.preset)


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
  """Every id that ends a completion: ``tokenizer.eos_ids`` if it has them."""
  return tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))
