"""KTAE: token-level advantages from the statistics of key tokens.

The only transform whose output is per token: rewards `[N]` in, advantages
`[N, T]` out (`T`: completion length). It reads the completions from the
extra arguments `tokens_NxT` (int) and `completion_mask_NxT` (bool); the
training loop's Collector passes `Rollout.completion_tokens` and
`Rollout.completion_mask`, and places the result on the completion columns
of `RLBatch.advantages_NxL`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_nonneg, _count, _grouped, _is_constant, _mean, _stateless,
    _std)

# BM25's term-frequency saturation constants in the authors' `compute_tf`.
_K1 = 2.0
_B = 0.5


def _log_comb(n, k):
  return (jax.lax.lgamma(n + 1.0) - jax.lax.lgamma(k + 1.0)
          - jax.lax.lgamma(n - k + 1.0))


def _fisher_two_sided(a, b, c, d, max_n):
  """Fisher's exact test p-value of the 2x2 table `[[a, b], [c, d]]`.

  The sum of the hypergeometric probabilities of every table with the same
  margins that is at most as likely as the observed one (relative tolerance
  1e-6 for ties, as scipy's 1e-7 in float64). `max_n` (static) bounds the
  first column sum.
  """
  r1, c1 = a + b, a + c
  n = a + b + c + d
  k = jnp.arange(max_n + 1, dtype=jnp.float32)
  k_min = jnp.maximum(0.0, r1 + c1 - n)[..., None]
  k_max = jnp.minimum(r1, c1)[..., None]
  inside = (k >= k_min) & (k <= k_max)
  log_norm = _log_comb(n, r1)[..., None]
  c1_, n_, r1_ = c1[..., None], n[..., None], r1[..., None]
  log_p = (_log_comb(c1_, jnp.where(inside, k, 0.0))
           + _log_comb(n_ - c1_, jnp.where(inside, r1_ - k, 0.0)) - log_norm)
  log_obs = _log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1)
  p_k = jnp.where(inside, jnp.exp(log_p), 0.0)
  keep = inside & (log_p <= log_obs[..., None] + 1e-6)
  return jnp.minimum(jnp.sum(jnp.where(keep, p_k, 0.0), -1), 1.0)


def _entropy(p):
  return jnp.where(p > 0, -p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0)


def _information_gain(a, b, c, d):
  """`H(correct) - H(correct | token present)`, in bits."""
  n = a + b + c + d
  safe = lambda x, y: x / jnp.maximum(y, 1e-30)
  h_y = _entropy(safe(a + c, n)) + _entropy(safe(b + d, n))
  h_present = _entropy(safe(a, a + b)) + _entropy(safe(b, a + b))
  h_absent = _entropy(safe(c, c + d)) + _entropy(safe(d, c + d))
  h_y_x = safe(a + b, n) * h_present + safe(c + d, n) * h_absent
  return jnp.where(n > 0, h_y - h_y_x, 0.0)


def _group_token_weights(tok_GxT, valid_GxT, correct_G, alpha, beta, use_tf,
                         scale):
  """KTAE's weight of each completion token of one group, `[G, T]`."""
  g, t = tok_GxT.shape
  big = jnp.iinfo(jnp.int32).max
  tok = jnp.where(valid_GxT, tok_GxT, big).reshape(-1).astype(jnp.int32)
  row = jnp.repeat(jnp.arange(g, dtype=jnp.int32), t)
  pos = jnp.arange(g * t, dtype=jnp.int32)
  s_tok, s_row, s_pos = jax.lax.sort((tok, row, pos), num_keys=2)
  s_valid = s_tok != big
  first = jnp.arange(g * t) == 0
  new_tok = first | (s_tok != jnp.roll(s_tok, 1))
  new_pair = s_valid & (new_tok | (s_row != jnp.roll(s_row, 1)))
  seg = jnp.cumsum(new_tok) - 1
  s_correct = correct_G[s_row]
  total = lambda x: jax.ops.segment_sum(
      x.astype(jnp.float32), seg, num_segments=g * t)[seg]
  # Rows of each class that contain the token (a, b) and its frequency in
  # the tokens of each class.
  a = total(new_pair & s_correct)
  b = total(new_pair & ~s_correct)
  hist_c = total(s_valid & s_correct)
  hist_w = total(s_valid & ~s_correct)
  n_correct = jnp.sum(correct_G, dtype=jnp.float32)
  n_wrong = jnp.float32(g) - n_correct
  c, d = n_correct - a, n_wrong - b

  p = _fisher_two_sided(a, b, c, d, g)
  # The authors test `p != 1.0`; float rounding of a sum that is 1 in exact
  # arithmetic must not turn an uninformative token into exp(-2).
  fisher = jnp.where(p < 1.0 - 1e-6, jnp.exp(-2.0 * p), 0.0)
  ig = _information_gain(a, b, c, d)
  h = (jnp.arcsin(jnp.sqrt(jnp.clip(a / (a + c + 1e-10), 0.0, 1.0)))
       - jnp.arcsin(jnp.sqrt(jnp.clip(b / (b + d + 1e-10), 0.0, 1.0))))
  x = h
  if use_tf:
    len_c = jnp.sum(valid_GxT & correct_G[:, None], dtype=jnp.float32)
    len_w = jnp.sum(valid_GxT & ~correct_G[:, None], dtype=jnp.float32)
    avg = jnp.maximum((len_c + len_w) / 2.0, 1e-30)
    k_c = _K1 * (1.0 - _B + _B * len_c / avg)
    k_w = _K1 * (1.0 - _B + _B * len_w / avg)
    f_c = hist_c / jnp.maximum(len_c, 1.0)
    f_w = hist_w / jnp.maximum(len_w, 1.0)
    tf_c = f_c * (_K1 + 1.0) / (f_c + k_c)
    tf_w = f_w * (_K1 + 1.0) / (f_w + k_w)
    x = x + tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)
  key = (alpha * fisher + beta * ig) * x / (alpha + beta)
  w = (jax.nn.sigmoid(key) - 0.5) * 2.0 * scale
  w = jnp.where(s_valid & (n_correct > 0) & (n_wrong > 0), w, 0.0)
  return jnp.zeros((g * t,), jnp.float32).at[s_pos].set(w).reshape(g, t)


