"""A calculator tool for arithmetic word problems.

The model calls the tool by writing ``<calc>EXPRESSION</calc>``: the turn
ends at ``</calc>`` (a stop string) and the observation is ``=VALUE;``,
computed by ``rewards.parsing.evaluate_expression`` (an exact, whitelisted
arithmetic parser: never ``eval``). A turn without a tool call is the
answer: the episode ends and is rewarded 1 if its final number equals the
example's ``answer``, else 0.

Example::

    prompt:      "12 packs of 13 pens and 5 more. How many?"
    model turn:  "<calc>12*13+5</calc>"       (ends at the stop string)
    observation: "=161;"
    model turn:  "161" + EOS                  -> reward 1, done
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, ClassVar

from rljax.envs.base import Step
from rljax.rewards import parsing


def format_value(value: Fraction) -> str:
  """An exact value as the tool writes it: an integer, or ``p/q``."""
  return str(value.numerator) if value.denominator == 1 else str(value)


@dataclasses.dataclass(frozen=True)
class CalculatorEnv:
  """The calculator environment (see the module docstring).

  Attributes:
    open_tag, close_tag: the tool call's delimiters; ``close_tag`` is the
      turn's stop string.
    max_calls: tool calls per episode; the next call is answered with an
      error observation and counted (``env/tool_errors``).
  """

  open_tag: str = "<calc>"
  close_tag: str = "</calc>"
  max_calls: int = 4
  tools: ClassVar[tuple[str, ...]] = ("calc",)

  @property
  def stop_strings(self) -> tuple[str, ...]:
    return (self.close_tag,)

  def reset(self, example: dict[str, Any]) -> tuple[str, Any]:
    return example["prompt"], {"answer": str(example["answer"]), "calls": 0}

  def step(self, state: Any, action: str) -> Step:
    if action.endswith(self.close_tag):
      calls = state["calls"] + 1
      start = action.rfind(self.open_tag)
      expression = (action[start + len(self.open_tag):-len(self.close_tag)]
                    if start >= 0 else "")
      value = (parsing.evaluate_expression(expression)
               if calls <= self.max_calls else None)
      error = value is None
      return Step(observation="=error;" if error
                  else f"={format_value(value)};",
                  state=dict(state, calls=calls),
                  info={"tool_calls": 1.0, "tool_errors": float(error)})
    answer = parsing.extract_final_answer(action)
    correct = parsing.answers_match(answer, state["answer"])
    return Step(reward=1.0 if correct else 0.0, done=True, state=state)
