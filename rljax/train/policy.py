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
from typing import Any

import jax
import ml_collections

from rljax import checkpoint as ckpt_lib
from rljax import models
from rljax.train import build


@dataclasses.dataclass
class Policy:
  """What ``launch/sample.py`` and ``launch/evaluate.py`` need of a run.

  ``tokenizer`` renders prompts through the chat template
  (``tokenizers.ChatPromptTokenizer``) when the run did.
  """

  params: Any
  model_config: models.ModelConfig
  tokenizer: Any
  config: ml_collections.ConfigDict
  step: int


def load_policy(workdir: str, step: int | None = None) -> Policy:
  """Restores the params of checkpoint ``step`` (latest if None) of a run.

  Raises:
    FileNotFoundError: naming the missing file or directory.
  """
  hf = os.path.isdir(os.path.join(workdir, build.HF_DIR))
  for name in ("config.json", build.HF_DIR if hf else "tokenizer.model",
               "checkpoints"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise FileNotFoundError(
          f"{os.path.join(workdir, name)} does not exist: workdir={workdir!r} "
          "is not an rljax training run directory.")
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  model_config, tokenizer, described = build.run_model_and_tokenizer(
      config, workdir)
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
