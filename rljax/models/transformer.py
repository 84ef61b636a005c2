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
from jax.sharding import PartitionSpec as P

from rljax import sharding
from rljax.models.config import ModelConfig
from rljax.models import lora as lora_lib
from rljax.models.attention import (  # noqa: F401  (re-exported)
    CAUSAL_MAX_BLOCKS, CAUSAL_QUERY_BLOCK, DECODE_BLOCK, DECODE_VECTOR_ROWS,
    _softcap, attend, decode_attend)
from rljax.models import paged_cache
from rljax.models.kv_cache import KVCache, LayerKV

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


def _write_slots(cache_BxKxSxH, new_BxKxTxH, index):
  """The cache with ``new`` written at slot ``index`` (``[]``: every row's, or
  ``[B]``: each row at its own slot, as continuous batching's refilled rows)."""
  new_BxKxTxH = new_BxKxTxH.astype(cache_BxKxSxH.dtype)
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(cache_BxKxSxH, new_BxKxTxH,
                                        (0, 0, index, 0))
  return jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(
      c, x, (0, i, 0)))(cache_BxKxSxH, new_BxKxTxH, index)


def _project(x, w, in_dims: int = 1):
  """``x[..., I] @ w[I, O]`` (``I``, ``O``: one or more axes) as one 2-D matmul.

  The leading axes of ``x`` are flattened first (a free reshape). XLA:CPU
  runs the weight gradient of a 3-D ``einsum`` (contracting batch and time)
  through a transposing copy of the activations that costs as much as the
  matmul; flattened, it is one plain matmul, as in PyTorch's ``nn.Linear``.
  """
  lead, ins = x.shape[:x.ndim - in_dims], x.shape[x.ndim - in_dims:]
  y = x.reshape(-1, math.prod(ins)) @ w.reshape(math.prod(ins), -1)
  return y.reshape(*lead, *w.shape[in_dims:])


def _project_fused(x, *ws):
  """``[_project(x, w) for w in ws]`` as one matmul over the joined outputs.

  The cached path (prefill, decode) uses it for q/k/v and gate/up: a decode
  step's matmuls have few rows, and on XLA:CPU one wide matmul is cheaper
  than two or three narrow ones. The
  training path keeps separate matmuls: there the join and the split of its
  gradient cost what the wider matmul saves.
  """
  d = x.shape[-1]
  joined = jnp.concatenate([w.reshape(d, -1) for w in ws], axis=1)
  y = _project(x, joined)
  outs, start = [], 0
  for w in ws:
    size = math.prod(w.shape[1:])
    outs.append(y[..., start:start + size].reshape(*x.shape[:-1], *w.shape[1:]))
    start += size
  return tuple(outs)


def _param(module, name, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      dtype)


def _lookup(embedding_VxD, tokens_BxT):
  """``embedding[tokens]``, its rows handed to the batch's split in steps
  XLA partitions with collectives.

  The looked-up rows come out split as the table's width is (``embed``) and
  whole along the batch; left to itself, the partitioner moves the
  gradient of the batch-split rows back to that layout by replicating it
  whole ("involuntary full rematerialization", docs/multihost.md). Here
  the rows go to the batch axes the width does not use (a local slice),
  then to the batch's own split (an all-to-all over the width's axes); the
  gradient takes the same steps back: an all-to-all, then an all-gather
  over the remaining batch axes, and each device sums every row into its
  slice of the table's width, in the same order on any process layout.
  """
  x = jnp.take(embedding_VxD, tokens_BxT, axis=0)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  width = sharding.logical_to_spec((None, None, "embed"), shape=x.shape,
                                   mesh=mesh)[2]
  if width is None:
    return x
  batch = sharding.logical_to_spec(("batch",), shape=x.shape[:1],
                                   mesh=mesh)[0]
  width_axes = (width,) if isinstance(width, str) else tuple(width)
  batch_axes = (() if batch is None else (batch,) if isinstance(batch, str)
                else tuple(batch))
  rest = tuple(a for a in batch_axes if a not in width_axes)
  x = jax.lax.with_sharding_constraint(x, P(None, None, width))
  return jax.lax.with_sharding_constraint(
      x, P(rest[0] if len(rest) == 1 else rest or None, None, width))


