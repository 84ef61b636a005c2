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



from rljax import objectives as obj
from rljax.train._entry import Context, Entry, check_choice  # noqa: F401
from rljax.train._field import Field
from rljax.train.advantage_entries import (  # noqa: F401  (re-exported)
    ADVANTAGES, EXAMPLE_CHAIN, RANK_PRESETS, advantage_links, overlong_buffer,
    parse_rank_weights)



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
