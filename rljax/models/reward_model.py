"""Reward models: the decoder with a linear score head on the last real token.

A reward model is what Hugging Face calls a ``*ForSequenceClassification``
model: the decoder's final hidden states, a bias-free ``score`` projection
``[D] -> num_labels``, and the value at the last real (non-padding) token of
each row. ``transformers`` takes "the rightmost token that is not
``pad_token_id``"; rljax takes the rightmost position of ``input_mask``, which
is the same token for left- or right-padded rows whose padding is the pad id.

The params are ``{"decoder": <the decoder's params>, "score": {"kernel":
[D, num_labels]}}``. A reward model has no unembedding: its decoder config
says ``tie_embeddings=True``, so the decoder declares no ``lm_head`` (its
logits are never computed).

Hugging Face I/O: ``load_hf_reward_model`` reads
``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
``Qwen3ForSequenceClassification`` and ``Gemma2ForSequenceClassification``
checkpoints (the decoder through the causal LM's tensor map, plus
``score.weight``); ``save_hf_reward_model`` writes one that
``AutoModelForSequenceClassification`` loads. Reference: Ouyang et al.,
"Training language models to follow instructions with human feedback" (the
reward model: the SFT model with its unembedding replaced by a scalar head),
https://arxiv.org/abs/2203.02155.

Example:
  >>> config, params = load_hf_reward_model("/ckpt/rm")  # doctest: +SKIP
  >>> scores(params, config, tokens_BxT, mask_BxT)[:, 0]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax import sharding
from rljax.models import hf_weights
from rljax.models.config import ModelConfig
from rljax.models.hf_config import (HF_DTYPES, hf_config_from_model_config,
                                    infer_architecture, model_config_from_hf,
                                    read_hf_config)
from rljax.models.params import init_params as init_decoder
from rljax.models.params import param_shapes, param_shardings
from rljax.models.transformer import Decoder, positions_from_mask

CAUSAL_OF = {"LlamaForSequenceClassification": "LlamaForCausalLM",
             "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
             "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
             "Gemma2ForSequenceClassification": "Gemma2ForCausalLM"}
"""The sequence-classification architectures read and written, and the causal
LM whose decoder (and ``config.json`` fields) each shares."""

ARCHITECTURES = tuple(CAUSAL_OF)


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """A reward model's static shape.

  Attributes:
    decoder: the decoder's config (``tie_embeddings`` is always True: there
      is no unembedding).
    num_labels: outputs of the score head (1 for a scalar reward model).
  """

  decoder: ModelConfig
  num_labels: int = 1

  def __post_init__(self):
    if not isinstance(self.decoder, ModelConfig):
      raise TypeError(f"RewardModelConfig.decoder is a "
                      f"{type(self.decoder).__name__}; a ModelConfig is "
                      "required.")
    if self.decoder.lora is not None:
      raise ValueError("RewardModelConfig.decoder has lora set; a reward "
                       "model is a plain decoder (accepted: lora=None).")
    if not self.decoder.tie_embeddings:
      object.__setattr__(self, "decoder",
                         self.decoder.replace(tie_embeddings=True))
    if (isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int)
        or self.num_labels < 1):
      raise ValueError(f"RewardModelConfig.num_labels={self.num_labels!r}: "
                       "accepted an int >= 1.")


def _score_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def shardings(config: RewardModelConfig, mesh: Mesh,
              rules: sharding.Rules = sharding.DEFAULT_RULES) -> dict[str, Any]:
  """The params' shardings: the decoder's by the rules, the head replicated."""
  return {"decoder": param_shardings(config.decoder, mesh, rules),
          "score": {"kernel": _score_sharding(mesh)}}


def init_params(config: RewardModelConfig, key: jax.Array,
                mesh: Mesh | None = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES,
                decoder: Any = None) -> dict[str, Any]:
  """Fresh reward-model params: the decoder from ``key`` (or ``decoder``:
  e.g. an SFT policy's params, whose ``lm_head`` is dropped), a zero head
  (every score 0 at the start)."""
  if decoder is None:
    decoder = init_decoder(config.decoder, key, mesh, rules)
  else:
    decoder = {k: v for k, v in decoder.items() if k != "lm_head"}
    expected = param_shapes(config.decoder)
    if jax.tree.structure(decoder) != jax.tree.structure(expected):
      raise ValueError("init_params(decoder=...): the params do not have the "
                       "structure of config.decoder's params.")
  kernel = jnp.zeros((config.decoder.d_model, config.num_labels), jnp.float32)
  if mesh is not None:
    kernel = jax.device_put(kernel, _score_sharding(mesh))
  return {"decoder": decoder, "score": {"kernel": kernel}}


def last_token_index(input_mask_BxT: jax.Array) -> jax.Array:
  """``[B]``: each row's rightmost real position (0 for a row without one, as
  ``transformers``' argmax gives)."""
  t = input_mask_BxT.shape[1]
  return jnp.max(jnp.where(input_mask_BxT.astype(jnp.bool_), jnp.arange(t), 0),
                 axis=1)


def scores(params: Mapping[str, Any], config: RewardModelConfig,
           tokens_BxT: jax.Array, input_mask_BxT: jax.Array) -> jax.Array:
  """``[B, num_labels]`` fp32: the head on each row's last real token.

  Rows may be left- or right-padded (positions follow the mask). Gradients
  flow into ``params``.
  """
  mask = input_mask_BxT.astype(jnp.bool_)
  hidden, _ = Decoder(config.decoder).apply(
      {"params": params["decoder"]}, tokens_BxT, positions_from_mask(mask),
      input_mask_BxT=mask)
  last = last_token_index(mask)
  h_BxD = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  return jnp.einsum("bd,dl->bl", h_BxD.astype(jnp.float32),
                    params["score"]["kernel"].astype(jnp.float32))


# --------------------------------------------------------------------------
# Hugging Face checkpoints


def _tensors(config: RewardModelConfig) -> list[hf_weights.Tensor]:
  decoder = [dataclasses.replace(t, path=("decoder",) + t.path)
             for t in hf_weights.tensor_map(config.decoder)]
  return decoder + [hf_weights.linear("score.weight", ("score", "kernel"),
                                      config.num_labels,
                                      config.decoder.d_model)]


def _num_labels(hf: Mapping[str, Any], source: str) -> int:
  """``len(id2label)``, else ``num_labels``, else transformers' default 2."""
  id2label = hf.get("id2label")
  if id2label is not None:
    if not isinstance(id2label, dict) or not id2label:
      raise ValueError(f"{source}: config.json field id2label={id2label!r} is "
                       "invalid; accepted: a non-empty object.")
    return len(id2label)
  value = hf.get("num_labels", 2)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{source}: config.json field num_labels={value!r} is "
                     "invalid; accepted: a positive integer.")
  return value


