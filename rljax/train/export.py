"""Exporting a trained policy: one safetensors file, a Hugging Face
directory, or a LoRA run's adapters as a peft directory.

``export_policy(policy, workdir, "hf")`` writes ``<workdir>/export/hf``, a
directory ``transformers`` loads with ``AutoModelForCausalLM`` and
``AutoTokenizer``:

* the weights and ``config.json`` (``models.save_hf_checkpoint``), with
  ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``: the source
  checkpoint's where a run started from one has them, else the tokenizer's;
  a LoRA run's weights are merged (``models.lora.merged_params``: each
  kernel plus ``(alpha / r) A B``, an int8 base dequantized), a plain model;
* ``generation_config.json``: the source checkpoint's, else those ids;
* the tokenizer: a run that started from a Hugging Face checkpoint copies its
  files (``<workdir>/tokenizer/``); a run that trained its own sentencepiece
  model writes it as ``tokenizer.model``, ``tokenizer.json`` (``hf`` extra),
  ``tokenizer_config.json`` and ``special_tokens_map.json``
  (``tokenizers.save_hf_tokenizer``), so that ``tokenizer(prompt)`` gives the
  ids the policy was trained on, BOS first as ``tokenizers.encode_prompts``
  writes it.

``export_policy(policy, workdir, "peft")`` (a LoRA run only) writes
``<workdir>/export/adapters``, the adapters alone in peft's layout:
``adapter_model.safetensors`` (``base_model.model.model.layers.{i}.
self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``, and likewise ``k``/``v``/``o_proj`` and
``mlp.{gate,up,down}_proj``) and ``adapter_config.json``; and in its
``base/`` the frozen base the adapters were trained on, as an ``"hf"``
export of the params without adapters (an int8 base dequantized), which
``base_model_name_or_path`` names by its absolute path:
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
adapters)``. peft computes ``(lora_alpha / r) B_hf A_hf x``, rljax
``(alpha / r) x A B`` in ``[in, out]`` layout: ``A_hf`` is ``A`` as
``[in, r]``, transposed, ``B_hf`` is ``B`` as ``[r, out]``, transposed, the
head axes flattened as the kernels' are (``q`` ``[D, N, H]`` is torch's
``[N*H, D]``, ``o`` ``[N, H, D]`` torch's ``[D, N*H]``).

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

import jax
import numpy as np

from rljax import models, safetensors
from rljax import tokenizers as tok_lib
from rljax.train import _build_inputs as inputs_lib

FORMATS = ("safetensors", "hf", "peft")
_DEFAULT_NAMES = {"safetensors": "policy.safetensors", "hf": "hf",
                  "peft": "adapters"}
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Each LoRA target's module in a Hugging Face decoder layer (the names of
# ``models.save_hf_checkpoint``'s tensors) and the rljax module holding it.
_PEFT_MODULES = {"q": ("attn", "self_attn.q_proj"),
                 "k": ("attn", "self_attn.k_proj"),
                 "v": ("attn", "self_attn.v_proj"),
                 "o": ("attn", "self_attn.o_proj"),
                 "gate": ("mlp", "mlp.gate_proj"),
                 "up": ("mlp", "mlp.up_proj"),
                 "down": ("mlp", "mlp.down_proj")}
PEFT_BASE_DIR = "base"


class Exported(NamedTuple):
  """What ``export_policy`` wrote."""

  path: str          # the file, or the directory
  files: list[str]   # relative to the directory ("hf", "peft"), or the file name
  notes: list[str]   # what was left out and why


def default_path(workdir: str, fmt: str = "safetensors") -> str:
  """``<workdir>/export/hf``, ``<workdir>/export/adapters`` (``"peft"``) or
  ``<workdir>/export/policy.safetensors``."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt={fmt!r}: accepted {FORMATS}.")
  return os.path.join(workdir, "export", _DEFAULT_NAMES[fmt])


