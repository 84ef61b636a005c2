"""Reward -> advantage transforms in the optax protocol.

Each transform is an `optax.GradientTransformationExtraArgs` whose "updates"
are per-sample values: rewards go in, advantages come out, and transforms
compose with `optax.chain`:

    tx = optax.chain(center_by_group_mean(), scale_by_group_std())  # = grpo()
    state = tx.init(rewards_N)
    advantages_N, state = tx.update(rewards_N, state, group_size=8, mask_N=m)

Layout. `rewards_N` holds `N = num_groups * group_size` samples laid out
group-contiguous: samples `[g * G, (g + 1) * G)` are the `G` completions of
prompt `g`. Extra arguments are keyword-only:

* `group_size` (static Python `int`, required by the group transforms). Under
  `jax.jit` close over it (`functools.partial(tx.update, group_size=G)`) or
  pass it as a static argument; a traced value is rejected.
* `mask_N` (optional bool `[N]`): valid samples. Padding samples (a group with
  fewer than `G` completions, a dropped prompt) are `False`: they are ignored
  by every statistic and their advantage is exactly 0.

Several reward functions give rewards `[N, R]`; `sum_rewards` (weighted
sum) or `normalize_each_reward` (GDPO) turn them into one value per sample
at the head of a chain. Unknown extra arguments are accepted and ignored.

All statistics are computed in float32 and the advantages are returned in
the rewards' dtype. Every transform is O(N log N) or better (sorting within
groups), jit-able and vmap-able. With every baseline transform and preset, a
group whose valid rewards are all equal, or that has fewer valid samples
than the statistic needs, gets advantage exactly 0 (never NaN); the scale-only
transforms (`scale_by_*`) expect centred inputs. Advantages carry no
gradient (they are computed from rewards only).
"""

from __future__ import annotations

from rljax.advantages.baselines import (
    center_by_batch_mean, center_by_group_mean, center_by_group_median,
    clip_advantages, group_median_pivot_mask, leave_one_out,
    scale_by_batch_std, scale_by_group_mad, scale_by_group_std)
from rljax.advantages.metrics import advantage_metrics
from rljax.advantages.multi_reward import normalize_each_reward, sum_rewards
from rljax.advantages.order_statistics import (
    best_of_k_rank_weights, cvar_rank_weights, median_rank_weights,
    rank_weights, trimmed_mean_rank_weights)
from rljax.advantages.presets import (
    dr_grpo, gdpo, grpo, mc_grpo, reinforce_pp_baseline, rloo)

__all__ = [
    "advantage_metrics",
    "best_of_k_rank_weights",
    "center_by_batch_mean",
    "center_by_group_mean",
    "center_by_group_median",
    "clip_advantages",
    "cvar_rank_weights",
    "dr_grpo",
    "gdpo",
    "group_median_pivot_mask",
    "grpo",
    "leave_one_out",
    "mc_grpo",
    "median_rank_weights",
    "normalize_each_reward",
    "rank_weights",
    "reinforce_pp_baseline",
    "rloo",
    "scale_by_batch_std",
    "scale_by_group_mad",
    "scale_by_group_std",
    "sum_rewards",
    "trimmed_mean_rank_weights",
]
