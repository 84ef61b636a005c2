"""Named advantage chains of the published algorithms."""

from __future__ import annotations

from typing import Any

import optax

from rljax.advantages._common import _Tx
from rljax.advantages.baselines import (
    center_by_group_mean, center_by_group_median, leave_one_out,
    scale_by_batch_std, scale_by_group_mad, scale_by_group_std,
    scale_by_informative_fraction)
from rljax.advantages.length_aware import (
    _token_whitening, center_by_length_weighted_group_mean)
from rljax.advantages.min_variance import center_by_min_variance_baseline
from rljax.advantages.multi_reward import normalize_each_reward


def grpo(eps: float = 1e-6, singleton: str = "zero") -> _Tx:
  """GRPO: `(r - mean_g r) / (std_g r + eps)` (Bessel-corrected std).

  `eps=1e-6` is verl's; TRL adds 1e-4. `singleton="raw"` gives a group with
  one valid sample verl's `r / (1 + eps)` instead of 0.

  References:
    Shao et al., "DeepSeekMath", https://arxiv.org/abs/2402.03300.
  """
  return optax.chain(center_by_group_mean(singleton),
                     scale_by_group_std(eps=eps, singleton=singleton))


def grpo_batch_std(eps: float = 1e-4) -> _Tx:
  """TRL's `scale_rewards="batch"`: `(r - mean_g r) / (std_batch r + eps)`.

  The std is Bessel-corrected, over every valid reward of the batch (TRL's
  `nanstd(rewards)` of the raw rewards, not of the centred ones as in
  `reinforce_pp_baseline`), and `eps=1e-4` is TRL's. Since
  `(r - m) / (s + eps) = r / (s + eps) - m / (s + eps)`, it is the batch
  scaling followed by the group centring.

  References:
    Liu et al., "Part I: Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning" (Lite PPO), https://arxiv.org/abs/2508.08221; TRL
    `trainer/grpo_trainer.py`, `_generate_and_score_completions`.
  """
  return optax.chain(scale_by_batch_std(eps=eps), center_by_group_mean())


def gpg() -> _Tx:
  """GPG: `alpha * (r - mean_g r)`, `alpha = N_valid / N_informative`.

  No std scaling; `alpha` undoes the dilution of the loss normaliser by
  zero-variance groups (`scale_by_informative_fraction`). Pair it with the
  `reinforce` objective (GPG has no ratio clip and no KL).

  References:
    Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning", https://arxiv.org/abs/2504.02546.
  """
  return optax.chain(center_by_group_mean(), scale_by_informative_fraction())


def opo() -> _Tx:
  """OPO: `r - sum_g L r / sum_g L` (length-weighted group baseline).

  References:
    Hao et al., "On-Policy RL with Optimal Reward Baseline",
    https://arxiv.org/abs/2505.23585.
  """
  return optax.chain(center_by_length_weighted_group_mean())


def reinforce_pp_token(eps: float = 1e-8, singleton: str = "zero",
                       gamma: float | None = None) -> _Tx:
  """verl's `reinforce_plus_plus_baseline`: group mean subtracted, then
  whitened over all valid tokens of the batch (`whiten_by_tokens`).

  verl subtracts the group mean of the sequence rewards
  (`token_level_rewards.sum(-1)`), gives every completion token that value
  and applies `masked_whiten` over the batch's completion tokens. Its groups
  of one keep their reward (`id2mean = 0`): `singleton="raw"`; `"zero"` (as
  TRL) gives them 0 before the whitening.

  verl's baseline estimator has no discount. With `gamma < 1` (rljax's
  extension) the group-centred reward `r_i - mean_g r` is placed on the
  last completion token and discounted as verl's `reinforce_plus_plus`
  discounts a reward (`whiten_by_tokens(gamma)`), so before the whitening
  token `t` of a row of `L` tokens holds `gamma^(L-1-t) (r_i - mean_g r)`;
  the output is then `[N, T]` and needs `completion_mask_NxT`. Per-token
  rewards (`token_rewards_NxT`) are not read: verl's estimator reads only
  their row sums, which the caller passes as the rewards.

  Args:
    eps: added to the token variance inside the square root (verl: 1e-8).
    singleton: what a group with one valid sample gets: `"zero"` or `"raw"`.
    gamma: discount in `[0, 1]`; None (the default) or 1 (a Python number)
      gives `[N]`, verl's estimator.

  References:
    Hu et al., "REINFORCE++", https://arxiv.org/abs/2501.03262; verl v0.9.0
    `trainer/ppo/core_algos.py`
    (`compute_reinforce_plus_plus_baseline_outcome_advantage`).
  """
  return optax.chain(
      center_by_group_mean(singleton),
      _token_whitening("reinforce_pp_token", eps, gamma, False))


def vcpo() -> _Tx:
  """VCPO's minimum-variance baseline with the released scripts' std scaling
  (`center_by_min_variance_baseline(norm_by_std=True)`).

  References:
    Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for
    LLMs", https://arxiv.org/abs/2602.17616.
  """
  return optax.chain(center_by_min_variance_baseline(norm_by_std=True))


def dr_grpo(singleton: str = "zero") -> _Tx:
  """Dr.GRPO: `r - mean_g r`, no std scaling (pair it with the
  `sequence_mean_token_sum_norm` loss aggregation).

  References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783.
  """
  return optax.chain(center_by_group_mean(singleton))


def rloo(singleton: str = "zero") -> _Tx:
  """RLOO: `r_i - mean_{j != i} r_j` within the group.

  References:
    Ahmadian et al., https://arxiv.org/abs/2402.14740.
  """
  return optax.chain(leave_one_out(singleton))


def reinforce_pp_baseline(eps: float = 1e-6, singleton: str = "zero") -> _Tx:
  """REINFORCE++ with baseline: group mean subtracted, then batch std scaling.

  The paper z-scores the group-centred rewards over the global batch. Their
  batch mean is exactly 0 in exact arithmetic, so the centring step is left
  out: it would only add rounding noise (~1e-8) to zero-variance groups,
  which stay exactly 0 here. Statistics are per sample over the valid samples
  (verl whitens over tokens instead, which weights long completions more).

  References:
    Hu et al., "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization", https://arxiv.org/abs/2501.03262.
  """
  return optax.chain(center_by_group_mean(singleton),
                     scale_by_batch_std(eps=eps))


def mc_grpo(eps: float = 1e-3) -> _Tx:
  """MC-GRPO: `(r - median_g r) / (MAD_g + eps)`; mask the pivot in the loss
  with `group_median_pivot_mask`.

  References:
    Kim, "MC-GRPO", https://arxiv.org/abs/2601.22582.
  """
  return optax.chain(center_by_group_median(), scale_by_group_mad(eps=eps))


def gdpo(reward_weights: Any = None, eps: float = 1e-4) -> _Tx:
  """GDPO: per-reward group z-scores, weighted sum, then batch std scaling.

  GDPO's batch step is a z-score; the weighted sum of group z-scores already
  has batch mean exactly 0 (each group's z-scores sum to 0), so the centring is
  left out for the same reason as in `reinforce_pp_baseline`.

  References:
    Liu et al., "GDPO", https://arxiv.org/abs/2601.05242.
  """
  return optax.chain(normalize_each_reward(reward_weights, eps=eps),
                     scale_by_batch_std(eps=eps))
