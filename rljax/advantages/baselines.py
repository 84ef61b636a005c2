"""Baselines and scalings of one reward per sample: group and batch mean/std,
leave-one-out, group median/MAD (MC-GRPO), GPG's informative-fraction
scaling, and clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.advantages._common import (
    _Tx, _check_gamma, _check_nonneg, _check_rewards, _check_singleton, _count,
    _discounted_returns, _grouped, _is_constant, _is_one, _lower_median, _mean,
    _out, _stateless, _std, _token_mask, _token_rewards, _valid)


def center_by_group_mean(singleton: str = "zero") -> _Tx:
  """Subtracts each group's mean reward: `A_i = r_i - mean_{j in g(i)} r_j`.

  The baseline of GRPO and (without any std scaling) Dr.GRPO. The mean is over
  the valid samples of the group; a group whose valid rewards are all equal
  gets exactly 0.

  Args:
    singleton: a group with exactly one valid sample gets `"zero"` (its own
      mean: advantage 0, as TRL's `nanmean`) or `"raw"` (baseline 0, the
      advantage is the reward itself, as verl's `compute_grpo_outcome_advantage`
      which sets `id2mean = 0` for a group of one).

  References:
    Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
    in Open Language Models", https://arxiv.org/abs/2402.03300.
  """
  fn = "center_by_group_mean"
  _check_singleton(fn, singleton)

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    adv = jnp.where(_is_constant(x, valid), 0.0, x - _mean(x, valid))
    if singleton == "raw":
      adv = jnp.where(_count(valid) == 1, x, adv)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def scale_by_group_std(eps: float = 1e-6, ddof: int = 1,
                       singleton: str = "zero") -> _Tx:
  """Divides by each group's std: `A_i = u_i / (std_{j in g(i)} u_j + eps)`.

  Use after a centering transform (GRPO: `center_by_group_mean`). The std has
  `ddof` (1: Bessel-corrected, as TRL and verl compute it) and is 0 for a
  group with at most `ddof` valid samples, so an already-centred zero-variance
  group or group of one stays exactly 0.

  Args:
    eps: added to the std. TRL uses 1e-4, verl 1e-6.
    ddof: delta degrees of freedom of the std.
    singleton: the std of a group with exactly one valid sample: `"zero"`
      (as above) or `"raw"` (1, as verl's `id2std = 1` for a group of one;
      with `center_by_group_mean(singleton="raw")` the lone sample's advantage
      is `r / (1 + eps)`, verl's number).

  References:
    Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
    in Open Language Models", https://arxiv.org/abs/2402.03300.
  """
  fn = "scale_by_group_std"
  _check_nonneg(fn, "eps", eps)
  _check_singleton(fn, singleton)

  def update_fn(updates_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, updates_N, group_size, mask_N)
    std = _std(x, valid, ddof)
    if singleton == "raw":
      std = jnp.where(_count(valid) == 1, 1.0, std)
    return _out(x / (std + eps), valid, updates_N), state

  return _stateless(update_fn)


def center_by_batch_mean() -> _Tx:
  """Subtracts the mean over all valid samples: `A_i = u_i - mean_j u_j`.

  Used for REINFORCE++'s global normalisation and GDPO's batch step. If the
  whole batch is constant the result is exactly 0. Under `jit` with a sharded
  input the mean is over the global batch.

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  fn = "center_by_batch_mean"

  def update_fn(updates_N, state, params=None, *, mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, updates_N, 1)
    x = updates_N.astype(jnp.float32)
    valid = _valid(fn, mask_N, x.shape[0])
    adv = jnp.where(_is_constant(x, valid), 0.0, x - _mean(x, valid))
    return _out(adv, valid, updates_N), state

  return _stateless(update_fn)


def scale_by_batch_std(eps: float = 1e-6, ddof: int = 1) -> _Tx:
  """Divides by the std over all valid samples: `A_i = u_i / (std_j u_j + eps)`.

  Args:
    eps: added to the std.
    ddof: delta degrees of freedom of the std.

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  fn = "scale_by_batch_std"
  _check_nonneg(fn, "eps", eps)

  def update_fn(updates_N, state, params=None, *, mask_N=None, **extra_args):
    del params, extra_args
    _check_rewards(fn, updates_N, 1)
    x = updates_N.astype(jnp.float32)
    valid = _valid(fn, mask_N, x.shape[0])
    return _out(x / (_std(x, valid, ddof) + eps), valid, updates_N), state

  return _stateless(update_fn)


def leave_one_out(singleton: str = "zero") -> _Tx:
  """RLOO baseline: `A_i = r_i - mean_{j in g(i), j != i} r_j`.

  Over the valid samples of the group; a group with fewer than two valid
  samples, or with all rewards equal, gets exactly 0.

  Args:
    singleton: a group with exactly one valid sample gets `"zero"` (as above)
      or `"raw"` (the reward itself, as verl's `compute_rloo_outcome_advantage`
      leaves the score of a group of one unchanged).

  References:
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs",
    https://arxiv.org/abs/2402.14740; Kool et al., "Buy 4 REINFORCE Samples,
    Get a Baseline for Free!" (ICLR 2019 DeepRLStructPred workshop).
  """
  fn = "leave_one_out"
  _check_singleton(fn, singleton)

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    n = _count(valid)
    total = jnp.sum(jnp.where(valid, x, 0.0), -1, keepdims=True)
    baseline = (total - x) / jnp.maximum(n - 1.0, 1.0)
    keep = (n > 1) & ~_is_constant(x, valid)
    adv = jnp.where(keep, x - baseline, 0.0)
    if singleton == "raw":
      adv = jnp.where(n == 1, x, adv)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def center_by_group_median() -> _Tx:
  """MC-GRPO baseline: `A_i = r_i - median_{j in g(i)} r_j` (lower median).

  MC-GRPO samples `G + 1` completions per prompt so that the group has an odd
  size; the median ("pivot") sample then has advantage exactly 0 and is
  excluded from the gradient. Its advantage is 0 here for any group size (for
  an even number of valid samples the lower median, as `torch.median`, is
  used). To also drop the pivot from the loss normalisers and the KL term, as
  the paper does, AND `group_median_pivot_mask(...)` into the loss mask. The
  authors' scaling by the median absolute deviation is `scale_by_group_mad`;
  `mc_grpo()` chains both.

  References:
    Kim, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning", https://arxiv.org/abs/2601.22582.
  """
  fn = "center_by_group_median"

  def update_fn(rewards_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    return _out(x - _lower_median(x, valid), valid, rewards_N), state

  return _stateless(update_fn)


def scale_by_group_mad(eps: float = 1e-3) -> _Tx:
  """Divides by the group's median absolute deviation: `u_i / (MAD + eps)`.

  `MAD = median_j |u_j - median_k u_k|` over the valid samples (lower medians,
  as MC-GRPO's `torch.median`). MC-GRPO uses `eps=1e-3`; when more than half
  of a group shares one reward, MAD is 0 and the advantages are scaled by
  `1 / eps`, as in the authors' code.

  References:
    Kim, "MC-GRPO: Median-Centered Group Relative Policy Optimization for
    Small-Rollout Reinforcement Learning", https://arxiv.org/abs/2601.22582.
  """
  fn = "scale_by_group_mad"
  _check_nonneg(fn, "eps", eps)

  def update_fn(updates_N, state, params=None, *, group_size=None, mask_N=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, updates_N, group_size, mask_N)
    mad = _lower_median(jnp.abs(x - _lower_median(x, valid)), valid)
    return _out(x / (mad + eps), valid, updates_N), state

  return _stateless(update_fn)


def group_median_pivot_mask(rewards_N: jax.Array, *, group_size: int,
                            mask_N: jax.Array | None = None) -> jax.Array:
  """Bool `[N]`: valid samples that are not their group's median pivot.

  The pivot of a group is the valid sample at the lower-median position of a
  stable sort of the group's valid rewards (ties broken by position), i.e.
  exactly one sample per non-empty group. MC-GRPO drops it from the batch.

  Args:
    rewards_N: rewards, group-contiguous.
    group_size: samples per group (static int).
    mask_N: optional bool validity mask.

  Returns:
    keep_N: `mask_N` with each group's pivot set to False.
  """
  fn = "group_median_pivot_mask"
  x, valid = _grouped(fn, rewards_N, group_size, mask_N)
  order = jnp.argsort(jnp.where(valid, x, jnp.inf), axis=-1, stable=True)
  n = jnp.sum(valid, -1, keepdims=True)
  pivot = jnp.take_along_axis(order, jnp.maximum((n - 1) // 2, 0), axis=-1)
  is_pivot = (jnp.arange(x.shape[1])[None, :] == pivot) & (n > 0)
  return (valid & ~is_pivot).reshape(-1)


def scale_by_informative_fraction() -> _Tx:
  """GPG's correction: `A_i = u_i * alpha`, `alpha = N_valid / N_informative`.

  A group whose valid rewards are all equal gives no gradient under a group
  baseline, yet its samples still count in the loss's normaliser, which
  shrinks the step. GPG multiplies the advantages by the inverse of the
  fraction of valid samples that lie in an informative group (one whose
  valid rewards are not all equal), `alpha = B / (B - M)` in the paper's
  notation. `gpg()` chains it after `center_by_group_mean()` (GPG uses no
  std scaling). With no informative group, `alpha = 1` (all advantages are 0
  anyway). The authors' trainer divides the loss by
  `inverse_alpha = min(1, n_valid_samples / num_samples) + 1e-5`; the 1e-5
  (a relative change below 1e-5) is not reproduced. verl's `gpg` estimator
  counts non-zero rewards instead (`alpha = bsz / count_nonzero(scores)`),
  which differs unless exactly the informative samples have non-zero reward.

  References:
    Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning", https://arxiv.org/abs/2504.02546; code
    https://github.com/AMAP-ML/GPG (`open_r1/trainer/grpo_trainer.py`,
    `inverse_alpha`).
  """
  fn = "scale_by_informative_fraction"

  def update_fn(updates_N, state, params=None, *, group_size=None,
                mask_N=None, **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, updates_N, group_size, mask_N)
    informative = valid & ~_is_constant(x, valid)
    n_valid = jnp.sum(valid, dtype=jnp.float32)
    n_inf = jnp.sum(informative, dtype=jnp.float32)
    alpha = jnp.where(n_inf > 0, n_valid / jnp.maximum(n_inf, 1.0), 1.0)
    return _out(x * alpha, valid, updates_N), state

  return _stateless(update_fn)


def center_by_greedy_baseline(gamma: float | None = None) -> _Tx:
  """ReMax: `A_i = r_i - r_greedy(g(i))`, the last sample of each group being
  the prompt's greedy (argmax) completion.

  Each group holds `group_size = G + 1` samples: `G` sampled completions and,
  last, the greedy one (`SamplingMethod(greedy_every=G + 1)` draws it in the
  same call). The greedy sample's own advantage is 0 and the training loop
  drops it (`Algorithm.greedy_baseline`). A group whose greedy sample has no
  reward (outside `mask_N`) gets advantage 0 (no baseline); a group whose
  valid rewards are all equal gets exactly 0. No std scaling, as verl's
  `compute_remax_outcome_advantage` (returns minus `reward_baselines`).

  Per token. With `gamma` None (the default) or 1 (a Python number) and no
  `token_rewards_NxT` the output is `[N]`, as above. Otherwise it is
  `[N, T]` (and needs `completion_mask_NxT`): verl's formula

      A_t = G_t - b        on every completion token (0 elsewhere)

  with `G_t` the returns of verl's REINFORCE++ (`r_t + gamma * G_t'`, from
  the row reward on its last completion token, or from `token_rewards_NxT`
  when given) and `b` the greedy row's reward (with `token_rewards_NxT`: the
  sum of its masked token rewards, as verl's `rm_scores.sum(-1)`). verl
  v0.9's ReMax has no discount (its returns are an undiscounted reverse
  cumsum, i.e. `gamma = 1`, where the `[N, T]` values equal the `[N]` ones
  on every completion token); `gamma < 1` discounts the returns exactly as
  verl's REINFORCE++ does and subtracts the undiscounted greedy reward as
  verl's ReMax does. The baseline depends on the prompt only, so the
  estimator stays unbiased, but a sample whose reward equals the greedy one
  then gets `(gamma^(L-1-t) - 1) b` on its earlier tokens, not 0.

  Args:
    gamma: discount in `[0, 1]` of the returns; None is 1.

  References:
    Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models",
    https://arxiv.org/abs/2310.10505; verl v0.9.0 `trainer/ppo/core_algos.py`,
    `compute_remax_outcome_advantage` and
    `compute_reinforce_plus_plus_outcome_advantage` (the discounted returns).
  """
  fn = "center_by_greedy_baseline"
  _check_gamma(fn, gamma)

  def update_fn(rewards_N, state, params=None, *, group_size=None,
                mask_N=None, completion_mask_NxT=None, token_rewards_NxT=None,
                **extra_args):
    del params, extra_args
    x, valid = _grouped(fn, rewards_N, group_size, mask_N)
    k, g = x.shape
    if g < 2:
      raise ValueError(f"{fn}: group_size={g} must be at least 2 "
                       "(samples, then the greedy baseline sample).")
    baseline_ok = valid[:, -1:]
    if token_rewards_NxT is not None or not _is_one(gamma):
      mask = _token_mask(fn, completion_mask_NxT, valid.reshape(-1),
                         "gamma != 1 or token_rewards_NxT")
      rewards = _token_rewards(fn, rewards_N, mask, token_rewards_NxT)
      returns = _discounted_returns(rewards, mask, gamma).reshape(k, g, -1)
      if token_rewards_NxT is None:
        baseline = x[:, -1:]
      else:
        baseline = jnp.sum(rewards.reshape(k, g, -1)[:, -1], -1,
                           keepdims=True)
      keep = (mask.reshape(k, g, -1) & baseline_ok[..., None]
              & (jnp.arange(g) < g - 1)[None, :, None])
      adv = jnp.where(keep, returns - baseline[..., None], 0.0)
      return adv.reshape(rewards_N.shape[0], -1).astype(rewards_N.dtype), state
    adv = jnp.where(baseline_ok & ~_is_constant(x, valid), x - x[:, -1:], 0.0)
    adv = adv.at[:, -1].set(0.0)
    return _out(adv, valid, rewards_N), state

  return _stateless(update_fn)


def clip_advantages(max_abs: float) -> _Tx:
  """Clips each advantage to `[-max_abs, max_abs]`; padding stays 0."""
  _check_nonneg("clip_advantages", "max_abs", max_abs)

  def update_fn(updates_N, state, params=None, **extra_args):
    del params, extra_args
    return jnp.clip(updates_N, -max_abs, max_abs).astype(updates_N.dtype), state

  return _stateless(update_fn)
