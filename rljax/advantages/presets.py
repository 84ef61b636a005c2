"""Named advantage chains of the published algorithms."""

from __future__ import annotations

from typing import Any

import optax

from rljax.advantages._common import _Tx
from rljax.advantages.baselines import (
    center_by_group_mean, center_by_group_median, leave_one_out,
    scale_by_batch_std, scale_by_group_mad, scale_by_group_std)
from rljax.advantages.multi_reward import normalize_each_reward


def grpo(eps: float = 1e-6) -> _Tx:
  """GRPO: `(r - mean_g r) / (std_g r + eps)` (Bessel-corrected std).

  References:
    Shao et al., "DeepSeekMath", https://arxiv.org/abs/2402.03300.
  """
  return optax.chain(center_by_group_mean(), scale_by_group_std(eps=eps))


def dr_grpo() -> _Tx:
  """Dr.GRPO: `r - mean_g r`, no std scaling (pair it with the
  `sequence_mean_token_sum_norm` loss aggregation).

  References:
    Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective", https://arxiv.org/abs/2503.20783.
  """
  return optax.chain(center_by_group_mean())


def rloo() -> _Tx:
  """RLOO: `r_i - mean_{j != i} r_j` within the group.

  References:
    Ahmadian et al., https://arxiv.org/abs/2402.14740.
  """
  return optax.chain(leave_one_out())


def reinforce_pp_baseline(eps: float = 1e-6) -> _Tx:
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
  return optax.chain(center_by_group_mean(), scale_by_batch_std(eps=eps))


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
