"""Hugging Face checkpoints: import into rljax params, export back.

Supported architectures (``config.json: architectures``):

=====================  ====================================================
``LlamaForCausalLM``   Llama 3.x (``rope_type: llama3`` or ``linear``)
``Qwen2ForCausalLM``   Qwen2 / Qwen2.5 (q/k/v biases)
``Qwen3ForCausalLM``   Qwen3 dense (q/k RMSNorm)
``Gemma2ForCausalLM``  Gemma 2 (post-norms, soft-caps, alternating windows)
``Gemma3ForCausalLM``  Gemma 3 text (q/k norm, 5:1 windows, local RoPE base)
=====================  ====================================================

Anything else, and any config value rljax cannot represent exactly, is a
``ValueError`` naming the architecture, the field, the value and what is
accepted, raised before any tensor is read.

Import reads the safetensors files without torch: the 8-byte header length
and the JSON header give each tensor's dtype, shape and byte range, and a
read-only ``np.memmap`` of the file gives a zero-copy view; the layout change
(``[N*H, D]`` to ``[D, N, H]`` and so on) is a view too. Each parameter is
then materialised once, in its target dtype: with a mesh through
``jax.make_array_from_callback``, so every device reads just its own shard of
the view; without one on the default device. At no point is more than one
tensor copied on the host, and the file pages are the OS's cache, not a
second copy of the model.

Export writes ``config.json`` (pre-v5 field names, which ``transformers`` 5
still reads) and safetensors shards of at most ``max_shard_size`` bytes with
a ``model.safetensors.index.json``, fetching one parameter at a time.

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
import shutil
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rljax import hf_tokenizer
from rljax import sharding
from rljax.models.config import ModelConfig, RopeScaling
from rljax.models.params import param_shapes, param_shardings

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text"}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")
_LAYER_TYPES = ("full_attention", "sliding_attention")

# Fields whose value is fixed by the architecture (checked on export).
_FIXED = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False, post_norms=False,
                             norm_offset=0.0, activation="silu",
                             embed_scale=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False, post_norms=False,
                             norm_offset=0.0, activation="silu",
                             embed_scale=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True, post_norms=False,
                             norm_offset=0.0, activation="silu",
                             embed_scale=False),
    "Gemma2ForCausalLM": dict(qkv_bias=False, qk_norm=False, post_norms=True,
                              norm_offset=1.0, activation="gelu_tanh",
                              embed_scale=True, rope_local_theta=None),
    "Gemma3ForCausalLM": dict(qkv_bias=False, qk_norm=True, post_norms=True,
                              norm_offset=1.0, activation="gelu_tanh",
                              embed_scale=True),
}

_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_HF_DTYPES = ("float32", "bfloat16", "float16")


def _unsupported(arch: str, field: str, value: Any, accepted: Any) -> ValueError:
  return ValueError(f"{arch}: config.json field {field}={value!r} is not "
                    f"supported by rljax; accepted: {accepted}.")


# --------------------------------------------------------------------------
# config.json <-> ModelConfig


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The ``config.json`` of a checkpoint directory, as a dict."""
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"{file} does not exist: {os.fspath(path)!r} is "
                            "not a Hugging Face checkpoint directory.")
  with open(file, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{file} is not valid JSON: {e}") from e


def _required(arch: str, hf: Mapping[str, Any], field: str) -> Any:
  if hf.get(field) is None:
    raise ValueError(f"{arch}: config.json has no {field!r}, which rljax "
                     "needs; the file is incomplete.")
  return hf[field]


def _architecture(hf: Mapping[str, Any]) -> str:
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise ValueError(f"config.json field architectures={archs!r} is not "
                     f"supported by rljax; accepted: one of {ARCHITECTURES}.")
  return archs[0]


def _rope(arch: str, params: Mapping[str, Any], where: str,
          default_theta: float, max_position: int,
          ) -> tuple[float, RopeScaling | None]:
  """``(theta, scaling)`` from one HF rope-parameters dict."""
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in _ROPE_TYPES:
    raise _unsupported(arch, f"{where}.rope_type", kind, _ROPE_TYPES)
  partial = params.get("partial_rotary_factor", 1.0)
  if partial not in (None, 1, 1.0):
    raise _unsupported(arch, f"{where}.partial_rotary_factor", partial, 1.0)
  theta = float(params.get("rope_theta") or default_theta)
  if kind == "default":
    return theta, None
  factor = _required(arch, params, "factor")
  if kind == "linear":
    return theta, RopeScaling(factor=float(factor), rope_type="linear")
  return theta, RopeScaling(
      factor=float(factor),
      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
      original_max_position=int(params.get("original_max_position_embeddings")
                                or max_position),
      rope_type="llama3")


def _rope_fields(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
  """RoPE fields from either the v5 ``rope_parameters`` or the older keys."""
  max_pos = int(hf.get("max_position_embeddings") or 8192)
  rp = hf.get("rope_parameters")
  if arch == "Gemma3ForCausalLM":
    if rp and ("full_attention" in rp or "sliding_attention" in rp):
      full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
      full_where = "rope_parameters.full_attention"
      local_where = "rope_parameters.sliding_attention"
    else:
      full = dict(rp or hf.get("rope_scaling") or {})
      full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
      local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
      full_where, local_where = "rope_scaling", "rope_local_base_freq"
    theta, scaling = _rope(arch, full, full_where, 1_000_000.0, max_pos)
    local_theta, local_scaling = _rope(arch, local, local_where, 10_000.0,
                                       max_pos)
    if local_scaling is not None:
      raise _unsupported(arch, f"{local_where}.rope_type",
                         local_scaling.rope_type, "'default'")
    return dict(rope_theta=theta, rope_scaling=scaling,
                rope_local_theta=local_theta)
  if rp and ("full_attention" in rp or "sliding_attention" in rp):
    raise _unsupported(arch, "rope_parameters", rp,
                       "one dict for all layers")
  params = dict(rp or hf.get("rope_scaling") or {})
  params.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
  theta, scaling = _rope(arch, params,
                         "rope_parameters" if rp else "rope_scaling",
                         10_000.0, max_pos)
  return dict(rope_theta=theta, rope_scaling=scaling)


def _layer_types(arch: str, hf: Mapping[str, Any], num_layers: int) -> list[str]:
  types = hf.get("layer_types")
  if types is None:
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
      window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
      start = hf.get("max_window_layers", 28)
      types = ["sliding_attention" if window is not None and i >= start
               else "full_attention" for i in range(num_layers)]
    elif arch in _GEMMA:
      every = (2 if arch == "Gemma2ForCausalLM" else
               hf.get("sliding_window_pattern")
               or hf.get("_sliding_window_pattern") or 6)
      types = ["sliding_attention" if (i + 1) % every else "full_attention"
               for i in range(num_layers)]
    else:
      types = ["full_attention"] * num_layers
  if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
    raise _unsupported(arch, "layer_types", types,
                       f"{num_layers} entries from {_LAYER_TYPES}")
  return list(types)


def _window_fields(arch: str, hf: Mapping[str, Any], num_layers: int
                   ) -> dict[str, Any]:
  """``sliding_window`` and ``global_every`` from the per-layer attention types."""
  local = [t == "sliding_attention" for t in _layer_types(arch, hf, num_layers)]
  if not any(local):
    return dict(sliding_window=None, global_every=1)
  window = hf.get("sliding_window")
  if not isinstance(window, int) or window < 1:
    raise _unsupported(arch, "sliding_window", window, "a positive integer")
  if hf.get("use_bidirectional_attention"):
    raise _unsupported(arch, "use_bidirectional_attention", True, False)
  full = [i for i, is_local in enumerate(local) if not is_local]
  every = full[0] + 1 if full else num_layers + 1
  if any(is_local != bool((i + 1) % every) for i, is_local in enumerate(local)):
    raise _unsupported(
        arch, "layer_types", hf.get("layer_types"),
        "every k-th layer full_attention, the others sliding_attention")
  return dict(sliding_window=window, global_every=every)


def model_config_from_hf(hf: Mapping[str, Any], *, param_dtype: str | None = None,
                         dtype: str | None = None) -> ModelConfig:
  """Translates a Hugging Face ``config.json`` dict into a ``ModelConfig``.

  Args:
    hf: the parsed ``config.json``.
    param_dtype: storage dtype; None takes the checkpoint's ``dtype`` /
      ``torch_dtype`` (``float32`` if absent or unsupported).
    dtype: compute dtype; None uses ``param_dtype``.

  Returns:
    The model config.

  Raises:
    ValueError: naming the architecture, field, value and what is accepted.
  """
  arch = _architecture(hf)
  gemma = arch in _GEMMA
  act_field = ("hidden_activation" if gemma and hf.get("hidden_activation")
               else "hidden_act")
  act = hf.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
  accepted_act = ("gelu_pytorch_tanh",) if gemma else ("silu",)
  if act not in accepted_act:
    raise _unsupported(arch, act_field, act, accepted_act)
  fixed_false = ["mlp_bias", "use_bidirectional_attention"]
  if arch != "Qwen2ForCausalLM":
    fixed_false.append("attention_bias")
  for field in fixed_false:
    if hf.get(field):
      raise _unsupported(arch, field, hf[field], False)
  d = int(_required(arch, hf, "hidden_size"))
  n = int(_required(arch, hf, "num_attention_heads"))
  num_layers = int(_required(arch, hf, "num_hidden_layers"))
  head_dim = int(hf.get("head_dim") or d // n)
  if param_dtype is None:
    param_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    param_dtype = param_dtype if param_dtype in _HF_DTYPES else "float32"
  fields = dict(
      vocab_size=int(_required(arch, hf, "vocab_size")), d_model=d,
      num_layers=num_layers, num_heads=n,
      num_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=head_dim,
      mlp_dim=int(_required(arch, hf, "intermediate_size")),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      param_dtype=param_dtype, dtype=dtype or param_dtype,
      **{k: v for k, v in _FIXED[arch].items() if k != "rope_local_theta"},
      **_rope_fields(arch, hf), **_window_fields(arch, hf, num_layers))
  if gemma:
    softcap = 50.0 if arch == "Gemma2ForCausalLM" else None
    final_softcap = 30.0 if arch == "Gemma2ForCausalLM" else None
    fields.update(
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=hf.get("attn_logit_softcapping", softcap),
        final_logit_softcap=hf.get("final_logit_softcapping", final_softcap))
  if (fields["rope_scaling"] is not None and fields["sliding_window"] is not None
      and arch != "Gemma3ForCausalLM"):
    # rljax scales only the global layers' RoPE, as Gemma 3 does.
    raise _unsupported(arch, "rope_scaling", fields["rope_scaling"],
                       "None with sliding-window layers")
  return ModelConfig(**fields)


def load_hf_config(path: str | os.PathLike, *, param_dtype: str | None = None,
                   dtype: str | None = None) -> ModelConfig:
  """``model_config_from_hf`` of a checkpoint directory's ``config.json``."""
  return model_config_from_hf(read_hf_config(path), param_dtype=param_dtype,
                              dtype=dtype)


def infer_architecture(config: ModelConfig) -> str:
  """The Hugging Face architecture whose fixed fields ``config`` has."""
  if config.post_norms:
    return "Gemma3ForCausalLM" if config.qk_norm else "Gemma2ForCausalLM"
  if config.qkv_bias:
    return "Qwen2ForCausalLM"
  return "Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"


def _number(x: float) -> int | float:
  return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def hf_config_from_model_config(config: ModelConfig,
                                architecture: str | None = None, *,
                                dtype: str | None = None) -> dict[str, Any]:
  """The ``config.json`` dict of ``config`` as a Hugging Face model.

  Args:
    config: the model config.
    architecture: one of ``ARCHITECTURES``; None infers it.
    dtype: the ``torch_dtype`` to record; None uses ``config.param_dtype``.

  Raises:
    ValueError: if ``config`` has a field the architecture cannot express.
  """
  c = config
  arch = architecture or infer_architecture(c)
  if arch not in ARCHITECTURES:
    raise ValueError(f"architecture={arch!r}: accepted {ARCHITECTURES}.")
  for field, value in _FIXED[arch].items():
    if getattr(c, field) != value:
      raise ValueError(f"model.{field}={getattr(c, field)!r} cannot be "
                       f"exported as {arch}, which requires {value!r}.")
  gemma = arch in _GEMMA
  if not gemma:
    for field in ("attn_logit_softcap", "final_logit_softcap",
                  "sliding_window", "rope_local_theta"):
      if getattr(c, field) is not None:
        raise ValueError(f"model.{field}={getattr(c, field)!r} cannot be "
                         f"exported as {arch}, which requires None.")
    if c.query_scale is not None and not math.isclose(
        c.query_scale, c.head_dim ** -0.5, rel_tol=1e-6):
      raise ValueError(f"model.query_scale={c.query_scale!r} cannot be "
                       f"exported as {arch}, which uses head_dim ** -0.5.")
  if (c.rope_scaling is not None and c.sliding_window is not None
      and arch != "Gemma3ForCausalLM"):
    raise ValueError(f"model.rope_scaling with model.sliding_window cannot be "
                     f"exported as {arch}: it scales every layer's RoPE.")
  dtype = dtype or c.param_dtype
  hf: dict[str, Any] = {
      "architectures": [arch], "model_type": _MODEL_TYPES[arch],
      "vocab_size": c.vocab_size, "hidden_size": c.d_model,
      "intermediate_size": c.mlp_dim, "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
      "rms_norm_eps": c.norm_eps, "tie_word_embeddings": c.tie_embeddings,
      "rope_theta": c.rope_theta, "torch_dtype": dtype,
  }
  s = c.rope_scaling
  if s is not None and s.rope_type == "linear":
    hf["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
  elif s is not None:
    hf["rope_scaling"] = {
        "rope_type": "llama3", "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position}
  else:
    hf["rope_scaling"] = None
  if not gemma:
    hf["hidden_act"] = "silu"
    if arch == "LlamaForCausalLM":
      hf.update(attention_bias=False, mlp_bias=False)
    else:
      hf.update(use_sliding_window=False, sliding_window=None)
      if arch == "Qwen3ForCausalLM":
        hf["attention_bias"] = False
    return hf
  scale = c.query_scale if c.query_scale is not None else c.head_dim ** -0.5
  types = ["sliding_attention" if c.is_local_layer(i) else "full_attention"
           for i in range(c.num_layers)]
  hf.update(
      hidden_activation="gelu_pytorch_tanh", attention_bias=False,
      query_pre_attn_scalar=_number(scale ** -2),
      attn_logit_softcapping=c.attn_logit_softcap,
      final_logit_softcapping=c.final_logit_softcap,
      sliding_window=c.sliding_window, layer_types=types)
  if arch == "Gemma3ForCausalLM":
    hf.update(rope_local_base_freq=c.rope_local_theta or c.rope_theta,
              sliding_window_pattern=c.global_every,
              use_bidirectional_attention=False)
  return hf


# --------------------------------------------------------------------------
# The tensor map: Hugging Face names and layouts <-> rljax params


@dataclasses.dataclass(frozen=True)
class _Tensor:
  hf_name: str
  path: tuple[str, ...]             # key path in the rljax params
  hf_shape: tuple[int, ...]
  to_rljax: Callable[[np.ndarray], np.ndarray]   # a view where possible
  to_hf: Callable[[np.ndarray], np.ndarray]


def _same(hf_name, path, shape):
  return _Tensor(hf_name, path, shape, lambda w: w, lambda a: a)


def _in_proj(hf_name, path, heads, h, d):
  """``[X*H, D]`` (torch Linear) <-> ``[D, X, H]``."""
  return _Tensor(hf_name, path, (heads * h, d),
                 lambda w: w.reshape(heads, h, d).transpose(2, 0, 1),
                 lambda a: a.transpose(1, 2, 0).reshape(heads * h, d))


def _out_proj(hf_name, path, n, h, d):
  """``[D, N*H]`` <-> ``[N, H, D]``."""
  return _Tensor(hf_name, path, (d, n * h),
                 lambda w: w.reshape(d, n, h).transpose(1, 2, 0),
                 lambda a: a.transpose(2, 0, 1).reshape(d, n * h))


def _bias(hf_name, path, heads, h):
  return _Tensor(hf_name, path, (heads * h,),
                 lambda w: w.reshape(heads, h), lambda a: a.reshape(heads * h))


def _linear(hf_name, path, out_dim, in_dim):
  """``[out, in]`` (torch Linear) <-> ``[in, out]``."""
  return _Tensor(hf_name, path, (out_dim, in_dim), lambda w: w.T, lambda a: a.T)


def _tensor_map(c: ModelConfig) -> list[_Tensor]:
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
    out += [_linear(p + "mlp.gate_proj.weight", (r, "mlp", "gate_kernel"), f, d),
            _linear(p + "mlp.up_proj.weight", (r, "mlp", "up_kernel"), f, d),
            _linear(p + "mlp.down_proj.weight", (r, "mlp", "down_kernel"), d, f)]
    out += [_same(p + hf_norm + ".weight", (r, norm, "scale"), (d,))
            for hf_norm, norm in norms]
  out.append(_same("model.norm.weight", ("final_norm", "scale"), (d,)))
  if not c.tie_embeddings:
    out.append(_linear("lm_head.weight", ("lm_head",), v, d))
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
# safetensors files


class _SafetensorsFile:
  """The header of a safetensors file and zero-copy views of its tensors."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes).")
      (n,) = struct.unpack("<Q", prefix)
      if n > size - 8:
        raise ValueError(f"{path} is not a safetensors file or is truncated: "
                         f"its header claims {n} bytes, the file has {size}.")
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON: "
                         f"{e}") from e
    self.metadata = header.pop("__metadata__", None) or {}
    self.tensors: dict[str, dict[str, Any]] = header
    self._start = 8 + n
    for name, info in header.items():
      begin, end = info["data_offsets"]
      if self._start + end > size:
        raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte "
                         f"{self._start + end}, the file has {size}.")
    self._mmap = None

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.tensors[name]["shape"])

  def view(self, name: str) -> np.ndarray:
    info = self.tensors[name]
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has dtype "
                       f"{info['dtype']!r}; accepted {tuple(_ST_DTYPES)}.")
    dt = _ST_DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if end - begin != math.prod(shape) * dt.itemsize:
      raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} and "
                       f"dtype {info['dtype']} has {end - begin} bytes.")
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    return self._mmap[self._start + begin:self._start + end].view(dt).reshape(shape)


class _Checkpoint:
  """All safetensors files of a directory, by tensor name."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map") or {}
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
    self.files = {name: _SafetensorsFile(os.path.join(directory, name))
                  for name in files}
    self.where: dict[str, str] = {}
    for name, file in self.files.items():
      for tensor in file.tensors:
        if tensor in self.where:
          raise ValueError(f"{directory}: tensor {tensor!r} is in both "
                           f"{self.where[tensor]} and {name}.")
        self.where[tensor] = name
    for tensor, name in (weight_map or {}).items():
      if self.where.get(tensor) != name:
        raise ValueError(f"{directory}: model.safetensors.index.json puts "
                         f"{tensor!r} in {name}, which does not hold it.")

  def view(self, name: str) -> np.ndarray:
    return self.files[self.where[name]].view(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return self.files[self.where[name]].shape(name)


def _ignorable(name: str, config: ModelConfig) -> bool:
  # Old checkpoints store RoPE buffers; tied checkpoints sometimes keep a copy
  # of the embedding as lm_head (transformers ignores it too).
  return name.endswith("rotary_emb.inv_freq") or (
      config.tie_embeddings and name == "lm_head.weight")


def _check_tensors(ckpt: _Checkpoint, tensors: list[_Tensor],
                   config: ModelConfig, arch: str, directory: str) -> None:
  expected = {t.hf_name: t for t in tensors}
  missing = [name for name in expected if name not in ckpt.where]
  if missing:
    raise ValueError(f"{directory}: {len(missing)} tensor(s) that {arch} with "
                     f"this config.json needs are missing, e.g. {missing[:5]}.")
  extra = [name for name in ckpt.where
           if name not in expected and not _ignorable(name, config)]
  if extra:
    raise ValueError(f"{directory}: {len(extra)} tensor(s) that rljax's {arch} "
                     f"does not use, e.g. {extra[:5]}: config.json and the "
                     "weights disagree, or the model has parts rljax lacks.")
  for name, t in expected.items():
    shape = ckpt.shape(name)
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
    ValueError: an unsupported architecture or config value, a missing,
      unexpected or wrongly shaped tensor; all checked before any tensor is
      read.
  """
  path = os.fspath(path)
  hf = read_hf_config(path)
  config = model_config_from_hf(hf, param_dtype=param_dtype, dtype=dtype)
  arch = _architecture(hf)
  ckpt = _Checkpoint(path)
  tensors = _tensor_map(config)
  _check_tensors(ckpt, tensors, config, arch, path)
  target = np.dtype(config.jnp_param_dtype)
  shardings = None if mesh is None else param_shardings(config, mesh, rules)
  params: dict[str, Any] = {}
  for t in tensors:
    view = t.to_rljax(ckpt.view(t.hf_name))
    if shardings is None:
      array = jax.device_put(np.array(view, dtype=target))
    else:
      array = jax.make_array_from_callback(
          view.shape, _get_path(shardings, t.path),
          lambda index, view=view: np.array(view[index], dtype=target))
    _set_path(params, t.path, array)
  return config, params


class HFModel(NamedTuple):
  """What ``load_hf_pretrained`` returns (unpacks as a tuple)."""

  config: ModelConfig
  params: dict[str, Any]
  tokenizer: Any


def load_hf_pretrained(path: str | os.PathLike, mesh: Mesh | None = None, *,
                       param_dtype: str | None = None, dtype: str | None = None,
                       rules: sharding.Rules = sharding.DEFAULT_RULES,
                       ) -> HFModel:
  """Config, params and tokenizer of a checkpoint: what a training run needs.

  The tokenizer is ``hf_tokenizer.load_tokenizer(path)``: its ``eos_ids``
  (every id that ends a turn) and ``apply_chat_template`` go with it. The
  model's ``vocab_size`` may exceed the tokenizer's (padded embeddings).
  """
  config, params = load_hf_checkpoint(path, mesh, param_dtype=param_dtype,
                                      dtype=dtype, rules=rules)
  return HFModel(config, params, hf_tokenizer.load_tokenizer(path))


# --------------------------------------------------------------------------
# Export

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def _parse_size(size: int | str) -> int:
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


def _write_shard(file: str, entries: list[tuple[_Tensor, tuple[int, ...]]],
                 params: Mapping[str, Any], out_dtype: np.dtype) -> None:
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for t, shape in entries:
    size = math.prod(shape) * out_dtype.itemsize
    header[t.hf_name] = {"dtype": _ST_NAMES[out_dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for t, _ in entries:
      array = t.to_hf(_to_host(_get_path(params, t.path)))
      f.write(np.ascontiguousarray(array, dtype=out_dtype).tobytes())


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
    path: output directory (created; existing files of the same names are
      overwritten).
    config: the model config of ``params``.
    params: the params pytree (sharded or not; one tensor at a time is
      gathered to the host).
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
  if dtype not in _HF_DTYPES:
    raise ValueError(f"dtype={dtype!r}: accepted {_HF_DTYPES}.")
  out_dtype = np.dtype(jnp.dtype(dtype))
  limit = _parse_size(max_shard_size)
  hf = hf_config_from_model_config(config, architecture, dtype=dtype)
  hf.update(extra_config or {})
  expected = param_shapes(config)
  if jax.tree.structure(params) != jax.tree.structure(expected):
    raise ValueError("params do not have the structure of the config's params: "
                     f"{jax.tree.structure(params)} vs "
                     f"{jax.tree.structure(expected)}.")
  tensors = _tensor_map(config)
  for t in tensors:
    got = tuple(_get_path(params, t.path).shape)
    want = tuple(_get_path(expected, t.path).shape)
    if got != want:
      raise ValueError(f"params[{'/'.join(t.path)}] has shape {got}; the "
                       f"config gives {want}.")
  shards: list[list[tuple[_Tensor, tuple[int, ...]]]] = [[]]
  used = 0
  for t in tensors:
    size = math.prod(t.hf_shape) * out_dtype.itemsize
    if shards[-1] and used + size > limit:
      shards.append([])
      used = 0
    shards[-1].append((t, t.hf_shape))
    used += size
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            for i in range(len(shards))])
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
  for name, entries in zip(names, shards):
    if writer:
      _write_shard(os.path.join(path, name), entries, params, out_dtype)
    else:  # every process joins the gathers of non-addressable params
      for t, _ in entries:
        _to_host(_get_path(params, t.path))
  written = list(names)
  if not writer:
    return written
  if len(shards) > 1:
    total = sum(math.prod(t.hf_shape) * out_dtype.itemsize for t in tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {t.hf_name: name for name, entries in zip(names, shards)
                            for t, _ in entries}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
    written.append("model.safetensors.index.json")
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  written.append("config.json")
  if tokenizer_from is not None:
    for name in _TOKENIZER_FILES:
      source = os.path.join(os.fspath(tokenizer_from), name)
      if os.path.exists(source):
        shutil.copyfile(source, os.path.join(path, name))
        written.append(name)
  return written
