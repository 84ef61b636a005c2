"""The algorithm table: every name a config accepts, as one entry each.

An ``Entry`` holds a name's factory, the config fields it adds (with
defaults and ranges; ``schema.py`` merges them into ``FIELDS``), the fields
it reads, and its traits. ``algorithm.from_config`` builds from it,
``build.validate`` checks against it, the loop test trains every name in it
and the README's algorithm table is tested to list exactly its names.

Adding a method is one entry plus its transform and test, e.g.::

    "cispo": Entry(
        "CISPO: the clipped ratio as the coefficient of every token",
        lambda rl, ctx: [obj.cispo(rl["cispo_cap"])],
        fields={"cispo_cap": Field(5.0, ">0", "CISPO's absolute cap")}),

Axes (``AXES``): ``rl.advantage`` (presets, and links that ``"+"`` joins
after the reward head), ``rl.objective``, ``rl.is_correction``,
``rl.kl_estimator``, ``rl.aggregation`` and the statistics of
``rl.rejection``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import optax

from rljax import advantages as adv
from rljax import objectives as obj
from rljax.train._field import Field

_Tx = optax.GradientTransformationExtraArgs


class Context(NamedTuple):
  """What a factory needs besides the ``rl`` section.

  Attributes:
    group_size: samples per prompt the advantage chain sees (``G + 1``
      when an entry samples an extra row).
    max_new_tokens: the generation budget (``sampler.max_new_tokens``).
    seed: the run's seed (Clip-Cov's token draw).
  """

  group_size: int
  max_new_tokens: int | None = None
  seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
  """One name of one axis.

  Attributes:
    doc: one line for the README's table.
    build: ``(rl, ctx) -> [transform, ...]``: an advantage preset's whole
      chain, an advantage link's one transform, an objective's or an IS
      correction's coefficient links. None for names the step reads
      directly (aggregations, KL estimators, rejection statistics).
    fields: ``rl.*`` fields this entry adds (name without ``rl.`` ->
      ``Field``).
    reads: ``rl.*`` fields it reads besides its own (documentation and the
      README; e.g. ``clip_eps_low``).
    link: an advantage transform that ``"+"`` may join into a chain.
    needs_groups: divides by a per-group statistic (needs G >= 2, unless
      ``singleton_ok`` and ``rl.singleton_groups="raw"``).
    singleton_ok: honours ``rl.singleton_groups``.
    needs_critic: advantages come from a value model (``critic.*``).
    extra_samples: samples per prompt beyond ``rl.group_size``.
    drop_pivot: MC-GRPO's median pivot row is dropped after the advantages.
    greedy_baseline: the extra sample is greedy (ReMax) and dropped.
    ess_kl_coef: the default of ``rl.ess_kl_coef`` with this objective.
    step_settings: ``rl -> {RLStepConfig field: value}``: the step's own
      loss term of this objective (KL-Cov's and DRO's penalties).
    needs_seed: draws tokens at random (``Context.seed``).
    check: ``(rl, ctx, eval_num_samples) -> None``, raising ``ValueError``
      for settings a range cannot express.
    loop_fixups: settings it needs to mean anything in the 2-step loop test.
  """

  doc: str
  build: Callable[[Mapping[str, Any], Context], list[_Tx]] | None = None
  fields: Mapping[str, Field] = dataclasses.field(default_factory=dict)
  reads: tuple[str, ...] = ()
  link: bool = False
  needs_groups: bool = False
  singleton_ok: bool = False
  needs_critic: bool = False
  extra_samples: int = 0
  drop_pivot: bool = False
  greedy_baseline: bool = False
  ess_kl_coef: float = 0.0
  step_settings: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
  needs_seed: bool = False
  check: Callable[..., None] | None = None
  loop_fixups: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def check_choice(field: str, value: Any, accepted) -> None:
  """Raises ``ValueError`` naming the field, the value and what is accepted."""
  accepted = tuple(accepted)
  if value not in accepted:
    raise ValueError(f"{field}={value!r} is unknown; accepted: {accepted}.")


# ----------------------------------------------------------------------------
# Advantage estimators (rewards [N, R] -> advantages [N] or [N, T]).

RANK_PRESETS = ("median", "trimmed_mean", "cvar", "best_of_k")


def parse_rank_weights(spec: str, group_size: int) -> np.ndarray:
  """Rank weights from ``"<preset>:<k>[:<param>]"``.

  Presets: ``median:k``, ``trimmed_mean:k:trim``, ``cvar:k:alpha``,
  ``best_of_k:k`` (``advantages.*_rank_weights``); ``k <= group_size - 1``.
  """
  field = "rl.rank_weights"
  parts = str(spec).split(":")
  preset = parts[0]
  check_choice(field + " preset", preset, RANK_PRESETS)
  needs = 3 if preset in ("trimmed_mean", "cvar") else 2
  if len(parts) != needs:
    form = {"median": "median:k", "best_of_k": "best_of_k:k",
            "trimmed_mean": "trimmed_mean:k:trim", "cvar": "cvar:k:alpha"}
    raise ValueError(f"{field}={spec!r}: accepted form {form[preset]!r}, "
                     "e.g. 'median:3'.")
  try:
    k = int(parts[1])
  except ValueError as e:
    raise ValueError(f"{field}={spec!r}: k={parts[1]!r} must be an integer.") from e
  if not 1 <= k <= group_size - 1:
    raise ValueError(f"{field}={spec!r}: k={k} must be in [1, rl.group_size - 1 "
                     f"= {group_size - 1}].")
  try:
    if preset == "median":
      return adv.median_rank_weights(k)
    if preset == "best_of_k":
      return adv.best_of_k_rank_weights(k)
    if preset == "trimmed_mean":
      return adv.trimmed_mean_rank_weights(k, int(parts[2]))
    return adv.cvar_rank_weights(k, float(parts[2]))
  except ValueError as e:
    raise ValueError(f"{field}={spec!r}: {e}") from e


def overlong_buffer(rl: Mapping[str, Any], max_new_tokens: int) -> int:
  """DAPO's ``L_cache``: ``rl.overlong_buffer``, or a fifth of the budget
  (DAPO's 4096 of 20480) when it is None."""
  buffer = rl["overlong_buffer"]
  return int(max(1, max_new_tokens // 5) if buffer is None else buffer)


def _eps(rl, own: float) -> float:
  """``rl.std_eps``, or the chain's own epsilon when it is None."""
  return own if rl["std_eps"] is None else float(rl["std_eps"])


def _head(*links):
  """A preset: the weighted reward sum, then the links."""
  return lambda rl, ctx: [adv.sum_rewards()] + [f(rl, ctx) for f in links]


def _overlong(rl, ctx):
  if ctx.max_new_tokens is None:
    raise ValueError("rl.advantage link 'overlong_penalty' needs the "
                     "generation budget (sampler.max_new_tokens).")
  return adv.overlong_penalty(int(ctx.max_new_tokens),
                              overlong_buffer(rl, int(ctx.max_new_tokens)),
                              float(rl["overlong_penalty_factor"]))


def _check_overlong(rl, ctx, eval_num_samples):
  del eval_num_samples
  buffer = rl["overlong_buffer"]
  if buffer is not None and ctx.max_new_tokens and buffer > ctx.max_new_tokens:
    raise ValueError(
        f"rl.overlong_buffer={buffer} with rl.advantage={rl['advantage']!r}: "
        "the penalty ramp must fit in the generation budget; accepted: an "
        f"integer in [1, sampler.max_new_tokens={ctx.max_new_tokens}], or "
        "None (a fifth of it).")


def _check_pass_k(rl, ctx, eval_num_samples):
  del eval_num_samples
  if rl["pass_k"] > ctx.group_size:
    raise ValueError(f"rl.pass_k={rl['pass_k']} with rl.advantage="
                     f"'pass_at_k': k must be at most rl.group_size="
                     f"{ctx.group_size}.")


def _check_remax(rl, ctx, eval_num_samples):
  if eval_num_samples == ctx.group_size:  # G + 1, the training sampler's
    raise ValueError(
        f"eval.num_samples={eval_num_samples} with rl.advantage='remax': the "
        "training sampler of rl.group_size + 1 samples per prompt decodes "
        "its last row greedily (ReMax's baseline), and the evaluation "
        "sampler must not share that count; accepted: any other "
        "eval.num_samples.")


def _check_rank_weights(rl, ctx, eval_num_samples):
  del eval_num_samples
  parse_rank_weights(rl["rank_weights"], ctx.group_size)


def _rank_weights(rl, ctx):
  return adv.rank_weights(parse_rank_weights(rl["rank_weights"],
                                             ctx.group_size))


def _singleton(rl):
  return rl["singleton_groups"]


_GROUPS = dict(needs_groups=True)
_GAMMA = {"gamma": Field(1.0, "[0,1]", "discount of the token-level "
                         "returns (REINFORCE++, ReMax; < 1 gives per-token "
                         "advantages)")}

ADVANTAGES: dict[str, Entry] = {
    # Presets.
    "grpo": Entry("GRPO: group mean and std",
                  _head(lambda rl, c: adv.grpo(_eps(rl, 1e-6), _singleton(rl))),
                  reads=("std_eps", "singleton_groups"), singleton_ok=True,
                  **_GROUPS),
    "dr_grpo": Entry("Dr.GRPO: group mean, no std",
                     _head(lambda rl, c: adv.dr_grpo(_singleton(rl))),
                     reads=("singleton_groups",), singleton_ok=True, **_GROUPS),
    "rloo": Entry("RLOO: leave-one-out mean",
                  _head(lambda rl, c: adv.rloo(_singleton(rl))),
                  reads=("singleton_groups",), singleton_ok=True, **_GROUPS),
    "reinforce_pp": Entry(
        "REINFORCE++ with the group-mean baseline and batch std",
        _head(lambda rl, c: adv.reinforce_pp_baseline(_eps(rl, 1e-6),
                                                      _singleton(rl))),
        reads=("std_eps", "singleton_groups"), singleton_ok=True, **_GROUPS),
    "mc_grpo": Entry("MC-GRPO: samples G+1, centres by the median and drops "
                     "the median pivot", _head(lambda rl, c: adv.mc_grpo()),
                     extra_samples=1, drop_pivot=True, **_GROUPS),
    "gdpo": Entry("GDPO: each reward normalised in its group, then summed",
                  lambda rl, c: [adv.gdpo(eps=_eps(rl, 1e-4))],
                  reads=("std_eps",), **_GROUPS),
    "batch_std": Entry("batch mean and std (no groups)",
                       _head(lambda rl, c: adv.center_by_batch_mean(),
                             lambda rl, c: adv.scale_by_batch_std(
                                 _eps(rl, 1e-6))), reads=("std_eps",)),
    "grpo_batch_std": Entry("TRL's scale_rewards='batch': group mean, "
                            "batch std",
                            _head(lambda rl, c: adv.grpo_batch_std(
                                _eps(rl, 1e-4))),
                            reads=("std_eps",), **_GROUPS),
    "gpg": Entry("GPG: group mean, scaled by the informative fraction",
                 _head(lambda rl, c: adv.gpg()), **_GROUPS),
    "pass_at_k": Entry(
        "Pass@k Training: the pass@k of each group's k-subsets",
        _head(lambda rl, c: adv.pass_at_k_advantages(
            int(rl["pass_k"]), float(rl["pass_threshold"]))),
        fields={"pass_k": Field(2, "int>=1", "the k of pass@k (<= "
                                "rl.group_size)"),
                "pass_threshold": Field(1.0, ">=0", "a reward >= this is a "
                                        "pass")},
        check=_check_pass_k, loop_fixups={"rl.pass_threshold": 0.5},
        **_GROUPS),
    "opo": Entry("OPO: length-weighted group baseline",
                 _head(lambda rl, c: adv.opo()), **_GROUPS),
    "reinforce_pp_token": Entry(
        "verl's REINFORCE++ with the group-mean baseline: token-level "
        "whitening (rl.gamma: discounted returns)",
        _head(lambda rl, c: adv.reinforce_pp_token(
            singleton=_singleton(rl), gamma=float(rl["gamma"]))),
        fields=_GAMMA, reads=("singleton_groups",), singleton_ok=True,
        **_GROUPS),
    "grpo_passk": Entry(
        "verl's grpo_passk: only each group's best sample gets (r_max - "
        "r_second) / std",
        _head(lambda rl, c: adv.grpo_passk(_eps(rl, 1e-6),
                                           bool(rl["passk_norm_by_std"]))),
        fields={"passk_norm_by_std": Field(True, None, "grpo_passk: divide "
                                           "by the group std (verl's "
                                           "norm_adv_by_std_in_grpo)")},
        reads=("std_eps",), **_GROUPS),
    "vcpo": Entry("VCPO: minimum-variance baseline",
                  _head(lambda rl, c: adv.vcpo()), **_GROUPS),
    "ktae": Entry("KTAE: per-token advantages from key-token statistics",
                  _head(lambda rl, c: adv.ktae_advantages()), **_GROUPS),
    "remax": Entry("ReMax: a greedy completion per prompt is the baseline "
                   "(sampled in the same call, not trained on)",
                   _head(lambda rl, c: adv.center_by_greedy_baseline(
                       float(rl["gamma"]))), fields=_GAMMA,
                   extra_samples=1, greedy_baseline=True, check=_check_remax,
                   # A discount < 1 gives per-token advantages: trained too.
                   loop_fixups={"rl.gamma": 0.9}),
    "gae": Entry("PPO with a value model: token-level GAE from a critic "
                 "(critic.*)", _head(), needs_critic=True),
    # Links ("+" chains; each alone is the reward head and the link).
    "center_by_group_mean": Entry(
        "subtract the group mean", _head(lambda rl, c: adv.center_by_group_mean(
            _singleton(rl))), link=True, singleton_ok=True, **_GROUPS),
    "scale_by_group_std": Entry(
        "divide by the group std",
        _head(lambda rl, c: adv.scale_by_group_std(_eps(rl, 1e-6),
                                                   singleton=_singleton(rl))),
        link=True, singleton_ok=True, **_GROUPS),
    "center_by_batch_mean": Entry(
        "subtract the batch mean",
        _head(lambda rl, c: adv.center_by_batch_mean()), link=True),
    "scale_by_batch_std": Entry(
        "divide by the batch std",
        _head(lambda rl, c: adv.scale_by_batch_std() if rl["std_eps"] is None
              else adv.scale_by_batch_std(float(rl["std_eps"]))), link=True),
    "leave_one_out": Entry(
        "subtract the mean of the group's other samples",
        _head(lambda rl, c: adv.leave_one_out(_singleton(rl))), link=True,
        singleton_ok=True, **_GROUPS),
    "center_by_group_median": Entry(
        "subtract the group median",
        _head(lambda rl, c: adv.center_by_group_median()), link=True,
        **_GROUPS),
    "scale_by_group_mad": Entry(
        "divide by the group's median absolute deviation",
        _head(lambda rl, c: adv.scale_by_group_mad()), link=True, **_GROUPS),
    "rank_weights": Entry(
        "OrderGrad: weights by rank within the group",
        _head(_rank_weights),
        fields={"rank_weights": Field("median:3", None, "median:k, "
                                      "best_of_k:k, cvar:k:alpha, "
                                      "trimmed_mean:k:trim")},
        check=_check_rank_weights, link=True, **_GROUPS),
    "clip_advantages": Entry(
        "clip to +-rl.advantage_clip (5 when unset)",
        _head(lambda rl, c: adv.clip_advantages(
            5.0 if rl["advantage_clip"] is None
            else float(rl["advantage_clip"]))), link=True),
    "overlong_penalty": Entry(
        "DAPO's soft overlong penalty added to the reward",
        _head(_overlong),
        fields={"overlong_buffer": Field(None, "int>=1?", "the ramp length "
                                         "(None: sampler.max_new_tokens // 5)",
                                         int),
                "overlong_penalty_factor": Field(1.0, ">=0", "its depth")},
        check=_check_overlong, link=True),
    "whiten_by_tokens": Entry(
        "verl's REINFORCE++ whitening over the batch's tokens",
        _head(lambda rl, c: adv.whiten_by_tokens(gamma=float(rl["gamma"]))),
        fields=_GAMMA, link=True),
}

EXAMPLE_CHAIN = "center_by_group_median+scale_by_group_mad+clip_advantages"


def advantage_links(name: str) -> list[str]:
  """The entries of ``rl.advantage``: one preset, or links joined by ``"+"``."""
  links = name.split("+")
  if len(links) > 1:
    for link in links:
      check_choice("rl.advantage (a link of a '+' chain)", link,
                   [n for n, e in ADVANTAGES.items() if e.link])
  else:
    check_choice("rl.advantage", name, ADVANTAGES)
  return links


# ----------------------------------------------------------------------------
# Objectives (ratio [B, T] -> coefficient [B, T]).


def _clip(rl):
  return float(rl["clip_eps_low"]), float(rl["clip_eps_high"])


def _band(divergence):
  return lambda rl, c: [obj.band_clip(divergence, float(rl["band_delta"]),
                                      *_clip(rl))]


def _check_clip_cov(rl, ctx, eval_num_samples):
  del rl, eval_num_samples
  if ctx.seed is None:
    raise ValueError("rl.objective='clip_cov' draws tokens at random: pass "
                     "seed= to coefficient_chain / from_config.")


_PPO = ("clip_eps_low", "clip_eps_high")
_DPPO_CAP = {"dppo_cap": Field(10.0, ">0", "DPPO: cap of the ratio to the "
                               "sampler (verl's clip_ratio_c; a default "
                               "verl run has 3)")}


def _dppo(divergence):
  return lambda rl, c: [obj.dppo(divergence, *_clip(rl),
                                 cap=float(rl["dppo_cap"]))]


def _check_vespo(rl, ctx, eval_num_samples):
  del ctx, eval_num_samples
  if rl["is_correction"] != "none":
    raise ValueError(
        f"rl.is_correction={rl['is_correction']!r} with rl.objective='vespo': "
        "VESPO's weight already holds the sampler correction (rl.vespo_is_*); "
        "accepted: rl.is_correction='none'.")
  mode = rl["vespo_is_mode"]
  check_choice("rl.vespo_is_mode", mode, obj.VESPO_IS_MODES + (None,))
  low, high = rl["vespo_is_min"], rl["vespo_is_max"]
  if low is not None and high is not None and low > high:
    raise ValueError(f"rl.vespo_is_min={low!r} > rl.vespo_is_max={high!r}: "
                     "the interval is empty.")
_BAND_DELTA = {"band_delta": Field(0.05, ">0", "BandPO's divergence radius")}

OBJECTIVES: dict[str, Entry] = {
    "ppo_clip": Entry("PPO's clip (DAPO clip-higher with rl.clip_eps_high)",
                      lambda rl, c: [obj.ppo_clip(*_clip(rl))], reads=_PPO),
    "dual_clip": Entry(
        "PPO's clip and the dual clip (no gradient where A < 0 and r > c)",
        lambda rl, c: [obj.ppo_clip(*_clip(rl)),
                       obj.dual_clip(float(rl["dual_clip_c"]))],
        fields={"dual_clip_c": Field(3.0, ">1", "the dual clip's bound on r "
                                     "where A < 0")},
        reads=_PPO),
    "gspo": Entry(
        "GSPO: the sequence ratio, clipped",
        lambda rl, c: [obj.gspo(
            float(rl["gspo_eps_low"]), float(rl["gspo_eps_high"]),
            None if rl["gspo_max_log_ratio"] is None
            else float(rl["gspo_max_log_ratio"]))],
        fields={"gspo_eps_low": Field(3e-4, ">0", "GSPO's clip range"),
                "gspo_eps_high": Field(4e-4, ">0", "(paper values)"),
                "gspo_max_log_ratio": Field(None, ">0?", "clamp of log s "
                                            "(verl: 10)", float)},
        loop_fixups={"rl.aggregation": "sequence_mean_token_mean",
                     "rl.gspo_max_log_ratio": 10.0}),
    "cispo": Entry("CISPO: the ratio capped, on every token",
                   lambda rl, c: [obj.cispo(float(rl["cispo_cap"]))],
                   fields={"cispo_cap": Field(5.0, ">0", "CISPO's absolute "
                                              "cap (TRL's epsilon_high)")}),
    "ess": Entry("FeynRL's ESS trust region and its (1 - ESS) pull toward "
                 "the sampler", lambda rl, c: [obj.ess_trust_region()],
                 ess_kl_coef=1.0),
    "reinforce": Entry("REINFORCE: coefficient 1", lambda rl, c: []),
    "sapo": Entry("SAPO: a soft gate",
                  lambda rl, c: [obj.sapo(float(rl["sapo_tau_pos"]),
                                          float(rl["sapo_tau_neg"]))],
                  fields={"sapo_tau_pos": Field(1.0, ">0", "SAPO's gate "
                                                "temperature, A > 0"),
                          "sapo_tau_neg": Field(1.05, ">0", "... A < 0")}),
    # GMPO's range is in log space (paper: e^-0.4, e^0.4).
    "gmpo": Entry("GMPO: the geometric mean of the token ratios",
                  lambda rl, c: [obj.gmpo(float(rl["gmpo_eps"]),
                                          float(rl["gmpo_eps"]))],
                  fields={"gmpo_eps": Field(0.4, ">0", "GMPO's clip range, "
                                            "in log space")}),
    "pnpo": Entry("the prefix-normalised ratio",
                  lambda rl, c: [obj.prefix_ratio(*_clip(rl))], reads=_PPO),
    # DPPO's reference code reads its deltas from the PPO clip fields.
    "dppo_tv": Entry("DPPO: a total-variation trust region against the "
                     "sampler", _dppo("tv"), fields=_DPPO_CAP, reads=_PPO),
    "dppo_kl": Entry("DPPO: a KL trust region against the sampler",
                     _dppo("kl"), fields=_DPPO_CAP, reads=_PPO),
    "clip_cov": Entry(
        "Clip-Cov: drop a random fraction of high-covariance tokens",
        lambda rl, c: [obj.clip_cov(
            *_clip(rl), float(rl["clip_cov_ratio"]),
            float(rl["clip_cov_low"]), float(rl["clip_cov_high"]),
            seed=int(c.seed))],
        fields={"clip_cov_ratio": Field(2e-4, "(0,1]", "fraction of tokens "
                                        "dropped"),
                "clip_cov_low": Field(1.0, None, "drawn among covariances in "
                                      "(low, high)"),
                "clip_cov_high": Field(5.0, None, "")},
        reads=_PPO, needs_seed=True, check=_check_clip_cov),
    "kl_cov": Entry(
        "KL-Cov: a KL penalty on the highest-covariance tokens",
        lambda rl, c: [obj.kl_cov()],
        fields={"kl_cov_ratio": Field(2e-4, "(0,1]", "fraction of tokens "
                                      "penalised"),
                "kl_cov_coef": Field(1.0, ">=0", "the penalty's weight")},
        step_settings=lambda rl: {"kl_cov_coef": float(rl["kl_cov_coef"]),
                                  "kl_cov_ratio": float(rl["kl_cov_ratio"])}),
    "dcpo": Entry("DCPO: a probability-dependent clip",
                  lambda rl, c: [obj.dcpo_clip(*_clip(rl),
                                               float(rl["dcpo_clip_c"]))],
                  fields={"dcpo_clip_c": Field(10.0, ">0", "DCPO's dual clip "
                                               "and cap of its upper bound")},
                  reads=_PPO),
    # BandPO relaxes its band to at least the PPO interval (its code).
    "bandpo_tv": Entry("BandPO: a total-variation band", _band("tv"),
                       fields=_BAND_DELTA, reads=_PPO),
    "bandpo_chi2": Entry("BandPO: a chi-square band", _band("chi2"),
                         fields=_BAND_DELTA, reads=_PPO),
    "bandpo_kl": Entry("BandPO: a KL band", _band("kl"), fields=_BAND_DELTA,
                       reads=_PPO),
    "bapo": Entry("BAPO: a balancing clip search",
                  lambda rl, c: [obj.bapo_clip(float(rl["bapo_target"]))],
                  fields={"bapo_target": Field(1.0, ">0", "BAPO: positive / "
                                               "negative contribution")}),
    "sat": Entry("SAT: the clip's endpoint on the side of log pi - log mu "
                 "shrinks beyond the batch's staleness quantile",
                 lambda rl, c: [obj.sat_clip(*_clip(rl),
                                             float(rl["sat_quantile"]))],
                 fields={"sat_quantile": Field(0.9, "(0,1]", "SAT: |log pi - "
                                               "log mu| quantile of the gate")},
                 reads=_PPO),
    "dro": Entry(
        "DRO (verl's policy_loss/dro): REINFORCE plus a quadratic pull "
        "0.5 beta (log pi - log pi_old)^2",
        lambda rl, c: [obj.dro()],
        fields={"dro_beta": Field(0.05, ">0", "DRO's beta (verl's example)")},
        step_settings=lambda rl: {"dro_beta": float(rl["dro_beta"])}),
    "vespo": Entry(
        "VESPO (TRL): a Gamma-kernel weight of the sequence's importance "
        "ratio, the sampler's correction inside it",
        lambda rl, c: [obj.vespo(
            float(rl["vespo_k_pos"]), float(rl["vespo_lambda_pos"]),
            float(rl["vespo_k_neg"]), float(rl["vespo_lambda_neg"]),
            is_mode=rl["vespo_is_mode"],
            is_max=None if rl["vespo_is_max"] is None
            else float(rl["vespo_is_max"]),
            is_min=None if rl["vespo_is_min"] is None
            else float(rl["vespo_is_min"]))],
        fields={"vespo_k_pos": Field(2.0, ">=0", "VESPO's k, A >= 0"),
                "vespo_lambda_pos": Field(3.0, ">0", "VESPO's lambda, A >= 0"),
                "vespo_k_neg": Field(3.0, ">=0", "VESPO's k, A < 0"),
                "vespo_lambda_neg": Field(2.0, ">0", "VESPO's lambda, A < 0"),
                "vespo_is_mode": Field("truncate", None, "the sampler "
                                       "correction: truncate, mask or None",
                                       str),
                "vespo_is_max": Field(3.0, ">0?", "its cap (TRL: 3)", float),
                "vespo_is_min": Field(None, ">0?", "its floor", float)},
        check=_check_vespo, loop_fixups={"rl.is_correction": "none"}),
    "opsm": Entry(
        "PPO's clip under TRL's off-policy sequence masking: a sequence "
        "with A < 0 whose mean log(mu / pi) exceeds rl.opsm_delta is dropped",
        lambda rl, c: [obj.off_policy_sequence_mask(
            obj.ppo_clip(*_clip(rl)), float(rl["opsm_delta"]))],
        fields={"opsm_delta": Field(0.5, ">0", "OPSM's threshold (TRL's "
                                    "suggested 0.5)")},
        reads=_PPO),
}


# ----------------------------------------------------------------------------
# Sampler-mismatch corrections (links after the objective's).


_IS = ("is_cap", "is_level")

IS_CORRECTIONS: dict[str, Entry] = {
    "none": Entry("no correction", lambda rl, c: []),
    "tis": Entry(
        "truncated importance sampling (rl.is_cap, rl.is_floor, "
        "rl.is_batch_normalize)",
        lambda rl, c: [obj.truncated_is(
            cap=float(rl["is_cap"]), level=rl["is_level"],
            floor=None if rl["is_floor"] is None else float(rl["is_floor"]),
            batch_normalize=bool(rl["is_batch_normalize"]))],
        reads=_IS + ("is_floor", "is_batch_normalize")),
    "mis": Entry("masked importance sampling (zeroed weights stay in the "
                 "normaliser)",
                 lambda rl, c: [obj.masked_is(high=float(rl["is_cap"]),
                                              level=rl["is_level"])],
                 reads=_IS),
}


# ----------------------------------------------------------------------------
# Names the step reads directly.

KL_ESTIMATORS: dict[str, Entry] = {
    name: Entry(doc, loop_fixups={} if name == "k3" else {"rl.kl_coef": 0.01})
    for name, doc in (
        ("k3", "k3 (default)"), ("k1", "k1"), ("k2", "k2"), ("abs", "|k1|"),
        ("low_var_kl", "verl's clamped k3"),
        ("k1+", "straight-through: value k1, gradient k2"),
        ("k3+", "straight-through: value k3, gradient k2"),
        ("k3_is", "TRL's bias-corrected k3"))
}

AGGREGATIONS: dict[str, Entry] = {
    name: Entry(doc) for name, doc in (
        ("token_mean", "mean over the minibatch's tokens"),
        ("token_sum", "sum over tokens"),
        ("sequence_mean_token_mean", "mean over sequences of token means"),
        ("sequence_mean_token_sum", "mean over sequences of token sums"),
        ("sequence_mean_token_sum_norm", "Dr.GRPO: token sums over the "
         "generation budget"),
        ("sequence_mean_token_scale", "Tunix's name for the same formula"))
}

REJECTION_STATISTICS: dict[str, Entry] = {
    name: Entry(f"{name} of pi_old vs the sampler")
    for name in obj.REJECTION_STATISTICS
}

AXES: dict[str, dict[str, Entry]] = {
    "rl.advantage": ADVANTAGES,
    "rl.objective": OBJECTIVES,
    "rl.is_correction": IS_CORRECTIONS,
    "rl.kl_estimator": KL_ESTIMATORS,
    "rl.aggregation": AGGREGATIONS,
    "rl.rejection": REJECTION_STATISTICS,
}


def entry_fields() -> dict[str, Field]:
  """``{"rl.<field>": Field}`` of every entry (``schema.FIELDS`` merges them)."""
  out: dict[str, Field] = {}
  for entries in AXES.values():
    for entry in entries.values():
      for name, field in entry.fields.items():
        key = "rl." + name
        if key in out and out[key] != field:
          raise ValueError(f"{key} is declared twice, differently.")
        out[key] = field
  return out


def _check_tables() -> None:
  """The step's own name lists and the table agree (at import)."""
  for axis, names in (("rl.kl_estimator", obj.KL_ESTIMATORS),
                      ("rl.aggregation", obj.AGGREGATIONS)):
    if set(AXES[axis]) != set(names):
      raise ValueError(f"{axis}: the table lists {sorted(AXES[axis])}, the "
                       f"objectives accept {sorted(names)}.")


_check_tables()


def markdown() -> str:
  """The README's algorithm tables: one per axis, a row per name with its
  description and the fields it adds or reads (``launch/algorithm_table.py``
  writes it into README.md; ``tests/test_algorithm.py`` checks it)."""
  lines = []
  for axis, entries in AXES.items():
    if axis == "rl.rejection":
      continue  # statistics of a spec string, listed in one line below
    lines += [f"**`{axis}`**", "", "| name | what | fields |", "|---|---|---|"]
    for name, entry in entries.items():
      fields = [f"`rl.{f}`" + (f" = {e.default!r}" if (e := entry.fields.get(f))
                               else "")
                for f in (*entry.fields, *entry.reads)]
      kind = " (link)" if entry.link else ""
      lines.append(f"| `{name}`{kind} | {entry.doc} | {', '.join(fields)} |")
    lines.append("")
  stats = ", ".join(f"`{n}`" for n in REJECTION_STATISTICS)
  lines.append(f"**`rl.rejection`**: `\"stat:upper\"` or `\"stat:lower:upper\"` "
               f"joined with `,`, stat one of {stats}; `\"\"` is off.")
  return "\n".join(lines) + "\n"