def ktae_advantages(eps: float = 1e-6, alpha: float = 1.0, beta: float = 1.0,
                    use_tf: bool = True, scale: float = 1.0) -> _Tx:
  """GRPO + KTAE: `A_it = (r_i - mean_g r) / (std_g r + eps) + w_g(y_it)`.

  For each group, the completions are split into correct (reward `> 0`, as
  the authors) and wrong ones, and every token id `v` that occurs in the
  group gets a 2x2 table: `a`/`b` correct/wrong completions containing `v`,
  `c`/`d` those that do not. The token's weight combines Fisher's exact test
  `p`, the information gain `IG` of "contains v" about correctness,
  Cohen's `h` of the two containment rates and a BM25-style term-frequency
  contrast `tf_c / tf_w - tf_w / tf_c` (`use_tf`; `k1 = 2`, `b = 0.5`):

      key = (alpha * exp(-2 p) [p != 1] + beta * IG) * (h + tf term)
            / (alpha + beta)
      w_g(v) = (sigmoid(key) - 0.5) * 2 * scale

  Every token `y_it` of a completion gets its group's `w_g(y_it)` added to
  the sample's GRPO advantage (Bessel std; a group whose rewards are all
  equal has GRPO part 0). A group without both a correct and a wrong
  completion adds nothing. Output `[N, T]`; tokens outside
  `completion_mask_NxT` and rows outside `mask_N` are 0.

  The authors' code also zeroes the weight of one hard-coded token id
  (151643, Qwen's `<|endoftext|>`); a token that ends every completion of
  a group already gets weight 0 here (`a/(a+c) = b/(b+d)`, `p = 1`, IG 0),
  and no id is special-cased. Fisher's test keeps the tables at most as
  likely as the observed one up to a relative 1e-6, and `p` within 1e-6 of
  1 counts as 1 (ties and `p = 1` as in exact arithmetic; the authors
  compare float32 values with `<=` and `!= 1.0`).

  Args:
    eps: added to the group std (the authors' GRPO: 1e-6).
    alpha: weight of Fisher's test (authors: 1).
    beta: weight of the information gain (authors: 1).
    use_tf: add the term-frequency contrast (the authors' `gamma_tf=1`).
    scale: the weights' range is `(-scale, scale)` (the authors' `top=1`).

  References:
    Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens Advantage
    Estimation in Mathematical Reasoning", https://arxiv.org/abs/2505.16826;
    code https://github.com/xiaolizh1/KTAE
    (`verl/workers/actor/compute_key_tokens.py`,
    `compute_ktae_outcome_advantage_and_keytokens`).
  """
  fn = "ktae_advantages"
  _check_nonneg(fn, "eps", eps)
  if isinstance(alpha, (int, float)) and isinstance(beta, (int, float)) and (
      alpha < 0 or beta < 0 or alpha + beta <= 0):
    raise ValueError(f"{fn}: alpha={alpha!r} and beta={beta!r} must be >= 0 "
                     "with a positive sum.")

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, tokens_NxT=None, completion_mask_NxT=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    if tokens_NxT is None or completion_mask_NxT is None:
      raise ValueError(
          f"{fn}: the keyword extra arguments tokens_NxT and "
          "completion_mask_NxT (the completions [N, T]) are required; the "
          "training loop's Collector passes them.")
    tokens_NxT = jnp.asarray(tokens_NxT)
    n = rewards_N.shape[0]
    if tokens_NxT.ndim != 2 or tokens_NxT.shape[0] != n or jnp.shape(
        completion_mask_NxT) != tokens_NxT.shape:
      raise ValueError(
          f"{fn}: tokens_NxT and completion_mask_NxT must both have shape "
          f"({n}, T); got {tokens_NxT.shape} and "
          f"{jnp.shape(completion_mask_NxT)}.")
    g, t = x.shape[1], tokens_NxT.shape[1]
    z = jnp.where(_is_constant(x, valid), 0.0,
                  (x - _mean(x, valid)) / (_std(x, valid, 1) + eps))
    z = jnp.where(_count(valid) > 1, z, 0.0)
    tok = tokens_NxT.reshape(-1, g, t)
    tok_valid = (jnp.asarray(completion_mask_NxT, bool).reshape(-1, g, t)
                 & valid[..., None])
    correct = valid & (x > 0)
    w = jax.vmap(lambda tk, tv, cr: _group_token_weights(
        tk, tv, cr, alpha, beta, use_tf, scale))(tok, tok_valid, correct)
    adv = jnp.where(tok_valid, z[..., None] + w, 0.0)
    return adv.reshape(n, t).astype(rewards_N.dtype), state

  return _stateless(update_fn)
