"""Hugging Face ``config.json`` <-> rljax ``ModelConfig``.

Supported architectures (``config.json: architectures``):

=====================  ====================================================
``LlamaForCausalLM``   Llama 3.x (``rope_type: llama3`` or ``linear``)
``Qwen2ForCausalLM``   Qwen2 / Qwen2.5 (q/k/v biases)
``Qwen3ForCausalLM``   Qwen3 dense (q/k RMSNorm)
``Gemma2ForCausalLM``  Gemma 2 (post-norms, soft-caps, alternating windows)
``Gemma3ForCausalLM``  Gemma 3 text (q/k norm, 5:1 windows, local RoPE base)
=====================  ====================================================

Anything else, any config value rljax cannot represent exactly, and any
invalid one (a size that is not a positive integer, key/value heads that do
not divide the query heads, a non-positive scale) is a ``ValueError`` naming
the architecture, the field, the value and what is accepted, after the path
of the ``config.json`` when it was read from a file. Both the
``transformers`` 5 field names (``rope_parameters``, ``layer_types``) and the
older ones are read; export writes the pre-v5 names, which ``transformers`` 5
still reads. The weights themselves are ``rljax.models.hf_weights``.

Example:
  >>> config = load_hf_config("/ckpt/qwen2.5-0.5b")  # doctest: +SKIP
  >>> hf = hf_config_from_model_config(config)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from rljax.models.config import ModelConfig, RopeScaling

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

HF_DTYPES = ("float32", "bfloat16", "float16")
"""The parameter dtypes a Hugging Face checkpoint is read or written in."""


def _unsupported(arch: str, field: str, value: Any, accepted: Any) -> ValueError:
  return ValueError(f"{arch}: config.json field {field}={value!r} is not "
                    f"supported by rljax; accepted: {accepted}.")


def _invalid(arch: str, field: str, value: Any, accepted: Any) -> ValueError:
  return ValueError(f"{arch}: config.json field {field}={value!r} is "
                    f"invalid; accepted: {accepted}.")


def _integer(arch: str, hf: Mapping[str, Any], field: str,
             default: int | None = None, *, minimum: int = 1,
             where: str | None = None) -> int:
  """``hf[field]`` (``default`` when absent or null), an integer >= ``minimum``.

  ``where`` names the field in errors (``field`` if None); a missing field
  without a default is an error.
  """
  value = hf.get(field)
  if value is None:
    if default is None:
      raise _missing(arch, where or field)
    return default
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise _invalid(arch, where or field, value,
                   "a positive integer" if minimum == 1
                   else f"an integer >= {minimum}")
  return value


def _real(arch: str, hf: Mapping[str, Any], field: str, default: float | None,
          *, minimum: float = 0.0, strict: bool = True,
          where: str | None = None) -> float | None:
  """``hf[field]`` (``default`` when absent or null), a finite number.

  It must be above ``minimum``, or equal to it if ``strict`` is false.

  ``where`` names the field in errors (``field`` if None).
  """
  value = hf.get(field)
  if value is None:
    return default
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value)
      or (value <= minimum if strict else value < minimum)):
    raise _invalid(arch, where or field, value,
                   f"a finite number {'>' if strict else '>='} {minimum:g}")
  return float(value)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The ``config.json`` of a checkpoint directory, as a dict."""
  file = os.path.join(os.fspath(path), "config.json")
  if not os.path.exists(file):
    raise FileNotFoundError(f"{file} does not exist: {os.fspath(path)!r} is "
                            "not a Hugging Face checkpoint directory.")
  with open(file, "rb") as f:
    try:
      hf = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(hf, dict):
    raise ValueError(f"{file} holds a JSON {type(hf).__name__}; a JSON object "
                     "of config fields is required.")
  return hf


def _missing(arch: str, field: str) -> ValueError:
  return ValueError(f"{arch}: config.json has no {field!r}, which rljax "
                    "needs; the file is incomplete.")


def hf_architecture(hf: Mapping[str, Any]) -> str:
  """The one supported ``architectures`` entry of a ``config.json`` dict.

  Raises:
    ValueError: if there is not exactly one, or it is not in ``ARCHITECTURES``.
  """
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
  theta = _real(arch, params, "rope_theta", default_theta,
                where=f"{where}.rope_theta")
  if kind == "default":
    return theta, None
  factor = _real(arch, params, "factor", None, where=f"{where}.factor")
  if factor is None:
    raise _missing(arch, f"{where}.factor")
  if kind == "linear":
    return theta, RopeScaling(factor=factor, rope_type="linear")
  low = _real(arch, params, "low_freq_factor", 1.0,
              where=f"{where}.low_freq_factor")
  high = _real(arch, params, "high_freq_factor", 4.0, minimum=low,
               where=f"{where}.high_freq_factor")
  return theta, RopeScaling(
      factor=factor, low_freq_factor=low, high_freq_factor=high,
      original_max_position=_integer(
          arch, params, "original_max_position_embeddings", max_position,
          where=f"{where}.original_max_position_embeddings"),
      rope_type="llama3")