def _dense_init(in_axis, out_axis):
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def _kernel(module, config: ModelConfig, name: str, shape, axes, in_dims: int):
  """A projection kernel ``[I..., O...]`` in the compute dtype: a float
  param, or an int8 base's (``models/lora.py``) dequantized."""
  dt = config.jnp_dtype
  if config.lora is None or config.lora.quantize_base == "none":
    init = _dense_init(0 if in_dims == 1 else tuple(range(in_dims)),
                       in_dims if len(shape) - in_dims == 1
                       else tuple(range(in_dims, len(shape))))
    return _param(module, name, init, shape, axes,
                  config.jnp_param_dtype).astype(dt)
  q = _param(module, name, nn.initializers.zeros, shape, axes, jnp.int8)
  scale = _param(module, name + lora_lib.SCALE_SUFFIX, nn.initializers.ones,
                 shape[in_dims:], axes[in_dims:], jnp.float32)
  return lora_lib.dequantize(q, scale, dt)


def _lora_delta(module, config: ModelConfig, target: str, x, shape, axes,
                in_dims: int = 1):
  """``(alpha / r) (x A) B`` of ``target``'s adapter, or None when it has
  none (``models/lora.py``). ``A`` ``[I..., r]`` starts random, ``B``
  ``[r, O...]`` at zero; both are float32 whatever ``param_dtype`` (the
  trained weights: bfloat16 would round small updates away)."""
  lora = config.lora
  if lora is None or target not in lora.targets:
    return None
  pd, dt = jnp.float32, config.jnp_dtype
  a_init = _dense_init(0 if in_dims == 1 else tuple(range(in_dims)), in_dims)
  a = _param(module, f"{target}_lora_a", a_init,
             tuple(shape[:in_dims]) + (lora.rank,),
             tuple(axes[:in_dims]) + ("lora_rank",), pd)
  b = _param(module, f"{target}_lora_b", nn.initializers.zeros,
             (lora.rank,) + tuple(shape[in_dims:]),
             ("lora_rank",) + tuple(axes[in_dims:]), pd)
  h = _project(x, a.astype(dt), in_dims) * jnp.asarray(lora.scaling, dt)
  return _project(h, b.astype(dt))


def _plus(y, delta):
  return y if delta is None else y + delta.astype(y.dtype)


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
    shapes = {"q": ((d, n, h), ("embed", "heads", "head_dim")),
              "k": ((d, k, h), ("embed", "kv_heads", "head_dim")),
              "v": ((d, k, h), ("embed", "kv_heads", "head_dim"))}
    wq, wk, wv = (_kernel(self, c, f"{name}_kernel", *shapes[name], 1)
                  for name in ("q", "k", "v"))
    o_shape, o_axes = (n, h, d), ("heads", "head_dim", "embed")
    wo = _kernel(self, c, "o_kernel", o_shape, o_axes, 2)
    x = x_BxTxD.astype(dt)
    if layer_kv is None:
      q, kk, vv = (_project(x, w) for w in (wq, wk, wv))
    else:
      q, kk, vv = _project_fused(x, wq, wk, wv)
    q, kk, vv = (_plus(y, _lora_delta(self, c, name, x, *shapes[name]))
                 for y, name in zip((q, kk, vv), ("q", "k", "v")))
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
    elif isinstance(layer_kv, paged_cache.PagedLayer):  # blocks, per row
      pk, pv = paged_cache.write(
          layer_kv.k, layer_kv.v, layer_kv.table, layer_kv.lengths,
          jnp.transpose(kk, (0, 2, 1, 3)), jnp.transpose(vv, (0, 2, 1, 3)),
          layer_kv.k.shape[2])
      keys = paged_cache.gather(pk, layer_kv.table)
      values = paged_cache.gather(pv, layer_kv.table)
      new_kv = LayerKV(pk, pv)
    else:
      keys = _write_slots(layer_kv.k, jnp.transpose(kk, (0, 2, 1, 3)), index)
      values = _write_slots(layer_kv.v, jnp.transpose(vv, (0, 2, 1, 3)), index)
      new_kv = LayerKV(keys, values)
    prefix = None if prefix_kv is None else (prefix_kv.k, prefix_kv.v,
                                             prefix_mask)
    scale = c.query_scale if c.query_scale is not None else h ** -0.5
    if layer_kv is None:
      out = attend(q, keys, values, mask_BxTxS, scale=scale,
                   softcap=c.attn_logit_softcap, causal=True)
    else:
      out = decode_attend(q, keys.astype(dt), values.astype(dt), mask_BxTxS,
                          scale=scale, softcap=c.attn_logit_softcap,
                          prefix=prefix)
    out = _plus(_project(out, wo, in_dims=2),
                _lora_delta(self, c, "o", out, o_shape, o_axes, 2))
    return sharding.constrain(out, ("batch", "length", "act_embed")), new_kv


