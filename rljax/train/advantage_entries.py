"""The advantage entries of the algorithm table (``rl.advantage``: presets and
``"+"`` links); ``table.py`` holds the other axes and re-exports these."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rljax import advantages as adv
from rljax.train._entry import Entry, check_choice
from rljax.train._field import Field


RANK_PRESETS = ("median", "trimmed_mean", "cvar", "best_of_k")


def parse_rank_weights(spec: str, rows: int) -> np.ndarray:
  """Rank weights from ``"<preset>:<k>[:<param>]"``.

  Presets: ``median:k``, ``trimmed_mean:k:trim``, ``cvar:k:alpha``,
  ``best_of_k:k`` (``advantages.*_rank_weights``); ``k <= rows - 1``, the
  rows of a group the chain ranks (``Context.samples_per_prompt``).
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
  if not 1 <= k <= rows - 1:
    raise ValueError(f"{field}={spec!r}: k={k} must be in [1, {rows - 1}] "
                     f"(one less than the {rows} rows of a group).")
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
  if rl["pass_k"] > ctx.samples_per_prompt:
    raise ValueError(f"rl.pass_k={rl['pass_k']} with rl.advantage="
                     f"'pass_at_k': k must be at most the "
                     f"{ctx.samples_per_prompt} samples per prompt "
                     f"(rl.group_size={ctx.group_size}).")


def _check_remax(rl, ctx, eval_num_samples):
  if eval_num_samples == ctx.samples_per_prompt:  # the training sampler's
    raise ValueError(
        f"eval.num_samples={eval_num_samples} with rl.advantage='remax': the "
        "training sampler of rl.group_size + 1 samples per prompt decodes "
        "its last row greedily (ReMax's baseline), and the evaluation "
        "sampler must not share that count; accepted: any other "
        "eval.num_samples.")


def _check_rank_weights(rl, ctx, eval_num_samples):
  del eval_num_samples
  parse_rank_weights(rl["rank_weights"], ctx.samples_per_prompt)


def _rank_weights(rl, ctx):
  return adv.rank_weights(parse_rank_weights(rl["rank_weights"],
                                             ctx.samples_per_prompt))


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
    "treepo": Entry("TreePO: the leaf's reward centred on each subtree of a "
                    "tree rollout (rl.rollout='tree'), then token whitening",
                    _head(lambda rl, c: adv.treepo(str(rl["tree_weighting"]))),
                    fields={"tree_weighting": Field(
                        "group_size", None, "treepo: each subtree's weight, "
                        "its leaf count or 1 (\"average\")",
                        choices=("group_size", "average"))},
                    loop_fixups={"rl.rollout": "tree",
                                 "sampler.speculative": False}, **_GROUPS),
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
  if len(links) > 1 and not all(links):
    empty = [i for i, link in enumerate(links) if not link]
    raise ValueError(
        f"rl.advantage={name!r} has an empty link at position {empty[0]} "
        f"(of {len(links)}, counting from 0): links are names joined by one "
        f"'+', e.g. {EXAMPLE_CHAIN!r}.")
  if len(links) > 1:
    for link in links:
      check_choice("rl.advantage (a link of a '+' chain)", link,
                   [n for n, e in ADVANTAGES.items() if e.link])
  else:
    check_choice("rl.advantage", name, ADVANTAGES)
  return links
