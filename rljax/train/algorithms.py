"""Choosing the algorithm by name: advantage chain, coefficient chain, optimizer.

Configs name components (``rl.advantage = "grpo"``, ``rl.objective =
"ppo_clip"``, ``rl.is_correction = "tis"``); these builders turn names into
optax transform chains and fail with the accepted names otherwise.
"""

from __future__ import annotations

from typing import Any

import optax

from rljax import advantages as adv_lib
from rljax import objectives as obj_lib
from rljax import optim as optim_lib

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "mc_grpo", "gdpo",
              "batch_std")
# Advantage chains that divide by a per-group statistic: they need G >= 2.
GROUP_STATISTIC_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                              "mc_grpo", "gdpo")
OBJECTIVES = ("ppo_clip", "dual_clip", "gspo", "cispo", "ess", "reinforce")
IS_CORRECTIONS = ("none", "tis", "mis")


def _get(cfg, name, default=None):
  return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def check_choice(field: str, value: Any, accepted: tuple[str, ...]) -> None:
  if value not in accepted:
    raise ValueError(f"{field}={value!r} is unknown; accepted: {accepted}.")


def advantage_transform(rl: Any) -> optax.GradientTransformationExtraArgs:
  """The reward -> advantage chain named by ``rl.advantage``."""
  name = _get(rl, "advantage", "grpo")
  check_choice("rl.advantage", name, ADVANTAGES)
  clip = _get(rl, "advantage_clip", None)
  base = {
      "grpo": lambda: adv_lib.grpo(),
      "dr_grpo": adv_lib.dr_grpo,
      "rloo": adv_lib.rloo,
      "reinforce_pp": lambda: adv_lib.reinforce_pp_baseline(),
      "mc_grpo": lambda: adv_lib.mc_grpo(),
      "gdpo": lambda: adv_lib.gdpo(),
      "batch_std": lambda: optax.chain(adv_lib.center_by_batch_mean(),
                                       adv_lib.scale_by_batch_std()),
  }[name]()
  if clip:
    return optax.chain(base, adv_lib.clip_advantages(float(clip)))
  return base


def coefficient_transform(rl: Any) -> optax.GradientTransformationExtraArgs:
  """The per-token coefficient chain named by ``rl.objective`` and ``rl.is_correction``."""
  objective = _get(rl, "objective", "ppo_clip")
  check_choice("rl.objective", objective, OBJECTIVES)
  correction = _get(rl, "is_correction", "none")
  check_choice("rl.is_correction", correction, IS_CORRECTIONS)
  eps_low = float(_get(rl, "clip_eps_low", 0.2))
  eps_high = _get(rl, "clip_eps_high", None)
  eps_high = eps_low if eps_high is None else float(eps_high)
  links = {
      "ppo_clip": lambda: [obj_lib.ppo_clip(eps_low, eps_high)],
      "dual_clip": lambda: [obj_lib.ppo_clip(eps_low, eps_high),
                            obj_lib.dual_clip(float(_get(rl, "dual_clip_c", 3.0)))],
      "gspo": lambda: [obj_lib.gspo(float(_get(rl, "gspo_eps_low", 3e-4)),
                                    float(_get(rl, "gspo_eps_high", 4e-4)))],
      "cispo": lambda: [obj_lib.cispo(float(_get(rl, "cispo_cap", 5.0)))],
      "ess": lambda: [obj_lib.ess_trust_region()],
      "reinforce": lambda: [],
  }[objective]()
  level = _get(rl, "is_level", "token")
  cap = float(_get(rl, "is_cap", 2.0))
  if correction == "tis":
    links.append(obj_lib.truncated_is(cap=cap, level=level))
  elif correction == "mis":
    links.append(obj_lib.masked_is(high=cap, level=level))
  if not links:
    # Plain REINFORCE: the coefficient is 1 on every token.
    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None, **kw: (updates * 0 + 1, state))
  return optax.chain(*links)


def optimizer(opt: Any, num_steps: int) -> optax.GradientTransformationExtraArgs:
  """The optax optimizer of ``opt`` (name, learning rate, warm-up, ...)."""
  lr = float(_get(opt, "learning_rate", 1e-6))
  warmup = int(_get(opt, "warmup_steps", 0))
  schedule_name = _get(opt, "schedule", "constant")
  check_choice("optimizer.schedule", schedule_name, ("constant", "cosine"))
  if schedule_name == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(warmup, 1), max(num_steps, warmup + 1),
        end_value=lr * float(_get(opt, "final_lr_fraction", 0.1)))
  elif warmup:
    schedule = optax.linear_schedule(0.0, lr, warmup)
  else:
    schedule = lr
  name = _get(opt, "name", "adamw")
  check_choice("optimizer.name", name, tuple(optim_lib.OPTIMIZERS))
  return optim_lib.make_optimizer(
      name, schedule,
      weight_decay=float(_get(opt, "weight_decay", 0.0)),
      b1=_get(opt, "b1", None), b2=_get(opt, "b2", None),
      max_grad_norm=_get(opt, "max_grad_norm", 1.0),
      ess_scaling=_get(opt, "ess_scaling", None),
      max_consecutive_nonfinite=_get(opt, "max_consecutive_nonfinite", None))