class MLP(nn.Module):
  """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU or GeGLU).

  ``fused``: gate and up as one matmul (``_project_fused``; the cached path).
  """

  config: ModelConfig
  fused: bool = False

  @nn.compact
  def __call__(self, x_BxTxD):
    c = self.config
    dt = c.jnp_dtype
    up_shape, down_shape = (c.d_model, c.mlp_dim), (c.mlp_dim, c.d_model)
    up_axes, down_axes = ("embed", "mlp"), ("mlp", "embed")
    wg = _kernel(self, c, "gate_kernel", up_shape, up_axes, 1)
    wu = _kernel(self, c, "up_kernel", up_shape, up_axes, 1)
    wd = _kernel(self, c, "down_kernel", down_shape, down_axes, 1)
    x = x_BxTxD.astype(dt)
    if self.fused:
      gate, up = _project_fused(x, wg, wu)
    else:
      gate, up = _project(x, wg), _project(x, wu)
    gate = _plus(gate, _lora_delta(self, c, "gate", x, up_shape, up_axes))
    up = _plus(up, _lora_delta(self, c, "up", x, up_shape, up_axes))
    act = (jax.nn.silu(gate) if c.activation == "silu"
           else jax.nn.gelu(gate, approximate=True))
    hidden = sharding.constrain(act * up,
                                ("batch", "length", "act_mlp"))
    return _plus(_project(hidden, wd),
                 _lora_delta(self, c, "down", hidden, down_shape, down_axes))


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
    h = MLP(c, fused=layer_kv is not None, name="mlp")(
        norm(name="pre_mlp_norm")(x))
    if c.post_norms:
      h = norm(name="post_mlp_norm")(h)
    x = x + h.astype(x.dtype)
    return sharding.constrain(x, ("batch", "length", "act_embed")), new_kv


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _one_element_each(d_params, adapters_only: bool) -> jax.Array:
  """The sum of the first element of each trained weight's gradient (the
  adapters' alone with LoRA: the frozen base's gradient is never
  computed)."""
  trained = lora_lib.adapters_of(d_params) if adapters_only else d_params
  return sum((g.reshape(-1)[0].astype(jnp.float32)
              for g in jax.tree.leaves(trained)
              if g.dtype != jax.dtypes.float0), jnp.zeros((), jnp.float32))


