"""Built-in tasks of the built-in environments (``rljax.envs``): their
examples, and demonstrations for the SFT warm-up as turn segments.

A demonstration's ``segments`` is a list of ``[kind, text]``: ``"model"``
(trained tokens), ``"eos"`` (the end-of-turn token, trained) and
``"observation"`` (what the environment appends; an input, not trained).
``train.sft.sft_arrays`` encodes each segment as the multi-turn rollout
does (``tokenizers.continuation_ids`` after the first), so the warm-up sees
the token stream that RL will.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar

import numpy as np

from rljax.data import tasks as _tasks
from rljax.data.tasks import _check, _GeneratedTask

WORD_TEMPLATES = (
    ("{a} packs of {b} pens and {c} more. How many?", "{a}*{b}+{c}"),
    ("{a} rows of {b} seats, {c} empty. How many full?", "{a}*{b}-{c}"),
)


def _key_rng(key: str) -> np.random.Generator:
  seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                        "little")
  return np.random.default_rng(seed)


def _joined(segments: list[list[str]]) -> str:
  return "".join(text for kind, text in segments if kind != "eos")


@dataclasses.dataclass(frozen=True)
class WordProblemsTask(_GeneratedTask):
  """Two-step word problems for the calculator environment
  (``envs.CalculatorEnv``): ``a * b + c`` or ``a * b - c`` in words, with
  two-digit ``a`` and ``b``.

  Demonstrations call the tool (``<calc>a*b+c</calc>``, then copy the value)
  with probability ``tool_fraction``; the others answer at once, which a
  small model cannot compute: RL has to learn to call the tool.

  Fields: ``prompt``, ``answer``, ``expression``. Reward: ``env``.
  """

  name: ClassVar[str] = "word_problems"
  default_rewards: ClassVar[tuple[str, ...]] = ("env",)
  tokenizer_symbols: ClassVar[tuple[str, ...]] = ("<calc>", "</calc>")

  min_value: int = 10
  max_value: int = 99
  tool_fraction: float = 0.5
  heldout_fraction: float = 0.1
  operators: tuple[str, ...] = ("+",)  # unused; the templates fix them

  def __post_init__(self):
    _check("min_value", self.min_value, 1 <= self.min_value <= 999,
           "an int in [1, 999]")
    _check("max_value", self.max_value,
           self.min_value <= self.max_value <= 999,
           f"an int in [min_value={self.min_value}, 999]")
    _check("tool_fraction", self.tool_fraction,
           0.0 <= self.tool_fraction <= 1.0, "a float in [0, 1]")
    _check("heldout_fraction", self.heldout_fraction,
           0.0 < self.heldout_fraction < 1.0, "a float in (0, 1)")

  def _draw(self, rng: np.random.Generator) -> dict[str, Any] | None:
    a, b = (int(x) for x in rng.integers(self.min_value, self.max_value + 1,
                                         2))
    c = int(rng.integers(1, self.max_value + 1))
    template, expression = WORD_TEMPLATES[int(rng.integers(
        len(WORD_TEMPLATES)))]
    expression = expression.format(a=a, b=b, c=c)
    value = a * b + c if "+" in expression else a * b - c
    return {"prompt": template.format(a=a, b=b, c=c), "answer": str(value),
            "expression": expression}

  def _key(self, example: dict[str, Any]) -> str:
    return f"{self.name}:{example['prompt']}"

  def segments(self, example: dict[str, Any]) -> list[list[str]]:
    """A demonstration: the tool call and the copied value, or (``1 -
    tool_fraction`` of them) the answer at once."""
    if _key_rng(self._key(example)).random() < self.tool_fraction:
      return [["model", f"<calc>{example['expression']}</calc>"],
              ["observation", f"={example['answer']};"],
              ["model", example["answer"]], ["eos", ""]]
    return [["model", example["answer"]], ["eos", ""]]

  def _completion(self, example: dict[str, Any]) -> str:
    return _joined(self.segments(example))

  def sft_examples(self, split: str, num_examples: int, seed: int
                   ) -> list[dict[str, Any]]:
    return [dict(e, completion=self._completion(e), segments=self.segments(e))
            for e in self.examples(split, num_examples, seed)]

  def tokenizer_corpus(self, num_examples: int, seed: int) -> list[str]:
    return super().tokenizer_corpus(num_examples, seed) + ["=error;"]


@dataclasses.dataclass(frozen=True)
class GuessNumberTask(_GeneratedTask):
  """Secrets for the guessing game (``envs.GuessNumberEnv``): a range
  ``[1, high]`` with ``high`` in ``[min_high, max_high]`` and a secret in it.

  Demonstrations guess the middle of the range the hints allow with
  probability ``midpoint_fraction``, else any number in it; they end at
  the right guess or after ``max_guesses``.

  Fields: ``prompt`` (``"1-20?"``), ``secret``, ``high``, ``answer`` (the
  secret). Reward: ``env``.
  """

  name: ClassVar[str] = "guess_number"
  default_rewards: ClassVar[tuple[str, ...]] = ("env",)
  tokenizer_symbols: ClassVar[tuple[str, ...]] = ()

  min_high: int = 8
  max_high: int = 31
  max_guesses: int = 5
  midpoint_fraction: float = 0.25
  heldout_fraction: float = 0.2
  operators: tuple[str, ...] = ("+",)  # unused

  def __post_init__(self):
    _check("min_high", self.min_high, 2 <= self.min_high <= 9999,
           "an int in [2, 9999]")
    _check("max_high", self.max_high, self.min_high <= self.max_high <= 9999,
           f"an int in [min_high={self.min_high}, 9999]")
    _check("max_guesses", self.max_guesses, self.max_guesses >= 1,
           "an int >= 1")
    _check("midpoint_fraction", self.midpoint_fraction,
           0.0 <= self.midpoint_fraction <= 1.0, "a float in [0, 1]")
    _check("heldout_fraction", self.heldout_fraction,
           0.0 < self.heldout_fraction < 1.0, "a float in (0, 1)")

  def _draw(self, rng: np.random.Generator) -> dict[str, Any] | None:
    high = int(rng.integers(self.min_high, self.max_high + 1))
    secret = int(rng.integers(1, high + 1))
    return {"prompt": f"1-{high}?", "secret": secret, "high": high,
            "answer": str(secret)}

  def _key(self, example: dict[str, Any]) -> str:
    return f"{self.name}:{example['high']}:{example['secret']}"

  def segments(self, example: dict[str, Any], draw: int = 0
               ) -> list[list[str]]:
    """A demonstration game (see the class docstring); ``draw`` picks one of
    many for the same secret."""
    rng = _key_rng(f"{self._key(example)}:{draw}")
    lo, hi, secret = 1, int(example["high"]), int(example["secret"])
    out: list[list[str]] = []
    for turn in range(self.max_guesses):
      if rng.random() < self.midpoint_fraction:
        guess = (lo + hi) // 2
      else:
        guess = int(rng.integers(lo, hi + 1))
      out += [["model", str(guess)], ["eos", ""]]
      if guess == secret or turn + 1 == self.max_guesses:
        break
      if secret > guess:
        lo = guess + 1
        out.append(["observation", "+"])
      else:
        hi = guess - 1
        out.append(["observation", "-"])
    return out

  def _completion(self, example: dict[str, Any]) -> str:
    return _joined(self.segments(example))

  def sft_examples(self, split: str, num_examples: int, seed: int
                   ) -> list[dict[str, Any]]:
    """``num_examples`` demonstration games: the split's problems in turn
    (there are few), each game drawn afresh."""
    rng = np.random.default_rng([int(seed), 7])
    problems = self.examples(split, min(num_examples, self.num_problems(
        split)), seed)
    out = []
    for i in range(num_examples):
      e = problems[int(rng.integers(len(problems)))]
      segments = self.segments(e, draw=i + 1)
      out.append(dict(e, completion=_joined(segments), segments=segments))
    return out

  def num_problems(self, split: str) -> int:
    """How many distinct problems ``split`` has."""
    return sum(1 for high in range(self.min_high, self.max_high + 1)
               for secret in range(1, high + 1)
               if _tasks.split_of(f"{self.name}:{high}:{secret}",
                                  self.heldout_fraction) == split)

  def tokenizer_corpus(self, num_examples: int, seed: int) -> list[str]:
    texts = [e["prompt"] + e["completion"]
             for e in self.sft_examples("train", num_examples, seed)]
    return texts + ["0123456789+-?"]


TASKS = {"word_problems": WordProblemsTask, "guess_number": GuessNumberTask}
_tasks._REGISTRY.update(TASKS)  # pylint: disable=protected-access
