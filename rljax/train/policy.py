"""Loading a trained policy (params, model config, tokenizer) from a workdir,
and a distillation teacher from a run directory or a Hugging Face checkpoint.

A run directory holds ``config.json`` (the training config), ``checkpoints/``
and the tokenizer: ``tokenizer.model`` for a run that trained its own
sentencepiece model, or ``tokenizer/`` for a run that started from a Hugging
Face checkpoint (``model.path``): a copy of the checkpoint's tokenizer files
and its ``config.json``, from which the model config is rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import jax
import ml_collections

from rljax import checkpoint as ckpt_lib
from rljax import models
from rljax import sharding as sharding_lib
from rljax.train import _build_inputs as inputs_lib
from rljax.train import schema


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
    FileNotFoundError: naming the missing file or directory, or a
      ``checkpoints/`` without a checkpoint.
    ValueError: a ``step`` with no checkpoint, naming the steps there.
  """
  hf = os.path.isdir(os.path.join(workdir, inputs_lib.HF_DIR))
  for name in ("config.json", inputs_lib.HF_DIR if hf else "tokenizer.model",
               "checkpoints"):
    if not os.path.exists(os.path.join(workdir, name)):
      raise FileNotFoundError(
          f"{os.path.join(workdir, name)} does not exist: workdir={workdir!r} "
          "is not an rljax training run directory.")
  with open(os.path.join(workdir, "config.json")) as f:
    config = schema.complete_config(json.load(f))
  model_config, tokenizer, described = inputs_lib.run_model_and_tokenizer(
      config, workdir)
  directory = os.path.join(workdir, "checkpoints")
  manager = ckpt_lib.CheckpointManager(directory, async_save=False)
  try:
    steps = manager.all_steps()
    if not steps:
      raise FileNotFoundError(
          f"{directory} holds no checkpoint: the run in workdir={workdir!r} "
          "has not saved one yet.")
    if step is not None and step not in steps:
      raise ValueError(f"step={step}: {directory} holds the checkpoints of "
                       f"steps {steps}; accepted: one of them, or None for "
                       "the latest.")
    step = steps[-1] if step is None else step
    tree, meta = manager.restore(step, None)
  finally:
    manager.close()
  state = tree["state"] if "state" in tree else tree  # {"state": TrainState, ...}
  params = state["params"] if isinstance(state, dict) else state[0]
  if model_config.lora is not None:  # adapters; the base is referenced
    params = models.lora.merge(
        _lora_base(workdir, meta.get("lora_base"), model_config), params)
  expected = models.param_shapes(model_config)
  if jax.tree.structure(params) != jax.tree.structure(expected) or any(
      tuple(p.shape) != tuple(e.shape) for p, e in zip(
          jax.tree.leaves(params), jax.tree.leaves(expected))):
    raise ValueError(f"checkpoint step {step} in {workdir} does not hold params "
                     f"of the configured model ({described}).")
  return Policy(jax.tree.map(jax.numpy.asarray, params), model_config,
                tokenizer, config, int(step))


# A LoRA run's frozen base, next to its checkpoints (``session.save_lora_base``).
LORA_BASE_DIR = "lora_base"


def _lora_base(workdir: str, reference: dict[str, str] | None,
               model_config: models.ModelConfig) -> Any:
  """The frozen base a LoRA run's checkpoint names (``session.save``): its
  ``lora_base`` directory or the Hugging Face weights of ``model.path``."""
  if not reference:
    raise ValueError(f"{workdir}: a LoRA run's checkpoint without a "
                     "'lora_base' reference in its metadata.")
  if reference["source"] == "hf":
    if not os.path.isfile(os.path.join(reference["path"], "config.json")):
      raise FileNotFoundError(
          f"{workdir}: its LoRA base is the Hugging Face checkpoint "
          f"{reference['path']!r}, which is not there any more (the run's "
          "checkpoints hold the adapters only).")
    _, base = models.load_hf_pretrained(
        reference["path"], None, param_dtype=model_config.param_dtype,
        dtype=model_config.dtype)
    if model_config.lora.quantize_base == "int8":
      base = jax.jit(models.lora.quantize_params)(base)
    return base
  directory = os.path.join(workdir, reference["path"])
  manager = ckpt_lib.CheckpointManager(directory, async_save=False)
  try:
    if manager.latest_step() is None:
      raise FileNotFoundError(
          f"{directory} holds no checkpoint: the frozen LoRA base of the run "
          f"in {workdir} is missing (its checkpoints hold the adapters only).")
    base, _ = manager.restore(None, None)
  finally:
    manager.close()
  return base


