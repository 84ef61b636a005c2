"""``Field``: one config field's default, range and meaning (``schema.py``
collects them; the algorithm table declares its entries' own)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    default: the library's default (None: unset; see ``type``).
    rule: the range rule (``_checks.check_range``), or None.
    doc: what it means, one line.
    type: the type of a field whose default is None (an
      ``ml_collections`` placeholder), so the command line can set it.
    choices: the accepted values of a choice field.
  """

  default: Any
  rule: str | None = None
  doc: str = ""
  type: type | None = None
  choices: tuple[Any, ...] | None = None
