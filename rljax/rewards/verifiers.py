"""Built-in reward functions (verifiers) and their registry.

Every function follows the batched protocol
``fn(prompts, completions, **example_fields) -> list[float | None]`` and is
module-level, so it pickles to a worker process. Options (``use_all``,
``pattern``, ...) are keyword-only; bind them with ``get_reward_fn(name,
**options)``, which returns a picklable ``functools.partial``. Example fields
a function does not use are ignored.

Shared semantics:

* 1.0 for a correct completion, 0.0 for a wrong, malformed or unsafe one.
* None ("no reward") for a sample whose example lacks what the verifier needs:
  the field is not passed at all, its value is None, or the reference itself
  cannot be parsed (a data problem, not the policy's).
* A field of the wrong kind (e.g. ``numbers`` that is not a list of ints)
  raises ValueError naming it; the evaluator counts that as an error.

Example:
  >>> numeric_match(["2+2="], ["4"], answer=["4"])
  [1.0]
  >>> countdown(["..."], ["(3+5)*2"], numbers=[[2, 3, 5]], target=[16])
  [1.0]
  >>> countdown(["..."], ["__import__('os')"], numbers=[[2, 3, 5]], target=[16])
  [0.0]
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import re
import types
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from rljax.rewards import parsing

DEFAULT_FORMAT_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def _column(name: str, values: Sequence[Any] | None, n: int
            ) -> Sequence[Any]:
  """The example field ``name``, or N Nones when the example lacks it."""
  if values is None:
    return [None] * n
  if len(values) != n:
    raise ValueError(f"example field {name!r} has {len(values)} values for "
                     f"{n} completions: fields must be aligned with the batch.")
  return values


def _reference(value: Any) -> Any:
  """A reference answer; a full GSM8K/MATH solution is reduced to its answer."""
  if isinstance(value, str):
    found = parsing.extract_hash_answer(value) or parsing.extract_boxed(value)
    return found if found is not None else value.strip()
  return value


def numeric_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any] | None = None,
    fallback_to_last_number: bool = True,
    **unused_fields: Any,
) -> list[float | None]:
  """1.0 if the completion's final answer equals ``answer`` as a number.

  The final answer is found by ``parsing.extract_final_answer``: an
  ``<answer>`` tag, then ``\\boxed{}``, then ``####``, then (if
  ``fallback_to_last_number``) the last number, so ``"46"``, ``"12+34=46"`` and
  ``"<answer>46</answer>"`` all answer 46. Values are compared exactly with
  ``parsing.parse_number`` (``0.5 == 1/2``).

  Args:
    prompts: unused.
    completions: the model's completions.
    answer: reference answers (int, str or Fraction); a string holding a full
      ``####`` or ``\\boxed{}`` solution is reduced to its answer first.
    fallback_to_last_number: see above.
    **unused_fields: other example fields, ignored.

  Returns:
    Per completion 1.0 / 0.0, or None where the reference is missing or not
    a number.
  """
  del prompts, unused_fields
  answers = _column("answer", answer, len(completions))
  out: list[float | None] = []
  for completion, ref in zip(completions, answers):
    ref_value = parsing.parse_number(_reference(ref))
    if ref_value is None:
      out.append(None)
      continue
    got = parsing.parse_number(parsing.extract_final_answer(
        completion, fallback_to_last_number=fallback_to_last_number))
    out.append(float(got is not None and got == ref_value))
  return out


def exact_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any] | None = None,
    **unused_fields: Any,
) -> list[float | None]:
  """1.0 if the whole completion (or its ``<answer>`` tag) equals ``answer``.

  Compared as strings after ``strip()``; no numeric equivalence (use
  ``numeric_match`` or ``math_answer`` for that).

  Returns:
    Per completion 1.0 / 0.0, or None where ``answer`` is missing.
  """
  del prompts, unused_fields
  answers = _column("answer", answer, len(completions))
  out: list[float | None] = []
  for completion, ref in zip(completions, answers):
    if ref is None:
      out.append(None)
      continue
    tagged = parsing.extract_tag(completion)
    got = completion.strip() if tagged is None else tagged
    out.append(float(got == str(ref).strip()))
  return out


def math_answer(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence[Any] | None = None,
    **unused_fields: Any,
) -> list[float | None]:
  """1.0 if the marked final answer is equivalent to ``answer`` (MATH/GSM8K).

  The completion must mark its answer with ``\\boxed{}``, ``####`` or an
  ``<answer>`` tag (an unmarked completion scores 0.0). Numbers compare
  exactly in any of the forms ``parsing.parse_number`` accepts (``3/4``,
  ``0.75``, ``\\frac{3}{4}``, ``$1,000``); other answers compare by
  ``parsing.normalize_answer``.

  Returns:
    Per completion 1.0 / 0.0, or None where ``answer`` is missing.
  """
  del prompts, unused_fields
  answers = _column("answer", answer, len(completions))
  out: list[float | None] = []
  for completion, ref in zip(completions, answers):
    ref = _reference(ref)
    if ref is None or (isinstance(ref, str) and not ref):
      out.append(None)
      continue
    got = parsing.extract_final_answer(completion,
                                       fallback_to_last_number=False)
    out.append(float(parsing.answers_match(got, ref)))
  return out


def question_expression(prompt: str) -> str:
  """The arithmetic expression a prompt asks about.

  Takes the text before the last ``=`` (or all of it), then its longest tail
  made of digits, spaces, ``+ - * / ( ) .``. ``"Q: 12+34="`` gives
  ``"12+34"``.
  """
  head = prompt.rsplit("=", 1)[0] if "=" in prompt else prompt
  m = re.search(r"[0-9+\-*/(). ]*$", head)
  return m.group(0).strip() if m else ""


def arithmetic(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    expression: Sequence[str | None] | None = None,
    **unused_fields: Any,
) -> list[float | None]:
  """1.0 if the completion's final answer is the value of the question.

  The question is the example's ``expression`` field if given, else
  ``question_expression(prompt)``; it is evaluated exactly and safely by
  ``parsing.evaluate_expression`` (no ``eval``). The completion's answer is
  found as in ``numeric_match``.

  Returns:
    Per completion 1.0 / 0.0, or None where the question is not a valid
    expression (or divides by zero).
  """
  del unused_fields
  expressions = _column("expression", expression, len(completions))
  out: list[float | None] = []
  for prompt, completion, expr in zip(prompts, completions, expressions):
    expr = question_expression(prompt) if expr is None else expr
    value = parsing.evaluate_expression(expr, allow_decimals=True)
    if value is None:
      out.append(None)
      continue
    got = parsing.parse_number(parsing.extract_final_answer(completion))
    out.append(float(got is not None and got == value))
  return out


def _countdown_numbers(value: Any) -> list[int] | None:
  if value is None:
    return None
  if not isinstance(value, (list, tuple)) or not all(
      isinstance(x, int) and not isinstance(x, bool) for x in value):
    raise ValueError(f"example field 'numbers'={value!r}: accepted is a list "
                     "of ints per example.")
  return [int(x) for x in value]


def countdown_equation(completion: str) -> str:
  """The equation a countdown completion proposes.

  The last ``<answer>...</answer>`` if any, else the last non-empty line.
  """
  tagged = parsing.extract_tag(completion)
  if tagged is not None:
    return tagged
  lines = [line.strip() for line in completion.strip().splitlines()]
  return lines[-1] if lines else ""


def check_countdown(equation: str, numbers: Sequence[int], target: int, *,
                    use_all: bool = False) -> bool:
  """Whether ``equation`` reaches ``target`` using ``numbers`` legally.

  Legal: integer literals each taken from ``numbers`` (each given number at
  most once, or exactly once if ``use_all``), the binary operators
  ``+ - * /`` (exact rational division) and parentheses; no unary minus,
  decimals, ``**``, names or calls. ``"expr = value"`` is accepted if
  ``value`` equals the expression's value.
  """
  lhs, _, rhs = equation.partition("=")
  if "=" in rhs:
    return False
  result = parsing.evaluate_expression_with_literals(
      lhs, allow_unary=False, allow_decimals=False)
  if result is None:
    return False
  value, literals = result
  if rhs.strip() and parsing.parse_number(rhs.strip()) != value:
    return False
  used = collections.Counter(literals)
  given = collections.Counter(Fraction(x) for x in numbers)
  if use_all:
    if used != given:
      return False
  elif any(used[x] > given[x] for x in used):
    return False
  return value == target


def countdown(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    numbers: Sequence[Sequence[int] | None] | None = None,
    target: Sequence[int | None] | None = None,
    use_all: bool = False,
    **unused_fields: Any,
) -> list[float | None]:
  """1.0 if the completion's equation hits ``target`` with the given numbers.

  See ``countdown_equation`` (what is read) and ``check_countdown`` (what is
  legal). Adversarial text (``__import__('os')``, ``2**99999``, ``x.y``,
  reused or foreign numbers) scores 0.0 without being executed.

  Args:
    prompts: unused.
    completions: the model's completions.
    numbers: per example, the list of available ints.
    target: per example, the int to reach.
    use_all: require every number to be used exactly once (TinyZero's rule)
      instead of at most once.
    **unused_fields: other example fields, ignored.

  Returns:
    Per completion 1.0 / 0.0, or None where ``numbers`` or ``target`` is
    missing.
  """
  del prompts, unused_fields
  n = len(completions)
  out: list[float | None] = []
  for completion, nums, tgt in zip(completions, _column("numbers", numbers, n),
                                   _column("target", target, n)):
    nums = _countdown_numbers(nums)
    tgt_value = parsing.parse_number(tgt)
    if nums is None or tgt_value is None:
      out.append(None)
      continue
    out.append(float(check_countdown(countdown_equation(completion), nums,
                                     tgt_value, use_all=use_all)))
  return out


def format_match(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    pattern: str = DEFAULT_FORMAT_PATTERN,
    **unused_fields: Any,
) -> list[float]:
  """1.0 if the completion fully matches the regex ``pattern`` (DOTALL).

  The default asks for ``<think>...</think>`` then ``<answer>...</answer>``.
  """
  del prompts, unused_fields
  regex = re.compile(pattern, re.DOTALL)
  return [float(regex.fullmatch(c) is not None) for c in completions]


def env_reward(prompts: list[str], completions: list[str], *,
               env_reward: Sequence[float | None] | None = None,
               **unused: Any) -> list[float | None]:
  """The reward function ``"env"``: each episode's environment reward.

  The multi-turn rollout (``rljax.rollout.multi_turn``) adds the field
  ``env_reward`` to the batch: the sum of the episode's step rewards (0 if
  none gave one), or None for an episode the environment failed (it raised,
  hung or answered malformed output), which the evaluator counts as
  ``reward/env/none``. Listed in ``rewards.names`` with the other reward
  functions, it is one column of ``[N, R]`` like them, with its weight.
  """
  del prompts, unused
  if env_reward is None:
    raise ValueError("the reward 'env' needs the batch field env_reward, "
                     "which only a run with an environment (env.name) has.")
  if len(env_reward) != len(completions):
    raise ValueError(f"{len(env_reward)} env_reward values for "
                     f"{len(completions)} completions.")
  return [None if r is None or (isinstance(r, float) and math.isnan(r))
          else float(r) for r in env_reward]


REWARD_FNS: types.MappingProxyType[str, Callable[..., list[float | None]]] = (
    types.MappingProxyType({
        "numeric_match": numeric_match,
        "exact_match": exact_match,
        "math_answer": math_answer,
        "arithmetic": arithmetic,
        "countdown": countdown,
        "format": format_match,
        "env": env_reward,
    }))


def get_reward_fn(name: str, **options: Any) -> Callable[..., Any]:
  """A built-in reward function by name, with options bound.

  Args:
    name: a key of ``REWARD_FNS``.
    **options: keyword-only options of that function (e.g.
      ``use_all=True`` for ``countdown``, ``pattern=...`` for ``format``).

  Returns:
    The function, or a picklable ``functools.partial`` of it.

  Raises:
    ValueError: for an unknown name or option (the message lists the
      accepted ones).
  """
  if name not in REWARD_FNS:
    raise ValueError(f"reward name={name!r}: accepted {sorted(REWARD_FNS)}.")
  fn = REWARD_FNS[name]
  # Example fields default to None; options have a real default.
  accepted = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY
              and p.default is not inspect.Parameter.empty
              and p.default is not None]
  unknown = sorted(set(options) - set(accepted))
  if unknown:
    raise ValueError(f"reward {name!r}: unknown options {unknown}; accepted "
                     f"{accepted}.")
  if "pattern" in options:
    re.compile(options["pattern"])
  return functools.partial(fn, **options) if options else fn
