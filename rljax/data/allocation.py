"""How many samples each prompt of a step gets: rollout allocation.

GRPO gives every prompt of a step the same ``G`` samples. A prompt whose
samples all get the same reward teaches nothing, and one whose rewards vary
most carries the largest advantages. The allocators here spend the same
budget of ``B * G`` rows per step in rounds, each round giving more samples
to the prompts whose rewards have varied most so far. The trained batch is
still ``B * G`` rows (static shapes, one train program), but its groups have
unequal sizes: the advantage chain runs on them through
``advantages.by_group_ids`` (``rljax/rollout/collector.py``).

* **VIGOR** (``rl.allocation.name="vigor"``; Jiang, Liu and Mirzasoleiman,
  "Learning as Reasoning Unfolds: Progressive Rollout Allocation for
  Efficient Reinforcement Learning", arXiv 2607.22002): ``T`` rounds
  (``rl.allocation.rounds``); every prompt starts with ``m0 = G / T``
  samples; after each round the ``1 / growth`` of the active prompts with
  the highest reward variance (over all their samples so far) stay active
  and get ``growth`` times the previous round's samples each. Every round
  samples ``B * m0`` rows. The paper's defaults, ``T = 4``, ``m0 = 2``,
  ``growth = 2`` (its ``alpha = 1 / 2``, ``gamma = 2``), give groups of 2,
  6, 14 or 30 samples for ``G = 8``.
* **Pilot-Commit** (``rl.allocation.name="pilot_commit"``): a pilot round
  spends ``rl.allocation.pilot_fraction`` of the budget (that share of
  ``G`` samples per prompt); the rest is committed in equal parts to the
  ``rl.allocation.commit_fraction`` of the prompts with the highest pilot
  reward variance; the others keep their pilot samples only.

* **sGPO** (``rl.allocation.name="sgpo"``; sorted Group Policy
  Optimization): before the first RL step a profiling pass samples
  ``rl.allocation.profile_samples`` completions of every training prompt
  with the initial policy, giving each its success rate ``p``. Trivial
  prompts (``p = 1``) leave the pool; unsolved ones (``p = 0``) stay with
  probability ``rl.allocation.unsolved_keep``; the rest are ordered easy
  to hard (a curriculum: decreasing ``p``, ties in a seeded order) and each
  step takes the next ``B`` of them. Within the step's budget a prompt's
  group size is about ``1 / p`` (``group_sizes``: proportional to
  ``1 / max(p, 1 / max_group)``, at least 2, at most
  ``rl.allocation.max_group``).

Variance is the population variance of a prompt's weighted reward totals
over its scored rows (rows whose every reward failed do not count; fewer
than two rows: 0). Ties, and there are many at 0, go to the prompt drawn
first. Allocation is a function of the step's rewards alone: it keeps no
state, so a resumed run allocates what the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

NAMES = ("none", "vigor", "pilot_commit", "sgpo")
"""The values ``rl.allocation.name`` accepts."""


class Schedule(NamedTuple):
  """A step's rounds.

  Attributes:
    prompts: per round, how many prompts are sampled (the first: all ``B``).
    samples: per round, how many samples each of them gets.
  """

  prompts: tuple[int, ...]
  samples: tuple[int, ...]

  @property
  def rows(self) -> int:
    """Rows sampled in the step, all rounds (the budget, ``B * G``)."""
    return sum(p * s for p, s in zip(self.prompts, self.samples))

  @property
  def max_group(self) -> int:
    """The largest group: a prompt active in every round."""
    return sum(self.samples)

  @property
  def sampler_samples(self) -> int:
    """Samples per prompt entry of the sampler (every round's count is a
    multiple: a prompt getting ``k`` of them is entered ``k / this``
    times)."""
    return math.gcd(*self.samples)

  @property
  def round_entries(self) -> int:
    """The most prompt entries one round gives the sampler (a plan of
    fixed capacity, continuous batching's queue, is built for them)."""
    return max(p * s for p, s in zip(self.prompts, self.samples)
               ) // self.sampler_samples


def vigor(batch_size: int, group_size: int, rounds: int = 4,
          growth: int = 2) -> Schedule:
  """VIGOR's rounds for ``B`` prompts and a budget of ``G`` samples each."""
  fn = "rl.allocation.name='vigor'"
  if rounds < 1 or growth < 2:
    raise ValueError(f"{fn}: rl.allocation.rounds={rounds} (>= 1) and "
                     f"rl.allocation.growth={growth} (>= 2) are accepted.")
  if group_size % rounds:
    raise ValueError(
        f"{fn}: rl.group_size={group_size} does not split into "
        f"rl.allocation.rounds={rounds} rounds of equal budget; accepted: a "
        f"group size that is a multiple of {rounds}.")
  if batch_size % growth ** (rounds - 1):
    raise ValueError(
        f"{fn}: rl.prompts_per_step={batch_size} cannot keep 1/{growth} of "
        f"its prompts {rounds - 1} times; accepted: a multiple of "
        f"{growth ** (rounds - 1)} (rl.allocation.growth ** (rounds - 1)).")
  first = group_size // rounds
  return Schedule(tuple(batch_size // growth ** t for t in range(rounds)),
                  tuple(first * growth ** t for t in range(rounds)))


def pilot_commit(batch_size: int, group_size: int, pilot_fraction: float,
                 commit_fraction: float) -> Schedule:
  """Pilot-Commit's two rounds: ``round(pilot_fraction * G)`` samples for
  every prompt, then the rest of the budget in equal parts to
  ``round(commit_fraction * B)`` prompts."""
  fn = "rl.allocation.name='pilot_commit'"
  pilot = round(pilot_fraction * group_size)
  committed = round(commit_fraction * batch_size)
  if not 1 <= pilot < group_size:
    raise ValueError(
        f"{fn}: rl.allocation.pilot_fraction={pilot_fraction} gives {pilot} "
        f"pilot samples of rl.group_size={group_size}; accepted: a fraction "
        f"giving 1 to {group_size - 1}.")
  rest = batch_size * (group_size - pilot)
  if not 1 <= committed <= batch_size or rest % committed:
    raise ValueError(
        f"{fn}: rl.allocation.commit_fraction={commit_fraction} commits to "
        f"{committed} of {batch_size} prompts, which do not share the "
        f"{rest} remaining samples equally; accepted: a fraction giving a "
        f"divisor of {rest} between 1 and {batch_size}.")
  return Schedule((batch_size, committed), (pilot, rest // committed))


def group_sizes(success_B: np.ndarray, budget: int, max_group: int,
                min_group: int = 2) -> np.ndarray:
  """sGPO's group sizes: about ``1 / p`` each, scaled to ``budget`` rows.

  Weights ``w = 1 / max(p, 1 / max_group)``; sizes are ``budget * w /
  sum(w)`` clipped to ``[min_group, max_group]``, then rounded down, and
  the rows still missing (or in excess) go one at a time to the prompts
  with the largest remainders (the smallest), within the bounds."""
  p = np.asarray(success_B, np.float64)
  b = len(p)
  if not b * min_group <= budget <= b * max_group:
    raise ValueError(f"sGPO: a budget of {budget} rows cannot give {b} "
                     f"prompts {min_group} to {max_group} samples each.")
  w = 1.0 / np.maximum(p, 1.0 / max_group)
  target = np.clip(budget * w / w.sum(), min_group, max_group)
  sizes = np.floor(target).astype(np.int64)
  remainder = target - sizes
  order = np.argsort(-remainder, kind="stable")
  while sizes.sum() < budget:
    for i in order:
      if sizes.sum() < budget and sizes[i] < max_group:
        sizes[i] += 1
  for i in order[::-1]:
    while sizes.sum() > budget and sizes[i] > min_group:
      sizes[i] -= 1
  return sizes


class SgpoState(NamedTuple):
  """sGPO's checkpointed state: each training prompt's profiled success
  rate (NaN before profiling), the curriculum (prompt indices in training
  order) and the position in it."""

  success: np.ndarray
  order: np.ndarray
  cursor: np.ndarray


class Sgpo:
  """sGPO: a profiled pool, a curriculum through it, group sizes ~ ``1/p``.

  Args:
    batch_size, group_size: ``B`` and ``G`` (the step's budget is ``B G``).
    profile_samples: completions per prompt in the profiling pass.
    max_group: the largest group (``G_max``).
    unsolved_keep: the share of never-solved prompts kept in the pool.
    seed: the config's seed (the subsample and the ties' order).
  """

  def __init__(self, *, batch_size: int, group_size: int,
               profile_samples: int = 4, max_group: int = 32,
               unsolved_keep: float = 0.25, seed: int = 0):
    if group_size < 2 or max_group < group_size:
      raise ValueError(
          f"rl.allocation.max_group={max_group} with rl.group_size="
          f"{group_size}: sGPO needs groups of at least 2 and max_group >= "
          "rl.group_size.")
    if profile_samples < 1:
      raise ValueError(f"rl.allocation.profile_samples={profile_samples}: "
                       ">= 1 is accepted.")
    self.batch_size, self.group_size = batch_size, group_size
    self.profile_samples, self.max_group = profile_samples, max_group
    self.unsolved_keep, self.seed = unsolved_keep, seed
    self.state = SgpoState(np.zeros(0), np.zeros(0, np.int64),
                           np.zeros(1, np.int64))
    self.pool: Sequence[Any] | None = None
    self.longest: int | None = None

  def attach(self, pool: Sequence[Any], longest: int) -> None:
    """The training examples (dicts of fields) and their longest prompt's
    token count (every sampler call pads to it: one program)."""
    if len(pool) < self.batch_size:
      raise ValueError(f"sGPO: {len(pool)} training prompts for "
                       f"rl.prompts_per_step={self.batch_size}.")
    self.pool, self.longest = pool, int(longest)

  # The Schedule-like view ``Collector`` and ``build`` read.
  @property
  def prompts(self) -> tuple[int]:
    return (self.batch_size,)

  @property
  def rows(self) -> int:
    return self.batch_size * self.group_size

  sampler_samples = 1

  @property
  def round_entries(self) -> int:
    """Entries of the step's one round, and of each profiling call."""
    return self.rows

  @property
  def profiled(self) -> bool:
    return len(self.state.order) > 0

  def set_profile(self, success: np.ndarray) -> None:
    """The pool and curriculum from each prompt's profiled success rate."""
    p = np.asarray(success, np.float64)
    rng = np.random.default_rng((self.seed, 0x56504f))  # "sGPO"
    tiebreak = rng.permutation(len(p))
    keep = p < 1.0
    unsolved = p <= 0.0
    keep &= ~unsolved | (rng.random(len(p)) < self.unsolved_keep)
    if keep.sum() < self.batch_size:
      raise ValueError(
          f"sGPO: only {int(keep.sum())} of {len(p)} training prompts are "
          f"neither trivial (every profiled sample right) nor dropped as "
          f"unsolved; a step needs rl.prompts_per_step={self.batch_size}. "
          "Raise rl.allocation.unsolved_keep or use a harder task.")
    kept = np.flatnonzero(keep)
    order = kept[np.lexsort((tiebreak[kept], -p[kept]))]
    self.state = SgpoState(p, order.astype(np.int64), np.zeros(1, np.int64))

  def next_prompts(self, count: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt indices [count], group sizes [count])`` of the next step:
    the curriculum's next ``count`` prompts (wrapping around; default
    ``B``), sized by ``group_sizes`` from a budget of ``count * G`` rows. A
    step that replays ``R`` groups asks for ``B - R``: the replayed groups
    hold the other ``R * G`` rows, and the curriculum moves on by the
    prompts it sampled."""
    count = self.batch_size if count is None else int(count)
    if not 1 <= count <= self.batch_size:
      raise ValueError(f"sGPO: {count} prompts for a step of "
                       f"rl.prompts_per_step={self.batch_size}: 1 to "
                       f"{self.batch_size} are accepted.")
    order, cursor = self.state.order, int(self.state.cursor[0])
    idx = order[(cursor + np.arange(count)) % len(order)]
    self.state = self.state._replace(cursor=np.asarray(
        [(cursor + count) % len(order)], np.int64))
    return idx, group_sizes(self.state.success[idx], count * self.group_size,
                            self.max_group)

  def arrays(self) -> dict[str, np.ndarray]:
    """The state as named host arrays (a checkpoint item)."""
    return dict(self.state._asdict())

  def load_arrays(self, arrays) -> None:
    """Restores ``arrays()``; a missing or malformed field is named."""
    missing = [f for f in SgpoState._fields if f not in arrays]
    if missing:
      raise ValueError(f"the checkpoint's sGPO state lacks {missing}.")
    state = SgpoState(*(np.asarray(arrays[f]) for f in SgpoState._fields))
    if (state.cursor.shape != (1,) or state.order.ndim != 1
        or (len(state.order) and (state.order.max() >= len(state.success)
                                  or state.order.min() < 0))):
      raise ValueError("the checkpoint's sGPO state is inconsistent: "
                       f"{[np.shape(x) for x in state]}.")
    self.state = SgpoState(state.success.astype(np.float64),
                           state.order.astype(np.int64),
                           state.cursor.astype(np.int64))


def make_schedule(name: str, *, batch_size: int, group_size: int,
                  rounds: int = 4, growth: int = 2,
                  pilot_fraction: float = 0.25,
                  commit_fraction: float = 0.25, profile_samples: int = 4,
                  max_group: int = 32, unsolved_keep: float = 0.25,
                  seed: int = 0) -> Schedule | Sgpo | None:
  """The ``Schedule`` (or, for sGPO, the ``Sgpo``) of ``rl.allocation``;
  None for ``"none"``."""
  if name not in NAMES:
    raise ValueError(f"rl.allocation.name={name!r}; accepted: {NAMES}.")
  if name == "none":
    return None
  if name == "sgpo":
    return Sgpo(batch_size=batch_size, group_size=group_size,
                profile_samples=profile_samples, max_group=max_group,
                unsolved_keep=unsolved_keep, seed=seed)
  if name == "vigor":
    return vigor(batch_size, group_size, rounds, growth)
  return pilot_commit(batch_size, group_size, pilot_fraction, commit_fraction)


def variances(totals: Sequence[Sequence[float]]) -> np.ndarray:
  """``[B]`` population variance of each prompt's scored totals (0 with
  fewer than two)."""
  return np.asarray([float(np.var(np.asarray(t, np.float64))) if len(t) >= 2
                     else 0.0 for t in totals])


def choose(variance_B: np.ndarray, active: np.ndarray, keep: int
           ) -> np.ndarray:
  """The ``keep`` prompts of ``active`` with the highest variance; ties to
  the prompt drawn first. Returned in ascending order."""
  active = np.asarray(active, np.int64)
  order = np.argsort(-np.asarray(variance_B, np.float64)[active],
                     kind="stable")
  return np.sort(active[order[:keep]])


def entries(active: np.ndarray, samples: int, sampler_samples: int
            ) -> np.ndarray:
  """The sampler's prompt entries of a round: each active prompt (index
  into the step's batch) repeated ``samples / sampler_samples`` times."""
  return np.repeat(np.asarray(active, np.int64), samples // sampler_samples)


__all__ = ["NAMES", "Schedule", "Sgpo", "SgpoState", "choose", "entries",
           "group_sizes", "make_schedule", "pilot_commit", "variances",
           "vigor"]