def export_policy(policy: Any, workdir: str, fmt: str = "safetensors",
                  path: str | None = None) -> Exported:
  """Writes a policy's params as ``fmt`` (see the module docstring).

  Args:
    policy: a ``Policy`` (``load_policy``); with ``tokenizer`` None only the
      weights and ``config.json`` are written.
    workdir: the run directory (its ``tokenizer/`` holds a source
      checkpoint's files).
    fmt: ``"safetensors"``, ``"hf"`` (a LoRA run's adapters merged) or
      ``"peft"`` (a LoRA run's adapters apart, with their base in
      ``base/``).
    path: the output file (``"safetensors"``) or directory; None is
      ``default_path(workdir, fmt)``.

  Returns:
    The path, the files written and notes on files left out.

  Raises:
    ValueError: an unknown ``fmt``, ``"peft"`` for a run without adapters,
      or a model no ``transformers`` architecture expresses (``"hf"``,
      ``"peft"``).
    IsADirectoryError: ``"safetensors"`` to a directory.
  """
  if fmt not in FORMATS:
    raise ValueError(f"fmt={fmt!r}: accepted {FORMATS}.")
  lora = policy.model_config.lora
  if fmt == "peft" and (lora is None or not lora.targets):
    raise ValueError(
        f"fmt={fmt!r}: the run has no LoRA adapters (model.lora.rank=0); "
        "accepted for a LoRA run only, use 'hf' or 'safetensors'.")
  path = default_path(workdir, fmt) if path is None else os.fspath(path)
  if fmt == "safetensors":
    if os.path.dirname(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
    metadata = {
        "rljax_model_config": json.dumps(dataclasses.asdict(policy.model_config)),
        "step": str(policy.step)}
    safetensors.save_file(safetensors.flatten_names(policy.params), path,
                          metadata)
    return Exported(path, [os.path.basename(path)], [])
  config = policy.model_config
  if fmt == "hf":
    params = (policy.params if lora is None
              else models.lora.merged_params(policy.params, config))
    files, notes = _write_hf(policy, workdir, config.without_lora(), params,
                             path)
    if lora is not None:
      notes.append("the LoRA adapters are merged into the weights; "
                   "format 'peft' writes them apart.")
    return Exported(path, files, notes)
  base = models.lora.dequantize_params(models.lora.split(policy.params)[1],
                                       config.jnp_param_dtype)
  base_path = os.path.join(path, PEFT_BASE_DIR)
  files, notes = _write_hf(policy, workdir, config.without_lora(), base,
                           base_path)
  files = [os.path.join(PEFT_BASE_DIR, name) for name in files]
  files += _write_peft(path, config, policy.params,
                       os.path.abspath(base_path))
  return Exported(path, files, notes)


def _write_hf(policy: Any, workdir: str, config: models.ModelConfig,
              params: Any, path: str) -> tuple[list[str], list[str]]:
  """``(files, notes)`` of an ``"hf"`` export of ``params`` to ``path``."""
  source = os.path.join(workdir, inputs_lib.HF_DIR)
  source = source if os.path.isdir(source) else None
  tokenizer = policy.tokenizer
  ids = _token_ids(tokenizer, source)
  files = models.save_hf_checkpoint(path, config, params, extra_config=ids,
                                    tokenizer_from=source)
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
  return files, notes


def _write_peft(path: str, config: models.ModelConfig, params: Any,
                base: str) -> list[str]:
  """Writes ``adapter_model.safetensors`` and ``adapter_config.json``.

  Args:
    path: the output directory.
    config: the run's model config (``config.lora`` set).
    params: the params tree with the adapters.
    base: ``base_model_name_or_path``.

  Returns:
    The files written, relative to ``path``.
  """
  lora = config.lora
  tensors = {}
  for i in range(config.num_layers):
    for target in lora.targets:
      module, hf_module = _PEFT_MODULES[target]
      leaves = params[f"layers_{i}"][module]
      a = np.asarray(jax.device_get(leaves[f"{target}_lora_a"]))
      b = np.asarray(jax.device_get(leaves[f"{target}_lora_b"]))
      name = f"base_model.model.model.layers.{i}.{hf_module}"
      # A [I..., r] -> [r, in]; B [r, O...] -> [out, r] (torch Linear).
      tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(
          a.reshape(-1, lora.rank).T)
      tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(
          b.reshape(lora.rank, -1).T)
  os.makedirs(path, exist_ok=True)
  safetensors.save_file(tensors, os.path.join(path, "adapter_model.safetensors"),
                        metadata={"format": "pt"})
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base, "r": lora.rank,
      "lora_alpha": lora.alpha,
      "target_modules": [_PEFT_MODULES[t][1].split(".")[-1]
                         for t in lora.targets],
      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
      "use_rslora": False, "use_dora": False, "inference_mode": True}
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(adapter_config, f, indent=2)
  return ["adapter_model.safetensors", "adapter_config.json"]


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
