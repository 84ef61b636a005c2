"""Loading a trained policy (params, model config, tokenizer) from a workdir.

A run directory holds ``config.json`` (the training config), ``checkpoints/``
and the tokenizer: ``tokenizer.model`` for a run that trained its own
sentencepiece model, or ``tokenizer/`` for a run that started from a Hugging
Face checkpoint (``model.path``): a copy of the checkpoint's tokenizer files
and its ``config.json``, from which the model config is rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import ml_collections

from rljax import checkpoint as ckpt_lib
from rljax import models
from rljax import tokenizers as tok_lib
from rljax.train import batching

HF_DIR = "tokenizer"
"""The subdirectory of a run that holds a Hugging Face checkpoint's files."""

HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "generation_config.json", "tokenizer.model",
            "config.json")
"""The files ``save_hf_files`` copies (those that exist)."""

HF_OVERRIDES = ("param_dtype", "dtype", "remat")
"""The ``model.overrides`` accepted with ``model.path``: the checkpoint fixes
every other field."""


@dataclasses.dataclass
class Policy:
  """What ``launch/sample.py`` and ``launch/evaluate.py`` need of a run.

  ``tokenizer`` renders prompts through the chat template
  (``batching.ChatPromptTokenizer``) when the run did.
  """

  params: Any
  model_config: models.ModelConfig
  tokenizer: Any
  config: ml_collections.ConfigDict
  step: int


def hf_overrides(config: Any) -> dict[str, Any]:
  """``config.model.overrides`` for a run with ``model.path``, checked.

  Raises:
    ValueError: naming a field the checkpoint fixes.
  """
  overrides = dict(config.model.get("overrides", {}) or {})
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
  return model_config


def save_hf_files(source: str, workdir: str) -> list[str]:
  """Copies a checkpoint's tokenizer files and config.json to ``workdir/tokenizer``.

  Returns:
    The names copied.
  """
  out = os.path.join(workdir, HF_DIR)
  os.makedirs(out, exist_ok=True)
  copied = []
  for name in HF_FILES:
    path = os.path.join(os.fspath(source), name)
    if os.path.exists(path):
      shutil.copyfile(path, os.path.join(out, name))
      copied.append(name)
  return copied


def load_policy(workdir: str, step: int | None = None) -> Policy:
  """Restores the params of checkpoint ``step`` (latest if None) of a run.

  Raises:
    FileNotFoundError: naming the missing file or directory.
  """
  hf_dir = os.path.join(workdir, HF_DIR)
  hf = os.path.isdir(hf_dir)
  for name in ("config.json", HF_DIR if hf else "tokenizer.model",
               "checkpoints"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise FileNotFoundError(
          f"{os.path.join(workdir, name)} does not exist: workdir={workdir!r} "
          "is not an rljax training run directory.")
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  if hf:
    from rljax import hf_tokenizer  # pylint: disable=import-outside-toplevel
    tokenizer = hf_tokenizer.load_tokenizer(hf_dir)
    model_config = hf_model_config(hf_dir, config)
    tokenizer = batching.prompt_tokenizer(
        tokenizer, bool(config.get("tokenizer", {}).get("chat_template")))
    described = f"{config.model.path} (config.json in {hf_dir})"
  else:
    tokenizer = tok_lib.SentencePieceTokenizer(
        os.path.join(workdir, "tokenizer.model"))
    overrides = dict(config.model.get("overrides", {}) or {})
    overrides.setdefault("vocab_size", tokenizer.vocab_size)
    model_config = models.get_preset(config.model.preset, **overrides)
    described = config.model.preset
  manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                       async_save=False)
  step = manager.latest_step() if step is None else step
  tree, _ = manager.restore(step, None)
  manager.close()
  state = tree["state"] if "state" in tree else tree  # {"state": TrainState, ...}
  params = state["params"] if isinstance(state, dict) else state[0]
  expected = models.param_shapes(model_config)
  if jax.tree.structure(params) != jax.tree.structure(expected) or any(
      tuple(p.shape) != tuple(e.shape) for p, e in zip(
          jax.tree.leaves(params), jax.tree.leaves(expected))):
    raise ValueError(f"checkpoint step {step} in {workdir} does not hold params "
                     f"of the configured model ({described}).")
  return Policy(jax.tree.map(jax.numpy.asarray, params), model_config,
                tokenizer, config, int(step))
