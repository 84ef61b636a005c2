"""Hugging Face checkpoint weights: import into rljax params, export back.

The architectures and the ``config.json`` mapping are
``rljax.models.hf_config``; this module maps tensors. ``tensor_map`` is the
one table of Hugging Face tensor names and layouts (``[N*H, D]`` to
``[D, N, H]`` and so on) against rljax parameter paths, used both ways.

Files are read and written through ``rljax.safetensors`` (the
``safetensors`` package's NumPy API; no torch). Import first checks the
whole checkpoint against the config: every tensor present, none unexpected,
each of a float dtype and of the shape ``config.json`` implies, all from the
file headers before any tensor is read. Then it maps one tensor at a time
(``SafetensorsFile.view``: a memory map, nothing read yet), changes its
layout (a view of the map) and materialises it once, in its target dtype:
with a mesh through ``jax.make_array_from_callback``, so each device gets
just its own shard, with the sharding ``models.param_shardings`` gives it,
and only the file pages that shard touches are read (a process of a
multi-host run reads its devices' slices, not the model); without one on
the default device. At most one tensor's converted copy is on the host at
any time, never the whole file.

Export writes ``config.json`` (pre-v5 field names, which ``transformers`` 5
still reads) and safetensors shards of at most ``max_shard_size`` bytes with
a ``model.safetensors.index.json``, fetching one parameter at a time; a shard
is held on the host while it is written (``safetensors.numpy.save_file``
takes a file's arrays at once). Tokenizer files are copied as files: the
model package knows no tokenizer.

Example:
  >>> config, params = load_hf_checkpoint("/ckpt/qwen2.5-0.5b", mesh)  # doctest: +SKIP
  >>> save_hf_checkpoint("/tmp/out", config, params,  # doctest: +SKIP
  ...                    tokenizer_from="/ckpt/qwen2.5-0.5b")
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rljax import safetensors
from rljax import sharding
from rljax.models.config import ModelConfig
from rljax.models.hf_config import (HF_DTYPES, hf_architecture,
                                    hf_config_from_model_config,
                                    model_config_from_hf, read_hf_config)
from rljax.models.params import param_shapes, param_shardings


# --------------------------------------------------------------------------
# The tensor map: Hugging Face names and layouts <-> rljax params


@dataclasses.dataclass(frozen=True)
class Tensor:
  hf_name: str
  path: tuple[str, ...]             # key path in the rljax params
  hf_shape: tuple[int, ...]
  to_rljax: Callable[[np.ndarray], np.ndarray]   # a view where possible
  to_hf: Callable[[np.ndarray], np.ndarray]


def _same(hf_name, path, shape):
  return Tensor(hf_name, path, shape, lambda w: w, lambda a: a)


def _in_proj(hf_name, path, heads, h, d):
  """``[X*H, D]`` (torch Linear) <-> ``[D, X, H]``."""
  return Tensor(hf_name, path, (heads * h, d),
                 lambda w: w.reshape(heads, h, d).transpose(2, 0, 1),
                 lambda a: a.transpose(1, 2, 0).reshape(heads * h, d))


def _out_proj(hf_name, path, n, h, d):
  """``[D, N*H]`` <-> ``[N, H, D]``."""
  return Tensor(hf_name, path, (d, n * h),
                 lambda w: w.reshape(d, n, h).transpose(1, 2, 0),
                 lambda a: a.transpose(2, 0, 1).reshape(d, n * h))


def _bias(hf_name, path, heads, h):
  return Tensor(hf_name, path, (heads * h,),
                 lambda w: w.reshape(heads, h), lambda a: a.reshape(heads * h))


def linear(hf_name, path, out_dim, in_dim):
  """``[out, in]`` (torch Linear) <-> ``[in, out]``."""
  return Tensor(hf_name, path, (out_dim, in_dim), lambda w: w.T, lambda a: a.T)


def tensor_map(c: ModelConfig) -> list[Tensor]:
  """Every parameter of ``c``, in Hugging Face's file order."""
  d, n, k, h, f, v = (c.d_model, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.mlp_dim, c.vocab_size)
  out = [_same("model.embed_tokens.weight", ("embedding",), (v, d))]
  norms = ((("input_layernorm", "pre_attn_norm"),
            ("post_attention_layernorm", "post_attn_norm"),
            ("pre_feedforward_layernorm", "pre_mlp_norm"),
            ("post_feedforward_layernorm", "post_mlp_norm")) if c.post_norms
           else (("input_layernorm", "pre_attn_norm"),
                 ("post_attention_layernorm", "pre_mlp_norm")))
  for i in range(c.num_layers):
    p, r = f"model.layers.{i}.", f"layers_{i}"
    a = p + "self_attn."
    out += [_in_proj(a + "q_proj.weight", (r, "attn", "q_kernel"), n, h, d),
            _in_proj(a + "k_proj.weight", (r, "attn", "k_kernel"), k, h, d),
            _in_proj(a + "v_proj.weight", (r, "attn", "v_kernel"), k, h, d),
            _out_proj(a + "o_proj.weight", (r, "attn", "o_kernel"), n, h, d)]
    if c.qkv_bias:
      out += [_bias(a + "q_proj.bias", (r, "attn", "q_bias"), n, h),
              _bias(a + "k_proj.bias", (r, "attn", "k_bias"), k, h),
              _bias(a + "v_proj.bias", (r, "attn", "v_bias"), k, h)]
    if c.qk_norm:
      out += [_same(a + "q_norm.weight", (r, "attn", "q_norm", "scale"), (h,)),
              _same(a + "k_norm.weight", (r, "attn", "k_norm", "scale"), (h,))]
    out += [linear(p + "mlp.gate_proj.weight", (r, "mlp", "gate_kernel"), f, d),
            linear(p + "mlp.up_proj.weight", (r, "mlp", "up_kernel"), f, d),
            linear(p + "mlp.down_proj.weight", (r, "mlp", "down_kernel"), d, f)]
    out += [_same(p + hf_norm + ".weight", (r, norm, "scale"), (d,))
            for hf_norm, norm in norms]
  out.append(_same("model.norm.weight", ("final_norm", "scale"), (d,)))
  if not c.tie_embeddings:
    out.append(linear("lm_head.weight", ("lm_head",), v, d))
  return out


