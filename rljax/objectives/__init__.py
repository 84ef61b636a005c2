"""Per-token policy-gradient coefficients, the policy loss, KL and aggregation.

Every policy-gradient objective of the GRPO family has the gradient

    grad loss = -(1 / normaliser) * sum_{b,t} mask * c_bt * A_bt * grad logp_bt

for a stop-gradient coefficient `c_BxT` computed from importance ratios. Here
`c` is produced by optax-protocol transforms whose "updates" start as the
importance ratio and are refined link by link, and the loss is one function:

    ratio_BxT = importance_ratio(logprobs_BxT, old_logprobs_BxT, mask_BxT)
    tx = optax.chain(ppo_clip(0.2, 0.28), truncated_is(cap=2.0))
    coef_BxT, tx_state = tx.update(
        ratio_BxT, tx_state, advantages_BxT=adv_B, mask_BxT=mask_BxT,
        old_logprobs_BxT=old_lp, sampler_logprobs_BxT=sampler_lp)
    loss = policy_gradient_loss(coef_BxT, adv_B, logprobs_BxT, mask_BxT,
                                "token_mean", num_tokens=global_tokens)

Order in a chain: `sequence_ratio` (if any) comes first, then one trust
region that reads its input as the ratio (`ppo_clip`, optionally followed by
`dual_clip`; or `cispo`, `ess_trust_region`, `sapo`, `gmpo`,
`prefix_ratio` (PNPO), `dppo`, `clip_cov`, `kl_cov`, `dcpo_clip`,
`band_clip`, `bapo_clip`, `sat_clip`, `vespo`, `dro`), then behaviour-policy
corrections that multiply by a weight computed from the extra arguments
(`truncated_is`, `masked_is`; not after `vespo`, whose weight includes
them). `off_policy_sequence_mask` (OPSM) wraps such a chain, since its
mask needs the ratio. `rejection_mask` acts on the loss mask
instead (a rejected token leaves the normaliser), and `kl_penalty` /
`kl_cov_penalty` / `dro_penalty` are extra per-token loss terms.

Extra arguments (keyword-only; unknown ones are ignored):
  advantages_BxT: `[B, T]`, or `[B]` for one advantage per sequence.
  mask_BxT: bool `[B, T]`, valid completion tokens (default: all valid).
  old_logprobs_BxT: `log pi_old` of the sampled tokens, the trainer's
    recomputation at rollout time (the base of the ratio).
  sampler_logprobs_BxT: `log mu`, the sampler's logprobs of the same tokens.
  ess: a precomputed normalised ESS for `ess_trust_region` (see there).

All transforms compute in float32, return the coefficient in the input's
dtype and stop its gradient. Gradients reach the parameters only through the
`logprobs_BxT` argument of the loss functions.
"""

from __future__ import annotations

from rljax.objectives._common import LEVELS
from rljax.objectives.adaptive_clips import (
    BAND_DIVERGENCES, band_clip, bapo_clip, dcpo_clip, sat_clip)
from rljax.objectives.corrections import (
    masked_is, off_policy_sequence_mask, truncated_is)
from rljax.objectives.covariance import (
    ClipCovState, clip_cov, kl_cov, kl_cov_penalty)
from rljax.objectives.divergence import DPPO_ANCHORS, DPPO_DIVERGENCES, dppo
from rljax.objectives.dro import dro, dro_penalty
from rljax.objectives.kl import (
    KL_ESTIMATORS, kl_abs, kl_k1, kl_k2, kl_k3, kl_k3_bias_corrected,
    kl_penalty, kl_straight_through)
from rljax.objectives.losses import (
    AGGREGATIONS, aggregate_loss, entropy_loss, ess_kl_penalty,
    policy_gradient_loss)
from rljax.objectives.metrics import (
    coefficient_metrics, kl_metrics, ratio_metrics)
from rljax.objectives.ratios import (
    EssStatistics, ess_from_statistics, ess_statistics, importance_ratio,
    normalized_ess, sequence_importance_weights)
from rljax.objectives.rejection import (
    REJECTION_STATISTICS, Rejection, parse_rejection, rejection_mask)
from rljax.objectives.soft_clips import (
    VESPO_IS_MODES, gmpo, prefix_ratio, sapo, vespo)
from rljax.objectives.trust_regions import (
    cispo, dual_clip, ess_trust_region, gspo, ppo_clip, reinforce,
    sequence_ratio)

__all__ = [
    "AGGREGATIONS",
    "BAND_DIVERGENCES",
    "ClipCovState",
    "DPPO_ANCHORS",
    "DPPO_DIVERGENCES",
    "EssStatistics",
    "KL_ESTIMATORS",
    "LEVELS",
    "REJECTION_STATISTICS",
    "Rejection",
    "VESPO_IS_MODES",
    "aggregate_loss",
    "band_clip",
    "bapo_clip",
    "cispo",
    "clip_cov",
    "coefficient_metrics",
    "dcpo_clip",
    "dppo",
    "dro",
    "dro_penalty",
    "dual_clip",
    "entropy_loss",
    "ess_from_statistics",
    "ess_kl_penalty",
    "ess_statistics",
    "ess_trust_region",
    "gmpo",
    "gspo",
    "importance_ratio",
    "kl_abs",
    "kl_cov",
    "kl_cov_penalty",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_bias_corrected",
    "kl_metrics",
    "kl_penalty",
    "kl_straight_through",
    "masked_is",
    "normalized_ess",
    "off_policy_sequence_mask",
    "parse_rejection",
    "policy_gradient_loss",
    "ppo_clip",
    "prefix_ratio",
    "ratio_metrics",
    "reinforce",
    "sat_clip",
    "rejection_mask",
    "sapo",
    "sequence_importance_weights",
    "sequence_ratio",
    "truncated_is",
    "vespo",
]
