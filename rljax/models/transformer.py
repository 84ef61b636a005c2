"""A flax.linen decoder-only transformer for the Llama 3 / Qwen / Gemma families.

The policy is pure: ``Decoder(config).apply({'params': params}, tokens_BxT,
positions_BxT, cache, input_mask_BxT=...)`` returns ``(hidden_BxTxD, cache)``
(or logits with ``return_logits=True``). Positions are explicit, so left- or
right-padded batches work; ``input_mask_BxT`` marks real tokens, and padding
slots are never attended to.

Attention is causal in *slot* order (the index of a token in the sequence or
the KV cache), with the padding slots masked out; RoPE uses the explicit
positions. The KV cache (``rljax.models.kv_cache``) may carry a read-only
``prefix`` with one row per group of ``G`` consecutive batch rows: the prompt
of a group is then stored (and read) once, not ``G`` times.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax.models.config import ModelConfig
from rljax.models.kv_cache import KVCache, LayerKV

_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax, not NaN


def positions_from_mask(input_mask_BxT: jax.Array) -> jax.Array:
  """Positions 0, 1, ... of the real tokens (padding gets the next one's, >= 0)."""
  return jnp.maximum(jnp.cumsum(input_mask_BxT.astype(jnp.int32), -1) - 1, 0)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
  """Inverse RoPE frequencies ``[H / 2]`` (with Llama-3 or linear scaling)."""
  theta = (config.rope_local_theta if local and config.rope_local_theta
           else config.rope_theta)
  h = config.head_dim
  inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  s = config.rope_scaling
  if s is not None and not local and s.rope_type == "linear":
    inv_freq = inv_freq / s.factor
  elif s is not None and not local:
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_sin_cos(positions_BxT: jax.Array, inv_freq: np.ndarray):
  angles_BxTxH2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  return jnp.sin(angles_BxTxH2), jnp.cos(angles_BxTxH2)


def apply_rope(x_BxTxNxH: jax.Array, sin_BxTxH2, cos_BxTxH2) -> jax.Array:
  """Rotates halves ``(x1, x2)`` of each head (the Hugging Face convention)."""
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin_BxTxH2[:, :, None, :], cos_BxTxH2[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


CAUSAL_QUERY_BLOCK = 48  # query rows per block of a causal ``attend``
CAUSAL_MAX_BLOCKS = 8  # at most this many blocks (unrolled in the program)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, *, scale: float,
           softcap: float | None = None, prefix: tuple | None = None,
           causal: bool = False):
  """Grouped-query attention over a cache, with an optional shared prefix.

  Args:
    q_BxTxNxH: queries.
    k_BxSxKxH: keys; ``N % K == 0``.
    v_BxSxKxH: values.
    mask_BxTxS: bool, which keys each query may see.
    scale: multiplier of ``q . k``.
    softcap: optional soft-cap of the logits.
    prefix: optional ``(k_PxSpxKxH, v_PxSpxKxH, mask_PxTxSp)`` with
      ``P = B // G`` rows: keys shared by each run of ``G`` consecutive rows.
    causal: the keys are the queries' own slots (``S = T``) and the mask
      hides every key after its query. Then the queries run in blocks of
      about ``CAUSAL_QUERY_BLOCK`` rows, each against the keys up to its last
      row: the blocks wholly above the diagonal, all masked, are skipped
      (issue 12: a training layer's attention forward + backward 2x faster
      on the CPU, as PyTorch's causal ``scaled_dot_product_attention``
      skips them). A query whose every key is masked (padding) then averages
      the values of its block's keys instead of all keys; nothing reads it.

  Returns:
    ``[B, T, N, H]`` attention outputs in the dtype of ``v``.
  """
  t = q_BxTxNxH.shape[1]
  num_blocks = min(CAUSAL_MAX_BLOCKS, -(-t // CAUSAL_QUERY_BLOCK))
  if causal and prefix is None and num_blocks > 1:
    if k_BxSxKxH.shape[1] != t:
      raise ValueError(f"attend(causal=True): keys have {k_BxSxKxH.shape[1]} "
                       f"slots, queries {t}; causal needs S = T.")
    size = -(-t // num_blocks)
    return jnp.concatenate([
        attend(q_BxTxNxH[:, lo:lo + size], k_BxSxKxH[:, :lo + size],
               v_BxSxKxH[:, :lo + size], mask_BxTxS[:, lo:lo + size, :lo + size],
               scale=scale, softcap=softcap)
        for lo in range(0, t, size)], axis=1)
  b, t, n, h = q_BxTxNxH.shape
  kh = k_BxSxKxH.shape[2]
  q = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  logits = _softcap(logits, softcap)
  logits = jnp.where(mask_BxTxS[:, None, None], logits, _NEG_INF)
  if prefix is None:
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
    return out.reshape(b, t, n, h)
  pk, pv, pmask = prefix
  p = pk.shape[0]
  g = b // p
  qg = q.reshape(p, g, t, kh, n // kh, h)
  plogits = jnp.einsum("pxtkgh,pskh->pxkgts", qg, pk.astype(q.dtype),
                       preferred_element_type=jnp.float32) * scale
  plogits = _softcap(plogits, softcap)
  plogits = jnp.where(pmask[:, None, None, None], plogits, _NEG_INF)
  plogits = plogits.reshape(b, kh, n // kh, t, -1)
  sp = plogits.shape[-1]
  probs = jax.nn.softmax(jnp.concatenate([plogits, logits], -1), axis=-1)
  probs = probs.astype(v_BxSxKxH.dtype)
  pprobs = probs[..., :sp].reshape(p, g, kh, n // kh, t, sp)
  out = jnp.einsum("pxkgts,pskh->pxtkgh", pprobs, pv.astype(v_BxSxKxH.dtype))
  out = out.reshape(b, t, kh, n // kh, h)
  out = out + jnp.einsum("bkgts,bskh->btkgh", probs[..., sp:], v_BxSxKxH)
  return out.reshape(b, t, n, h)


DECODE_BLOCK = 64  # cache slots per block of ``decode_attend``


def decode_attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, *, scale: float,
                  softcap: float | None = None, prefix: tuple | None = None,
                  block: int = DECODE_BLOCK):
  """``attend`` over a KV cache, in blocks of ``block`` slots: the decode seam.

  The one attention function of the cached (decode and draft-verify) path,
  and the seam where a fused decode kernel goes: on a GPU or TPU a Pallas
  (``jax.experimental.pallas``) paged/ragged decode-attention kernel can
  replace this body with the same arguments. None is wired: Pallas kernels
  run on CPU only with ``interpret=True``, an emulator far slower than this
  XLA code, so a CPU test could check equality but not speed; the seam is
  left for a device task.

  Why blocks: the sampler's decode cache grows between length segments, so
  one step may see ``S`` or ``2 S`` slots. Scores are per-slot dot products;
  the softmax sums and the value sum are taken within fixed ``block``-slot
  blocks and then across blocks, and a wholly empty block adds exact zeros,
  so the result does not depend on how many empty blocks follow: segmented
  and unsegmented decode give bitwise-equal logits with shared prefixes
  (with repeated prompts XLA:CPU's sum over blocks has been seen to differ in
  the last bit). 64-slot blocks: the per-block dots are few enough to be
  fast (16-slot blocks were 16% slower at 512 new tokens). When ``S`` is not a
  multiple of ``block`` the block is ``gcd(S, block)``, or ``S`` when ``S <=
  block``; the sampler sizes its caches in multiples of ``DECODE_BLOCK``,
  except caches that never outgrow one block.

  Args: as ``attend`` (``mask_BxTxS``: which cache slots each query sees).
  Returns: ``[B, T, N, H]`` in the dtype of ``v``.

  References: Dao et al., "FlashAttention" (blockwise softmax),
  https://arxiv.org/abs/2205.14135; gemma's sampler (cache layout).
  """
  b, t, n, h = q_BxTxNxH.shape
  s, kh = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  block = s if s <= block else math.gcd(s, block)
  nb = s // block
  q = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH.astype(q.dtype),
                      preferred_element_type=jnp.float32) * scale
  logits = _softcap(logits, softcap)
  logits = jnp.where(mask_BxTxS[:, None, None], logits, _NEG_INF)
  m = jnp.max(logits, axis=-1, keepdims=True)
  plogits = None
  if prefix is not None:
    pk, pv, pmask = prefix
    p = pk.shape[0]
    qg = q.reshape(p, b // p, t, kh, n // kh, h)
    plogits = jnp.einsum("pxtkgh,pskh->pxkgts", qg, pk.astype(q.dtype),
                         preferred_element_type=jnp.float32) * scale
    plogits = _softcap(plogits, softcap)
    plogits = jnp.where(pmask[:, None, None, None], plogits, _NEG_INF)
    plogits = plogits.reshape(b, kh, n // kh, t, -1)
    m = jnp.maximum(m, jnp.max(plogits, axis=-1, keepdims=True))
  e = jnp.exp(logits - m).reshape(b, kh, n // kh, t, nb, block)
  ones = jnp.ones(v_BxSxKxH.shape[:-1] + (1,), v_BxSxKxH.dtype)
  v1 = jnp.concatenate([v_BxSxKxH, ones], -1).reshape(b, nb, block, kh, h + 1)
  # Per block [..., h + 1]: the weighted values and (last) the weight sum.
  part = jnp.einsum("bkgtnc,bnckh->bkgtnh", e.astype(v1.dtype), v1,
                    preferred_element_type=jnp.float32)
  acc = jnp.sum(part, axis=4)
  if prefix is not None:
    pe = jnp.exp(plogits - m).reshape(p, b // p, kh, n // kh, t, -1)
    pones = jnp.ones(pv.shape[:-1] + (1,), pv.dtype)
    pv1 = jnp.concatenate([pv, pones], -1).astype(v1.dtype)
    pacc = jnp.einsum("pxkgts,pskh->pxkgth", pe.astype(v1.dtype), pv1,
                      preferred_element_type=jnp.float32)
    acc = acc + pacc.reshape(acc.shape)
  out = acc[..., :h] / acc[..., h:]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(
      v_BxSxKxH.dtype)


def _project(x, w, in_dims: int = 1):
  """``x[..., I] @ w[I, O]`` (``I``, ``O``: one or more axes) as one 2-D matmul.

  The leading axes of ``x`` are flattened first (a free reshape). XLA:CPU
  runs the weight gradient of a 3-D ``einsum`` (contracting batch and time)
  through a transposing copy of the activations that costs as much as the
  matmul; flattened, it is one plain matmul, as in PyTorch's ``nn.Linear``
  (issue 12: the MLP's forward + backward 1.9x faster on the CPU).
  """
  lead, ins = x.shape[:x.ndim - in_dims], x.shape[x.ndim - in_dims:]
  y = x.reshape(-1, math.prod(ins)) @ w.reshape(math.prod(ins), -1)
  return y.reshape(*lead, *w.shape[in_dims:])


def _param(module, name, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      dtype)


def _dense_init(in_axis, out_axis):
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


class RMSNorm(nn.Module):
  """RMSNorm computed in fp32; ``offset=1`` gives Gemma's ``x * (1 + w)``."""

  eps: float = 1e-6
  offset: float = 0.0
  param_dtype: Any = jnp.float32
  axis_name: str = "norm"

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = _param(self, "scale", init, (x.shape[-1],), (self.axis_name,),
                   self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    return (y * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE, optional qk-norm and biases."""

  config: ModelConfig
  local: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, sin_cos, mask_BxTxS, layer_kv, index,
               prefix_kv, prefix_mask):
    c = self.config
    pd, dt = c.jnp_param_dtype, c.jnp_dtype
    d, n, k, h = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    wq = _param(self, "q_kernel", _dense_init(0, (1, 2)), (d, n, h),
                ("embed", "heads", "head_dim"), pd)
    wk = _param(self, "k_kernel", _dense_init(0, (1, 2)), (d, k, h),
                ("embed", "kv_heads", "head_dim"), pd)
    wv = _param(self, "v_kernel", _dense_init(0, (1, 2)), (d, k, h),
                ("embed", "kv_heads", "head_dim"), pd)
    wo = _param(self, "o_kernel", _dense_init((0, 1), 2), (n, h, d),
                ("heads", "head_dim", "embed"), pd)
    x = x_BxTxD.astype(dt)
    q = _project(x, wq.astype(dt))
    kk = _project(x, wk.astype(dt))
    vv = _project(x, wv.astype(dt))
    if c.qkv_bias:
      zeros = nn.initializers.zeros
      q = q + _param(self, "q_bias", zeros, (n, h), ("heads", "head_dim"),
                     pd).astype(dt)
      kk = kk + _param(self, "k_bias", zeros, (k, h), ("kv_heads", "head_dim"),
                       pd).astype(dt)
      vv = vv + _param(self, "v_bias", zeros, (k, h), ("kv_heads", "head_dim"),
                       pd).astype(dt)
    if c.qk_norm:
      q = RMSNorm(c.norm_eps, c.norm_offset, pd, "head_dim", name="q_norm")(q)
      kk = RMSNorm(c.norm_eps, c.norm_offset, pd, "head_dim", name="k_norm")(kk)
    sin, cos = sin_cos
    q = apply_rope(q, sin, cos)
    kk = apply_rope(kk, sin, cos)
    q = sharding.constrain(q, ("batch", "length", "act_heads", None))

    if layer_kv is None:
      keys, values, new_kv = kk, vv, None
    else:
      start = (0, index, 0, 0)
      keys = jax.lax.dynamic_update_slice(
          layer_kv.k, kk.astype(layer_kv.k.dtype), start)
      values = jax.lax.dynamic_update_slice(
          layer_kv.v, vv.astype(layer_kv.v.dtype), start)
      new_kv = LayerKV(keys, values)
    prefix = None if prefix_kv is None else (prefix_kv.k, prefix_kv.v,
                                             prefix_mask)
    scale = c.query_scale if c.query_scale is not None else h ** -0.5
    attention = (functools.partial(attend, causal=True) if layer_kv is None
                 else decode_attend)
    out = attention(q, keys.astype(dt), values.astype(dt), mask_BxTxS,
                    scale=scale, softcap=c.attn_logit_softcap, prefix=prefix)
    out = _project(out, wo.astype(dt), in_dims=2)
    return sharding.constrain(out, ("batch", "length", "act_embed")), new_kv


class MLP(nn.Module):
  """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU or GeGLU)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    c = self.config
    pd, dt = c.jnp_param_dtype, c.jnp_dtype
    wg = _param(self, "gate_kernel", _dense_init(0, 1), (c.d_model, c.mlp_dim),
                ("embed", "mlp"), pd)
    wu = _param(self, "up_kernel", _dense_init(0, 1), (c.d_model, c.mlp_dim),
                ("embed", "mlp"), pd)
    wd = _param(self, "down_kernel", _dense_init(0, 1), (c.mlp_dim, c.d_model),
                ("mlp", "embed"), pd)
    x = x_BxTxD.astype(dt)
    gate = _project(x, wg.astype(dt))
    act = (jax.nn.silu(gate) if c.activation == "silu"
           else jax.nn.gelu(gate, approximate=True))
    hidden = sharding.constrain(act * _project(x, wu.astype(dt)),
                                ("batch", "length", "act_mlp"))
    return _project(hidden, wd.astype(dt))


class Block(nn.Module):
  """Pre-norm transformer block (with Gemma's optional post-norms)."""

  config: ModelConfig
  local: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, sin_cos, mask_BxTxS, layer_kv, index,
               prefix_kv, prefix_mask):
    c = self.config
    norm = functools.partial(RMSNorm, c.norm_eps, c.norm_offset,
                             c.jnp_param_dtype)
    h, new_kv = Attention(c, self.local, name="attn")(
        norm(name="pre_attn_norm")(x_BxTxD), sin_cos, mask_BxTxS, layer_kv,
        index, prefix_kv, prefix_mask)
    if c.post_norms:
      h = norm(name="post_attn_norm")(h)
    x = x_BxTxD + h.astype(x_BxTxD.dtype)
    h = MLP(c, name="mlp")(norm(name="pre_mlp_norm")(x))
    if c.post_norms:
      h = norm(name="post_mlp_norm")(h)
    x = x + h.astype(x.dtype)
    return sharding.constrain(x, ("batch", "length", "act_embed")), new_kv


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _window_mask(q_slot_T, k_slot_S, window):
  return (q_slot_T[:, None] - k_slot_S[None, :]) < window


class Decoder(nn.Module):
  """The policy network.

  ``__call__(tokens_BxT, positions_BxT, cache=None, *, input_mask_BxT=None,
  return_logits=False) -> (hidden_BxTxD | logits_BxTxV, cache)``.

  Without a cache, token ``t`` attends to the real tokens ``<= t``. With a
  cache, the new tokens are written at ``cache.index`` and attend to every
  real slot before them (prefix slots first).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None = None,
               *, input_mask_BxT=None, return_logits: bool = False):
    c = self.config
    b, t = tokens_BxT.shape
    if input_mask_BxT is None:
      input_mask_BxT = jnp.ones((b, t), jnp.bool_)
    input_mask_BxT = input_mask_BxT.astype(jnp.bool_)
    embedding = _param(self, "embedding", nn.initializers.normal(c.d_model ** -0.5),
                       (c.vocab_size, c.d_model), ("vocab", "embed"),
                       c.jnp_param_dtype)
    x = jnp.take(embedding, tokens_BxT, axis=0).astype(c.jnp_dtype)
    if c.embed_scale:
      x = x * jnp.asarray(math.sqrt(c.d_model), c.jnp_dtype)
    x = sharding.constrain(x, ("batch", "length", "act_embed"))

    if cache is None:
      index = jnp.zeros((), jnp.int32)
      key_mask_BxS = input_mask_BxT
      q_slot_T = k_slot_S = jnp.arange(t)
      new_mask = None
    else:
      index = cache.index
      new_mask = jax.lax.dynamic_update_slice(cache.mask, input_mask_BxT,
                                              (0, index))
      key_mask_BxS = new_mask
      q_slot_T = index + jnp.arange(t)
      k_slot_S = jnp.arange(cache.mask.shape[1])
    causal_TxS = k_slot_S[None, :] <= q_slot_T[:, None]
    global_mask = key_mask_BxS[:, None, :] & causal_TxS[None]
    local_mask = global_mask
    prefix = None if cache is None else cache.prefix
    prefix_global = prefix_local = None
    if prefix is not None:
      sp = prefix.mask.shape[1]
      prefix_global = jnp.broadcast_to(prefix.mask[:, None, :],
                                       (prefix.mask.shape[0], t, sp))
      prefix_local = prefix_global
    if c.sliding_window is not None:
      local_mask = global_mask & _window_mask(q_slot_T, k_slot_S,
                                              c.sliding_window)[None]
      if prefix is not None:
        sp = prefix.mask.shape[1]
        prefix_local = prefix_global & _window_mask(
            q_slot_T + sp, jnp.arange(sp), c.sliding_window)[None]

    sin_cos_global = rope_sin_cos(positions_BxT, rope_inv_freq(c))
    sin_cos_local = (rope_sin_cos(positions_BxT, rope_inv_freq(c, local=True))
                     if c.rope_local_theta else sin_cos_global)

    block_cls = Block
    if c.remat != "none":
      block_cls = nn.remat(Block, policy=_REMAT_POLICIES[c.remat])
    new_layers = []
    for i in range(c.num_layers):
      local = c.is_local_layer(i)
      x, kv = block_cls(c, local, name=f"layers_{i}")(
          x, sin_cos_local if local else sin_cos_global,
          local_mask if local else global_mask,
          None if cache is None else cache.layers[i], index,
          None if prefix is None else prefix.layers[i],
          prefix_local if local else prefix_global)
      new_layers.append(kv)
    x = RMSNorm(c.norm_eps, c.norm_offset, c.jnp_param_dtype,
                name="final_norm")(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(tuple(new_layers), new_mask, index + t, prefix)
    if c.tie_embeddings:
      w_DxV = embedding.T
    else:
      w_DxV = _param(self, "lm_head", _dense_init(0, 1),
                     (c.d_model, c.vocab_size), ("embed", "vocab"),
                     c.jnp_param_dtype)
    if not return_logits:
      return x, new_cache
    return compute_logits(x, w_DxV, c.final_logit_softcap), new_cache


def compute_logits(hidden_BxTxD, w_DxV, softcap=None):
  """fp32 logits from final hidden states (small batches only: ``B x T x V``)."""
  logits = jnp.einsum("btd,dv->btv", hidden_BxTxD, w_DxV.astype(hidden_BxTxD.dtype),
                      preferred_element_type=jnp.float32)
  return _softcap(logits, softcap)


def output_projection(params: Any, config: ModelConfig) -> jax.Array:
  """The unembedding ``W_DxV`` (the transposed embedding when tied)."""
  if config.tie_embeddings:
    return params["embedding"].T
  return params["lm_head"]
