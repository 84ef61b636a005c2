"""Per-token logprobs and entropy from final hidden states, chunked.

An RL step needs ``log pi(y_t)`` of the sampled tokens and (sometimes) the
entropy of ``pi`` at each position, but never the full ``B x T x V`` fp32
logits: for a 150k vocabulary they dwarf the model's activations. Here logits
are formed one time chunk at a time (``C`` positions), optionally one vocab
chunk at a time with an online logsumexp, reduced to a few numbers per token
and discarded. ``jax.checkpoint`` on the chunk body makes the backward pass
recompute a chunk's logits instead of storing them, so the peak extra memory is
``B x C x V`` (or ``B x C x V_chunk``) floats in both passes.

Rematerialisation is chosen by size (``remat=None``): recomputing a chunk's
projection costs one more ``B x C x D x V`` matmul in the backward pass, which
pays when the logits are large. Up to ``REMAT_ABOVE_BYTES`` of fp32 logits the
whole ``B x T x V`` block is formed once, in one matmul, and kept for the
backward pass (what an eager PyTorch step does); above it, chunks are
rematerialised. ``launch/bench_train_step.py --remat_sweep``
measures the crossover.

The entropy is computed only when asked for (``with_entropy``): a loss
without an entropy bonus skips one ``B x T x V`` pass.

With ``z = softcap(h @ W) / temperature``:

    logp_t    = z[y_t] - logsumexp(z)
    entropy_t = logsumexp(z) - sum_v softmax(z)_v * z_v

Gradients flow into ``hidden_BxTxD`` and ``w_DxV``; ``targets_BxT`` are ints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30

# fp32 logits bytes (B * T * V * 4) above which chunks are rematerialised.
# Measured on a 2-core CPU (``bench_train_step --remat_sweep``, 2048 positions,
# width 256): at 16 MiB both ways take the same time; from 32 MiB on the
# chunked, rematerialised pass is faster (its chunk stays in cache) and
# needs a quarter of the memory.
REMAT_ABOVE_BYTES = 16 * 2**20


def _check(hidden_BxTxD, w_DxV, targets_BxT, chunk_size, vocab_chunk_size,
           temperature):
  if hidden_BxTxD.ndim != 3:
    raise ValueError(
        f"hidden_BxTxD must have rank 3 [B, T, D]; got shape {hidden_BxTxD.shape}.")
  if w_DxV.ndim != 2 or w_DxV.shape[0] != hidden_BxTxD.shape[-1]:
    raise ValueError(
        f"w_DxV must have shape [D={hidden_BxTxD.shape[-1]}, V]; got "
        f"{w_DxV.shape}.")
  if targets_BxT.shape != hidden_BxTxD.shape[:2]:
    raise ValueError(
        f"targets_BxT shape {targets_BxT.shape} must equal hidden_BxTxD's "
        f"[B, T] = {hidden_BxTxD.shape[:2]}.")
  if not jnp.issubdtype(targets_BxT.dtype, jnp.integer):
    raise TypeError(f"targets_BxT must be integer; got {targets_BxT.dtype}.")
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size}: a positive integer is required.")
  if vocab_chunk_size is not None and vocab_chunk_size < 1:
    raise ValueError(
        f"vocab_chunk_size={vocab_chunk_size}: a positive integer or None is "
        "required.")
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(
        f"temperature={temperature}: a positive number is required.")


def _scaled_logits(h_BxCxD, w_DxV, softcap, temperature):
  # One 2-D matmul over the flattened rows (its weight gradient needs no
  # transposing copy on XLA:CPU, unlike a 3-D einsum's).
  b, c, d = h_BxCxD.shape
  z = jnp.dot(h_BxCxD.reshape(b * c, d), w_DxV.astype(h_BxCxD.dtype),
              preferred_element_type=jnp.float32).reshape(b, c, -1)
  if softcap is not None:
    z = softcap * jnp.tanh(z / softcap)
  return z / temperature


def _full_vocab_stats(h_BxCxD, y_BxC, w_DxV, softcap, temperature,
                      with_entropy):
  z = _scaled_logits(h_BxCxD, w_DxV, softcap, temperature)
  lse = jax.nn.logsumexp(z, axis=-1)
  z_y = jnp.take_along_axis(z, y_BxC[..., None], axis=-1)[..., 0]
  if not with_entropy:
    return z_y - lse, None
  p = jnp.exp(z - lse[..., None])
  return z_y - lse, lse - jnp.sum(p * z, axis=-1)


def _vocab_chunked_stats(h_BxCxD, y_BxC, w_DxV, softcap, temperature,
                         vocab_chunk_size, with_entropy):
  v = w_DxV.shape[1]
  n = -(-v // vocab_chunk_size)
  b, c = y_BxC.shape

  @jax.checkpoint
  def body(carry, i):
    m, s, t, z_y = carry
    # Slicing W in place (no padded copy): the last chunk is shifted left to
    # end at V, and columns an earlier chunk already counted are masked out.
    start = jnp.minimum(i * vocab_chunk_size, v - vocab_chunk_size)
    w_chunk = jax.lax.dynamic_slice_in_dim(w_DxV, start, vocab_chunk_size, 1)
    cols = start + jnp.arange(vocab_chunk_size)
    new = cols >= i * vocab_chunk_size
    z = _scaled_logits(h_BxCxD, w_chunk, softcap, temperature)
    z = jnp.where(new, z, _NEG)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    e = jnp.exp(z - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    s = s * alpha + jnp.sum(e, -1)
    t = t * alpha + jnp.sum(e * jnp.where(new, z, 0.0), -1)
    hit = (y_BxC[..., None] == cols) & new
    z_y = z_y + jnp.sum(jnp.where(hit, z, 0.0), -1)
    return (m_new, s, t, z_y), None

  zeros = jnp.zeros((b, c), jnp.float32)
  init = (jnp.full((b, c), _NEG, jnp.float32), zeros, zeros, zeros)
  (m, s, t, z_y), _ = jax.lax.scan(body, init, jnp.arange(n))
  lse = m + jnp.log(s)
  return z_y - lse, (lse - t / s) if with_entropy else None


def remat_by_size(batch: int, length: int, vocab_size: int) -> bool:
  """Whether ``token_logprobs(remat=None)`` rematerialises: when the fp32
  logits ``batch x length x vocab_size`` exceed ``REMAT_ABOVE_BYTES``."""
  return batch * length * vocab_size * 4 > REMAT_ABOVE_BYTES


def token_logprobs(
    hidden_BxTxD: jax.Array,
    w_DxV: jax.Array,
    targets_BxT: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    softcap: float | None = None,
    chunk_size: int = 128,
    vocab_chunk_size: int | None = None,
    with_entropy: bool = True,
    remat: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Logprob of each target token and the entropy at each position.

  Args:
    hidden_BxTxD: final hidden states (after the final norm); position ``t``
      predicts ``targets_BxT[:, t]``.
    w_DxV: the unembedding matrix.
    targets_BxT: int token ids to score.
    temperature: logits are divided by it (after soft-capping).
    softcap: optional final-logit soft-cap (Gemma 2).
    chunk_size: positions per chunk (``C``).
    vocab_chunk_size: if set, vocabulary columns per chunk, with an online
      logsumexp; bounds memory by ``B x C x vocab_chunk_size`` (always
      rematerialised).
    with_entropy: compute the entropy (else ``entropy_BxT`` is None).
    remat: recompute each chunk's logits in the backward pass (True), or
      form all ``B x T x V`` logits at once and keep them (False; one chunk,
      ``chunk_size`` is ignored). None chooses by size (``remat_by_size``).

  Returns:
    ``(logp_BxT, entropy_BxT)``, fp32 (``entropy_BxT`` None without
    ``with_entropy``).
  """
  _check(hidden_BxTxD, w_DxV, targets_BxT, chunk_size, vocab_chunk_size,
         temperature)
  b, t, d = hidden_BxTxD.shape
  v = w_DxV.shape[1]
  temperature = jnp.asarray(temperature, jnp.float32)
  vocab_chunked = vocab_chunk_size is not None and vocab_chunk_size < v
  if remat is None:
    remat = vocab_chunked or remat_by_size(b, t, v)
  if not remat and not vocab_chunked:
    return _full_vocab_stats(hidden_BxTxD, targets_BxT, w_DxV, softcap,
                             temperature, with_entropy)
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  y = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  h_NxBxCxD = h.reshape(b, n, c, d).transpose(1, 0, 2, 3)
  y_NxBxC = y.reshape(b, n, c).transpose(1, 0, 2)

  def chunk(inputs):
    h_BxCxD, y_BxC = inputs
    if not vocab_chunked:
      return _full_vocab_stats(h_BxCxD, y_BxC, w_DxV, softcap, temperature,
                               with_entropy)
    return _vocab_chunked_stats(h_BxCxD, y_BxC, w_DxV, softcap, temperature,
                                vocab_chunk_size, with_entropy)

  if remat:
    chunk = jax.checkpoint(chunk)
  logp, ent = jax.lax.map(chunk, (h_NxBxCxD, y_NxBxC))
  unchunk = lambda x: x.transpose(1, 0, 2).reshape(b, n * c)[:, :t]
  return unchunk(logp), None if ent is None else unchunk(ent)
