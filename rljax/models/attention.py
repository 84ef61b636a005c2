"""Attention without and with a KV cache: the decoder's two attention
functions (``attend`` for training and scoring, ``decode_attend`` for
prefill, decode and draft verification), split off ``transformer.py``."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax, not NaN


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


CAUSAL_QUERY_BLOCK = 48  # query rows per block of a causal ``attend``
CAUSAL_MAX_BLOCKS = 8  # at most this many blocks (unrolled in the program)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, *, scale: float,
           softcap: float | None = None, causal: bool = False):
  """Grouped-query attention of a forward without a cache (training, scoring).

  Args:
    q_BxTxNxH: queries.
    k_BxSxKxH: keys; ``N % K == 0``.
    v_BxSxKxH: values.
    mask_BxTxS: bool, which keys each query may see.
    scale: multiplier of ``q . k``.
    softcap: optional soft-cap of the logits.
    causal: the keys are the queries' own slots (``S = T``) and the mask
      hides every key after its query. Then the queries run in blocks of
      about ``CAUSAL_QUERY_BLOCK`` rows, each against the keys up to its last
      row: the blocks wholly above the diagonal, all masked, are skipped
      (as PyTorch's causal ``scaled_dot_product_attention`` skips them;
      ``launch/bench_train_step.py`` measures it). A query whose every key
      is masked (padding) then averages the values of its block's keys
      instead of all keys; nothing reads it.

  With two blocks or more the work runs as batched matmuls over ``(B, K)``
  whose rows are the ``(t, g)`` query pairs (one transpose of ``q``, ``k``,
  ``v`` and the output each), the softmax normalised on the ``[.., H]``
  outputs rather than the ``[.., S]`` probabilities, and a hand-written
  backward
  (``jax.custom_vjp``): ``dS = P * (dP - rowsum(dO * O))``, FlashAttention's
  identity, with ``P`` saved unnormalised from the forward; its key and
  value gradients are plain matmuls of the queries and output gradients
  transposed to ``[B, K, H, T * G]``. Differentiated
  by JAX instead, each block's slices, transposes and softmax gradient cost
  more than its matmuls (``launch/bench_train_step.py``).

  Returns:
    ``[B, T, N, H]`` attention outputs in the dtype of ``v``.

  References: Dao et al., "FlashAttention: Fast and Memory-Efficient Exact
  Attention with IO-Awareness" (the backward's ``rowsum(dO * O)``),
  https://arxiv.org/abs/2205.14135.
  """
  t, s = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
  blocks = causal_blocks(t)
  if not causal or len(blocks) == 1:
    return _attend_dense(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, scale,
                         softcap)
  if s != t:
    raise ValueError(f"attend(causal=True): keys have {s} slots, queries "
                     f"{t}; causal needs S = T.")
  return _attend_blocks(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, scale,
                        softcap, blocks)


def causal_blocks(t: int) -> tuple[tuple[int, int, int], ...]:
  """``attend(causal=True)``'s query blocks of ``t`` rows: ``(lo, hi, end)``,
  query rows ``lo:hi`` against keys ``:end`` (``= hi``), at most
  ``CAUSAL_MAX_BLOCKS`` of equal size, each up to about
  ``CAUSAL_QUERY_BLOCK`` rows."""
  size = -(-t // min(CAUSAL_MAX_BLOCKS, -(-t // CAUSAL_QUERY_BLOCK)))
  return tuple((lo, min(lo + size, t), min(lo + size, t))
               for lo in range(0, t, size))


def _attend_dense(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, scale, softcap):
  """One block: every query against every key, differentiated by JAX (on
  short rows, e.g. the main job's, faster than the blocks' layout changes:
  ``launch/bench_train_step.py``)."""
  b, t, n, h = q_BxTxNxH.shape
  kh = k_BxSxKxH.shape[2]
  q = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  logits = _softcap(logits, softcap)
  logits = jnp.where(mask_BxTxS[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
  return out.reshape(b, t, n, h)


def _rows(x_BxTxKxGxH):
  """``[B, T, K, G, H]`` <-> ``[B, K, T, G, H]`` (the matmuls' layout)."""
  return jnp.transpose(x_BxTxKxGxH, (0, 2, 1, 3, 4))


def _block_rows(x_BxKxTxGxH, lo, hi):
  b, kh, _, g, h = x_BxKxTxGxH.shape
  return x_BxKxTxGxH[:, :, lo:hi].reshape(b, kh, (hi - lo) * g, h)


def _block_mask(mask_BxTxS, lo, hi, end, g):
  """``[B, 1, (hi - lo) * G, end]``: the mask of a block's query rows."""
  b = mask_BxTxS.shape[0]
  return jnp.broadcast_to(mask_BxTxS[:, None, lo:hi, None, :end],
                          (b, 1, hi - lo, g, end)).reshape(b, 1, -1, end)


def _attend_parts(q, k, v, mask, scale, softcap, blocks):
  """The outputs and, per block ``(lo, hi, end)`` (query rows ``lo:hi``
  against keys ``:end``), what the backward reads."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  qr = _rows(q.reshape(b, t, kh, g, h))
  kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
  outs, saved = [], []
  for lo, hi, end in blocks:
    logits = jnp.einsum("bkrh,bksh->bkrs", _block_rows(qr, lo, hi),
                        kt[:, :, :end].astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    tanh = None
    if softcap is not None:
      tanh = jnp.tanh(logits / softcap)
      logits = softcap * tanh
    logits = jnp.where(_block_mask(mask, lo, hi, end, g), logits, _NEG_INF)
    e = jnp.exp(logits - jnp.max(logits, -1, keepdims=True))
    total = jnp.sum(e, -1, keepdims=True)
    out = jnp.einsum("bkrs,bksh->bkrh", e.astype(v.dtype), vt[:, :, :end],
                     preferred_element_type=jnp.float32) / total
    outs.append(out)
    saved.append((e, total, tanh, out))
  out = jnp.concatenate(outs, axis=2).reshape(b, kh, t, g, h)
  return _rows(out).reshape(b, t, n, h).astype(v.dtype), saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attend_blocks(q, k, v, mask, scale, softcap, blocks):
  return _attend_parts(q, k, v, mask, scale, softcap, blocks)[0]


def _attend_blocks_fwd(q, k, v, mask, scale, softcap, blocks):
  out, saved = _attend_parts(q, k, v, mask, scale, softcap, blocks)
  return out, (q, k, v, mask, saved)


def _cols(x_BxTxKxGxH):
  """``[B, T, K, G, H]`` -> ``[B, K, H, T * G]``: rows as columns."""
  b, t, kh, g, h = x_BxTxKxGxH.shape
  return jnp.transpose(x_BxTxKxGxH, (0, 2, 4, 1, 3)).reshape(b, kh, h, t * g)


def _attend_blocks_bwd(scale, softcap, blocks, residuals, d_out):
  q, k, v, mask, saved = residuals
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  qc = _cols(q.reshape(b, t, kh, g, h))
  d5 = d_out.reshape(b, t, kh, g, h).astype(v.dtype)
  dor, doc = _rows(d5), _cols(d5)
  kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
  # dK and dV contract the query rows of P and dS ([r, s]). Contracting an
  # operand's leading axis, XLA:CPU runs an Eigen matmul at about half the
  # rate of a plain one; with Q and dO transposed to [H, r] (activation-sized
  # copies) they are plain matmuls, dK^T = Q^T dS and dV^T = dO^T P:
  # attention's forward + backward 13% faster on the small preset (the
  # findings of ``launch/bench_train_step.py``). They accumulate
  # block by block in place (``.at[].add`` on the keys a block sees):
  # summing a zero-padded full-size copy per block read and wrote every
  # block's padding too.
  dqs = []
  dkt = jnp.zeros((b, kh, h, s), jnp.float32)
  dvt = jnp.zeros((b, kh, h, s), jnp.float32)
  for (lo, hi, end), (e, total, tanh, out) in zip(blocks, saved):
    probs = e / total
    do_rows = _block_rows(dor, lo, hi)
    dvt = dvt.at[..., :end].add(jnp.einsum(
        "bkhr,bkrs->bkhs", doc[..., lo * g:hi * g], probs.astype(v.dtype),
        preferred_element_type=jnp.float32))
    dp = jnp.einsum("bkrh,bksh->bkrs", do_rows, vt[:, :, :end],
                    preferred_element_type=jnp.float32)
    delta = jnp.sum(do_rows.astype(jnp.float32) * out, -1, keepdims=True)
    ds = probs * (dp - delta)
    if tanh is not None:
      ds = ds * (1 - tanh * tanh)
    ds = jnp.where(_block_mask(mask, lo, hi, end, g), ds * scale, 0.0)
    ds = ds.astype(q.dtype)
    dqs.append(jnp.einsum("bkrs,bksh->bkrh", ds, kt[:, :, :end].astype(q.dtype),
                          preferred_element_type=jnp.float32))
    dkt = dkt.at[..., :end].add(jnp.einsum(
        "bkhr,bkrs->bkhs", qc[..., lo * g:hi * g], ds,
        preferred_element_type=jnp.float32))
  dq = _rows(jnp.concatenate(dqs, axis=2).reshape(b, kh, t, g, h))
  dk, dv = (jnp.transpose(x, (0, 3, 1, 2)) for x in (dkt, dvt))
  return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype), None)


_attend_blocks.defvjp(_attend_blocks_fwd, _attend_blocks_bwd)


def _halving_sum(x):
  """The sum over the last axis as halving adds of slices: one loop fusion
  (XLA:CPU runs it faster than a reduce for the softmax denominators of
  ``decode_attend``; ``launch/bench_sampler.py``)."""
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    y = x[..., :half] + x[..., half:2 * half]
    if x.shape[-1] % 2:
      y = jnp.concatenate([y[..., :-1], y[..., -1:] + x[..., -1:]], -1)
    x = y
  return x[..., 0]


DECODE_BLOCK = 64  # cache slots per block of ``decode_attend``
DECODE_VECTOR_ROWS = 8  # ``T * N / K`` query rows up to which it skips dots


def decode_attend(q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, mask_BxTxS, *, scale: float,
                  softcap: float | None = None, prefix: tuple | None = None,
                  block: int = DECODE_BLOCK):
  """``attend`` over a KV cache laid out ``[B, K, S, H]``: the decode seam.

  The one attention function of the cached path (prefill, decode steps and
  draft verification), and the seam where a fused decode kernel goes: on a
  GPU or TPU a Pallas (``jax.experimental.pallas``) paged/ragged
  decode-attention kernel can replace this body with the same arguments.
  None is wired: Pallas kernels run on CPU only with ``interpret=True``, an
  emulator far slower than this XLA code, so a CPU test could check equality
  but not speed; the seam is left for a device task.

  Two bodies, chosen by the static query rows per KV head (``T * N / K``):
    * Few rows (a decode step, ``<= DECODE_VECTOR_ROWS``): no dots. Scores
      and the weighted value sum are broadcast products reduced in one
      fusion each, which stream the cache once. A batched ``dot_general``
      here runs ``B * K`` matrix-vector products of ``[G, H] x [H, S]``,
      each too small for the matmul kernel (``launch/bench_sampler.py``
      compares the two).
      The value sum is taken within fixed ``block``-slot blocks and then
      block by block in a fixed order, and an empty slot adds an exact zero,
      so in exact arithmetic empty trailing blocks change nothing. In
      floating point the sampler's length segments (caches that grow between
      segments) give the same logits as one full-size cache to the last bit
      or close to it: XLA:CPU picks its reduction kernels (YNNPACK fusions)
      and their tiling by shape, and a 6-row cache of 64 slots has been seen
      to round differently from the same rows in 192 slots (logprobs within
      2e-6; the 64-row benchmark shapes agree bitwise). When ``S`` is not a
      multiple of ``block`` the block is ``gcd(S, block)``, or ``S`` when
      ``S <= block``.
    * More rows (prefill, verification): batched dots over ``(B, K)``; the
      ``[B, K, S, H]`` layout is already the dot's, so no cache transpose.

  Args: as ``attend``, with ``k_BxKxSxH``/``v_BxKxSxH`` (and a prefix's
    ``k_PxKxSpxH``/``v_PxKxSpxH``) in the cache layout.
  Returns: ``[B, T, N, H]`` in the dtype of ``v``.

  References: Dao et al., "FlashAttention" (blockwise softmax),
  https://arxiv.org/abs/2205.14135; gemma's sampler (cache layout).
  """
  b, t, n, h = q_BxTxNxH.shape
  kh, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
  g = n // kh
  dt = v_BxKxSxH.dtype
  # [B, K, G*T, H]: the rows that share one KV head.
  q = jnp.transpose(q_BxTxNxH.reshape(b, t, kh, g, h), (0, 2, 3, 1, 4))
  q = q.reshape(b, kh, g * t, h)
  mask = jnp.broadcast_to(mask_BxTxS[:, None, None], (b, 1, g, t, s))
  mask = mask.reshape(b, 1, g * t, s)
  vector = g * t <= DECODE_VECTOR_ROWS

  def scores(q_xKxMxH, k_xKxSxH):
    if vector:
      out = jnp.sum(q_xKxMxH[..., None, :].astype(jnp.float32)
                    * k_xKxSxH[..., None, :, :].astype(jnp.float32), -1)
    else:
      out = jnp.einsum("...kmh,...ksh->...kms", q_xKxMxH,
                       k_xKxSxH.astype(q_xKxMxH.dtype),
                       preferred_element_type=jnp.float32)
    return _softcap(out * scale, softcap)

  logits = jnp.where(mask, scores(q, k_BxKxSxH), _NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  plogits = None
  if prefix is not None:
    pk, pv, pmask = prefix
    p = pk.shape[0]
    qp = q.reshape(p, b // p, kh, g * t, h)
    plogits = scores(qp, pk[:, None])
    sp = pk.shape[2]
    pm = jnp.broadcast_to(pmask[:, None, None], (p, 1, g, t, sp))
    plogits = jnp.where(pm.reshape(p, 1, 1, g * t, sp), plogits, _NEG_INF)
    plogits = plogits.reshape(b, kh, g * t, sp)
    m = jnp.maximum(m, jnp.max(plogits, axis=-1, keepdims=True))
  e = jnp.exp(logits - m)
  if vector:
    block = s if s <= block else math.gcd(s, block)
    nb = s // block
    e_blocks = e.reshape(b, kh, g * t, nb, block)
    v_blocks = v_BxKxSxH.reshape(b, kh, nb, block, h).astype(jnp.float32)
    num = jnp.sum(e_blocks[..., None] * v_blocks[:, :, None], axis=-2)
    den = _halving_sum(e_blocks)
    acc, total = num[:, :, :, 0], den[..., 0]
    for j in range(1, nb):  # a fixed order: empty trailing blocks add 0
      acc, total = acc + num[:, :, :, j], total + den[..., j]
  else:
    acc = jnp.einsum("bkms,bksh->bkmh", e.astype(dt), v_BxKxSxH,
                     preferred_element_type=jnp.float32)
    total = jnp.sum(e, axis=-1)
  if prefix is not None:
    pe = jnp.exp(plogits - m)
    total = total + jnp.sum(pe, axis=-1)
    pe = pe.reshape(p, b // p, kh, g * t, sp)
    if vector:
      pacc = jnp.sum(pe[..., None] * pv[:, None, :, None].astype(jnp.float32),
                     axis=-2)
    else:
      pacc = jnp.einsum("pxkms,pksh->pxkmh", pe.astype(dt), pv.astype(dt),
                        preferred_element_type=jnp.float32)
    acc = acc + pacc.reshape(acc.shape)
  out = (acc / total[..., None]).reshape(b, kh, g, t, h)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(dt)
