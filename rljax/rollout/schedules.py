"""When rollouts are sampled relative to the updates: the loop's one call.

``loop.py`` asks its schedule for one RL step, ``schedule.step(state, ...)``,
and gets back the new state, the trained batch (``Collected``) and the
train step's metrics. Two schedules are built in:

* ``Synchronous`` (``rl.max_staleness=0``): collect with the current params,
  then train on it. The library's loop, bitwise, as it always was.
* ``OffPolicy`` (``rl.max_staleness=k >= 1``): the batch trained at update
  ``t`` was sampled with the params of update ``t - s``, ``s <= k``. The
  sampling of the next batch is dispatched to the devices first, the train
  step after it, and the host decodes and scores the next batch (and the
  reward workers run) while the devices train: on one mesh shared in time
  that overlaps the host's work with the devices'. Every batch's tokens carry
  their policy version; ``rollout/sampler_lag`` and
  ``rollout/staleness/{mean,max}`` are logged, and the trainer's corrections
  (TIS/MIS, rejection, ESS, SAT) see each token's sampler logprob, the exact
  behaviour policy. With a split mesh (``rl.sampler_devices``) the params
  are published to the sampler's devices (``publish``, a ``device_put``)
  before each update is dispatched, and sampling and training run on
  different devices at the same time.

Checkpoints. Nothing is sampled ahead across a checkpoint: the step before a
checkpoint (``barrier``) trains without prefetching, so a checkpoint holds
no batch in flight and a resumed run continues exactly as the uninterrupted
one. A stop signal between checkpoints saves at once and drops the batches
in flight: the saved data position and carried partial rows are those from
before they were drawn (``checkpoint_extras``), so their prompts are sampled
again, with the restored params, on resume.

A researcher's schedule is any object with ``step`` and
``checkpoint_extras`` (``loop.run(..., schedule=factory)``).

References:
  Noukhovitch et al., "Asynchronous RLHF: Faster and More Efficient
  Off-Policy RL for Language Models", https://arxiv.org/abs/2410.18252
  (one-step off-policy); verl's ``one_step_off_policy`` recipe.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, NamedTuple, Protocol

import jax
import numpy as np

from rljax.rollout.collector import Collected, Collector


class StepOutput(NamedTuple):
  """What ``Schedule.step`` returns.

  Attributes:
    state: the state after the update.
    collected: the batch it was trained on.
    train_metrics: the train step's metrics (host floats).
    metrics: the schedule's own (``rollout/staleness/*``, ``time/train``).
  """

  state: Any
  collected: Collected
  train_metrics: dict[str, Any]
  metrics: dict[str, float]


class Schedule(Protocol):
  """The loop's view of a rollout schedule."""

  def step(self, state: Any, ref_params: Any, extra: tuple, *,
           barrier: bool) -> StepOutput:
    """One update; ``barrier``: a checkpoint follows, sample nothing ahead."""

  def checkpoint_extras(self) -> tuple[Any, Any]:
    """``(data iterator state, carried partial rows)`` to save now."""


def sample_key(state: Any) -> jax.Array:
  """The sampler's key of the batch drawn at ``state`` (its key, folded)."""
  # The key data comes to the host (8 bytes): an uncommitted key gives one
  # fold_in program whatever the state's sharding.
  return jax.random.fold_in(
      jax.random.wrap_key_data(np.asarray(jax.device_get(state.key))), 1)


def staleness_metrics(collected: Collected, version: int,
                      trained_version: int) -> dict[str, float]:
  """``rollout/sampler_lag``: updates between the params that sampled the
  batch (``version``) and those it trains (at most ``rl.max_staleness``);
  ``rollout/staleness/*``: per trained token, ``trained_version`` minus the
  version that drew it (partial rollouts add a carried row's age);
  ``rollout/version_spread``: per row, newest minus oldest token version."""
  versions = collected.token_versions
  if versions is None:
    stale = np.asarray([trained_version - version], np.float64)
    spread = 0.0
  else:
    real = versions >= 0
    stale = (trained_version - versions[real]).astype(np.float64)
    lo = np.where(real, versions, np.iinfo(np.int32).max).min(1)
    hi = np.where(real, versions, -1).max(1)
    rows = real.any(1)
    spread = float((hi - lo)[rows].mean()) if rows.any() else 0.0
  if stale.size == 0:
    stale = np.zeros((1,))
  return {"rollout/sampler_lag": float(trained_version - version),
          "rollout/staleness/mean": float(stale.mean()),
          "rollout/staleness/max": float(stale.max()),
          "rollout/version_spread": spread}