def _pieces(tokenizer: Any, size: int) -> list[str]:
  piece = getattr(tokenizer, "id_to_piece", None)
  if piece is None:
    return [tokenizer.decode([i]) for i in range(size)]
  return [str(piece(i)) for i in range(size)]


def check_same_tokenizer(student: Any, teacher: Any, path: str,
                         field: str = "teacher.path") -> None:
  """Raises unless ``teacher`` gives every id the student's token string and
  the same special ids (by content: a vocabulary of the same size with other
  ids is refused), naming ``teacher.path`` and one differing token."""
  size = student.vocab_size
  if teacher.vocab_size != size:
    raise ValueError(
        f"{field}={path!r}: its tokenizer has {teacher.vocab_size} "
        f"tokens, the student's {size}: the teacher must share the student's "
        "tokenizer.")
  for name in ("bos_id", "eos_id", "pad_id"):
    if getattr(student, name) != getattr(teacher, name):
      raise ValueError(
          f"{field}={path!r}: its {name} is {getattr(teacher, name)}, "
          f"the student's {getattr(student, name)}: the teacher must share "
          "the student's tokenizer.")
  mine, theirs = _pieces(student, size), _pieces(teacher, size)
  for i, (a, b) in enumerate(zip(mine, theirs)):
    if a != b:
      raise ValueError(
          f"{field}={path!r}: token {i} is {b!r} for the teacher and "
          f"{a!r} for the student: the teacher must share the student's "
          "tokenizer (the same vocabulary and ids), or the per-token KL "
          "compares unrelated tokens.")


def _teacher_tokenizer(path: str) -> Any:
  """The tokenizer files of a Hugging Face teacher directory."""
  from rljax import tokenizers as tok_lib  # pylint: disable=g-import-not-at-top
  if not any(os.path.isfile(os.path.join(path, name))
             for name in ("tokenizer.json", "tokenizer.model")):
    raise ValueError(
        f"teacher.path={path!r} has no tokenizer.json or tokenizer.model: "
        "rljax cannot check that the teacher shares the student's tokenizer; "
        "copy the tokenizer files next to its config.json.")
  try:
    return tok_lib.load_hf_tokenizer(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"teacher.path={path!r}: its tokenizer cannot be read "
                     f"({e}).") from e


