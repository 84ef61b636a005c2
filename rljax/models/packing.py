"""Padding-free forward passes: rows packed into token buffers by segment.

A batch of ``B`` rows of length ``L`` (left-padded prompt, right-padded
completion) holds far fewer real tokens than ``B * L`` when completion lengths
are long-tailed. ``pack_rows`` (host, NumPy) lays each row's real tokens
end to end in ``Bp`` buffers of length ``Lp``, first-fit by decreasing
length, a row never split across buffers. Each buffer slot knows the row it
came from (its *segment*, ``1 + row``; 0 is an empty slot) and its position
in that row; ``Packing.slot_BxL`` maps every row column back to its slot.

``hidden_states`` runs the decoder on the buffers, attention block-diagonal
by segment and positions restarting per segment (``Decoder``'s
``segment_ids_BxT``), and gathers the hidden states back to the rows'
layout. Every real token then sees exactly the tokens it sees in the padded
forward, at the same RoPE positions, so logprobs, entropies, values and every
loss read from them are the padded ones (up to float summation order), while
the decoder runs on ``Bp * Lp`` slots instead of ``B * L``.

The output projection and the log-softmax (``scoring.sequence_logprobs``)
run where they have fewer positions: on the buffers themselves
(``buffer_hidden_states`` with ``next_targets``: each slot predicts the next
slot of its segment), when ``Bp * Lp`` is below the ``B * S`` scored
columns of the rows, as it is for long-tailed completions; else on the
scored columns in the rows' layout. Either is the same per token; the
choice is made from the shapes alone, so it adds no program.

This is verl's ``use_remove_padding`` and TRL's ``padding_free`` for the
training forward; ``rljax/train/packing.py`` plans it for the RL step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.config import ModelConfig
from rljax.models.transformer import Decoder


class Packing(NamedTuple):
  """Where ``B`` rows of length ``L`` sit in ``Bp`` buffers of length ``Lp``.

  Attributes:
    source_BpxLp: int32, each slot's token as a flat index ``row * L +
      column`` into the rows (0 for an empty slot).
    segment_BpxLp: int32, ``1 + row`` of each slot; 0 for an empty slot.
    position_BpxLp: int32, the token's position within its row (its RoPE
      position in the padded forward, ``positions_from_mask``).
    slot_BxL: int32, each row column's slot as a flat index ``buffer * Lp +
      offset`` (0 where the column is padding: read nothing from it).
  """

  source_BpxLp: Any
  segment_BpxLp: Any
  position_BpxLp: Any
  slot_BxL: Any


def row_lengths(input_mask_BxL: np.ndarray) -> np.ndarray:
  """Real tokens per row."""
  return np.asarray(input_mask_BxL, bool).sum(-1)


def first_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray,
                                                            np.ndarray]:
  """First-fit decreasing: ``(buffer, offset)`` of each row in buffers of
  ``capacity`` tokens (every length must be ``<= capacity``)."""
  sizes = np.asarray(lengths, np.int64)
  if sizes.size and sizes.max() > capacity:
    raise ValueError(f"pack_rows: a row of {int(sizes.max())} real tokens "
                     f"does not fit a buffer of {capacity}.")
  buffer = [0] * len(sizes)
  offset = [0] * len(sizes)
  used: list[int] = []
  as_list = sizes.tolist()
  for i in np.argsort(-sizes, kind="stable").tolist():
    size = as_list[i]
    for b, u in enumerate(used):
      if u + size <= capacity:
        break
    else:
      b = len(used)
      used.append(0)
    buffer[i], offset[i] = b, used[b]
    used[b] += size
  return np.asarray(buffer, np.int64), np.asarray(offset, np.int64)


def buffers_needed(lengths: np.ndarray, capacity: int) -> int:
  """How many buffers ``first_fit`` fills."""
  buffer, _ = first_fit(lengths, capacity)
  return int(buffer.max()) + 1 if len(buffer) else 0


def pack_rows(input_mask_BxL: np.ndarray, num_buffers: int,
              buffer_length: int | None = None,
              placement: tuple[np.ndarray, np.ndarray] | None = None
              ) -> Packing:
  """The ``Packing`` of rows into ``num_buffers`` buffers (NumPy, host).

  Args:
    input_mask_BxL: bool, the rows' real tokens (any layout; their order is
      kept within a row).
    num_buffers: ``Bp``; at least ``buffers_needed`` (more leaves empty
      buffers, as shape buckets do).
    buffer_length: ``Lp`` (default ``L``).
    placement: ``first_fit``'s ``(buffer, offset)`` of the rows, if already
      computed for this ``buffer_length``.

  Raises:
    ValueError: the rows need more than ``num_buffers`` buffers.
  """
  mask = np.asarray(input_mask_BxL, bool)
  b, length = mask.shape
  lp = length if buffer_length is None else buffer_length
  buffer, offset = placement or first_fit(mask.sum(-1), lp)
  needed = int(buffer.max()) + 1 if b else 0
  if needed > num_buffers:
    raise ValueError(f"pack_rows: these rows need {needed} buffers of {lp} "
                     f"tokens; num_buffers={num_buffers}.")
  rows, cols = np.nonzero(mask)  # row-major: each row's tokens in order
  rank = np.arange(len(rows)) - np.searchsorted(rows, rows)
  at = buffer[rows] * lp + offset[rows] + rank  # flat slot of each token
  source = np.zeros(num_buffers * lp, np.int32)
  segment = np.zeros(num_buffers * lp, np.int32)
  position = np.zeros(num_buffers * lp, np.int32)
  slot = np.zeros((b, length), np.int32)
  source[at] = rows * length + cols
  segment[at] = rows + 1
  position[at] = rank
  slot[rows, cols] = at
  return Packing(source.reshape(num_buffers, lp),
                 segment.reshape(num_buffers, lp),
                 position.reshape(num_buffers, lp), slot)


def buffer_hidden_states(params: Any, config: ModelConfig,
                         tokens_BxL: jax.Array, packing: Packing) -> jax.Array:
  """The decoder's final hidden states on the buffers, ``[Bp, Lp, D]``
  (empty slots hold arbitrary values: read nothing from them)."""
  segment = packing.segment_BpxLp
  tokens = jnp.take(tokens_BxL.reshape(-1), packing.source_BpxLp, axis=0)
  hidden, _ = Decoder(config).apply(
      {"params": params}, tokens, packing.position_BpxLp,
      input_mask_BxT=segment > 0, segment_ids_BxT=segment)
  return hidden


def next_targets(tokens_BxL: jax.Array, packing: Packing) -> jax.Array:
  """``[Bp, Lp]``: the token each slot predicts, the next slot's where it
  continues the same row (segment), else 0 (a row's last token, an empty
  slot: masked by the caller)."""
  tokens = jnp.take(tokens_BxL.reshape(-1), packing.source_BpxLp, axis=0)
  segment = packing.segment_BpxLp
  same = (segment[:, 1:] == segment[:, :-1]) & (segment[:, :-1] > 0)
  nxt = jnp.where(same, tokens[:, 1:], 0)
  return jnp.concatenate([nxt, jnp.zeros_like(nxt[:, :1])], 1)


def hidden_states(params: Any, config: ModelConfig, tokens_BxL: jax.Array,
                  packing: Packing, columns: tuple[int, int] | None = None
                  ) -> jax.Array:
  """The decoder's final hidden states of the rows, computed packed.

  Args:
    params: the decoder's params.
    config: its model config.
    tokens_BxL: the rows' tokens.
    packing: from ``pack_rows`` (as arrays).
    columns: ``(lo, hi)``: only these columns of the rows are returned.

  Returns:
    ``[B, hi - lo, D]``: at every real column the padded forward's hidden
    state; at padding columns an arbitrary slot's (read nothing from them).
  """
  hidden = buffer_hidden_states(params, config, tokens_BxL, packing)
  slot = packing.slot_BxL
  if columns is not None:
    slot = slot[:, columns[0]:columns[1]]
  return jnp.take(hidden.reshape(-1, hidden.shape[-1]), slot, axis=0)


__all__ = ["Packing", "buffer_hidden_states", "buffers_needed", "first_fit",
           "hidden_states", "next_targets", "pack_rows", "row_lengths"]