def recompute_in_backward(block: Block, x_BxTxD, sin_cos, mask_BxTxS, index):
  """``block``'s output (a forward without a cache), recomputed in the
  backward pass from its input: ``remat="full"``.

  ``jax.checkpoint`` (``nn.remat``) marks its recomputation with an
  optimisation barrier, which XLA:CPU removes before common-subexpression
  elimination: the recomputed block then merges back into the forward pass
  and every block's activations stay alive, as without remat
  (``tests/test_remat.py``, ``launch/bench_memory.py``). Here the backward pass
  recomputes the block from its input plus ``0 x`` one element of the
  incoming cotangent per row: the same values, which no compiler can merge
  with the forward pass or schedule before the cotangent exists, so the
  blocks' activations live one block at a time on every backend. Likewise
  the block's input gradient waits for one element of each trained
  weight's gradient, so those are computed in the block's backward pass,
  not deferred to its end with their operands alive (on the 0.5B shapes
  this took a LoRA step's temporaries from 7.2 to 2.6 GiB).
  """

  def forward(mdl, x, sin_cos, mask, index):
    return mdl(x, sin_cos, mask, None, index, None, None)[0]

  def forward_and_residuals(mdl, x, sin_cos, mask, index):
    return (forward(mdl, x, sin_cos, mask, index),
            (mdl.variables, x, sin_cos, mask, index))

  def backward(residuals, g_BxTxD):
    variables, x, sin_cos, mask, index = residuals
    # Depends on the cotangent, equals x (a non-finite cotangent makes the
    # gradient non-finite either way).
    x = x + jnp.zeros_like(x[:, :1, :1]) * g_BxTxD[:, :1, :1].astype(x.dtype)

    def pure(params, x, sin_cos):
      return Block(block.config, block.local).apply(
          {**variables, "params": params}, x, sin_cos, mask, None, index,
          None, None)[0]

    _, vjp = jax.vjp(pure, variables["params"], x, sin_cos)
    d_params, d_x, d_sin_cos = vjp(g_BxTxD)
    # The trained weights' gradients are computed here, not deferred to the
    # end of the backward pass with their [tokens, features] operands alive:
    # the next block's backward waits for one element of each.
    d_x = d_x + jnp.zeros((), d_x.dtype) * _one_element_each(
        d_params, block.config.lora is not None).astype(d_x.dtype)
    return ({"params": d_params}, d_x, d_sin_cos,
            np.zeros(mask.shape, jax.dtypes.float0),
            np.zeros(jnp.shape(index), jax.dtypes.float0))

  return nn.custom_vjp(forward, forward_and_residuals, backward)(
      block, x_BxTxD, sin_cos, mask_BxTxS, index)


def _window_mask(q_slot_T, k_slot_S, window):
  return (q_slot_T[:, None] - k_slot_S[None, :]) < window


