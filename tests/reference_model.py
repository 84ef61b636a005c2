"""An independent numpy forward pass of the decoder, for parity tests.

Written from the model families' published definitions (Llama / Qwen / Gemma),
in float64, one sequence at a time, with no padding: it shares no code with
``rljax.models``.
"""

import math

import numpy as np


def _rms(x, w, eps, offset):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (offset + w)


def _inv_freq(c, local):
  theta = c.rope_local_theta if (local and c.rope_local_theta) else c.rope_theta
  inv = 1.0 / theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
  s = c.rope_scaling
  if s is None or local:
    return inv
  out = []
  for f in inv:
    wavelen = 2 * math.pi / f
    if wavelen < s.original_max_position / s.high_freq_factor:
      out.append(f)
    elif wavelen > s.original_max_position / s.low_freq_factor:
      out.append(f / s.factor)
    else:
      smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
                / (s.high_freq_factor - s.low_freq_factor))
      out.append((1 - smooth) * f / s.factor + smooth * f)
  return np.array(out)


def _rope(x_TxNxH, inv):
  t = x_TxNxH.shape[0]
  ang = np.arange(t)[:, None] * inv[None]  # T, H/2
  cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
  h = x_TxNxH.shape[-1] // 2
  rot = np.concatenate([-x_TxNxH[..., h:], x_TxNxH[..., :h]], -1)
  return x_TxNxH * cos + rot * sin


def _cap(x, cap):
  return x if cap is None else cap * np.tanh(x / cap)


def forward(params, c, tokens_T):
  """Logits ``[T, V]`` of one unpadded sequence, float64."""
  p = {k: v for k, v in params.items()}
  f = lambda a: np.asarray(a, np.float64)
  x = f(p["embedding"])[np.asarray(tokens_T)]
  if c.embed_scale:
    x = x * math.sqrt(c.d_model)
  t = len(tokens_T)
  for i in range(c.num_layers):
    lp = p[f"layers_{i}"]
    a = lp["attn"]
    local = c.sliding_window is not None and (i + 1) % c.global_every != 0
    h = _rms(x, f(lp["pre_attn_norm"]["scale"]), c.norm_eps, c.norm_offset)
    q = np.einsum("td,dnh->tnh", h, f(a["q_kernel"]))
    k = np.einsum("td,dkh->tkh", h, f(a["k_kernel"]))
    v = np.einsum("td,dkh->tkh", h, f(a["v_kernel"]))
    if c.qkv_bias:
      q, k, v = q + f(a["q_bias"]), k + f(a["k_bias"]), v + f(a["v_bias"])
    if c.qk_norm:
      q = _rms(q, f(a["q_norm"]["scale"]), c.norm_eps, c.norm_offset)
      k = _rms(k, f(a["k_norm"]["scale"]), c.norm_eps, c.norm_offset)
    inv = _inv_freq(c, local)
    q, k = _rope(q, inv), _rope(k, inv)
    rep = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scale = c.query_scale if c.query_scale is not None else c.head_dim ** -0.5
    s = _cap(np.einsum("tnh,snh->nts", q, k) * scale, c.attn_logit_softcap)
    allowed = np.tril(np.ones((t, t), bool))
    if local:
      allowed &= (np.arange(t)[:, None] - np.arange(t)[None]) < c.sliding_window
    s = np.where(allowed[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("nts,snh->tnh", s, v)
    o = np.einsum("tnh,nhd->td", o, f(a["o_kernel"]))
    if c.post_norms:
      o = _rms(o, f(lp["post_attn_norm"]["scale"]), c.norm_eps, c.norm_offset)
    x = x + o
    h = _rms(x, f(lp["pre_mlp_norm"]["scale"]), c.norm_eps, c.norm_offset)
    m = lp["mlp"]
    g = h @ f(m["gate_kernel"])
    if c.activation == "silu":
      g = g / (1 + np.exp(-g))
    else:
      g = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    o = (g * (h @ f(m["up_kernel"]))) @ f(m["down_kernel"])
    if c.post_norms:
      o = _rms(o, f(lp["post_mlp_norm"]["scale"]), c.norm_eps, c.norm_offset)
    x = x + o
  x = _rms(x, f(p["final_norm"]["scale"]), c.norm_eps, c.norm_offset)
  w = f(p["embedding"]).T if c.tie_embeddings else f(p["lm_head"])
  return _cap(x @ w, c.final_logit_softcap)
