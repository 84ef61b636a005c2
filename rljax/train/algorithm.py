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
        optimizer=optim.make_optimizer("adamw", 1e-4, max_grad_norm=1.0,
                                       max_consecutive_nonfinite=5))

The guarded optimizer skips an update whose gradients are not finite (and
the loop stops after 5 in a row); non-finite advantages never reach it:
their rows are out of the loss, counted as ``adv/nonfinite_rows``
(``train/rollout.py``); a coefficient chain's NaN/inf tokens weigh 0 and are
counted as ``coef/nonfinite_tokens`` (``train/steps.py``).

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
import optax

from rljax import advantages as adv_lib
from rljax import objectives as obj_lib
from rljax import optim as optim_lib
from rljax.train import schema, table

_Tx = optax.GradientTransformationExtraArgs

# The names each axis accepts, in the table's order (rljax/train/table.py).
ADVANTAGE_PRESETS = tuple(n for n, e in table.ADVANTAGES.items() if not e.link)
ADVANTAGE_TRANSFORMS = tuple(n for n, e in table.ADVANTAGES.items() if e.link)
OBJECTIVES = tuple(table.OBJECTIVES)
IS_CORRECTIONS = tuple(table.IS_CORRECTIONS)
check_choice = table.check_choice
parse_rank_weights = table.parse_rank_weights
overlong_buffer = table.overlong_buffer


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
    critic: the advantage chain gives each row's (weighted) reward, which
      the step turns into token-level GAE advantages with a value model
      (``RLStepConfig.critic``; the ``gae`` entry).
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
  critic: bool = False
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
    fields = schema.fields()
    check_choice("Algorithm.ess_pooling", self.ess_pooling,
                 fields["rl.ess_pooling"].choices)
    check_choice("Algorithm.failed_rewards", self.failed_rewards,
                 fields["rl.failed_rewards"].choices)
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
    # A per-token chain (KTAE) returns [N, T]. The chain is traced with two
    # completion lengths unlike every other dimension: an output whose
    # second axis does not follow T (e.g. [N, R + 1]) cannot pass.
    t_first = max(num_rows, num_rewards, group_size) + 3
    out = self._advantage_shape(rewards, num_rows, num_rewards, group_size,
                                t_first)
    if len(out) == 2 and out[1] == t_first:
      again = self._advantage_shape(rewards, num_rows, num_rewards,
                                    group_size, t_first + 1)
      if again != (num_rows, t_first + 1):
        out = again
    if out not in ((num_rows,), (num_rows, t_first)):
      raise ValueError(
          f"Algorithm.advantage maps rewards [{num_rows}, {num_rewards}] to "
          f"shape {out}; advantages [{num_rows}] (or per completion "
          f"token, [{num_rows}, T], following T) are required. Start "
          "the chain with advantages.sum_rewards() or "
          "advantages.normalize_each_reward().")

  def _advantage_shape(self, rewards, num_rows: int, num_rewards: int,
                       group_size: int, t: int) -> tuple[int, ...]:
    """The chain's output shape with completions of ``t`` tokens."""

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
      return tuple(jax.eval_shape(run, rewards).shape)
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"Algorithm.advantage cannot take rewards [N, R] = [{num_rows}, "
          f"{num_rewards}] with group_size={group_size}: {e} Start the chain "
          "with advantages.sum_rewards() or advantages.normalize_each_reward()."
      ) from e


def advantage_extra_args(lengths_N: jax.Array, seq_log_ratio_N: jax.Array,
                         tokens_NxT: jax.Array,
                         completion_mask_NxT: jax.Array,
                         token_rewards_NxT: jax.Array | None = None,
                         tree_nodes_NxD: jax.Array | None = None
                         ) -> dict[str, jax.Array]:
  """The per-row extra arguments every advantage chain receives, besides
  ``group_size``, ``mask_N`` and ``reward_weights_R``: the completion
  lengths ``lengths_N``, the sequence log-ratio
  ``seq_log_ratio_N = log pi_old(y) / mu(y)`` (0 without the sampler's policy
  logprobs), the completions ``tokens_NxT`` / ``completion_mask_NxT``
  (KTAE, whose advantages are ``[N, T]``) and, for a multi-turn batch, the
  per-token rewards ``token_rewards_NxT`` (an environment's turn rewards:
  ``batch_layout.token_rewards``; read by ``whiten_by_tokens``, ReMax's
  ``center_by_greedy_baseline``) and, for a tree rollout, each row's
  ancestors ``tree_nodes_NxD`` (``Rollout.tree_nodes``; read by TreePO's
  ``center_by_subtrees``). Transforms that do not read them ignore them."""
  out = {"lengths_N": lengths_N, "seq_log_ratio_N": seq_log_ratio_N,
         "tokens_NxT": tokens_NxT, "completion_mask_NxT": completion_mask_NxT}
  if token_rewards_NxT is not None:
    out["token_rewards_NxT"] = token_rewards_NxT
  if tree_nodes_NxD is not None:
    out["tree_nodes_NxD"] = tree_nodes_NxD
  return out


