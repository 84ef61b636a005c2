"""Scoring token sequences with the policy (full forward, chunked logprobs)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from rljax import logprobs as logprobs_lib
from rljax.models import packing as packing_lib
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
    num_scored: int | None = None,
    with_entropy: bool = True,
    remat: bool | None = None,
    packing: packing_lib.Packing | None = None,
    projection: str = "auto",
) -> tuple[jax.Array, jax.Array | None]:
  """Per-token ``log pi(tokens[t] | tokens[<t])`` and entropy, aligned to T.

  With ``num_scored = S`` only the last ``S`` columns are scored (an RL
  batch's completion, ``L = P + T`` with the prompt left-padded to ``P``):
  the hidden states are sliced before the output projection, so the
  projection, the log-softmax and their backward pass run on ``S`` positions,
  not ``T - 1`` (as ``logits_to_keep`` in transformers and TRL's
  ``_get_per_token_logps``). The decoder itself still runs on every token.

  With ``packing`` the decoder runs on the packed buffers, and the
  projection and log-softmax run on whichever layout has fewer positions:
  the buffers' ``Bp * Lp`` slots (each predicting the next slot of its row,
  gathered back to the rows' columns afterwards) or the ``B * S`` scored
  columns (hidden states gathered to the rows first). Long-tailed
  completions fill far fewer slots than ``B * S``; full-length rows, whose
  buffers also hold the prompts, keep the rows' layout.

  Args:
    params: policy params.
    config: model config.
    tokens_BxT: token ids (left or right padded).
    input_mask_BxT: 1 for real tokens.
    temperature: logits are divided by it.
    chunk_size: time chunk of ``rljax.logprobs.token_logprobs``.
    vocab_chunk_size: optional vocab chunk.
    num_scored: score only the last ``S`` columns (``1 <= S < T``); None
      scores all ``T``.
    with_entropy: compute the entropy (else the second output is None).
    remat: rematerialisation of the logprob chunks
      (``rljax.logprobs.token_logprobs``; None chooses by size).
    packing: run the decoder padding-free on these rows' ``Packing``
      (``models/packing.py``): the same result, on the real tokens only.
    projection: with ``packing``, where the output projection runs:
      ``"auto"`` (the layout with fewer positions, ``on_buffers``),
      ``"buffers"`` or ``"rows"`` (the same values either way;
      ``launch/bench_train_step.py`` times both).

  Returns:
    ``(logp_BxS, entropy_BxS)`` in fp32 (``S = T`` without ``num_scored``):
    entry ``s`` scores token ``T - S + s`` given the tokens before it (the
    entropy of that predictive distribution). Both are 0 wherever that token
    or its predecessor is padding, so column 0 of a full-width result, every
    padded position and the first real token of a left-padded row (which has
    only padding before it) are 0.
  """
  t = tokens_BxT.shape[1]
  s = t - 1 if num_scored is None else num_scored
  if not 1 <= s < t:
    raise ValueError(
        f"num_scored={num_scored}: between 1 and the row length - 1 = {t - 1} "
        "(the first token has no predecessor) is accepted, or None.")
  stats = functools.partial(
      logprobs_lib.token_logprobs, w_DxV=output_projection(params, config),
      temperature=temperature, softcap=config.final_logit_softcap,
      chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
      with_entropy=with_entropy, remat=remat)
  if projection not in PROJECTIONS:
    raise ValueError(f"projection={projection!r}: accepted {PROJECTIONS}.")
  if projection == "buffers" and packing is None:
    raise ValueError("projection='buffers' needs a packing (the buffers).")
  buffers = packing is not None and (
      projection == "buffers" or projection == "auto" and on_buffers(
          packing, tokens_BxT.shape[0], s))
  if buffers:
    logp, ent = stats(
        packing_lib.buffer_hidden_states(params, config, tokens_BxT, packing),
        targets_BxT=packing_lib.next_targets(tokens_BxT, packing))
    # Column c's token is predicted at the slot of column c - 1.
    slot = packing.slot_BxL[:, t - s - 1:t - 1]
    logp = jnp.take(logp.reshape(-1), slot, axis=0)
    ent = None if ent is None else jnp.take(ent.reshape(-1), slot, axis=0)
  else:
    if packing is None:
      positions = positions_from_mask(input_mask_BxT)
      hidden, _ = Decoder(config).apply(
          {"params": params}, tokens_BxT, positions,
          input_mask_BxT=input_mask_BxT)
      hidden = hidden[:, t - s - 1:t - 1]
    else:
      hidden = packing_lib.hidden_states(params, config, tokens_BxT, packing,
                                         (t - s - 1, t - 1))
    logp, ent = stats(hidden, targets_BxT=tokens_BxT[:, t - s:])
  input_mask_BxT = input_mask_BxT.astype(jnp.bool_)
  scored = input_mask_BxT[:, t - s:] & input_mask_BxT[:, t - s - 1:t - 1]
  logp = jnp.where(scored, logp, 0.0)
  ent = None if ent is None else jnp.where(scored, ent, 0.0)
  if num_scored is not None:
    return logp, ent
  zero = jnp.zeros_like(logp[:, :1])
  return (jnp.concatenate([zero, logp], 1),
          None if ent is None else jnp.concatenate([zero, ent], 1))


PROJECTIONS = ("auto", "buffers", "rows")


def on_buffers(packing: packing_lib.Packing, rows: int, scored: int) -> bool:
  """Whether ``sequence_logprobs`` projects on the packed buffers: they
  hold fewer positions than the rows' ``rows x scored`` columns (static
  shapes: the choice is made while tracing)."""
  bp, lp = packing.segment_BpxLp.shape
  return bp * lp < rows * scored


def map_row_chunks(fn: Any, chunks: int, *arrays_NxL: jax.Array) -> jax.Array:
  """``fn(*arrays)`` over ``chunks`` row chunks, without gradient.

  The no-gradient forward passes of a train step (``pi_old``, the reference
  and the teacher logprobs, the critic's values) run one chunk at a time
  (``lax.map``), so their activations take ``1 / chunks`` of the memory of
  one pass over all ``N`` rows. ``N`` must divide by ``chunks``.

  Returns:
    ``fn``'s rows of every chunk, concatenated (``[N, ...]``), gradient
    stopped.
  """
  n = arrays_NxL[0].shape[0]
  if n % chunks:
    raise ValueError(f"map_row_chunks: {n} rows do not split into {chunks} "
                     "chunks.")
  split = [a.reshape(chunks, n // chunks, *a.shape[1:]) for a in arrays_NxL]
  out = jax.lax.map(lambda xs: fn(*xs), split)
  return jax.lax.stop_gradient(out.reshape(n, *out.shape[2:]))
