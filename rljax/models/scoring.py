"""Scoring token sequences with the policy (full forward, chunked logprobs)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax import logprobs as logprobs_lib
from rljax.models.config import ModelConfig
from rljax.models.transformer import (Decoder, output_projection,
                                      positions_from_mask)


def sequence_logprobs(
    params: Any,
    config: ModelConfig,
    tokens_BxT: jax.Array,
    input_mask_BxT: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    chunk_size: int = 128,
    vocab_chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token ``log pi(tokens[t] | tokens[<t])`` and entropy, aligned to T.

  Args:
    params: policy params.
    config: model config.
    tokens_BxT: token ids (left or right padded).
    input_mask_BxT: 1 for real tokens.
    temperature: logits are divided by it.
    chunk_size: time chunk of ``rljax.logprobs.token_logprobs``.
    vocab_chunk_size: optional vocab chunk.

  Returns:
    ``(logp_BxT, entropy_BxT)`` in fp32: entry ``t`` scores token ``t`` given
    the tokens before it (the entropy of that predictive distribution). Both
    are 0 wherever token ``t`` or token ``t - 1`` is padding, so column 0,
    every padded position and the first real token of a left-padded row
    (which has only padding before it) are 0.
  """
  positions = positions_from_mask(input_mask_BxT)
  hidden, _ = Decoder(config).apply({"params": params}, tokens_BxT, positions,
                                    input_mask_BxT=input_mask_BxT)
  logp, ent = logprobs_lib.token_logprobs(
      hidden[:, :-1], output_projection(params, config), tokens_BxT[:, 1:],
      temperature=temperature, softcap=config.final_logit_softcap,
      chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
  input_mask_BxT = input_mask_BxT.astype(jnp.bool_)
  scored = input_mask_BxT[:, 1:] & input_mask_BxT[:, :-1]
  logp = jnp.where(scored, logp, 0.0)
  ent = jnp.where(scored, ent, 0.0)
  zero = jnp.zeros_like(logp[:, :1])
  return (jnp.concatenate([zero, logp], 1), jnp.concatenate([zero, ent], 1))
