"""An adaptive KL coefficient that holds a target KL (``rl.kl_target``).

Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
(https://arxiv.org/abs/1909.08593, section 2.2), as TRL's
``AdaptiveKLController`` and OpenRLHF's: after each step, with the step's
measured KL to the reference (``kl``, the metric of the KL term) and ``n``
the step's trained rows,

    e = clip(kl / kl_target - 1, -0.2, 0.2)
    kl_coef <- kl_coef * (1 + e * n / kl_horizon)

so the coefficient grows while the policy drifts beyond the target and
shrinks while it stays within. ``rl.kl_coef`` is the starting value. The
coefficient reaches the step as ``RLBatch.kl_coef_N`` (one value on every
row: the compiled step does not change), it is logged as ``kl_coef``, and
a checkpoint keeps it (``Session.kl_coef``), so a resumed run goes on with
the value the uninterrupted run had.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rljax import sharding

MAX_ERROR = 0.2


def next_coef(coef: float, kl: float, target: float, n: int,
              horizon: int) -> float:
  """The coefficient after a step that measured ``kl`` (the module
  docstring's update); a non-finite ``kl`` leaves it as it is."""
  if not math.isfinite(kl):
    return coef
  error = min(max(kl / target - 1.0, -MAX_ERROR), MAX_ERROR)
  return coef * (1.0 + error * n / horizon)


class AdaptiveKL:
  """The controller of one run: ``value`` now, ``update`` after a step,
  ``wrap`` a (jitted) ``rl_step`` to hand it the value."""

  def __init__(self, value: float, target: float, horizon: int,
               mesh: jax.sharding.Mesh):
    self.value, self.target, self.horizon = float(value), target, horizon
    self.mesh = mesh

  def update(self, kl: float, n: int) -> None:
    self.value = next_coef(self.value, kl, self.target, n, self.horizon)

  def wrap(self, rl_step: Callable[..., Any]) -> Callable[..., Any]:
    sharded = sharding.batch_sharding(self.mesh, 1)

    def step(state, batch, *args):
      n = batch.tokens_NxL.shape[0]
      coef = np.full((n,), self.value, np.float32)
      # A global array on every process count: each supplies its shards.
      coef_N = jax.make_array_from_callback((n,), sharded,
                                            lambda index: coef[index])
      return rl_step(state, batch._replace(kl_coef_N=coef_N), *args)
    return step


def from_config(config: Any, mesh: jax.sharding.Mesh,
                restored: float | None = None) -> AdaptiveKL | None:
  """The controller of ``rl.kl_target`` (None: a fixed ``rl.kl_coef``),
  starting at ``restored`` (a checkpoint's value) or ``rl.kl_coef``."""
  rl = config.rl
  if rl.kl_target is None:
    return None
  start = float(rl.kl_coef) if restored is None else float(restored)
  return AdaptiveKL(start, float(rl.kl_target), int(rl.kl_horizon), mesh)


def attach(config: Any, mesh: jax.sharding.Mesh, run: Any,
           rl_step: Callable[..., Any]
           ) -> tuple[Callable[..., Any], AdaptiveKL | None]:
  """``(rl_step, controller)``: with ``rl.kl_target`` the step wrapped to
  read the controller's value (resumed from ``run.kl_coef``, a
  ``session.Session``'s), else as it is and None."""
  controller = from_config(config, mesh, run.kl_coef)
  if controller is None:
    return rl_step, None
  run.kl_coef = controller.value
  return controller.wrap(rl_step), controller


def observe(controller: AdaptiveKL | None, run: Any,
            metrics: dict[str, float], n: int) -> None:
  """After a step: the next step's coefficient from its ``kl`` metric,
  kept in ``run.kl_coef`` for the checkpoints."""
  if controller is not None:
    controller.update(metrics["kl"], n)
    run.kl_coef = controller.value


__all__ = ["AdaptiveKL", "attach", "from_config", "next_coef", "observe"]
