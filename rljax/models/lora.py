"""LoRA adapters on the decoder's projections, and an int8 frozen base.

A LoRA projection computes ``y = x W + (alpha / r) (x A) B`` with a frozen
``W`` (``[I..., O...]``), ``A`` ``[I..., r]`` and ``B`` ``[r, O...]``
(Hu et al.). ``LoraConfig`` on ``ModelConfig.lora`` makes
``transformer.Decoder`` declare ``{target}_lora_a`` / ``{target}_lora_b``
next to each targeted kernel (``q``/``k``/``v``/``o`` of attention,
``gate``/``up``/``down`` of the MLP), with logical axes, so they shard on the
mesh like every other param. ``B`` starts at zero: a model with fresh
adapters computes exactly what its base computes.

Everything that reads ``Decoder(config)`` (the trainer, the samplers with
their fused decode projections, SPEC-RL's verification, evaluation) runs the
adapted forward. The base is the same params tree without the adapters:
``Decoder(config.without_lora())`` ignores the adapter leaves, so the KL
reference is the base with no second copy of the weights
(``train/steps.py``).

Training only the adapters: ``split`` / ``merge`` divide the params tree
into the trained adapters and the frozen rest; the RL step differentiates
the adapters only (no base gradient is computed), and the optimizer state
exists for them only.

``quantize_base="int8"`` stores each projection kernel of the frozen base as
int8 with a float32 scale per output channel (symmetric, absmax / 127; the
``{target}_kernel_scale`` leaf): ``dequantize`` gives ``q * scale``.
Embeddings, norms and biases stay float, as in QLoRA. ``quantize_params``
turns float params into that layout; ``dequantize_params`` back.

Merging for export: ``merged_params`` folds ``(alpha / r) A B`` into each
kernel and drops the adapters (and dequantizes), giving params of
``config.without_lora()``.

Why native and not qwix: qwix intercepts matmul ops inside a module, and
this decoder's projections are plain matmuls on reshaped kernels that the
cached path fuses (q/k/v and gate/up as one matmul, ``_project_fused``); an
intercepted fused matmul would get one adapter for three projections, which
neither matches per-projection targets nor peft's layout for export.

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
  https://arxiv.org/abs/2106.09685.
  Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs",
  https://arxiv.org/abs/2305.14314.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
QUANTIZATIONS = ("none", "int8")
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections get adapters, of what rank and scale.

  Attributes:
    rank: ``r``, the adapters' inner width (>= 1).
    alpha: the adapters' output is scaled by ``alpha / rank`` (peft's
      ``lora_alpha``).
    targets: projections with adapters, from ``TARGETS`` (empty: none, the
      frozen base alone; ``ModelConfig.base_config``).
    quantize_base: ``"none"`` or ``"int8"`` (the frozen projection kernels
      stored as int8 with a scale per output channel).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = TARGETS
  quantize_base: str = "none"

  def __post_init__(self):
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or (
        self.rank < 1):
      raise ValueError(f"model.lora.rank={self.rank!r}: a positive integer "
                       "is required (0 in the run config turns LoRA off).")
    if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
      raise ValueError(f"model.lora.alpha={self.alpha!r}: a positive number "
                       "is required.")
    targets = tuple(self.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or len(set(targets)) != len(targets):
      raise ValueError(
          f"model.lora.targets={targets!r}: accepted a tuple of distinct "
          f"names from {TARGETS}"
          + (f" ({unknown[0]!r} is unknown)." if unknown else "."))
    object.__setattr__(self, "targets", targets)
    if self.quantize_base not in QUANTIZATIONS:
      raise ValueError(f"model.lora.quantize_base={self.quantize_base!r}: "
                       f"accepted {QUANTIZATIONS}.")

  @property
  def scaling(self) -> float:
    return float(self.alpha) / self.rank


def projection_dims(config: Any) -> dict[str, tuple[int, int]]:
  """``{target: (fan_in, fan_out)}`` of each projection of ``config`` (a
  ``ModelConfig``)."""
  d, n, k, h, f = (config.d_model, config.num_heads, config.num_kv_heads,
                   config.head_dim, config.mlp_dim)
  return {"q": (d, n * h), "k": (d, k * h), "v": (d, k * h), "o": (n * h, d),
          "gate": (d, f), "up": (d, f), "down": (f, d)}


def check_rank(lora: LoraConfig, config: Any) -> None:
  """Raises unless ``lora.rank`` fits every targeted projection."""
  dims = projection_dims(config)
  for target in lora.targets:
    if lora.rank > min(dims[target]):
      raise ValueError(
          f"model.lora.rank={lora.rank} is larger than the {target} "
          f"projection's smaller dimension ({dims[target][0]} -> "
          f"{dims[target][1]}): accepted 1 <= rank <= {min(dims[target])}, "
          "or drop that target.")


# ----------------------------------------------------------------------------
# Splitting the params tree.


def is_adapter_key(key: str) -> bool:
  return key.endswith(ADAPTER_SUFFIXES)


def _filter(tree: Mapping[str, Any], keep) -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      sub = _filter(value, keep)
      if sub:
        out[key] = sub
    elif keep(key):
      out[key] = value
  return out


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(adapters, base)``: the params tree's adapter leaves and the rest,
  each a nested dict with the same paths."""
  return (_filter(params, is_adapter_key),
          _filter(params, lambda k: not is_adapter_key(k)))