def _rope_fields(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
  """RoPE fields from either the v5 ``rope_parameters`` or the older keys."""
  max_pos = _integer(arch, hf, "max_position_embeddings", 8192)
  rp = hf.get("rope_parameters")
  for field in ("rope_parameters", "rope_scaling"):
    if not isinstance(hf.get(field) or {}, Mapping):
      raise _invalid(arch, field, hf[field], "an object (or null)")
  if arch == "Gemma3ForCausalLM":
    if rp and ("full_attention" in rp or "sliding_attention" in rp):
      full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
      full_where = "rope_parameters.full_attention"
      local_where = "rope_parameters.sliding_attention"
    else:
      full = dict(rp or hf.get("rope_scaling") or {})
      full.setdefault("rope_theta", _real(arch, hf, "rope_theta", 1_000_000.0))
      local = {"rope_theta": _real(arch, hf, "rope_local_base_freq", 10_000.0)}
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
  params.setdefault("rope_theta", _real(arch, hf, "rope_theta", 10_000.0))
  theta, scaling = _rope(arch, params,
                         "rope_parameters" if rp else "rope_scaling",
                         10_000.0, max_pos)
  return dict(rope_theta=theta, rope_scaling=scaling)


def _layer_types(arch: str, hf: Mapping[str, Any], num_layers: int) -> list[str]:
  types = hf.get("layer_types")
  if types is None:
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
      window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
      start = _integer(arch, hf, "max_window_layers", 28, minimum=0)
      types = ["sliding_attention" if window is not None and i >= start
               else "full_attention" for i in range(num_layers)]
    elif arch in _GEMMA:
      pattern = ("sliding_window_pattern"
                 if hf.get("sliding_window_pattern") is not None
                 else "_sliding_window_pattern")
      every = (2 if arch == "Gemma2ForCausalLM" else
               _integer(arch, hf, pattern, 6))
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
  window = _integer(arch, hf, "sliding_window")
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
                         dtype: str | None = None,
                         source: str | os.PathLike | None = None,
                         ) -> ModelConfig:
  """Translates a Hugging Face ``config.json`` dict into a ``ModelConfig``.

  Every value rljax uses is checked first: sizes are positive integers,
  ``num_key_value_heads`` divides ``num_attention_heads``, ``hidden_size`` is
  a multiple of ``num_attention_heads`` when there is no ``head_dim``, scales
  and RoPE parameters are positive finite numbers, the activation is the
  architecture's.

  Args:
    hf: the parsed ``config.json``.
    param_dtype: storage dtype; None takes the checkpoint's ``dtype`` /
      ``torch_dtype`` (``float32`` if absent or unsupported).
    dtype: compute dtype; None uses ``param_dtype``.
    source: the file ``hf`` was read from, named at the start of errors.

  Returns:
    The model config.

  Raises:
    ValueError: naming the file (with ``source``), the architecture, field,
      value and what is accepted.
  """
  try:
    return _model_config(hf, param_dtype, dtype)
  except ValueError as e:
    if source is None:
      raise
    raise ValueError(f"{os.fspath(source)}: {e}") from e


def _model_config(hf: Mapping[str, Any], param_dtype: str | None,
                  dtype: str | None) -> ModelConfig:
  if not isinstance(hf, Mapping):
    raise ValueError(f"config.json holds a {type(hf).__name__}; a JSON object "
                     "of config fields is required.")
  arch = hf_architecture(hf)
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
  d = _integer(arch, hf, "hidden_size")
  n = _integer(arch, hf, "num_attention_heads")
  kv = _integer(arch, hf, "num_key_value_heads", n)
  if n % kv:
    raise _invalid(arch, "num_key_value_heads", kv,
                   f"a divisor of num_attention_heads={n} (grouped-query "
                   "attention shares each key/value head among "
                   "num_attention_heads / num_key_value_heads query heads)")
  if hf.get("head_dim") is None and d % n:
    raise _invalid(arch, "hidden_size", d,
                   f"a multiple of num_attention_heads={n}, since there is no "
                   "head_dim (head_dim = hidden_size / num_attention_heads)")
  num_layers = _integer(arch, hf, "num_hidden_layers")
  tie = hf.get("tie_word_embeddings", gemma)
  if not isinstance(tie, bool):
    raise _invalid(arch, "tie_word_embeddings", tie, "true or false")
  if param_dtype is None:
    param_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    param_dtype = param_dtype if param_dtype in HF_DTYPES else "float32"
  fields = dict(
      vocab_size=_integer(arch, hf, "vocab_size"), d_model=d,
      num_layers=num_layers, num_heads=n, num_kv_heads=kv,
      head_dim=_integer(arch, hf, "head_dim", d // n),
      mlp_dim=_integer(arch, hf, "intermediate_size"),
      norm_eps=_real(arch, hf, "rms_norm_eps", 1e-6, strict=False),
      tie_embeddings=tie, param_dtype=param_dtype, dtype=dtype or param_dtype,
      **{k: v for k, v in _FIXED[arch].items() if k != "rope_local_theta"},
      **_rope_fields(arch, hf), **_window_fields(arch, hf, num_layers))
  if gemma:
    gemma2 = arch == "Gemma2ForCausalLM"

    def softcap(field: str, default: float | None) -> float | None:
      # An explicit null turns the soft-cap off; an absent field is the default.
      return _real(arch, hf, field, None) if field in hf else default

    fields.update(
        query_scale=_real(arch, hf, "query_pre_attn_scalar", 256.0) ** -0.5,
        attn_logit_softcap=softcap("attn_logit_softcapping",
                                   50.0 if gemma2 else None),
        final_logit_softcap=softcap("final_logit_softcapping",
                                    30.0 if gemma2 else None))
  if (fields["rope_scaling"] is not None and fields["sliding_window"] is not None
      and arch != "Gemma3ForCausalLM"):
    # rljax scales only the global layers' RoPE, as Gemma 3 does.
    raise _unsupported(arch, "rope_scaling", fields["rope_scaling"],
                       "None with sliding-window layers")
  return ModelConfig(**fields)


def load_hf_config(path: str | os.PathLike, *, param_dtype: str | None = None,
                   dtype: str | None = None) -> ModelConfig:
  """``model_config_from_hf`` of a checkpoint directory's ``config.json``.

  Errors name the file.
  """
  return model_config_from_hf(
      read_hf_config(path), param_dtype=param_dtype, dtype=dtype,
      source=os.path.join(os.fspath(path), "config.json"))


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