def _load_pinned(path: str, step: int | None) -> Policy:
  """A teacher run's policy from its newest readable checkpoint (or
  ``step``), pinned: the checkpoint is copied before it is read, so a live
  run pruning its old steps cannot remove it mid-restore. An unreadable or
  vanished checkpoint falls back to the one before it (a warning names it);
  every failure names ``teacher.path``."""
  directory = os.path.join(path, "checkpoints")
  steps = ([step] if step is not None else sorted(
      (int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True))
  if not steps:
    raise ValueError(f"teacher.path={path!r} has no checkpoint in "
                     f"{directory}.")
  hf = os.path.isdir(os.path.join(path, inputs_lib.HF_DIR))
  errors = []
  for candidate in steps:
    with tempfile.TemporaryDirectory(prefix="rljax-teacher-") as pinned:
      try:
        for name in ("config.json",):
          shutil.copy2(os.path.join(path, name), pinned)
        if hf:
          shutil.copytree(os.path.join(path, inputs_lib.HF_DIR),
                          os.path.join(pinned, inputs_lib.HF_DIR))
        else:
          shutil.copy2(os.path.join(path, "tokenizer.model"), pinned)
        shutil.copytree(os.path.join(directory, str(candidate)),
                        os.path.join(pinned, "checkpoints", str(candidate)))
        base = os.path.join(path, LORA_BASE_DIR)
        if os.path.isdir(base):  # a LoRA run's frozen base (session.py)
          shutil.copytree(base, os.path.join(pinned, LORA_BASE_DIR))
        loaded = load_policy(pinned, candidate)
      except Exception as e:  # pylint: disable=broad-exception-caught
        # orbax / tensorstore / the file system raise many kinds.
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        errors.append(f"step {candidate}: {why}")
        logging.getLogger("rljax").warning(
            "teacher.path=%r: checkpoint %d is unreadable (%s)%s", path,
            candidate, why, "; trying the one before it" if
            candidate != steps[-1] else "")
        continue
    return loaded
  raise ValueError(f"teacher.path={path!r}: no readable checkpoint ("
                   + "; ".join(errors) + ").")


def load_teacher(path: str, mesh: jax.sharding.Mesh, vocab_size: int, *,
                 step: int | None = None, tokenizer: Any = None,
                 field: str = "teacher.path"
                 ) -> tuple[models.ModelConfig, Any]:
  """``(model_config, params)`` of a teacher, sharded on ``mesh``.

  Args:
    path: an rljax run directory (``checkpoints/`` and ``config.json``;
      checkpoint ``step``, else the newest readable one, copied before it
      is read: ``_load_pinned``) or a Hugging Face checkpoint
      directory (``config.json`` and safetensors).
    mesh: the device mesh.
    vocab_size: the student's vocabulary size; the teacher's must equal it.
    step: the run directory's checkpoint.
    tokenizer: the student's tokenizer; given, the teacher's must be the
      same by content (``check_same_tokenizer``): its tokenizer files for a
      Hugging Face directory, the run's tokenizer for a run directory.
    field: the config field errors name (``preference.reference`` reads a
      reference model with it).

  Raises:
    ValueError: naming ``teacher.path`` when it is neither, or when the
      vocabularies differ.
  """
  if os.path.isdir(os.path.join(path, "checkpoints")):
    loaded = _load_pinned(path, step)
    if tokenizer is not None:
      check_same_tokenizer(tokenizer, getattr(loaded.tokenizer, "tokenizer",
                                              loaded.tokenizer), path, field)
    model_config = loaded.model_config
    # Onto the global mesh, whichever process count wrote or reads it.
    params = sharding_lib.put_global(
        loaded.params, models.param_shardings(model_config, mesh))
  elif os.path.isfile(os.path.join(path, "config.json")):
    if step is not None:
      raise ValueError(f"teacher.step={step} with {field}={path!r}, a "
                       "Hugging Face checkpoint: accepted teacher.step=None.")
    if tokenizer is not None:
      check_same_tokenizer(tokenizer, _teacher_tokenizer(path), path, field)
    model_config, params = models.load_hf_pretrained(path, mesh)
  else:
    raise ValueError(
        f"{field}={path!r} is neither an rljax run directory (with "
        "checkpoints/) nor a Hugging Face checkpoint directory (with "
        "config.json).")
  if model_config.vocab_size != vocab_size:
    raise ValueError(
        f"{field}={path!r} has vocab_size={model_config.vocab_size}, the "
        f"student {vocab_size}: the teacher must share the student's "
        "tokenizer.")
  return model_config, params


def load_judge(path: str, mesh: jax.sharding.Mesh | None
               ) -> tuple[models.ModelConfig, Any, Any]:
  """``(model_config, params, tokenizer)`` of a generative judge
  (``rljax.train.judges``): an rljax run's newest checkpoint, or a Hugging
  Face causal LM with its tokenizer files; params placed on ``mesh``."""
  from rljax import tokenizers as tok_lib  # pylint: disable=g-import-not-at-top
  if os.path.isdir(os.path.join(path, "checkpoints")):
    loaded = load_policy(path)
    params = loaded.params
    if mesh is not None:
      params = sharding_lib.put_global(params, models.param_shardings(
          loaded.model_config, mesh))
    return loaded.model_config, params, loaded.tokenizer
  model_config, params = models.load_hf_pretrained(path, mesh)
  return model_config, params, tok_lib.load_hf_tokenizer(path)
