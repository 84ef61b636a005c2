"""Guess-a-number: a multi-turn game with higher/lower feedback.

The secret is an integer in ``[1, high]`` (the example's fields); the prompt
names the range, e.g. ``"1-20?"``. Each model turn is a guess (a number, then
the end-of-turn token); the observation is ``"+"`` (the secret is higher) or
``"-"`` (lower), or ``"?"`` for a turn that is not a number. The episode
ends at the right guess (reward 1) or after ``max_guesses`` guesses
(reward 0). Binary search solves every secret up to ``2^k - 1`` in ``k``
guesses; guessing at random among the numbers the hints allow solves about
70% of ``[1, 31]`` in 5: what RL has to find is the halving.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from rljax.envs.base import Step


@dataclasses.dataclass(frozen=True)
class GuessNumberEnv:
  """The guessing game (see the module docstring).

  Attributes:
    max_guesses: guesses before the episode ends unsolved.
  """

  max_guesses: int = 5
  stop_strings: tuple[str, ...] = ()

  def reset(self, example: dict[str, Any]) -> tuple[str, Any]:
    return example["prompt"], {"secret": int(example["secret"]), "guesses": 0}

  def step(self, state: Any, action: str) -> Step:
    guesses = state["guesses"] + 1
    state = dict(state, guesses=guesses)
    match = re.fullmatch(r"\s*(\d{1,6})\s*", action)
    if match and int(match.group(1)) == state["secret"]:
      return Step(reward=1.0, done=True, state=state,
                  info={"invalid_guesses": 0.0})
    if guesses >= self.max_guesses:
      return Step(reward=0.0, done=True, state=state,
                  info={"invalid_guesses": float(not match)})
    if not match:
      return Step(observation="?", state=state, info={"invalid_guesses": 1.0})
    higher = state["secret"] > int(match.group(1))
    return Step(observation="+" if higher else "-", state=state,
                info={"invalid_guesses": 0.0})