class Synchronous:
  """Collect with the current params, then train (``rl.max_staleness=0``)."""

  def __init__(self, collector: Collector, iterator: Any, rl_step: Callable,
               mesh: jax.sharding.Mesh, *, publish: Callable | None = None):
    self.collector, self.iterator = collector, iterator
    self.rl_step, self.mesh = rl_step, mesh
    # The params where the sampler reads them (a split mesh: a copy).
    self.publish = publish or (lambda params: params)

  def _train(self, state, collected: Collected, ref_params, extra):
    state = state._replace(adv_state=collected.adv_state)
    with jax.set_mesh(self.mesh):
      return self.rl_step(state, collected.batch, ref_params, *extra)

  def step(self, state, ref_params, extra, *, barrier: bool) -> StepOutput:
    del barrier
    version = int(state.step)
    collected = self.collector.collect(
        self.publish(state.params), next(self.iterator), sample_key(state),
        state.adv_state, version=version,
        more_examples=lambda: next(self.iterator))
    t = time.time()
    state, train_metrics = self._train(state, collected, ref_params, extra)
    train_metrics = jax.device_get(train_metrics)
    metrics = {"time/train": time.time() - t,
               **staleness_metrics(collected, version, version)}
    return StepOutput(state, collected, train_metrics, metrics)

  def checkpoint_extras(self):
    return self.iterator.get_state(), self.collector.carried_arrays()


class OffPolicy(Synchronous):
  """Sample up to ``max_staleness`` updates ahead (see the module doc).

  Args: as ``Synchronous``'s, and
    max_staleness: ``k >= 1``.
    num_steps: the run's last update (nothing is sampled beyond it).
  """

  def __init__(self, collector, iterator, rl_step, mesh, *,
               max_staleness: int, num_steps: int,
               publish: Callable | None = None):
    super().__init__(collector, iterator, rl_step, mesh, publish=publish)
    if max_staleness < 1:
      raise ValueError(f"rl.max_staleness={max_staleness}: OffPolicy needs "
                       ">= 1 (0 is Synchronous).")
    self.max_staleness, self.num_steps = max_staleness, num_steps
    # Batches sampled ahead, oldest first: (version, collected, what to save
    # if it is dropped: the data position and carried rows before it).
    self.pending: collections.deque = collections.deque()
    self._adv_state = None

  def _collect(self, state, params, version, for_step, on_dispatch=None):
    before = (self.iterator.get_state(), self.collector.carried_arrays())
    adv_state = (state.adv_state if self._adv_state is None
                 else self._adv_state)
    # The batch trained now is drawn with the synchronous key (so that a
    # schedule that never samples ahead is the synchronous loop, bitwise).
    key = sample_key(state)
    if for_step != int(state.step):
      key = jax.random.fold_in(key, for_step)
    collected = self.collector.collect(
        params, next(self.iterator), key, adv_state, version=version,
        on_dispatch=on_dispatch, more_examples=lambda: next(self.iterator))
    self._adv_state = collected.adv_state
    return version, collected, before

  def step(self, state, ref_params, extra, *, barrier: bool) -> StepOutput:
    t = int(state.step)
    if not self.pending:
      self.pending.append(self._collect(state, self.publish(state.params),
                                        t, t))
    version, collected, _ = self.pending.popleft()
    # Batches still to draw ahead: up to max_staleness, none past the run's
    # end or across a checkpoint.
    ahead = 0 if barrier else min(self.max_staleness,
                                  self.num_steps - t - 1) - len(self.pending)
    # Published before the update is dispatched (it donates state.params).
    params = self.publish(state.params) if ahead >= 1 else None
    for _ in range(max(ahead - 1, 0)):  # deeper ahead: no overlap for these
      self.pending.append(self._collect(state, params, t,
                                        t + 1 + len(self.pending)))
    trained: list[Any] = []
    t_train = [0.0]

    def train():
      start = time.time()
      trained.append(self._train(state, collected, ref_params, extra))
      t_train[0] = time.time() - start

    if ahead >= 1:  # sampler dispatched first, then the update
      self.pending.append(self._collect(state, params, t,
                                        t + 1 + len(self.pending),
                                        on_dispatch=train))
    else:
      train()
    new_state, train_metrics = trained[0]
    start = time.time()
    train_metrics = jax.device_get(train_metrics)
    metrics = {"time/train": t_train[0] + time.time() - start,
               **staleness_metrics(collected, version, t)}
    return StepOutput(new_state, collected, train_metrics, metrics)

  def checkpoint_extras(self):
    if self.pending:
      return self.pending[0][2]
    return super().checkpoint_extras()


def make_schedule(collector: Collector, iterator: Any, rl_step: Callable,
                  mesh: jax.sharding.Mesh, *, max_staleness: int,
                  num_steps: int, publish: Callable | None = None
                  ) -> Schedule:
  """The schedule ``rl.max_staleness`` names; ``publish`` puts the params
  where the sampler reads them (``build.Components.publish``)."""
  if max_staleness == 0:
    return Synchronous(collector, iterator, rl_step, mesh, publish=publish)
  return OffPolicy(collector, iterator, rl_step, mesh,
                   max_staleness=max_staleness, num_steps=num_steps,
                   publish=publish)


__all__ = ["OffPolicy", "Schedule", "StepOutput", "Synchronous",
           "make_schedule", "sample_key", "staleness_metrics"]