def merge(base: Mapping[str, Any], adapters: Mapping[str, Any]
          ) -> dict[str, Any]:
  """The inverse of ``split``: one tree with both sets of leaves."""
  out = dict(base)
  for key, value in adapters.items():
    if isinstance(value, Mapping):
      out[key] = merge(base.get(key, {}), value)
    else:
      out[key] = value
  return out


def adapters_of(params: Mapping[str, Any]) -> dict[str, Any]:
  return split(params)[0]


def has_adapters(params: Mapping[str, Any]) -> bool:
  return bool(jax.tree.leaves(adapters_of(params)))


# ----------------------------------------------------------------------------
# The frozen base's int8 layout.


def quantize(w: jax.Array, in_dims: int) -> tuple[jax.Array, jax.Array]:
  """``(q, scale)``: symmetric int8 with one float32 scale per output
  element of ``w`` ``[I..., O...]`` (absmax over the ``in_dims`` leading
  axes / 127; an all-zero channel gets scale 1)."""
  w32 = jnp.asarray(w, jnp.float32)
  absmax = jnp.max(jnp.abs(w32), axis=tuple(range(in_dims)))
  scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return q, scale.astype(jnp.float32)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  return q.astype(dtype) * scale.astype(dtype)


# Projection kernels by module: (key, input axes).
_KERNELS = {"attn": (("q", 1), ("k", 1), ("v", 1), ("o", 2)),
            "mlp": (("gate", 1), ("up", 1), ("down", 1))}


def _layers(params: Mapping[str, Any]):
  return sorted((k for k in params if k.startswith("layers_")),
                key=lambda k: int(k.split("_")[1]))


def _map_kernels(params: Mapping[str, Any], fn) -> dict[str, Any]:
  """A copy of ``params`` where ``fn(sub, path, target, in_dims)`` rewrites,
  for each projection, its module's dict ``sub`` (a copy; ``path`` is
  ``(layer, module)``)."""
  out = dict(params)
  for layer in _layers(params):
    out[layer] = dict(out[layer])
    for module, kernels in _KERNELS.items():
      sub = dict(out[layer][module])
      for target, in_dims in kernels:
        fn(sub, (layer, module), target, in_dims)
      out[layer][module] = sub
  return out


def quantize_params(params: Mapping[str, Any]) -> dict[str, Any]:
  """Float params -> the int8 base layout (each projection kernel as int8
  plus ``{name}_kernel_scale``); other leaves unchanged."""
  def fn(sub, path, target, in_dims):
    del path
    q, scale = quantize(sub[f"{target}_kernel"], in_dims)
    sub[f"{target}_kernel"] = q
    sub[f"{target}_kernel{SCALE_SUFFIX}"] = scale
  return _map_kernels(params, fn)


def dequantize_params(params: Mapping[str, Any], dtype: Any
                      ) -> dict[str, Any]:
  """The int8 base layout -> float params of ``dtype`` (a no-op for float
  kernels)."""
  def fn(sub, path, target, in_dims):
    del path, in_dims
    scale = sub.pop(f"{target}_kernel{SCALE_SUFFIX}", None)
    if scale is not None:
      sub[f"{target}_kernel"] = dequantize(sub[f"{target}_kernel"], scale,
                                           dtype)
  return _map_kernels(params, fn)


def merged_params(params: Mapping[str, Any], config: Any) -> dict[str, Any]:
  """Params of ``config.without_lora()`` (float): each targeted kernel plus
  ``(alpha / r) A B``, the adapters dropped, an int8 base dequantized.

  The sum is taken in float32 and cast to the kernel's dtype.
  """
  lora = config.lora
  base = dequantize_params(split(params)[1], config.jnp_param_dtype)
  if lora is None:
    return base

  def fn(sub, path, target, in_dims):
    layer, module = path
    a = params[layer][module].get(f"{target}_lora_a")
    if a is None:
      return
    b = params[layer][module][f"{target}_lora_b"]
    w = sub[f"{target}_kernel"]
    fan_in = int(np.prod(w.shape[:in_dims]))
    delta = (jnp.asarray(a, jnp.float32).reshape(fan_in, -1)
             @ jnp.asarray(b, jnp.float32).reshape(lora.rank, -1))
    sub[f"{target}_kernel"] = (jnp.asarray(w, jnp.float32)
                               + lora.scaling * delta.reshape(w.shape)
                               ).astype(w.dtype)
  return _map_kernels(base, fn)
