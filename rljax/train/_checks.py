"""Range rules for config values (used by ``build.validate``; reads no config).

A rule is ``"int>=1"`` (an integer >= 1), ``"int>=0"``, ``"int>=2"``, ``">0"`` / ``">=0"`` /
``">1"``
(a finite number), or an interval ``"(0,1]"``, ``"[0,1)"``, ``"[0,1]"``,
``"(0,1)"``; a
trailing ``"?"`` also accepts None.
"""

from __future__ import annotations

import math
from typing import Any

_WANT = {"int>=1": "a positive integer", "int>=0": "an integer >= 0",
         "int>=2": "an integer >= 2",
         ">0": "a finite number > 0", ">1": "a number > 1", ">=0": "a finite number >= 0",
         "(0,1]": "a number in (0, 1]", "[0,1)": "a number in [0, 1)",
         "[0,1]": "a number in [0, 1]", "(0,1)": "a number in (0, 1)",
         "[0,0.5)": "a number in [0, 0.5)"}
_TESTS = {"int>=1": lambda v: v >= 1, "int>=0": lambda v: v >= 0,
          "int>=2": lambda v: v >= 2,
          ">0": lambda v: v > 0, ">1": lambda v: v > 1, ">=0": lambda v: v >= 0,
          "(0,1]": lambda v: 0 < v <= 1, "[0,1)": lambda v: 0 <= v < 1,
          "[0,1]": lambda v: 0 <= v <= 1, "(0,1)": lambda v: 0 < v < 1,
          "[0,0.5)": lambda v: 0 <= v < 0.5}


def check_range(field: str, value: Any, rule: str) -> None:
  """Raises unless ``value`` satisfies ``rule``, naming the field and value."""
  optional = rule.endswith("?")
  rule = rule.rstrip("?")
  if value is None and optional:
    return
  kinds = (int,) if rule.startswith("int") else (int, float)
  ok = (isinstance(value, kinds) and not isinstance(value, bool)
        and math.isfinite(value) and _TESTS[rule](value))
  if not ok:
    want = _WANT[rule] + (" or None" if optional else "")
    raise ValueError(f"{field}={value!r}: {want} is required.")


