"""How many samples each prompt of a step gets: rollout allocation.

GRPO gives every prompt of a step the same ``G`` samples. A prompt whose
samples all get the same reward teaches nothing, and one whose rewards vary
most carries the largest advantages. The allocators here spend the same
budget of ``B * G`` rows per step in rounds, each round giving more samples
to the prompts whose rewards have varied most so far. The trained batch is
still ``B * G`` rows (static shapes, one train program), but its groups have
unequal sizes: the advantage chain runs on them through
``advantages.by_group_ids`` (``rljax/train/rollout.py``).

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

Variance is the population variance of a prompt's weighted reward totals
over its scored rows (rows whose every reward failed do not count; fewer
than two rows: 0). Ties, and there are many at 0, go to the prompt drawn
first. Allocation is a function of the step's rewards alone: it keeps no
state, so a resumed run allocates what the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

NAMES = ("none", "vigor", "pilot_commit")
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


def make_schedule(name: str, *, batch_size: int, group_size: int,
                  rounds: int = 4, growth: int = 2,
                  pilot_fraction: float = 0.25,
                  commit_fraction: float = 0.25) -> Schedule | None:
  """The ``Schedule`` of ``rl.allocation``; None for ``"none"``."""
  if name not in NAMES:
    raise ValueError(f"rl.allocation.name={name!r}; accepted: {NAMES}.")
  if name == "none":
    return None
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


__all__ = ["NAMES", "Schedule", "choose", "entries", "make_schedule",
           "pilot_commit", "variances", "vigor"]
