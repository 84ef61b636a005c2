"""Answer extraction and safe exact arithmetic for verifiers.

Everything here is pure Python on bounded inputs: no ``eval``, no imports of
user code, and every parser refuses inputs past a size limit before doing work
that could grow with them (long strings, huge literals, deep nesting).

Numbers are compared exactly as ``fractions.Fraction``, so ``0.5``, ``1/2``
and ``\\frac{1}{2}`` are the same answer, and ``0.1 + 0.2`` is ``3/10``.

Example:
  >>> extract_boxed(r"so the answer is \\boxed{\\frac{3}{4}}.")
  '\\\\frac{3}{4}'
  >>> parse_number(r"\\frac{3}{4}") == parse_number("0.75")
  True
  >>> evaluate_expression("(3 + 5) * 2")
  Fraction(16, 1)
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

# Longest answer string `parse_number` looks at, and the most digits of any one
# literal: bounds the cost of `Fraction` arithmetic on adversarial text.
MAX_NUMBER_CHARS = 64
MAX_LITERAL_DIGITS = 18
# Longest expression `evaluate_expression` parses, and the bound on the
# numerator and denominator of any intermediate value.
MAX_EXPRESSION_CHARS = 200
MAX_INTERMEDIATE = 10**30

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+(?!\.\d))?|-?\.\d+")
_EXPRESSION_CHARS = frozenset("0123456789+-*/(). \t")
_INT_LITERAL_RE = re.compile(r"\d+(?:\.\d+)?")


def _tag_pattern(tag: str) -> re.Pattern[str]:
  if not re.fullmatch(r"[A-Za-z_][\w-]*", tag):
    raise ValueError(f"tag={tag!r}: accepted are XML-like names such as "
                     "'answer'.")
  return re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)


def extract_tag(text: str, tag: str = "answer") -> str | None:
  """Returns the stripped content of the last ``<tag>...</tag>``, or None.

  Args:
    text: a completion.
    tag: the tag name (``answer`` matches ``<answer>...</answer>``).

  Example:
    >>> extract_tag("<answer>1</answer> then <answer> 42 </answer>")
    '42'
  """
  matches = _tag_pattern(tag).findall(text)
  return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
  r"""Returns the content of the last ``\boxed{...}``, braces balanced.

  ``\fbox{...}`` is accepted too. No box, or an unclosed one, yields None.

  Example:
    >>> extract_boxed(r"\boxed{1} and \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
  """
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i:j].strip()
  return None


def extract_hash_answer(text: str) -> str | None:
  """Returns what follows the last ``####`` (GSM8K style) up to the line end.

  Example:
    >>> extract_hash_answer("5 + 7 = 12\\n#### 12")
    '12'
  """
  k = text.rfind("####")
  if k < 0:
    return None
  rest = text[k + 4:].strip().splitlines()
  return rest[0].strip() if rest else None


def extract_last_number(text: str) -> str | None:
  """Returns the last number in ``text`` as written.

  A number may have a sign, thousands commas, decimals, or be a fraction of
  integers (``3/4``).

  Example:
    >>> extract_last_number("12+34=46.")
    '46'
    >>> extract_last_number("it costs -1,250.5 dollars")
    '-1,250.5'
    >>> extract_last_number("half is 1/2")
    '1/2'
  """
  matches = _NUMBER_RE.findall(text)
  return matches[-1] if matches else None


def extract_final_answer(text: str, *, fallback_to_last_number: bool = True
                         ) -> str | None:
  r"""Returns a completion's final answer, in order of precedence.

  1. the last ``<answer>...</answer>``;
  2. the last ``\boxed{...}``;
  3. what follows the last ``####``;
  4. if ``fallback_to_last_number``, the last number in the text.

  Returns None when none applies.
  """
  for extract in (extract_tag, extract_boxed, extract_hash_answer):
    found = extract(text)
    if found is not None:
      return found
  return extract_last_number(text) if fallback_to_last_number else None


def _strip_latex(text: str) -> str:
  s = text.strip()
  for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\$", "$",
                "\\%", "%"):
    s = s.replace(token, "")
  s = re.sub(r"\\[dt]?frac", r"\\frac", s)
  s = re.sub(r"^\\text\{(.*)\}$", r"\1", s.strip())
  s = s.strip().rstrip(".").strip()
  if len(s) > 1 and (s[0], s[-1]) in (("(", ")"), ("{", "}")):
    s = s[1:-1].strip()
  return s


def _parse_decimal(s: str) -> Fraction | None:
  """Parses an optionally signed int or decimal, with thousands commas."""
  m = re.fullmatch(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)?(?:\.(\d+))?", s)
  if m is None or (m.group(2) is None and m.group(3) is None):
    return None
  whole = (m.group(2) or "0").replace(",", "")
  frac = m.group(3) or ""
  if len(whole) + len(frac) > MAX_LITERAL_DIGITS * 2:
    return None
  value = Fraction(int(whole + frac), 10**len(frac))
  return -value if m.group(1) == "-" else value


def parse_number(text: str | int | float | Fraction | None) -> Fraction | None:
  r"""Parses a number written as an int, decimal, fraction or LaTeX fraction.

  Accepted forms (surrounding spaces, ``$``, ``%``, a trailing ``.``,
  ``\text{...}``, one pair of enclosing ``()`` or ``{}`` and ``\left``/
  ``\right`` are ignored, so ``50\%`` is 50 and ``(1/2)`` is 1/2):
  ``42``, ``-3``, ``1,234``, ``0.75``, ``.5``, ``3/4``, ``-3/4``,
  ``\frac{3}{4}``, ``\dfrac{3}{4}``, ``-\frac{3}{4}``, ``\frac34``.
  Scientific notation is not accepted (it lets a short string denote an
  enormous number). Python numbers are converted exactly; floats
  through their shortest decimal repr (``0.1`` is ``1/10``).

  Args:
    text: the answer string, or a Python number.

  Returns:
    The exact value, or None if ``text`` is not one of the forms above, is
    longer than ``MAX_NUMBER_CHARS`` or divides by zero.
  """
  if text is None or isinstance(text, bool):
    return None
  if isinstance(text, Fraction):
    return text
  if isinstance(text, int):
    return Fraction(text)
  if isinstance(text, float):
    return Fraction(repr(text)) if math.isfinite(text) else None
  if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
    return None
  s = _strip_latex(text).replace(" ", "")
  sign = 1
  if s.startswith("-\\frac"):
    sign, s = -1, s[1:]
  m = (re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
       or re.fullmatch(r"\\frac(\d)(\d)", s))
  if m is None:
    m = re.fullmatch(r"([^/]+)/([^/]+)", s)
  if m is not None:
    num, den = _parse_decimal(m.group(1)), _parse_decimal(m.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * num / den
  value = _parse_decimal(s)
  return None if value is None else sign * value


def normalize_answer(text: str) -> str:
  r"""Canonical string form for non-numeric comparison.

  Drops LaTeX spacing and ``\left``/``\right``, ``$``, spaces and a trailing
  period, and lower-cases.
  """
  return _strip_latex(text).replace(" ", "").lower()


def answers_match(predicted: str | None, reference) -> bool:
  """Whether a predicted answer equals a reference, numerically if possible.

  Both sides are parsed with ``parse_number``; if both are numbers they are
  compared exactly, otherwise their ``normalize_answer`` strings are compared.
  """
  if predicted is None or reference is None:
    return False
  p, r = parse_number(predicted), parse_number(reference)
  if p is not None and r is not None:
    return p == r
  if p is not None or r is not None:
    return False
  return normalize_answer(predicted) == normalize_answer(str(reference))


def _check_bounded(value: Fraction) -> Fraction:
  if (abs(value.numerator) > MAX_INTERMEDIATE
      or value.denominator > MAX_INTERMEDIATE):
    raise ValueError("intermediate value too large")
  return value


def _eval_node(node: ast.AST, literals: list[Fraction], allow_unary: bool
               ) -> Fraction:
  if isinstance(node, ast.Expression):
    return _eval_node(node.body, literals, allow_unary)
  if isinstance(node, ast.Constant):
    # Exact types: bool is an int subclass, and `True` is not a number here.
    if type(node.value) in (int, float):
      value = parse_number(node.value)
      if value is None:
        raise ValueError("bad literal")
      literals.append(value)
      return value
    raise ValueError(f"constant {node.value!r} is not a number")
  if isinstance(node, ast.BinOp):
    left = _eval_node(node.left, literals, allow_unary)
    right = _eval_node(node.right, literals, allow_unary)
    if isinstance(node.op, ast.Add):
      return _check_bounded(left + right)
    if isinstance(node.op, ast.Sub):
      return _check_bounded(left - right)
    if isinstance(node.op, ast.Mult):
      return _check_bounded(left * right)
    if isinstance(node.op, ast.Div):
      if right == 0:
        raise ZeroDivisionError("division by zero")
      return _check_bounded(left / right)
    raise ValueError(f"operator {type(node.op).__name__} is not allowed")
  if isinstance(node, ast.UnaryOp) and allow_unary and isinstance(
      node.op, (ast.USub, ast.UAdd)):
    value = _eval_node(node.operand, literals, allow_unary)
    return -value if isinstance(node.op, ast.USub) else value
  raise ValueError(f"{type(node).__name__} is not allowed")


def evaluate_expression(
    expression: str,
    *,
    allow_unary: bool = True,
    allow_decimals: bool = False,
) -> Fraction | None:
  """Exactly evaluates an arithmetic expression of numbers, ``+ - * /``, ``()``.

  Nothing but decimal literals, the four binary operators, parentheses and
  (if allowed) unary ``+``/``-`` is accepted: names, calls, attribute access,
  subscripts, ``**``, ``//``, ``%``, bit operators, strings, underscores in
  literals and exponents are all rejected. Inputs are first checked against a
  character whitelist and ``MAX_EXPRESSION_CHARS``, literals against
  ``MAX_LITERAL_DIGITS`` and every intermediate value against
  ``MAX_INTERMEDIATE``, so adversarial inputs cost microseconds.

  Args:
    expression: e.g. ``"(3 + 5) * 2"``.
    allow_unary: accept unary minus/plus (``-3 + 5``).
    allow_decimals: accept decimal literals (``0.5 * 4``).

  Returns:
    The exact value, or None if the expression is malformed, not allowed,
    too large or divides by zero.
  """
  result = evaluate_expression_with_literals(
      expression, allow_unary=allow_unary, allow_decimals=allow_decimals)
  return None if result is None else result[0]


def evaluate_expression_with_literals(
    expression: str,
    *,
    allow_unary: bool = True,
    allow_decimals: bool = False,
) -> tuple[Fraction, list[Fraction]] | None:
  """Like ``evaluate_expression``, also returning the literals it used.

  Returns:
    ``(value, literals)`` with the literals in source order, or None.
  """
  if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
    return None
  if not expression.strip() or not set(expression) <= _EXPRESSION_CHARS:
    return None
  for literal in re.findall(r"[\d.]+", expression):
    if (not _INT_LITERAL_RE.fullmatch(literal)
        or len(literal) > MAX_LITERAL_DIGITS
        or ("." in literal and not allow_decimals)):
      return None
  try:
    tree = ast.parse(expression.strip(), mode="eval")
    literals: list[Fraction] = []
    value = _eval_node(tree, literals, allow_unary)
  except (SyntaxError, ValueError, ZeroDivisionError, RecursionError,
          MemoryError, OverflowError):
    return None
  return value, literals
