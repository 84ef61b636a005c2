"""Pass@k advantages: Pass@k Training's analytical group advantages (binary
rewards) and verl's `grpo_passk` (only each group's best sample)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_nonneg, _count, _grouped, _out, _stateless, _std)


def _ratio_of_binomials(top, bottom, k):
  """`C(top, k) / C(bottom, k)` as `prod_{i<k} (top - i) / (bottom - i)`.

  `top <= bottom`; a factor with `top - i <= 0` makes the product 0 (as
  `C(top, k) = 0` for `top < k`), and `k = 0` gives 1.
  """
  out = jnp.ones_like(top)
  for i in range(k):
    out = out * jnp.maximum(top - i, 0.0) / jnp.maximum(bottom - i, 1.0)
  return out


def pass_at_k_advantages(k: int, threshold: float = 1.0,
                         eps: float = 1e-6) -> _Tx:
  """Pass@k Training: the advantage of a sample for the pass@k reward.

  The group's `n` valid samples, `c` of them correct (reward `>= threshold`),
  define the pass@k reward of a random `k`-subset. Its mean and std over all
  `k`-subsets, and the mean advantage of the subsets that contain a given
  sample, are (Pass@k Training, Eqs. 12-15):

      R = 1 - C(n - c, k) / C(n, k),      sigma = sqrt(R (1 - R))
      A_pos = (1 - R) / (sigma + eps)
      A_neg = (1 - R - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps)

  A correct sample gets `A_pos`, an incorrect one `A_neg`. With `k = 1` this
  is GRPO with the population std. A group that is all correct or all wrong
  gets exactly 0, as does a group with fewer than `k` valid samples.
  `eps` is the authors' 1e-6. Binary rewards are assumed: the authors map
  reward 1 to `A_pos` and 0 to `A_neg`; here the threshold decides.

  Args:
    k: the `k` of pass@k, a static int in `[1, group_size]`.
    threshold: a reward `>= threshold` counts as correct.
    eps: added to `sigma`.

  References:
    Chen et al., "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation of Large Reasoning Models", https://arxiv.org/abs/2508.10751;
    code https://github.com/RUCAIBox/Passk_Training (`code/passk_adv.py`).
  """
  fn = "pass_at_k_advantages"
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"{fn}: k={k!r} must be a positive integer.")

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    if k > x.shape[1]:
      raise ValueError(f"{fn}: k={k} must be at most group_size="
                       f"{x.shape[1]}.")
    correct = valid & (x >= threshold)
    n = _count(valid)
    c = _count(correct)
    mean = 1.0 - _ratio_of_binomials(n - c, n, k)
    sigma = jnp.sqrt(jnp.maximum(mean * (1.0 - mean), 0.0))
    a_pos = (1.0 - mean) / (sigma + eps)
    a_neg = (1.0 - mean - _ratio_of_binomials(n - c - 1.0, n - 1.0, k - 1)
             ) / (sigma + eps)
    informative = (n >= k) & (c > 0) & (c < n)
    adv = jnp.where(informative, jnp.where(correct, a_pos, a_neg), 0.0)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def grpo_passk(eps: float = 1e-6, norm_by_std: bool = True) -> _Tx:
  """verl's `grpo_passk`: only each group's best sample gets an advantage.

      A_best = (r_max - r_second) / (std_g r + eps)     (norm_by_std)
      A_best = r_max - r_second                          (otherwise)

  and every other sample gets 0. `r_max` and `r_second` are the two largest
  valid rewards of the group counted with multiplicity (`torch.topk(r, 2)`),
  so when two samples share the maximum the difference, hence every
  advantage of the group, is 0; which of the tied samples verl's `topk`
  picks then does not matter (here: the first). The std is Bessel-corrected
  over the group's valid rewards (`torch.std`) and `eps` is added outside
  the root (verl's `epsilon=1e-6`). `r_max - r_second` is how much the
  group's maximum reward would drop without its best sample: the credit of
  each sample for the group's best-of-`G` reward.

  verl raises for a group with fewer than 2 samples; here `group_size` must
  be at least 2, and a group with fewer than 2 valid samples (under
  `mask_N`) gets 0. Padding rows (outside `mask_N`) are ignored and get 0.

  Args:
    eps: added to the group std (verl: 1e-6).
    norm_by_std: divide by the group std (verl's
      `algorithm.norm_adv_by_std_in_grpo`, default True).

  References:
    Walder and Karkhanis, "Pass@K Policy Optimization: Solving Harder
    Reinforcement Learning Problems", https://arxiv.org/abs/2505.15201
    (verl's docstring cites arXiv 2503.19595); verl v0.9.0
    `trainer/ppo/core_algos.py`, `compute_grpo_passk_outcome_advantage`.
  """
  fn = "grpo_passk"
  _check_nonneg(fn, "eps", eps)

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    g = x.shape[1]
    if g < 2:
      raise ValueError(f"{fn}: group_size={g} must be at least 2 (verl's "
                       "Pass@k requires at least 2 samples per group).")
    scores = jnp.where(valid, x, -jnp.inf)
    top, top_idx = jax.lax.top_k(scores, 2)
    enough = _count(valid) >= 2
    gap = jnp.where(enough, top[:, :1] - top[:, 1:], 0.0)
    if norm_by_std:  # gap > 0 implies std > 0: eps = 0 gives no NaN.
      std = _std(x, valid, 1)
      gap = jnp.where(gap > 0, gap / jnp.where(gap > 0, std + eps, 1.0), 0.0)
    best = jnp.arange(g)[None, :] == top_idx[:, :1]
    adv = jnp.where(best, gap, 0.0)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)