def reward_model_config_from_hf(hf: Mapping[str, Any], *,
                                param_dtype: str | None = None,
                                dtype: str | None = None,
                                source: str = "config.json"
                                ) -> RewardModelConfig:
  """The ``RewardModelConfig`` of a sequence-classification ``config.json``.

  Raises:
    ValueError: naming ``source``, for an architecture outside
      ``ARCHITECTURES`` (a causal LM is named as such) or any field the
      decoder's translation refuses.
  """
  archs = hf.get("architectures") if isinstance(hf, Mapping) else None
  arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
  if arch not in CAUSAL_OF:
    hint = (" (a causal LM: load it with models.load_hf_checkpoint, or give "
            "a reward model)" if isinstance(arch, str)
            and arch.endswith("ForCausalLM") else "")
    raise ValueError(f"{source}: config.json field architectures={archs!r} is "
                     f"not a reward model rljax reads{hint}; accepted: one of "
                     f"{ARCHITECTURES}.")
  decoder = model_config_from_hf(dict(hf, architectures=[CAUSAL_OF[arch]]),
                                 param_dtype=param_dtype, dtype=dtype,
                                 source=source)
  return RewardModelConfig(decoder, _num_labels(hf, source))


def load_hf_reward_model(path: str | os.PathLike, mesh: Mesh | None = None, *,
                         param_dtype: str | None = None,
                         dtype: str | None = None,
                         rules: sharding.Rules = sharding.DEFAULT_RULES,
                         ) -> tuple[RewardModelConfig, dict[str, Any]]:
  """Reads a Hugging Face sequence-classification checkpoint.

  The checks and the per-device reads of ``models.load_hf_checkpoint``:
  every tensor present, none unexpected, each of its shape (``score.weight``
  ``[num_labels, hidden_size]``), before any is read.

  Returns:
    ``(config, params)``.
  """
  path = os.fspath(path)
  source = os.path.join(path, "config.json")
  hf = read_hf_config(path)
  config = reward_model_config_from_hf(hf, param_dtype=param_dtype,
                                       dtype=dtype, source=source)
  params = hf_weights.read_tensors(
      path, _tensors(config), hf["architectures"][0],
      np.dtype(config.decoder.jnp_param_dtype),
      None if mesh is None else shardings(config, mesh, rules),
      ignorable=lambda name: name.endswith("rotary_emb.inv_freq"))
  return config, params


