"""Loading a trained policy (params, model config, tokenizer) from a workdir."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from rljax import checkpoint as ckpt_lib
from rljax import models
from rljax import tokenizers as tok_lib


@dataclasses.dataclass
class Policy:
  """What ``launch/sample.py`` and ``launch/evaluate.py`` need of a run."""

  params: Any
  model_config: models.ModelConfig
  tokenizer: tok_lib.SentencePieceTokenizer
  config: ml_collections.ConfigDict
  step: int


def load_policy(workdir: str, step: int | None = None) -> Policy:
  """Restores the params of checkpoint ``step`` (latest if None) of a run.

  Raises:
    FileNotFoundError: naming the missing file or directory.
  """
  for name in ("config.json", "tokenizer.model", "checkpoints"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise FileNotFoundError(
          f"{os.path.join(workdir, name)} does not exist: workdir={workdir!r} "
          "is not an rljax training run directory.")
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  tokenizer = tok_lib.SentencePieceTokenizer(os.path.join(workdir, "tokenizer.model"))
  overrides = dict(config.model.get("overrides", {}) or {})
  overrides.setdefault("vocab_size", tokenizer.vocab_size)
  model_config = models.get_preset(config.model.preset, **overrides)
  manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                       async_save=False)
  step = manager.latest_step() if step is None else step
  tree, _ = manager.restore(step, None)
  manager.close()
  state = tree["state"] if "state" in tree else tree  # {"state": TrainState, ...}
  params = state["params"] if isinstance(state, dict) else state[0]
  expected = jax.tree.structure(models.param_shapes(model_config))
  if jax.tree.structure(params) != expected:
    raise ValueError(f"checkpoint step {step} in {workdir} does not hold params "
                     f"of the configured model ({config.model.preset}).")
  return Policy(jax.tree.map(jax.numpy.asarray, params), model_config,
                tokenizer, config, int(step))