def advantage_chain(rl: Mapping[str, Any], group_size: int,
                    max_new_tokens: int | None = None) -> _Tx:
  """The rewards ``[N, R]`` -> advantages ``[N]`` chain named by ``rl.advantage``.

  ``rl.advantage`` is a preset or links joined with ``"+"``
  (``table.ADVANTAGES``); with ``rl.advantage_clip`` the advantages are
  clipped last. ``group_size`` is ``G`` (``rl.group_size``); the chain sees
  ``G + extra_samples`` rows per group (``G + 1`` for MC-GRPO and ReMax). Conventions: ``rl.std_eps`` (None: each
  chain's own, 1e-6 as verl, 1e-4 for TRL's ``grpo_batch_std`` and GDPO) is
  added to every std; ``rl.singleton_groups`` is what a group with one valid
  sample gets. ``max_new_tokens`` (the generation budget) is needed by
  ``overlong_penalty``. Fields ``rl`` leaves out take their defaults
  (``schema.FIELDS``).
  """
  rl = schema.complete("rl", rl)
  check_choice("rl.singleton_groups", rl["singleton_groups"],
               schema.fields()["rl.singleton_groups"].choices)
  ctx = table.Context(group_size, max_new_tokens, extra_samples=(
      sampling_needs(rl["advantage"])["extra_samples"]))
  links = table.advantage_links(rl["advantage"])
  chains = [table.ADVANTAGES[link].build(rl, ctx) for link in links]
  # One reward head, then each link's transforms.
  chain = chains[0] + [tx for c in chains[1:] for tx in c[1:]]
  if rl["advantage_clip"] and links[-1] != "clip_advantages":
    chain.append(adv_lib.clip_advantages(float(rl["advantage_clip"])))
  return optax.chain(*chain)


def coefficient_chain(rl: Mapping[str, Any], seed: int | None = None) -> _Tx:
  """The per-token coefficient chain of ``rl.objective`` and ``rl.is_correction``.

  ``seed`` seeds Clip-Cov's token draw (``rl.objective="clip_cov"`` needs
  it; ``build`` passes the config's ``seed``). KL-Cov's penalty and the
  rejection mask are loss terms of the step (``RLStepConfig``), not links.
  Fields ``rl`` leaves out take their defaults (``schema.FIELDS``).
  """
  rl = schema.complete("rl", rl)
  check_choice("rl.objective", rl["objective"], table.OBJECTIVES)
  check_choice("rl.is_correction", rl["is_correction"], table.IS_CORRECTIONS)
  check_choice("rl.is_level", rl["is_level"], obj_lib.LEVELS)
  ctx = table.Context(group_size=0, seed=seed)
  objective = table.OBJECTIVES[rl["objective"]]
  if objective.check is not None:
    objective.check(rl, ctx, None)
  links = (objective.build(rl, ctx)
           + table.IS_CORRECTIONS[rl["is_correction"]].build(rl, ctx))
  return optax.chain(*links) if links else obj_lib.reinforce()


def optimizer(opt: Mapping[str, Any], num_updates: int) -> _Tx:
  """The optax optimizer of the ``optimizer`` section (name, lr, schedule...).

  Args:
    opt: the config's ``optimizer`` section (missing fields: defaults).
    num_updates: optimizer updates of the whole run (for the cosine decay).
  """
  opt = schema.complete("optimizer", opt)
  fields = schema.fields()
  for name in ("name", "schedule", "ess_scaling"):
    check_choice(f"optimizer.{name}", opt[name],
                 fields[f"optimizer.{name}"].choices)
  lr = float(opt["learning_rate"])
  warmup = int(opt["warmup_steps"])
  if opt["schedule"] == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(warmup, 1), max(num_updates, warmup + 1),
        end_value=lr * float(opt["final_lr_fraction"]))
  elif warmup:
    schedule = optax.linear_schedule(0.0, lr, warmup)
  else:
    schedule = lr
  return optim_lib.make_optimizer(
      opt["name"], schedule, weight_decay=float(opt["weight_decay"]),
      b1=opt["b1"], b2=opt["b2"], max_grad_norm=opt["max_grad_norm"],
      ess_scaling=opt["ess_scaling"],
      max_consecutive_nonfinite=opt["max_consecutive_nonfinite"])


def sampling_needs(advantage: str) -> dict[str, Any]:
  """``extra_samples``, ``drop_pivot``, ``greedy_baseline`` and ``critic``
  of a chain, from its entries' traits."""
  entries = [table.ADVANTAGES[n] for n in table.advantage_links(advantage)]
  return {"extra_samples": max(e.extra_samples for e in entries),
          "drop_pivot": any(e.drop_pivot for e in entries),
          "greedy_baseline": any(e.greedy_baseline for e in entries),
          "critic": any(e.needs_critic for e in entries)}


def from_config(rl: Mapping[str, Any], opt: Mapping[str, Any],
                max_new_tokens: int | None = None,
                seed: int | None = None) -> Algorithm:
  """The ``Algorithm`` named by a config's ``rl`` and ``optimizer`` sections
  (``max_new_tokens``: the generation budget, for ``overlong_penalty``;
  ``seed``: for ``rl.objective="clip_cov"``; missing fields: defaults)."""
  rl = schema.complete("rl", rl)
  needs = sampling_needs(rl["advantage"])
  num_updates = (int(rl["num_steps"]) * int(rl["num_epochs"])
                 * int(rl["num_minibatches"]))
  ess_kl = rl["ess_kl_coef"]
  if ess_kl is None:
    ess_kl = table.OBJECTIVES[rl["objective"]].ess_kl_coef
  return Algorithm(
      advantage=advantage_chain(rl, int(rl["group_size"]), max_new_tokens),
      coefficient=coefficient_chain(rl, seed),
      optimizer=optimizer(opt, num_updates),
      ess_kl_coef=float(ess_kl), ess_pooling=rl["ess_pooling"],
      failed_rewards=rl["failed_rewards"],
      name=f"{rl['advantage']}/{rl['objective']}", **needs)
