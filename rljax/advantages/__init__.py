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
  by every statistic and their advantage is exactly 0. Rows tagged with group
  ids instead (groups of unequal size in a flat batch): wrap the chain in
  `by_group_ids(chain, num_groups, max_group_size)` (`grouping.py`).
* `lengths_N` (`[N]`, completion lengths in tokens): read by the
  length-aware transforms (OPO's baseline, token-level whitening, DAPO's
  overlong penalty, VCPO's baseline); `seq_log_ratio_N` (`[N]`,
  `log pi_old(y) / mu(y)` of each completion): read by VCPO's baseline;
  `tokens_NxT` and `completion_mask_NxT` (the completions): read by KTAE,
  whose advantages are per token (`[N, T]`), and by the token-level
  estimators below.
* `tree_nodes_NxD` (optional int `[N, D]`, a tree rollout's
  `Rollout.tree_nodes`): each row's ancestors, read by TreePO's
  `center_by_subtrees`.
* `token_rewards_NxT` (optional float `[N, T]`, verl's
  `token_level_rewards`): per-token rewards. `whiten_by_tokens` (verl's
  REINFORCE++) and `center_by_greedy_baseline` (ReMax) then compute their
  returns from it instead of the row reward.

Token-level estimators. `whiten_by_tokens`, `reinforce_pp_token` and
`center_by_greedy_baseline` take a discount `gamma`: with `gamma` None (the
default) or 1 (a Python number) and no `token_rewards_NxT` their advantages
are `[N]`, as before; otherwise they are per token, `[N, T]`, computed from the
returns `G_t = r_t + gamma * G_t'` of verl's REINFORCE++ (the row reward on
the last completion token), and need `completion_mask_NxT`.

Several reward functions give rewards `[N, R]`; `sum_rewards` (weighted
sum) or `normalize_each_reward` (GDPO) turn them into one value per sample
at the head of a chain. Unknown extra arguments are accepted and ignored.

All statistics are computed in float32 and the advantages are returned in
the rewards' dtype. Every transform is O(N log N) or better (sorting within
groups), jit-able and vmap-able. With every baseline transform and preset, a
group whose valid rewards are all equal, or that has fewer valid samples
than the statistic needs, gets advantage exactly 0, never NaN (one
exception: ReMax with `gamma < 1`, see `center_by_greedy_baseline`); the
scale-only transforms (`scale_by_*`) expect centred inputs. Advantages carry no
gradient (they are computed from rewards only).
"""

from __future__ import annotations

from rljax.advantages.baselines import (
    center_by_batch_mean, center_by_greedy_baseline, center_by_group_mean,
    center_by_group_median, clip_advantages, group_median_pivot_mask,
    leave_one_out, scale_by_batch_std, scale_by_group_mad, scale_by_group_std,
    scale_by_informative_fraction)
from rljax.advantages.length_aware import (
    center_by_length_weighted_group_mean, overlong_penalty, whiten_by_tokens)
from rljax.advantages.gae import (gae_advantages, terminal_rewards,
                                  whiten_advantages)
from rljax.advantages.grouping import by_group_ids, group_slots
from rljax.advantages.key_tokens import ktae_advantages
from rljax.advantages.metrics import advantage_metrics
from rljax.advantages.min_variance import center_by_min_variance_baseline
from rljax.advantages.multi_reward import normalize_each_reward, sum_rewards
from rljax.advantages.order_statistics import (
    best_of_k_rank_weights, cvar_rank_weights, median_rank_weights,
    rank_weights, trimmed_mean_rank_weights)
from rljax.advantages.pass_at_k import grpo_passk, pass_at_k_advantages
from rljax.advantages.presets import (
    dr_grpo, gdpo, gpg, grpo, grpo_batch_std, mc_grpo, opo, reinforce_pp_baseline,
    reinforce_pp_token, rloo, vcpo)
from rljax.advantages.tree import center_by_subtrees, treepo

__all__ = [
    "advantage_metrics",
    "best_of_k_rank_weights",
    "by_group_ids",
    "center_by_batch_mean",
    "center_by_greedy_baseline",
    "center_by_group_mean",
    "center_by_group_median",
    "center_by_length_weighted_group_mean",
    "center_by_min_variance_baseline",
    "center_by_subtrees",
    "clip_advantages",
    "cvar_rank_weights",
    "dr_grpo",
    "gae_advantages",
    "gdpo",
    "gpg",
    "group_median_pivot_mask",
    "grpo",
    "grpo_batch_std",
    "group_slots",
    "grpo_passk",
    "ktae_advantages",
    "leave_one_out",
    "mc_grpo",
    "median_rank_weights",
    "normalize_each_reward",
    "opo",
    "overlong_penalty",
    "pass_at_k_advantages",
    "rank_weights",
    "reinforce_pp_baseline",
    "reinforce_pp_token",
    "rloo",
    "scale_by_batch_std",
    "scale_by_group_mad",
    "scale_by_group_std",
    "scale_by_informative_fraction",
    "sum_rewards",
    "terminal_rewards",
    "treepo",
    "trimmed_mean_rank_weights",
    "vcpo",
    "whiten_advantages",
    "whiten_by_tokens",
]