def hf_config_of(config: RewardModelConfig, architecture: str | None = None,
                 *, dtype: str | None = None) -> dict[str, Any]:
  """The ``config.json`` dict of ``config`` as a sequence-classification
  model (``architecture`` None: the decoder's family)."""
  if architecture is None:
    causal = infer_architecture(config.decoder)
    architecture = {v: k for k, v in CAUSAL_OF.items()}.get(causal)
    if architecture is None:
      raise ValueError(f"the decoder is a {causal}, which has no "
                       f"sequence-classification architecture rljax writes; "
                       f"accepted: {ARCHITECTURES}.")
  if architecture not in CAUSAL_OF:
    raise ValueError(f"architecture={architecture!r}: accepted "
                     f"{ARCHITECTURES}.")
  hf = hf_config_from_model_config(config.decoder, CAUSAL_OF[architecture],
                                   dtype=dtype)
  labels = {str(i): f"LABEL_{i}" for i in range(config.num_labels)}
  hf.update(architectures=[architecture], id2label=labels,
            label2id={v: int(k) for k, v in labels.items()})
  return hf


def save_hf_reward_model(path: str | os.PathLike, config: RewardModelConfig,
                         params: Mapping[str, Any], *,
                         architecture: str | None = None,
                         dtype: str | None = None,
                         max_shard_size: int | str = "5GB",
                         extra_config: Mapping[str, Any] | None = None,
                         tokenizer_from: str | os.PathLike | None = None,
                         ) -> list[str]:
  """Writes a reward model as a Hugging Face sequence-classification
  checkpoint (``save_hf_checkpoint``'s files, shards and options).

  ``extra_config`` should give ``pad_token_id``: ``transformers`` needs it to
  score a padded batch.
  """
  if not isinstance(config, RewardModelConfig):
    raise TypeError(f"save_hf_reward_model(path, config, params): config is a "
                    f"{type(config).__name__}; a RewardModelConfig is "
                    "required.")
  dtype = dtype or config.decoder.param_dtype
  if dtype not in HF_DTYPES:
    raise ValueError(f"dtype={dtype!r}: accepted {HF_DTYPES}.")
  hf = hf_config_of(config, architecture, dtype=dtype)
  hf.update(extra_config or {})
  expected = {"decoder": param_shapes(config.decoder),
              "score": {"kernel": jax.ShapeDtypeStruct(
                  (config.decoder.d_model, config.num_labels), jnp.float32)}}
  return hf_weights.write_tensors(
      os.fspath(path), _tensors(config), params, expected, hf,
      np.dtype(jnp.dtype(dtype)), hf_weights.parse_size(max_shard_size),
      tokenizer_from)