def _get_path(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# --------------------------------------------------------------------------
# Reading a checkpoint directory


def _read_index(file: str) -> dict[str, str]:
  """The ``weight_map`` of a ``model.safetensors.index.json``, checked."""
  with open(file, "rb") as f:
    try:
      index = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{file} is not valid JSON: {e}") from e
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(
      isinstance(v, str) for v in weight_map.values()):
    raise ValueError(f"{file}: a JSON object whose 'weight_map' maps tensor "
                     "names to file names is required.")
  return weight_map


class _Checkpoint:
  """All safetensors files of a directory, by tensor name (headers only)."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
      weight_map = _read_index(index_path)
      files = sorted(set(weight_map.values()))
      missing = [name for name in files
                 if not os.path.exists(os.path.join(directory, name))]
      if missing:
        held = [t for t, name in weight_map.items() if name == missing[0]]
        raise FileNotFoundError(
            f"{directory}: shard(s) {missing} listed in "
            f"model.safetensors.index.json are missing ({missing[0]} holds "
            f"{len(held)} tensors, e.g. {held[:3]}); download the complete "
            "checkpoint.")
    else:
      weight_map = None
      files = sorted(name for name in os.listdir(directory)
                     if name.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(
            f"{directory} holds no model.safetensors, "
            "model.safetensors.index.json or other *.safetensors file.")
    self.files: dict[str, safetensors.SafetensorsFile] = {}
    self.where: dict[str, str] = {}
    try:  # the files opened so far are closed on any error
      for name in files:
        self.files[name] = safetensors.SafetensorsFile(
            os.path.join(directory, name))
        for tensor in self.files[name].names:
          if tensor in self.where:
            raise ValueError(f"{directory}: tensor {tensor!r} is in both "
                             f"{self.where[tensor]} and {name}.")
          self.where[tensor] = name
      for tensor, name in (weight_map or {}).items():
        if self.where.get(tensor) != name:
          raise ValueError(f"{directory}: model.safetensors.index.json puts "
                           f"{tensor!r} in {name}, which does not hold it.")
    except BaseException:
      self.close()
      raise

  def file(self, name: str) -> safetensors.SafetensorsFile:
    """The file holding tensor ``name``."""
    return self.files[self.where[name]]

  def close(self) -> None:
    for file in self.files.values():
      file.close()


def _ignorable(name: str, config: ModelConfig) -> bool:
  # Old checkpoints store RoPE buffers; tied checkpoints sometimes keep a copy
  # of the embedding as lm_head (transformers ignores it too).
  return name.endswith("rotary_emb.inv_freq") or (
      config.tie_embeddings and name == "lm_head.weight")


def _check_tensors(ckpt: _Checkpoint, tensors: list[Tensor],
                   ignorable: Callable[[str], bool], arch: str,
                   directory: str) -> None:
  expected = {t.hf_name: t for t in tensors}
  missing = [name for name in expected if name not in ckpt.where]
  if missing:
    raise ValueError(f"{directory}: {len(missing)} tensor(s) that {arch} with "
                     f"this config.json needs are missing, e.g. {missing[:5]}.")
  extra = [name for name in ckpt.where
           if name not in expected and not ignorable(name)]
  if extra:
    raise ValueError(f"{directory}: {len(extra)} tensor(s) that rljax's {arch} "
                     f"does not use, e.g. {extra[:5]}: config.json and the "
                     "weights disagree, or the model has parts rljax lacks.")
  for name, t in expected.items():
    file = ckpt.file(name)
    file.check(name, dtypes=safetensors.FLOAT_DTYPES)
    shape = file.shape(name)
    if shape != t.hf_shape:
      raise ValueError(
          f"{directory}/{ckpt.where[name]}: tensor {name!r} has shape "
          f"{list(shape)}, but config.json implies {list(t.hf_shape)}.")


# --------------------------------------------------------------------------
# Import


def load_hf_checkpoint(path: str | os.PathLike, mesh: Mesh | None = None, *,
                       param_dtype: str | None = None, dtype: str | None = None,
                       rules: sharding.Rules = sharding.DEFAULT_RULES,
                       ) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads a Hugging Face checkpoint directory into rljax params.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or shards
      with ``model.safetensors.index.json``).
    mesh: with a mesh, each parameter is created directly with the sharding
      ``models.param_shardings(config, mesh, rules)`` gives it; None places
      everything on the default device.
    param_dtype: storage dtype; None keeps the checkpoint's (see
      ``model_config_from_hf``).
    dtype: compute dtype; None uses ``param_dtype``.
    rules: logical-to-mesh rules.

  Returns:
    ``(config, params)``.

  Raises:
    FileNotFoundError: a missing ``config.json`` or shard.
    ValueError: an unsupported architecture or config value, an invalid
      safetensors file, a missing, unexpected, wrongly typed or wrongly shaped
      tensor; all checked before any tensor is read.
  """
  path = os.fspath(path)
  hf = read_hf_config(path)
  config = model_config_from_hf(hf, param_dtype=param_dtype, dtype=dtype,
                                source=os.path.join(path, "config.json"))
  shardings = None if mesh is None else param_shardings(config, mesh, rules)
  params = read_tensors(path, tensor_map(config), hf_architecture(hf),
                        np.dtype(config.jnp_param_dtype), shardings,
                        ignorable=lambda name: _ignorable(name, config))
  return config, params


def read_tensors(path: str, tensors: list[Tensor], arch: str,
                 target: np.dtype, shardings: Any = None, *,
                 ignorable: Callable[[str], bool] = lambda name: False,
                 ) -> dict[str, Any]:
  """The params tree of ``tensors`` read from checkpoint directory ``path``.

  Every tensor is checked (present, none unexpected unless ``ignorable``,
  float, of its shape) before any is read; then each is mapped, converted to
  ``target`` and placed: with ``shardings`` (a tree indexed like the params)
  each device gets its own slice, else the default device.
  """
  ckpt = _Checkpoint(path)
  try:
    _check_tensors(ckpt, tensors, ignorable, arch, path)
    params: dict[str, Any] = {}
    for t in tensors:
      # A memory map: each process reads the pages of its devices' slices.
      view = t.to_rljax(ckpt.file(t.hf_name).view(t.hf_name))
      if shardings is None:
        array = jax.device_put(np.array(view, dtype=target))
      else:
        array = jax.make_array_from_callback(
            view.shape, _get_path(shardings, t.path),
            lambda index, view=view: np.array(view[index], dtype=target))
      _set_path(params, t.path, array)
  finally:
    ckpt.close()
  return params


class HFModel(NamedTuple):
  """What ``load_hf_pretrained`` returns (unpacks as ``config, params``)."""

  config: ModelConfig
  params: dict[str, Any]


def load_hf_pretrained(path: str | os.PathLike, mesh: Mesh | None = None, *,
                       param_dtype: str | None = None, dtype: str | None = None,
                       rules: sharding.Rules = sharding.DEFAULT_RULES,
                       ) -> HFModel:
  """Config and params of a checkpoint directory, as an ``HFModel``.

  ``load_hf_checkpoint`` with named fields. The model package knows no
  tokenizer: read the checkpoint's with
  ``rljax.tokenizers.load_hf_tokenizer(path)`` (its ``eos_ids`` and
  ``apply_chat_template`` go with it). The model's ``vocab_size`` may exceed
  the tokenizer's (padded embeddings).
  """
  config, params = load_hf_checkpoint(path, mesh, param_dtype=param_dtype,
                                      dtype=dtype, rules=rules)
  return HFModel(config, params)


# --------------------------------------------------------------------------
# Export

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def parse_size(size: int | str) -> int:
  if isinstance(size, int) and size > 0:
    return size
  if isinstance(size, str):
    text = size.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
      if text.endswith(unit):
        try:
          value = float(text[:-len(unit)]) * _UNITS[unit]
        except ValueError:
          break
        if value >= 1:
          return int(value)
  raise ValueError(f"max_shard_size={size!r}: accepted a positive number of "
                   "bytes or a string such as '2GB', '500MB', '1GiB'.")


def _to_host(x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _write_shard(file: str, tensors: list[Tensor], params: Mapping[str, Any],
                 out_dtype: np.dtype) -> None:
  arrays = {}
  for t in tensors:
    array = t.to_hf(_to_host(_get_path(params, t.path)))
    arrays[t.hf_name] = np.ascontiguousarray(array, dtype=out_dtype)
  safetensors.save_file(arrays, file, metadata={"format": "pt"})


def save_hf_checkpoint(path: str | os.PathLike, config: ModelConfig,
                       params: Mapping[str, Any], *,
                       architecture: str | None = None,
                       dtype: str | None = None,
                       max_shard_size: int | str = "5GB",
                       extra_config: Mapping[str, Any] | None = None,
                       tokenizer_from: str | os.PathLike | None = None,
                       ) -> list[str]:
  """Writes params as a Hugging Face checkpoint ``transformers`` can load.

  Args:
    path: output directory (created). The files an earlier export wrote
      there (``config.json``, ``model.safetensors``,
      ``model-*-of-*.safetensors``, ``model.safetensors.index.json``) are
      removed first, so no stale shard or index outlives this export; other
      files are kept (tokenizer files of the same names are overwritten).
    config: the model config of ``params``.
    params: the params pytree (sharded or not; gathered to the host one
      tensor at a time, and held there one shard at a time).
    architecture: one of ``ARCHITECTURES``; None infers it from ``config``.
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` tensors; None uses
      ``config.param_dtype``.
    max_shard_size: the largest shard in bytes (int, or e.g. ``"2GB"``); a
      tensor larger than that gets a shard of its own.
    extra_config: fields merged into ``config.json`` (e.g. ``bos_token_id``,
      ``eos_token_id``, ``max_position_embeddings`` of the original).
    tokenizer_from: a directory whose tokenizer files (and
      ``generation_config.json``) are copied next to the weights.

  Returns:
    The files written, relative to ``path``.

  Raises:
    ValueError: if ``config`` cannot be expressed as the architecture, or
      ``params`` do not match ``config``.
  """
  if not isinstance(config, ModelConfig):
    raise TypeError(f"save_hf_checkpoint(path, config, params): config is a "
                    f"{type(config).__name__}; a ModelConfig is required.")
  path = os.fspath(path)
  dtype = dtype or config.param_dtype
  if dtype not in HF_DTYPES:
    raise ValueError(f"dtype={dtype!r}: accepted {HF_DTYPES}.")
  out_dtype = np.dtype(jnp.dtype(dtype))
  limit = parse_size(max_shard_size)
  hf = hf_config_from_model_config(config, architecture, dtype=dtype)
  hf.update(extra_config or {})
  return write_tensors(path, tensor_map(config), params, param_shapes(config),
                       hf, out_dtype, limit, tokenizer_from)


def write_tensors(path: str, tensors: list[Tensor], params: Mapping[str, Any],
                  expected: Any, hf: Mapping[str, Any], out_dtype: np.dtype,
                  limit: int, tokenizer_from: str | os.PathLike | None
                  ) -> list[str]:
  """Writes ``tensors`` of ``params`` (checked against the ``expected``
  shapes) in shards of at most ``limit`` bytes, ``config.json`` from ``hf``
  and the tokenizer files; returns the files written (``save_hf_checkpoint``).
  """
  if jax.tree.structure(params) != jax.tree.structure(expected):
    raise ValueError("params do not have the structure of the config's params: "
                     f"{jax.tree.structure(params)} vs "
                     f"{jax.tree.structure(expected)}.")
  for t in tensors:
    got = tuple(_get_path(params, t.path).shape)
    want = tuple(_get_path(expected, t.path).shape)
    if got != want:
      raise ValueError(f"params[{'/'.join(t.path)}] has shape {got}; the "
                       f"config gives {want}.")
  shards: list[list[Tensor]] = [[]]
  used = 0
  for t in tensors:
    size = math.prod(t.hf_shape) * out_dtype.itemsize
    if shards[-1] and used + size > limit:
      shards.append([])
      used = 0
    shards[-1].append(t)
    used += size
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            for i in range(len(shards))])
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    _remove_previous_export(path)
  for name, entries in zip(names, shards):
    if writer:
      _write_shard(os.path.join(path, name), entries, params, out_dtype)
    else:  # every process joins the gathers of non-addressable params
      for t in entries:
        _to_host(_get_path(params, t.path))
  written = list(names)
  if not writer:
    return written
  if len(shards) > 1:
    total = sum(math.prod(t.hf_shape) * out_dtype.itemsize for t in tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {t.hf_name: name for name, entries in zip(names, shards)
                            for t in entries}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
    written.append("model.safetensors.index.json")
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  written.append("config.json")
  if tokenizer_from is not None:
    written += copy_files(tokenizer_from, path, _TOKENIZER_FILES)
  return written


_EXPORTED = re.compile(
    r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?"
    r"|model\.safetensors\.index\.json")


def _remove_previous_export(path: str) -> None:
  """Removes what an earlier ``save_hf_checkpoint`` wrote to ``path``.

  Loaders (rljax's and ``transformers``') prefer an index to the weight
  files beside it, so an index left by an earlier sharded export would make
  them read its old shards instead of the new weights. The index goes first:
  an export that stops half-way then leaves weights without an index and no
  config, which fail to load with a clear error.
  """
  names = [n for n in os.listdir(path) if _EXPORTED.fullmatch(n)]
  for name in sorted(names, key=lambda n: not n.endswith(".index.json")):
    os.remove(os.path.join(path, name))


def copy_files(source: str | os.PathLike, destination: str | os.PathLike,
               names: tuple[str, ...]) -> list[str]:
  """Copies those of ``names`` that exist in ``source`` into ``destination``.

  Returns:
    The names copied.
  """
  os.makedirs(destination, exist_ok=True)
  copied = []
  for name in names:
    path = os.path.join(os.fspath(source), name)
    target = os.path.join(os.fspath(destination), name)
    if os.path.exists(path):
      if not (os.path.exists(target) and os.path.samefile(path, target)):
        shutil.copyfile(path, target)
      copied.append(name)
  return copied
