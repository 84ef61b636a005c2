"""Model configuration and presets for the rljax decoder.

One frozen dataclass describes every supported family; families differ only
by fields (norm offset, RoPE scaling, GQA, qk-norm, biases, tied embeddings,
soft-capping, sliding windows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from rljax.models import lora as lora_lib
from rljax.models.lora import LoraConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16}
_ACTIVATIONS = ("silu", "gelu_tanh")
_REMAT = ("none", "full", "dots")
_ROPE_TYPES = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling of the global (non-sliding) layers.

  Attributes:
    factor: the frequency divisor.
    low_freq_factor: llama3 only.
    high_freq_factor: llama3 only.
    original_max_position: llama3 only, the pre-training context length.
    rope_type: ``"llama3"`` (Llama 3.1+: only low frequencies divided,
      smoothly) or ``"linear"`` (all frequencies divided by ``factor``:
      position interpolation, as in Gemma 3's global layers). The names are
      Hugging Face's ``rope_type`` values.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  rope_type: str = "llama3"

  def __post_init__(self):
    if self.rope_type not in _ROPE_TYPES:
      raise ValueError(f"model.rope_scaling.rope_type={self.rope_type!r}: "
                       f"accepted {_ROPE_TYPES}.")
    if not self.factor > 0:
      raise ValueError(f"model.rope_scaling.factor={self.factor!r}: a "
                       "positive number is required.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  Attributes:
    vocab_size: number of token ids (V).
    d_model: residual width (D).
    num_layers: number of transformer blocks.
    num_heads: query heads (N).
    num_kv_heads: key/value heads (K); ``N % K == 0`` (grouped-query attention).
    head_dim: per-head width (H).
    mlp_dim: hidden width of the gated MLP (F).
    rope_theta: RoPE base frequency.
    rope_scaling: optional frequency scaling (Llama 3 or linear) of the
      global layers.
    rope_local_theta: RoPE base for sliding-window layers (Gemma 3); None uses
      ``rope_theta``.
    norm_eps: RMSNorm epsilon.
    norm_offset: 1.0 for Gemma's ``(1 + scale)`` norms, else 0.0.
    qk_norm: RMSNorm on queries and keys per head (Qwen3, Gemma 3).
    qkv_bias: biases on the q/k/v projections (Qwen2.5).
    tie_embeddings: reuse the input embedding as the output projection.
    activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
    post_norms: extra RMSNorm after attention and MLP outputs (Gemma 2/3).
    embed_scale: multiply embeddings by ``sqrt(d_model)`` (Gemma).
    query_scale: attention scale; None means ``head_dim ** -0.5``.
    attn_logit_softcap: soft-cap of attention logits (Gemma 2); None disables.
    final_logit_softcap: soft-cap of output logits (Gemma 2); None disables.
    sliding_window: window of local attention layers; None disables.
    global_every: with a sliding window, every ``global_every``-th layer
      (1-based) attends globally, the others locally.
    param_dtype: storage dtype of parameters (``"float32"`` or ``"bfloat16"``).
    dtype: compute dtype of matmuls.
    remat: ``"none"``, ``"full"`` (recompute each block in the backward pass)
      or ``"dots"`` (save only matmul outputs without batch dims).
    lora: LoRA adapters on the projections (and optionally an int8 frozen
      base; ``models/lora.py``), or None.
  """

  vocab_size: int = 256
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 128
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  rope_local_theta: float | None = None
  norm_eps: float = 1e-6
  norm_offset: float = 0.0
  qk_norm: bool = False
  qkv_bias: bool = False
  tie_embeddings: bool = True
  activation: str = "silu"
  post_norms: bool = False
  embed_scale: bool = False
  query_scale: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_window: int | None = None
  global_every: int = 1
  param_dtype: str = "float32"
  dtype: str = "float32"
  remat: str = "none"
  lora: LoraConfig | None = None

  def __post_init__(self):
    positive = ("vocab_size", "d_model", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "mlp_dim", "global_every")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"model.{name}={value!r} is invalid: a positive integer is required.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} is not a multiple of "
          f"model.num_kv_heads={self.num_kv_heads}: grouped-query attention "
          "needs num_heads % num_kv_heads == 0.")
    if self.activation not in _ACTIVATIONS:
      raise ValueError(
          f"model.activation={self.activation!r}: accepted {_ACTIVATIONS}.")
    if self.remat not in _REMAT:
      raise ValueError(f"model.remat={self.remat!r}: accepted {_REMAT}.")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
            f"model.{name}={getattr(self, name)!r}: accepted {tuple(_DTYPES)}.")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(
          f"model.sliding_window={self.sliding_window!r}: a positive integer "
          "or None is required.")
    if self.lora is not None:
      if not isinstance(self.lora, LoraConfig):
        raise TypeError(f"model.lora={self.lora!r}: a models.LoraConfig or "
                        "None is required.")
      lora_lib.check_rank(self.lora, self)

  def without_lora(self) -> "ModelConfig":
    """The plain model's config: no adapters, float kernels (the config of
    merged params, ``lora.merged_params``, and of an SFT warm-up)."""
    return self if self.lora is None else dataclasses.replace(self, lora=None)

  def base_config(self) -> "ModelConfig":
    """The frozen base's forward on this config's params tree: no adapters
    (their leaves are ignored), an int8 base still read as int8. The KL
    reference of a LoRA run."""
    if self.lora is None or self.lora.quantize_base == "none":
      return self.without_lora()
    return dataclasses.replace(self, lora=dataclasses.replace(self.lora,
                                                              targets=()))

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def is_local_layer(self, layer: int) -> bool:
    """Whether ``layer`` (0-based) uses the sliding window."""
    if self.sliding_window is None:
      return False
    return (layer + 1) % self.global_every != 0

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count (embeddings included once when tied)."""
    d, n, k, h, f = (self.d_model, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.mlp_dim)
    attn = d * n * h * 2 + d * k * h * 2
    if self.qkv_bias:
      attn += (n + 2 * k) * h
    if self.qk_norm:
      attn += 2 * h
    block = attn + 3 * d * f + d * (4 if self.post_norms else 2)
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * block + emb + d


PRESETS: dict[str, ModelConfig] = {
    # For unit tests: compiles in seconds on a CPU.
    "tiny": ModelConfig(),
    # For the CPU demo: ~3M parameters.
    "small": ModelConfig(
        vocab_size=512, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
        head_dim=32, mlp_dim=768),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151_936, d_model=896, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1_000_000.0,
        qkv_bias=True, tie_embeddings=True, norm_eps=1e-6,
        param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151_936, d_model=1024, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0,
        qk_norm=True, tie_embeddings=True, norm_eps=1e-6,
        param_dtype="bfloat16", dtype="bfloat16"),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128_256, d_model=2048, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0,
                                 original_max_position=8192),
        tie_embeddings=True, norm_eps=1e-5,
        param_dtype="bfloat16", dtype="bfloat16"),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns a preset config, optionally with fields replaced."""
  if name not in PRESETS:
    raise ValueError(
        f"model preset {name!r} is unknown; accepted: {sorted(PRESETS)}.")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
