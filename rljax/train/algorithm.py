"""The ``Algorithm``: what turns rewards and logprobs into a parameter update.

An ``Algorithm`` bundles three optax-protocol chains and what sampling they
need:

* ``advantage``: rewards ``[N, R]`` (one column per reward function, NaN
  where a function gave no reward) -> advantages ``[N]`` (KTAE: ``[N, T]``
  per completion token). Its head reduces the
  reward columns (``advantages.sum_rewards()`` or GDPO's
  ``advantages.normalize_each_reward()``); both read the reward weights from
  the extra argument ``reward_weights_R``, so the weights of the
  ``RewardSpec``s are applied in exactly one place. Extra arguments:
  ``group_size`` (static int), ``mask_N`` (rows with at least one reward: a
  row whose every reward failed is left out of every statistic and gets
  advantage 0, as TRL does; ``failed_rewards="zero"`` keeps it in, scored
  0), ``reward_weights_R`` and ``advantage_extra_args`` (completion lengths,
  sequence log-ratios).
* ``coefficient``: importance ratio ``[B, T]`` -> per-token policy-gradient
  coefficient (``rljax.objectives``).
* ``optimizer``: gradients -> updates; it receives the VCPO sequence-level
  ESS as the extra argument ``ess`` (``rljax.optim.scale_by_ess``).
* ``extra_samples``: samples per prompt beyond ``rl.group_size`` (MC-GRPO
  samples ``G + 1``); ``drop_pivot``: drop each group's median pivot row
  after the advantages, so exactly ``G`` rows per prompt are trained;
  ``greedy_baseline``: the extra sample of each prompt is its greedy
  completion (ReMax), dropped after the advantages.

Config names build one (``from_config``), and user code builds one from the
transforms directly and passes it to ``rljax.train.run(config, workdir,
algorithm=...)``:

    algorithm = Algorithm(
        advantage=optax.chain(adv.sum_rewards(), adv.center_by_group_median(),
                              adv.scale_by_group_mad(), adv.rank_weights(w)),
        coefficient=optax.chain(obj.ppo_clip(0.2, 0.28), obj.truncated_is(2.0)),
        optimizer=optim.make_optimizer("adamw", 1e-4))

Only ``rljax/train/build.py`` reads a ConfigDict; the builders here take the
config's sections as plain mappings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import advantages as adv_lib
from rljax import objectives as obj_lib
from rljax import optim as optim_lib

_Tx = optax.GradientTransformationExtraArgs

# Presets of the advantage chain; the head reduces rewards [N, R] -> [N].
ADVANTAGE_PRESETS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "mc_grpo",
                     "gdpo", "batch_std", "rank_weights", "gae",
                     "grpo_batch_std", "gpg", "pass_at_k", "opo",
                     "reinforce_pp_token", "vcpo", "ktae", "remax")
# Presets whose advantages come from a value model: the chain gives each
# row's weighted reward, and rl_step turns it into token-level GAE
# advantages with the critic's values (rljax.train.critic, critic.*).
CRITIC_ADVANTAGES = ("gae",)
# Single transforms that may be joined with "+" into a chain, e.g.
# rl.advantage = "center_by_group_median+scale_by_group_mad".
ADVANTAGE_TRANSFORMS = ("center_by_group_mean", "scale_by_group_std",
                        "center_by_batch_mean", "scale_by_batch_std",
                        "leave_one_out", "center_by_group_median",
                        "scale_by_group_mad", "rank_weights", "clip_advantages",
                        "overlong_penalty", "whiten_by_tokens")
# Chains that divide by a per-group statistic: they need G >= 2.
GROUP_STATISTIC_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                              "mc_grpo", "gdpo", "rank_weights",
                              "center_by_group_mean", "scale_by_group_std",
                              "leave_one_out", "center_by_group_median",
                              "scale_by_group_mad", "grpo_batch_std", "gpg",
                              "pass_at_k", "opo", "reinforce_pp_token", "vcpo",
                              "ktae")
# Chains that take rl.singleton_groups="raw" (verl: a group of one keeps its
# reward); with it they also run with rl.group_size=1.
SINGLETON_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                        "center_by_group_mean", "scale_by_group_std",
                        "leave_one_out")
SINGLETON_GROUPS = ("zero", "raw")
FAILED_REWARDS = ("exclude", "zero")
OBJECTIVES = ("ppo_clip", "dual_clip", "gspo", "cispo", "ess", "reinforce",
              "sapo", "gmpo", "pnpo", "dppo_tv", "dppo_kl", "clip_cov",
              "kl_cov", "dcpo", "bandpo_tv", "bandpo_chi2", "bandpo_kl",
              "bapo", "sat")
# "tis" takes rl.is_floor (a lower bound) and rl.is_batch_normalize.
IS_CORRECTIONS = ("none", "tis", "mis")
RANK_PRESETS = ("median", "trimmed_mean", "cvar", "best_of_k")
ESS_POOLINGS = ("microbatch", "minibatch")


def check_choice(field: str, value: Any, accepted: tuple[str, ...]) -> None:
  if value not in accepted:
    raise ValueError(f"{field}={value!r} is unknown; accepted: {accepted}.")


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """Advantage chain, coefficient chain, optimizer and their sampling needs.

  Attributes:
    advantage: rewards ``[N, R]`` -> advantages ``[N]``, or ``[N, T]`` per
      completion token (KTAE) (see module doc).
    coefficient: ratio ``[B, T]`` -> coefficient ``[B, T]``.
    optimizer: gradients -> updates (receives ``ess=``).
    extra_samples: samples per prompt beyond the group size (MC-GRPO: 1).
    drop_pivot: drop each group's median-reward pivot row after the
      advantages (MC-GRPO), leaving ``group_size`` rows per prompt.
    greedy_baseline: the last of each prompt's ``group_size + 1`` samples is
      decoded greedily in the same sampler call
      (``SamplingMethod.greedy_every``) and dropped after the advantages
      (ReMax's baseline); needs ``extra_samples=1``.
    ess_kl_coef: weight of FeynRL's ``(1 - ESS)``-weighted pull toward the
      behaviour policy (``objectives.ess_kl_penalty``); 0 turns it off.
    ess_pooling: pool the token-level (FeynRL) ESS per ``"microbatch"`` (as
      the reference code) or over the whole ``"minibatch"`` (one extra
      no-gradient forward pass per minibatch).
    failed_rewards: a row whose every reward failed is left out of every
      statistic with advantage 0 (``"exclude"``, TRL since PR #5902) or
      scored 0 and kept in the statistics (``"zero"``, TRL's earlier
      ``nansum``).
    name: a label for logs.
  """

  advantage: _Tx
  coefficient: _Tx
  optimizer: _Tx
  extra_samples: int = 0
  drop_pivot: bool = False
  greedy_baseline: bool = False
  ess_kl_coef: float = 0.0
  ess_pooling: str = "microbatch"
  failed_rewards: str = "exclude"
  name: str = "custom"

  def __post_init__(self):
    for field in ("advantage", "coefficient", "optimizer"):
      tx = getattr(self, field)
      if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"Algorithm.{field}={tx!r}: an optax transform (with "
                        "init and update) is required.")
    if not isinstance(self.extra_samples, int) or self.extra_samples < 0:
      raise ValueError(f"Algorithm.extra_samples={self.extra_samples!r}: a "
                       "non-negative integer is required.")
    if self.drop_pivot and self.extra_samples != 1:
      raise ValueError(
          f"Algorithm.drop_pivot=True with extra_samples={self.extra_samples}: "
          "dropping the pivot keeps group_size rows only with extra_samples=1.")
    if self.greedy_baseline and (self.extra_samples != 1 or self.drop_pivot):
      raise ValueError(
          f"Algorithm.greedy_baseline=True with extra_samples="
          f"{self.extra_samples}, drop_pivot={self.drop_pivot}: the greedy "
          "baseline is the one extra sample (extra_samples=1, drop_pivot="
          "False).")
    check_choice("Algorithm.ess_pooling", self.ess_pooling, ESS_POOLINGS)
    check_choice("Algorithm.failed_rewards", self.failed_rewards,
                 FAILED_REWARDS)
    if not (isinstance(self.ess_kl_coef, (int, float))
            and math.isfinite(self.ess_kl_coef) and self.ess_kl_coef >= 0):
      raise ValueError(f"Algorithm.ess_kl_coef={self.ess_kl_coef!r}: a finite "
                       "number >= 0 is required.")

  def check_advantage_shapes(self, num_rows: int, num_rewards: int,
                             group_size: int) -> None:
    """Traces the advantage chain once (no compile) and checks ``[N, R] -> [N]``.

    Raises:
      ValueError: naming the shape the chain returned.
    """
    rewards = jax.ShapeDtypeStruct((num_rows, num_rewards), jnp.float32)
    # A per-token chain (KTAE) returns [N, T]; a completion length unequal
    # to R keeps a chain that returns its rewards [N, R] from passing.
    t = num_rewards + 1

    def run(r):
      state = self.advantage.init(r)
      return self.advantage.update(
          r, state, group_size=group_size, mask_N=jnp.ones((num_rows,), bool),
          reward_weights_R=jnp.ones((num_rewards,), jnp.float32),
          **advantage_extra_args(jnp.ones((num_rows,), jnp.int32),
                                 jnp.zeros((num_rows,), jnp.float32),
                                 jnp.zeros((num_rows, t), jnp.int32),
                                 jnp.ones((num_rows, t), bool)))[0]

    try:
      out = jax.eval_shape(run, rewards)
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"Algorithm.advantage cannot take rewards [N, R] = [{num_rows}, "
          f"{num_rewards}] with group_size={group_size}: {e} Start the chain "
          "with advantages.sum_rewards() or advantages.normalize_each_reward()."
      ) from e
    if out.shape not in ((num_rows,), (num_rows, t)):
      raise ValueError(
          f"Algorithm.advantage maps rewards [{num_rows}, {num_rewards}] to "
          f"shape {out.shape}; advantages [{num_rows}] (or per completion "
          f"token, [{num_rows}, T]) are required. Start "
          "the chain with advantages.sum_rewards() or "
          "advantages.normalize_each_reward().")


def advantage_extra_args(lengths_N: jax.Array, seq_log_ratio_N: jax.Array,
                         tokens_NxT: jax.Array,
                         completion_mask_NxT: jax.Array) -> dict[str, jax.Array]:
  """The per-row extra arguments every advantage chain receives, besides
  ``group_size``, ``mask_N`` and ``reward_weights_R``: the completion
  lengths ``lengths_N``, the sequence log-ratio
  ``seq_log_ratio_N = log pi_old(y) / mu(y)`` (0 without the sampler's policy
  logprobs) and the completions ``tokens_NxT`` / ``completion_mask_NxT``
  (KTAE, whose advantages are ``[N, T]``). Transforms that do not read them
  ignore them."""
  return {"lengths_N": lengths_N, "seq_log_ratio_N": seq_log_ratio_N,
          "tokens_NxT": tokens_NxT, "completion_mask_NxT": completion_mask_NxT}


def _get(section: Mapping[str, Any], name: str, default: Any = None) -> Any:
  value = section.get(name, default)
  return default if value is None else value


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
      return adv_lib.median_rank_weights(k)
    if preset == "best_of_k":
      return adv_lib.best_of_k_rank_weights(k)
    if preset == "trimmed_mean":
      return adv_lib.trimmed_mean_rank_weights(k, int(parts[2]))
    return adv_lib.cvar_rank_weights(k, float(parts[2]))
  except ValueError as e:
    raise ValueError(f"{field}={spec!r}: {e}") from e


def overlong_buffer(rl: Mapping[str, Any], max_new_tokens: int) -> int:
  """DAPO's ``L_cache``: ``rl.overlong_buffer``, or a fifth of the budget
  (DAPO's 4096 of 20480) when it is None."""
  return int(_get(rl, "overlong_buffer", max(1, max_new_tokens // 5)))


def _transform(name: str, rl: Mapping[str, Any], group_size: int,
               max_new_tokens: int | None = None) -> _Tx:
  eps = rl.get("std_eps")
  singleton = _get(rl, "singleton_groups", "zero")
  if name == "rank_weights":
    return adv_lib.rank_weights(
        parse_rank_weights(_get(rl, "rank_weights", "median:3"), group_size))
  if name == "clip_advantages":
    return adv_lib.clip_advantages(float(_get(rl, "advantage_clip", 5.0)))
  if name == "overlong_penalty":
    if max_new_tokens is None:
      raise ValueError("rl.advantage link 'overlong_penalty' needs the "
                       "generation budget (sampler.max_new_tokens).")
    return adv_lib.overlong_penalty(
        int(max_new_tokens), overlong_buffer(rl, int(max_new_tokens)),
        float(_get(rl, "overlong_penalty_factor", 1.0)))
  if name in ("center_by_group_mean", "leave_one_out"):
    return getattr(adv_lib, name)(singleton)
  if name == "scale_by_group_std":
    return adv_lib.scale_by_group_std(
        1e-6 if eps is None else float(eps), singleton=singleton)
  if name == "scale_by_batch_std" and eps is not None:
    return adv_lib.scale_by_batch_std(float(eps))
  return getattr(adv_lib, name)()


def advantage_chain(rl: Mapping[str, Any], group_size: int,
                    max_new_tokens: int | None = None) -> _Tx:
  """The rewards ``[N, R]`` -> advantages ``[N]`` chain named by ``rl.advantage``.

  ``rl.advantage`` is a preset (``ADVANTAGE_PRESETS``) or transforms of
  ``ADVANTAGE_TRANSFORMS`` joined with ``"+"``; with ``rl.advantage_clip``
  the advantages are clipped last. ``group_size`` is the number of samples
  per prompt the chain sees (``G + 1`` for MC-GRPO). Conventions:
  ``rl.std_eps`` (None: each chain's own, 1e-6 as verl, 1e-4 for TRL's
  ``grpo_batch_std`` and GDPO) is added to every std; ``rl.singleton_groups``
  (``SINGLETON_GROUPS``) is what a group with one valid sample gets.
  ``max_new_tokens`` (the generation budget) is needed by
  ``overlong_penalty``.
  """
  name = _get(rl, "advantage", "grpo")
  eps = rl.get("std_eps")
  singleton = _get(rl, "singleton_groups", "zero")
  check_choice("rl.singleton_groups", singleton, SINGLETON_GROUPS)
  head = adv_lib.sum_rewards()
  if "+" in name or name in ADVANTAGE_TRANSFORMS and name != "rank_weights":
    links = name.split("+")
    for link in links:
      check_choice("rl.advantage (a link of a '+' chain)", link,
                   ADVANTAGE_TRANSFORMS)
    chain = [head] + [_transform(link, rl, group_size, max_new_tokens)
                      for link in links]
  else:
    check_choice("rl.advantage", name,
                 ADVANTAGE_PRESETS + ADVANTAGE_TRANSFORMS)
    e6 = 1e-6 if eps is None else float(eps)
    e4 = 1e-4 if eps is None else float(eps)
    chain = {
        "grpo": lambda: [head, adv_lib.grpo(e6, singleton)],
        "dr_grpo": lambda: [head, adv_lib.dr_grpo(singleton)],
        "rloo": lambda: [head, adv_lib.rloo(singleton)],
        "reinforce_pp": lambda: [head, adv_lib.reinforce_pp_baseline(
            e6, singleton)],
        "mc_grpo": lambda: [head, adv_lib.mc_grpo()],
        "gdpo": lambda: [adv_lib.gdpo(eps=e4)],
        "batch_std": lambda: [head, adv_lib.center_by_batch_mean(),
                              adv_lib.scale_by_batch_std(e6)],
        "rank_weights": lambda: [head, _transform("rank_weights", rl,
                                                  group_size)],
        "grpo_batch_std": lambda: [head, adv_lib.grpo_batch_std(e4)],
        "gpg": lambda: [head, adv_lib.gpg()],
        "pass_at_k": lambda: [head, adv_lib.pass_at_k_advantages(
            int(_get(rl, "pass_k", 2)),
            float(_get(rl, "pass_threshold", 1.0)))],
        "opo": lambda: [head, adv_lib.opo()],
        "reinforce_pp_token": lambda: [head, adv_lib.reinforce_pp_token()],
        "vcpo": lambda: [head, adv_lib.vcpo()],
        "ktae": lambda: [head, adv_lib.ktae_advantages()],
        "remax": lambda: [head, adv_lib.center_by_greedy_baseline()],
        "gae": lambda: [head],
    }[name]()
  clip = rl.get("advantage_clip")
  if clip and not name.endswith("clip_advantages"):
    chain.append(adv_lib.clip_advantages(float(clip)))
  return optax.chain(*chain)


def _reinforce() -> _Tx:
  """Plain REINFORCE: the coefficient is 1 on every token."""
  return _Tx(lambda params: optax.EmptyState(),
             lambda updates, state, params=None, **kw: (
                 jnp.ones_like(updates), state))


def coefficient_chain(rl: Mapping[str, Any], seed: int | None = None) -> _Tx:
  """The per-token coefficient chain of ``rl.objective`` and ``rl.is_correction``.

  ``seed`` seeds Clip-Cov's token draw (``rl.objective="clip_cov"`` needs
  it; ``build`` passes the config's ``seed``). KL-Cov's penalty and the
  rejection mask are loss terms of the step (``RLStepConfig``), not links.
  """
  objective = _get(rl, "objective", "ppo_clip")
  check_choice("rl.objective", objective, OBJECTIVES)
  correction = _get(rl, "is_correction", "none")
  check_choice("rl.is_correction", correction, IS_CORRECTIONS)
  eps_low = float(_get(rl, "clip_eps_low", 0.2))
  eps_high = float(_get(rl, "clip_eps_high", eps_low))
  if objective == "clip_cov" and seed is None:
    raise ValueError("rl.objective='clip_cov' draws tokens at random: pass "
                     "seed= to coefficient_chain / from_config.")
  gspo_max = rl.get("gspo_max_log_ratio")
  links = {
      "ppo_clip": lambda: [obj_lib.ppo_clip(eps_low, eps_high)],
      "dual_clip": lambda: [obj_lib.ppo_clip(eps_low, eps_high),
                            obj_lib.dual_clip(float(_get(rl, "dual_clip_c", 3.0)))],
      "gspo": lambda: [obj_lib.gspo(
          float(_get(rl, "gspo_eps_low", 3e-4)),
          float(_get(rl, "gspo_eps_high", 4e-4)),
          None if gspo_max is None else float(gspo_max))],
      "cispo": lambda: [obj_lib.cispo(float(_get(rl, "cispo_cap", 5.0)))],
      "ess": lambda: [obj_lib.ess_trust_region()],
      "reinforce": lambda: [],
      "sapo": lambda: [obj_lib.sapo(float(_get(rl, "sapo_tau_pos", 1.0)),
                                    float(_get(rl, "sapo_tau_neg", 1.05)))],
      # GMPO's range is in log space (paper: e^-0.4, e^0.4).
      "gmpo": lambda: [obj_lib.gmpo(float(_get(rl, "gmpo_eps", 0.4)),
                                    float(_get(rl, "gmpo_eps", 0.4)))],
      "pnpo": lambda: [obj_lib.prefix_ratio(eps_low, eps_high)],
      # DPPO's reference code reads its deltas from the PPO clip fields.
      "dppo_tv": lambda: [obj_lib.dppo("tv", eps_low, eps_high)],
      "dppo_kl": lambda: [obj_lib.dppo("kl", eps_low, eps_high)],
      "clip_cov": lambda: [obj_lib.clip_cov(
          eps_low, eps_high, float(_get(rl, "clip_cov_ratio", 2e-4)),
          float(_get(rl, "clip_cov_low", 1.0)),
          float(_get(rl, "clip_cov_high", 5.0)), seed=int(seed))],
      "kl_cov": lambda: [obj_lib.kl_cov()],
      "dcpo": lambda: [obj_lib.dcpo_clip(
          eps_low, eps_high, float(_get(rl, "dcpo_clip_c", 10.0)))],
      # BandPO relaxes its band to at least the PPO interval (its code).
      "bandpo_tv": lambda: [obj_lib.band_clip(
          "tv", float(_get(rl, "band_delta", 0.05)), eps_low, eps_high)],
      "bandpo_chi2": lambda: [obj_lib.band_clip(
          "chi2", float(_get(rl, "band_delta", 0.05)), eps_low, eps_high)],
      "bandpo_kl": lambda: [obj_lib.band_clip(
          "kl", float(_get(rl, "band_delta", 0.05)), eps_low, eps_high)],
      "bapo": lambda: [obj_lib.bapo_clip(float(_get(rl, "bapo_target", 1.0)))],
      "sat": lambda: [obj_lib.sat_clip(
          eps_low, eps_high, float(_get(rl, "sat_quantile", 0.9)))],
  }[objective]()
  level = _get(rl, "is_level", "token")
  check_choice("rl.is_level", level, obj_lib.LEVELS)
  cap = float(_get(rl, "is_cap", 2.0))
  if correction == "tis":
    floor = rl.get("is_floor")
    links.append(obj_lib.truncated_is(
        cap=cap, level=level, floor=None if floor is None else float(floor),
        batch_normalize=bool(rl.get("is_batch_normalize", False))))
  elif correction == "mis":
    links.append(obj_lib.masked_is(high=cap, level=level))
  return optax.chain(*links) if links else _reinforce()


def optimizer(opt: Mapping[str, Any], num_updates: int) -> _Tx:
  """The optax optimizer of the ``optimizer`` section (name, lr, schedule...).

  Args:
    opt: the config's ``optimizer`` section.
    num_updates: optimizer updates of the whole run (for the cosine decay).
  """
  lr = float(_get(opt, "learning_rate", 1e-6))
  warmup = int(_get(opt, "warmup_steps", 0))
  schedule_name = _get(opt, "schedule", "constant")
  check_choice("optimizer.schedule", schedule_name, ("constant", "cosine"))
  if schedule_name == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(warmup, 1), max(num_updates, warmup + 1),
        end_value=lr * float(_get(opt, "final_lr_fraction", 0.1)))
  elif warmup:
    schedule = optax.linear_schedule(0.0, lr, warmup)
  else:
    schedule = lr
  name = _get(opt, "name", "adamw")
  check_choice("optimizer.name", name, tuple(optim_lib.OPTIMIZERS))
  ess = opt.get("ess_scaling")
  if ess is not None:
    check_choice("optimizer.ess_scaling", ess, (None,) + optim_lib.ESS_RULES)
  return optim_lib.make_optimizer(
      name, schedule,
      weight_decay=float(_get(opt, "weight_decay", 0.0)),
      b1=opt.get("b1"), b2=opt.get("b2"),
      max_grad_norm=opt.get("max_grad_norm", 1.0),
      ess_scaling=ess,
      max_consecutive_nonfinite=opt.get("max_consecutive_nonfinite"))


def from_config(rl: Mapping[str, Any], opt: Mapping[str, Any],
                max_new_tokens: int | None = None,
                seed: int | None = None) -> Algorithm:
  """The ``Algorithm`` named by a config's ``rl`` and ``optimizer`` sections
  (``max_new_tokens``: the generation budget, for ``overlong_penalty``;
  ``seed``: for ``rl.objective="clip_cov"``)."""
  name = _get(rl, "advantage", "grpo")
  mc = name == "mc_grpo"
  remax = name == "remax"
  group_size = int(rl["group_size"]) + (1 if mc or remax else 0)
  objective = _get(rl, "objective", "ppo_clip")
  num_updates = (int(rl["num_steps"]) * int(_get(rl, "num_epochs", 1))
                 * int(_get(rl, "num_minibatches", 1)))
  ess_kl = _get(rl, "ess_kl_coef", 1.0 if objective == "ess" else 0.0)
  return Algorithm(
      advantage=advantage_chain(rl, group_size, max_new_tokens),
      coefficient=coefficient_chain(rl, seed),
      optimizer=optimizer(opt, num_updates),
      extra_samples=1 if mc or remax else 0,
      drop_pivot=mc,
      greedy_baseline=remax,
      ess_kl_coef=float(ess_kl),
      ess_pooling=_get(rl, "ess_pooling", "microbatch"),
      failed_rewards=_get(rl, "failed_rewards", "exclude"),
      name=f"{name}/{objective}")
