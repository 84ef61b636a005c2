"""Pass@k Training's analytical group advantages (binary rewards)."""

from __future__ import annotations

import jax.numpy as jnp

from rljax.advantages._common import _Tx, _count, _grouped, _out, _stateless


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
