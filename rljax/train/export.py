"""Exporting a trained policy: one safetensors file, or a Hugging Face directory.

``export_policy(policy, workdir, "hf")`` writes ``<workdir>/export/hf``, a
directory ``transformers`` loads with ``AutoModelForCausalLM`` and
``AutoTokenizer``:

* the weights and ``config.json`` (``models.save_hf_checkpoint``), with
  ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``: the source
  checkpoint's where a run started from one has them, else the tokenizer's;
* ``generation_config.json``: the source checkpoint's, else those ids;
* the tokenizer: a run that started from a Hugging Face checkpoint copies its
  files (``<workdir>/tokenizer/``); a run that trained its own sentencepiece
  model writes it as ``tokenizer.model``, ``tokenizer.json`` (``hf`` extra),
  ``tokenizer_config.json`` and ``special_tokens_map.json``
  (``tokenizers.save_hf_tokenizer``), so that ``tokenizer(prompt)`` gives the
  ids the policy was trained on, BOS first as ``tokenizers.encode_prompts``
  writes it.

``export_policy(policy, workdir)`` writes ``<workdir>/export/policy.safetensors``:
rljax's parameter names (``layers_0.attn.q_kernel``, ...) with the model
config and step as metadata.

Example:
  >>> policy = load_policy("/tmp/rljax_demo")  # doctest: +SKIP
  >>> export_policy(policy, "/tmp/rljax_demo", "hf").path  # doctest: +SKIP
  '/tmp/rljax_demo/export/hf'
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

from rljax import models, safetensors
from rljax import tokenizers as tok_lib
from rljax.train import _build_inputs as inputs_lib

FORMATS = ("safetensors", "hf")
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class Exported(NamedTuple):
  """What ``export_policy`` wrote."""

  path: str          # the file, or the directory
  files: list[str]   # relative to the directory (for "hf"), or the file name
  notes: list[str]   # what was left out and why


def default_path(workdir: str, fmt: str = "safetensors") -> str:
  """``<workdir>/export/hf`` or ``<workdir>/export/policy.safetensors``."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt={fmt!r}: accepted {FORMATS}.")
  return os.path.join(workdir, "export",
                      "hf" if fmt == "hf" else "policy.safetensors")


def export_policy(policy: Any, workdir: str, fmt: str = "safetensors",
                  path: str | None = None) -> Exported:
  """Writes a policy's params as ``fmt`` (see the module docstring).

  Args:
    policy: a ``Policy`` (``load_policy``); with ``tokenizer`` None only the
      weights and ``config.json`` are written.
    workdir: the run directory (its ``tokenizer/`` holds a source
      checkpoint's files).
    fmt: ``"safetensors"`` or ``"hf"``.
    path: the output file (``"safetensors"``) or directory (``"hf"``); None
      is ``default_path(workdir, fmt)``.

  Returns:
    The path, the files written and notes on files left out.

  Raises:
    ValueError: an unknown ``fmt``, or a model no ``transformers``
      architecture expresses (``"hf"``).
    IsADirectoryError: ``"safetensors"`` to a directory.
  """
  path = default_path(workdir, fmt) if path is None else os.fspath(path)
  if fmt not in FORMATS:  # default_path checks it only when it is used
    raise ValueError(f"fmt={fmt!r}: accepted {FORMATS}.")
  if fmt == "safetensors":
    if os.path.dirname(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
    metadata = {
        "rljax_model_config": json.dumps(dataclasses.asdict(policy.model_config)),
        "step": str(policy.step)}
    safetensors.save_file(safetensors.flatten_names(policy.params), path,
                          metadata)
    return Exported(path, [os.path.basename(path)], [])
  source = os.path.join(workdir, inputs_lib.HF_DIR)
  source = source if os.path.isdir(source) else None
  tokenizer = policy.tokenizer
  ids = _token_ids(tokenizer, source)
  files = models.save_hf_checkpoint(path, policy.model_config, policy.params,
                                    extra_config=ids, tokenizer_from=source)
  notes = []
  if source is None and isinstance(tokenizer, tok_lib.SentencePieceTokenizer):
    # The policy was trained on prompts as encode_prompts writes them: BOS
    # (when there is one), then the text.
    add_bos = tok_lib.encode_prompts(tokenizer, [""])[0] == [tokenizer.bos_id]
    saved = tok_lib.save_hf_tokenizer(tokenizer, path, add_bos_token=add_bos)
    files += saved.files
    notes += saved.notes
  elif source is None and tokenizer is not None:
    notes.append(f"no tokenizer files: a {type(tokenizer).__name__} is "
                 "copied only from a run's tokenizer/ directory, and only "
                 "a sentencepiece tokenizer is converted.")
  if ids and "generation_config.json" not in files:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump(ids, f, indent=2)
    files.append("generation_config.json")
  return Exported(path, files, notes)


def _token_ids(tokenizer: Any, source: str | None) -> dict[str, Any]:
  """``config.json``'s special ids: the source checkpoint's, else the tokenizer's."""
  ids = {}
  if tokenizer is not None:
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
  if source is not None and os.path.exists(os.path.join(source, "config.json")):
    with open(os.path.join(source, "config.json")) as f:
      original = json.load(f)
    ids.update({k: original[k] for k in _IDS if original.get(k) is not None})
  return {k: v for k, v in ids.items() if v is not None}