class Decoder(nn.Module):
  """The policy network.

  ``__call__(tokens_BxT, positions_BxT, cache=None, *, input_mask_BxT=None,
  segment_ids_BxT=None, return_logits=False) -> (hidden_BxTxD |
  logits_BxTxV, cache)``.

  Without a cache, token ``t`` attends to the real tokens ``<= t``; with
  ``segment_ids_BxT`` (packed rows, ``models/packing.py``) only to those of
  its own segment, so each segment is computed as if it were a row of its own
  (its positions restart at 0). With a cache, the new tokens are written at
  ``cache.index`` and attend to every real slot before them (prefix slots
  first).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache | None = None,
               *, input_mask_BxT=None, segment_ids_BxT=None,
               return_logits: bool = False):
    c = self.config
    b, t = tokens_BxT.shape
    if input_mask_BxT is None:
      input_mask_BxT = jnp.ones((b, t), jnp.bool_)
    input_mask_BxT = input_mask_BxT.astype(jnp.bool_)
    embedding = _param(self, "embedding", nn.initializers.normal(c.d_model ** -0.5),
                       (c.vocab_size, c.d_model), ("vocab", "embed"),
                       c.jnp_param_dtype)
    x = _lookup(embedding, tokens_BxT).astype(c.jnp_dtype)
    if c.embed_scale:
      x = x * jnp.asarray(math.sqrt(c.d_model), c.jnp_dtype)
    x = sharding.constrain(x, ("batch", "length", "act_embed"))

    paged = isinstance(cache, paged_cache.PagedKVCache)
    if cache is None:
      index = jnp.zeros((), jnp.int32)
      key_mask_BxS = input_mask_BxT
      q_slot_T = k_slot_S = jnp.arange(t)
      new_mask = None
    elif paged:  # each row writes at its own length, into its blocks
      index = cache.lengths
      new_mask = paged_cache.write_mask(cache.slot_mask, cache.table, index,
                                        input_mask_BxT)
      key_mask_BxS = paged_cache.gather_mask(new_mask, cache.table)
      q_slot_T = index[:, None] + jnp.arange(t)
      k_slot_S = jnp.arange(key_mask_BxS.shape[1])
    else:
      index = cache.index
      if index.ndim == 0:
        new_mask = jax.lax.dynamic_update_slice(cache.mask, input_mask_BxT,
                                                (0, index))
      else:  # each row writes at its own slot (continuous batching)
        if cache.prefix is not None:
          raise ValueError("a cache with per-row indices takes no prefix.")
        new_mask = jax.vmap(lambda m, x, i: jax.lax.dynamic_update_slice(
            m, x, (i,)))(cache.mask, input_mask_BxT, index)
      key_mask_BxS = new_mask
      q_slot_T = index[..., None] + jnp.arange(t)  # [T] or [B, T]
      k_slot_S = jnp.arange(cache.mask.shape[1])
    # [1, T, S] or, with per-row indices, [B, T, S].
    q_slot = q_slot_T[..., :, None] if q_slot_T.ndim == 2 else q_slot_T[
        None, :, None]
    causal = k_slot_S[None, None, :] <= q_slot
    global_mask = key_mask_BxS[:, None, :] & causal
    if segment_ids_BxT is not None:  # packed rows: block-diagonal by segment
      if cache is not None:
        raise ValueError("Decoder: segment_ids_BxT is for a forward without "
                         "a cache (packed training rows).")
      global_mask = global_mask & (segment_ids_BxT[:, :, None]
                                   == segment_ids_BxT[:, None, :])
    local_mask = global_mask
    prefix = None if cache is None or paged else cache.prefix
    prefix_global = prefix_local = None
    if prefix is not None:
      sp = prefix.mask.shape[1]
      prefix_global = jnp.broadcast_to(prefix.mask[:, None, :],
                                       (prefix.mask.shape[0], t, sp))
      prefix_local = prefix_global
    if c.sliding_window is not None:
      local_mask = global_mask & (
          (q_slot - k_slot_S[None, None, :]) < c.sliding_window)
      if prefix is not None:
        sp = prefix.mask.shape[1]
        prefix_local = prefix_global & _window_mask(
            q_slot_T + sp, jnp.arange(sp), c.sliding_window)[None]

    sin_cos_global = rope_sin_cos(positions_BxT, rope_inv_freq(c))
    sin_cos_local = (rope_sin_cos(positions_BxT, rope_inv_freq(c, local=True))
                     if c.rope_local_theta else sin_cos_global)

    # remat="full" without a cache (a forward to differentiate) recomputes
    # in the backward pass; otherwise nn.remat (jax.checkpoint) as before.
    recompute = c.remat == "full" and cache is None
    block_cls = Block
    if c.remat != "none" and not recompute:
      block_cls = nn.remat(Block, policy=_REMAT_POLICIES[c.remat])
    new_layers = []
    for i in range(c.num_layers):
      local = c.is_local_layer(i)
      block = block_cls(c, local, name=f"layers_{i}")
      if recompute:
        x, kv = recompute_in_backward(
            block, x, sin_cos_local if local else sin_cos_global,
            local_mask if local else global_mask, index), None
      else:
        layer = None if cache is None else cache.layers[i]
        if paged:
          layer = paged_cache.PagedLayer(layer.k, layer.v, cache.table,
                                         cache.lengths)
        x, kv = block(
            x, sin_cos_local if local else sin_cos_global,
            local_mask if local else global_mask, layer, index,
            None if prefix is None else prefix.layers[i],
            prefix_local if local else prefix_global)
      new_layers.append(kv)
    x = RMSNorm(c.norm_eps, c.norm_offset, c.jnp_param_dtype,
                name="final_norm")(x)
    new_cache = None
    if paged:
      new_cache = cache._replace(layers=tuple(new_layers), slot_mask=new_mask,
                                 lengths=index + t)
    elif cache is not None:
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
