"""Built-in tasks whose examples are generated from a seed.

A task is a frozen dataclass of difficulty knobs. It generates distinct
examples (dicts of plain Python values) for a split, deterministically from a
seed, and knows a reference completion for each (for supervised warm-up and
for training a tokenizer).

Splits: ``"train"`` and ``"heldout"``. Which split a problem belongs to is
fixed by a hash of the problem itself (not of the seed or the template), with
``heldout_fraction`` of all problems held out. So no seed and no template
ever puts a held-out problem in train.

Example:
  >>> task = ArithmeticTask()
  >>> [e["prompt"] + e["answer"] for e in task.examples("train", 2, seed=0)]
  ['13+0=13', '75+58=133']
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import types
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

SPLITS = ("train", "heldout")
_SPLIT_IDS = {"train": 0, "heldout": 1}
_OPERATORS = ("+", "-", "*", "/")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def split_of(key: str, heldout_fraction: float) -> str:
  """The split a problem belongs to, from a stable hash of its key."""
  digest = hashlib.blake2b(key.encode(), digest_size=8,
                           person=b"rljax-split").digest()
  u = int.from_bytes(digest, "little") / 2.0**64
  return "heldout" if u < heldout_fraction else "train"


def _check(name: str, value: Any, ok: bool, accepted: str) -> None:
  if not ok:
    raise ValueError(f"{name}={value!r}: accepted {accepted}.")


def _check_common(task: Any) -> None:
  _check("heldout_fraction", task.heldout_fraction,
         0.0 < task.heldout_fraction < 1.0, "a float in (0, 1)")
  ops = task.operators
  _check("operators", ops, isinstance(ops, tuple) and len(ops) > 0
         and set(ops) <= set(_OPERATORS) and len(set(ops)) == len(ops),
         f"a non-empty tuple of distinct operators from {_OPERATORS}")


class _GeneratedTask(abc.ABC):
  """Shared generation logic: distinct examples, rejection into a split."""

  name: ClassVar[str]
  heldout_fraction: float

  @abc.abstractmethod
  def _draw(self, rng: np.random.Generator) -> dict[str, Any] | None:
    """One random example, or None to draw again."""

  @abc.abstractmethod
  def _key(self, example: dict[str, Any]) -> str:
    """The text that identifies a problem (it decides the problem's split)."""

  @abc.abstractmethod
  def _completion(self, example: dict[str, Any]) -> str:
    """The reference completion of an example."""

  def examples(self, split: str, num_examples: int, seed: int
               ) -> list[dict[str, Any]]:
    """``num_examples`` distinct problems of ``split``, deterministic in seed.

    Args:
      split: ``"train"`` or ``"heldout"``.
      num_examples: how many.
      seed: a non-negative int; the same seed gives the same list.

    Returns:
      A list of example dicts (fields depend on the task; all have
      ``prompt``).

    Raises:
      ValueError: for a bad split or seed, or when the split has fewer
        distinct problems than asked for at these difficulty settings.
    """
    _check("split", split, split in SPLITS, str(SPLITS))
    _check("seed", seed, isinstance(seed, (int, np.integer)) and seed >= 0,
           "a non-negative int")
    _check("num_examples", num_examples, num_examples >= 0, "an int >= 0")
    rng = np.random.default_rng([int(seed), _SPLIT_IDS[split]])
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    max_draws = max(20_000, 200 * num_examples)
    draws = 0
    while len(out) < num_examples:
      if draws >= max_draws:
        raise ValueError(
            f"{self.name}: only {len(out)} distinct {split!r} problems found "
            f"in {draws} draws, num_examples={num_examples}: ask for fewer "
            f"or make the task larger ({self!r}).")
      draws += 1
      example = self._draw(rng)
      if example is None:
        continue
      key = self._key(example)
      if key in seen or split_of(key, self.heldout_fraction) != split:
        continue
      seen.add(key)
      out.append(example)
    return out

  def sft_examples(self, split: str, num_examples: int, seed: int
                   ) -> list[dict[str, Any]]:
    """Like ``examples``, each with a reference ``completion`` added."""
    return [dict(e, completion=self._completion(e))
            for e in self.examples(split, num_examples, seed)]

  def tokenizer_corpus(self, num_examples: int, seed: int) -> list[str]:
    """Texts to train a tokenizer on: train prompts with their completions.

    A final line holds every digit and operator, so each has a piece even in
    a small corpus.
    """
    texts = [e["prompt"] + e["completion"]
             for e in self.sft_examples("train", num_examples, seed)]
    return texts + ["0123456789 +-*/()="]


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(_GeneratedTask):
  """Integer arithmetic: ``"12+34="`` -> ``"46"``.

  Operands have between ``min_digits`` and ``max_digits`` digits (``0..9``
  counts as one digit); the count is drawn uniformly, then the value.
  Operators follow the usual precedence; a ``/`` must divide the product to
  its left exactly (with two operands the dividend is built as a multiple of
  the divisor), so every intermediate value is an integer.

  Fields: ``prompt``, ``answer`` (the value as a string), ``expression``.
  Reward: ``numeric_match`` (or ``arithmetic``, which reads the prompt).

  Attributes:
    min_digits: fewest digits of an operand, >= 1.
    max_digits: most digits of an operand, <= 9.
    num_operands: operands per expression, 2..8.
    operators: drawn uniformly from these (``+ - * /``).
    allow_negative: allow a negative result.
    template: the prompt; ``{expression}`` is replaced.
    heldout_fraction: fraction of all problems held out.
  """

  name: ClassVar[str] = "arithmetic"
  default_rewards: ClassVar[tuple[str, ...]] = ("numeric_match",)

  min_digits: int = 1
  max_digits: int = 2
  num_operands: int = 2
  operators: tuple[str, ...] = ("+",)
  allow_negative: bool = False
  template: str = "{expression}="
  heldout_fraction: float = 0.1

  def __post_init__(self):
    _check_common(self)
    _check("min_digits", self.min_digits, 1 <= self.min_digits <= 9,
           "an int in [1, 9]")
    _check("max_digits", self.max_digits,
           self.min_digits <= self.max_digits <= 9,
           f"an int in [min_digits={self.min_digits}, 9]")
    _check("num_operands", self.num_operands, 2 <= self.num_operands <= 8,
           "an int in [2, 8]")
    _check("template", self.template, "{expression}" in self.template,
           "a string containing '{expression}'")

  def _draw(self, rng: np.random.Generator) -> dict[str, Any] | None:
    # One uniform per choice, drawn in a single call (per-scalar numpy calls
    # dominate the cost otherwise).
    u = rng.random(3 * self.num_operands - 1).tolist()
    span = self.max_digits - self.min_digits + 1
    operands = []
    for k in range(self.num_operands):
      digits = self.min_digits + int(u[k] * span)
      lo = 0 if digits == 1 else 10**(digits - 1)
      operands.append(lo + int(u[self.num_operands + k] * (10**digits - lo)))
    ops = [self.operators[int(x * len(self.operators))]
           for x in u[2 * self.num_operands:]]
    if self.num_operands == 2 and ops[0] == "/":
      if operands[1] == 0:
        return None
      # A multiple of the divisor with at most max_digits digits.
      quotient_max = (10**self.max_digits - 1) // operands[1]
      operands[0] = operands[1] * int(rng.integers(0, quotient_max + 1))
    expression = str(operands[0]) + "".join(
        op + str(x) for op, x in zip(ops, operands[1:]))
    value = _evaluate_flat(operands, ops)
    if value is None or (value < 0 and not self.allow_negative):
      return None
    return {"prompt": self.template.format(expression=expression),
            "answer": str(value), "expression": expression}

  def _key(self, example: dict[str, Any]) -> str:
    return f"{self.name}:{example['expression']}"

  def _completion(self, example: dict[str, Any]) -> str:
    return example["answer"]


def _evaluate_flat(operands: Sequence[int], ops: Sequence[str]) -> int | None:
  """Value of ``operands[0] ops[0] operands[1] ...`` with precedence.

  None if a ``/`` does not divide its left-hand product exactly.
  """
  total, term = 0, operands[0]
  for op, x in zip(ops, operands[1:]):
    if op == "*":
      term *= x
    elif op == "/":
      if x == 0 or term % x:
        return None
      term //= x
    else:
      total, term = total + term, (x if op == "+" else -x)
  return total + term


def _combine(left: tuple[str, int, int], right: tuple[str, int, int], op: str
             ) -> tuple[str, int, int] | None:
  """Combines two (text, value, precedence) terms; None if not legal.

  Legal as in the game: every intermediate value is a positive integer.
  """
  (a_text, a, a_prec), (b_text, b, b_prec) = left, right
  if op == "+":
    value = a + b
  elif op == "-":
    value = a - b
  elif op == "*":
    value = a * b
  else:
    value = a // b if b and a % b == 0 else 0
  if value <= 0:
    return None
  prec = _PRECEDENCE[op]
  if a_prec < prec:
    a_text = f"({a_text})"
  if b_prec < prec or (b_prec == prec and op in "-/"):
    b_text = f"({b_text})"
  return f"{a_text}{op}{b_text}", value, prec


@dataclasses.dataclass(frozen=True)
class CountdownTask(_GeneratedTask):
  """Countdown: reach ``target`` from ``numbers`` with ``+ - * /``.

  Solvable by construction: numbers are drawn, then a random subset (all of
  them if ``use_all``) is combined in random order with random operators,
  keeping every intermediate value a positive integer; the result is the
  target. Problems whose target is in ``[min_target, max_target]`` and not
  itself one of the numbers are kept.

  Fields: ``prompt``, ``numbers`` (list of ints), ``target`` (int),
  ``solution`` (one expression reaching the target). Reward: ``countdown``
  (with ``use_all=True`` if the task sets it).

  Attributes:
    num_numbers: how many numbers are given, 2..6.
    min_number: smallest number, >= 1.
    max_number: largest number.
    min_target: smallest target.
    max_target: largest target.
    operators: operators the construction may use.
    use_all: the construction uses every number.
    template: the prompt; ``{numbers}`` (space-separated) and ``{target}``
      are replaced.
    heldout_fraction: fraction of all problems held out.
  """

  name: ClassVar[str] = "countdown"
  default_rewards: ClassVar[tuple[str, ...]] = ("countdown",)

  num_numbers: int = 3
  min_number: int = 1
  max_number: int = 20
  min_target: int = 1
  max_target: int = 100
  operators: tuple[str, ...] = _OPERATORS
  use_all: bool = False
  template: str = "Make {target} from {numbers}:"
  heldout_fraction: float = 0.1

  def __post_init__(self):
    _check_common(self)
    _check("num_numbers", self.num_numbers, 2 <= self.num_numbers <= 6,
           "an int in [2, 6]")
    _check("min_number", self.min_number, self.min_number >= 1, "an int >= 1")
    _check("max_number", self.max_number,
           self.min_number <= self.max_number <= 10**6,
           f"an int in [min_number={self.min_number}, 10**6]")
    _check("max_target", self.max_target,
           1 <= self.min_target <= self.max_target,
           f"an int >= min_target={self.min_target} >= 1")
    _check("template", self.template,
           "{numbers}" in self.template and "{target}" in self.template,
           "a string containing '{numbers}' and '{target}'")

  def _draw(self, rng: np.random.Generator) -> dict[str, Any] | None:
    numbers = [int(x) for x in rng.integers(
        self.min_number, self.max_number + 1, self.num_numbers)]
    k = (self.num_numbers if self.use_all
         else int(rng.integers(2, self.num_numbers + 1)))
    terms = [(str(numbers[i]), numbers[i], 3)
             for i in rng.permutation(self.num_numbers)[:k]]
    while len(terms) > 1:
      i, j = (int(x) for x in rng.choice(len(terms), size=2, replace=False))
      op = self.operators[int(rng.integers(len(self.operators)))]
      combined = _combine(terms[i], terms[j], op)
      if combined is None:
        return None
      terms = [t for m, t in enumerate(terms) if m not in (i, j)] + [combined]
    solution, target, _ = terms[0]
    if not self.min_target <= target <= self.max_target or target in numbers:
      return None
    return {"prompt": self.template.format(
                numbers=" ".join(map(str, numbers)), target=target),
            "numbers": numbers, "target": target, "solution": solution}

  def _key(self, example: dict[str, Any]) -> str:
    return (f"{self.name}:{sorted(example['numbers'])}->"
            f"{example['target']}")

  def _completion(self, example: dict[str, Any]) -> str:
    return example["solution"]


_REGISTRY: dict[str, type[_GeneratedTask]] = {"arithmetic": ArithmeticTask,
                                               "countdown": CountdownTask}
# The environments' tasks (rljax/data/agent_tasks.py) add themselves.
TASKS: types.MappingProxyType[str, type[_GeneratedTask]] = (
    types.MappingProxyType(_REGISTRY))


def get_task(name: str, **knobs: Any) -> ArithmeticTask | CountdownTask:
  """A built-in task by name (for configs), with difficulty knobs set.

  Raises:
    ValueError: for an unknown name or knob (listing the accepted ones).
  """
  _check("task name", name, name in TASKS, str(sorted(TASKS)))
  cls = TASKS[name]
  accepted = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
  unknown = sorted(set(knobs) - set(accepted))
  if unknown:
    raise ValueError(f"task {name!r}: unknown knobs {unknown}; accepted "
                     f"{accepted}.")
  if "operators" in knobs and not isinstance(knobs["operators"], tuple):
    knobs = dict(knobs, operators=tuple(knobs["operators"]))
  return cls(**knobs)


def tokenizer_corpus(tasks: Sequence[_GeneratedTask], num_examples: int,
                     seed: int) -> list[str]:
  """The union of several tasks' tokenizer corpora."""
  return [t for task in tasks for t in task.tokenizer_corpus(num_examples,
                                                             seed)]
