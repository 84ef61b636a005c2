"""Example sources: JSON Lines files, random access for grain.

Each line of a JSONL file is one example, a JSON object with at least a prompt
field. ``JsonlSource`` indexes the file once (validating every line) and then
reads lines on demand, so it is a grain ``RandomAccessDataSource`` that
pickles to grain worker processes as a path and an offset table.

Example:
  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
  >>> write_jsonl(path, [{"question": "1+1=", "answer": "2"}])
  1
  >>> source = JsonlSource(path, prompt_field="question")
  >>> source[0]
  {'prompt': '1+1=', 'answer': '2'}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def write_jsonl(path: str | os.PathLike, examples: Iterable[Mapping[str, Any]]
                ) -> int:
  """Writes examples as JSON Lines (UTF-8, one object per line).

  Returns:
    The number of lines written.
  """
  count = 0
  with open(path, "w", encoding="utf-8") as f:
    for example in examples:
      f.write(json.dumps(dict(example), ensure_ascii=False) + "\n")
      count += 1
  return count


class JsonlSource:
  """Random-access examples from a JSONL file.

  Each example is returned as a dict whose prompt is under ``"prompt"``
  (renamed from ``prompt_field``) plus the kept fields.

  Args:
    path: the ``.jsonl`` file (UTF-8). Blank lines are skipped.
    prompt_field: the field holding the prompt string.
    fields: other fields to keep (each must be in every line); None keeps all.
    required_fields: fields every line must have, not null, named as in the
      returned examples (``"prompt"`` is the ``prompt_field``, which is always
      required); e.g. ``("prompt", "answer")`` for a task whose rewards
      compare with an answer. They are kept even if ``fields`` omits them.

  Raises:
    ValueError: naming the file, the line number and the field, for a line
      that is not UTF-8 or not a JSON object, lacks the prompt, a kept or a
      required field, or has a non-string prompt; or for an empty file.
  """

  def __init__(self, path: str | os.PathLike, *, prompt_field: str = "prompt",
               fields: Sequence[str] | None = None,
               required_fields: Sequence[str] = ("prompt",)):
    self._path = os.fspath(path)
    self._prompt_field = prompt_field
    if isinstance(required_fields, str):
      raise TypeError(f"required_fields={required_fields!r}: a sequence of "
                      "field names is required, e.g. ('prompt', 'answer').")
    self._required = tuple(f for f in required_fields if f != "prompt")
    self._fields = None if fields is None else tuple(fields)
    if self._fields is not None and "prompt" in self._fields:
      raise ValueError(f"fields={self._fields!r}: 'prompt' is always kept; "
                       "do not list it.")
    if self._fields is not None:
      self._fields += tuple(f for f in self._required if f not in self._fields)
    offsets = []
    with open(self._path, "rb") as f:
      offset = 0
      for line_number, line in enumerate(f, start=1):
        if line.strip():
          self._validate(self._parse(line, line_number), line_number)
          offsets.append(offset)
        offset += len(line)
    if not offsets:
      raise ValueError(f"{self._path}: no examples (the file is empty).")
    self._offsets = np.asarray(offsets, np.int64)

  def _parse(self, line: bytes, line_number: int) -> dict[str, Any]:
    try:
      record = json.loads(line)
    except json.JSONDecodeError as exc:
      raise ValueError(f"{self._path}:{line_number}: not valid JSON "
                       f"({exc.msg}).") from exc
    except UnicodeDecodeError as exc:
      raise ValueError(f"{self._path}:{line_number}: not valid UTF-8 "
                       f"({exc.reason}: byte {exc.object[exc.start:exc.end]!r}"
                       f" at column {exc.start + 1}).") from exc
    if not isinstance(record, dict):
      raise ValueError(f"{self._path}:{line_number}: a JSON object is "
                       f"required, got {type(record).__name__}.")
    return record

  def _validate(self, record: dict[str, Any], line_number: int) -> None:
    prompt = record.get(self._prompt_field)
    if not isinstance(prompt, str):
      raise ValueError(
          f"{self._path}:{line_number}: prompt_field={self._prompt_field!r} "
          f"is {'missing' if prompt is None else repr(prompt)}; accepted is a "
          f"string field. Fields present: {sorted(record)}.")
    for field in self._required:
      if record.get(field) is None:
        raise ValueError(
            f"{self._path}:{line_number}: required field {field!r} is "
            f"{'null' if field in record else 'missing'} (required_fields="
            f"{('prompt',) + self._required!r}); fields present: "
            f"{sorted(record)}.")
    for field in self._fields or ():
      if field not in record:
        raise ValueError(f"{self._path}:{line_number}: field {field!r} is "
                         f"missing; fields present: {sorted(record)}.")

  def _project(self, record: dict[str, Any]) -> dict[str, Any]:
    example = {"prompt": record[self._prompt_field]}
    keep = (self._fields if self._fields is not None
            else [k for k in record if k != self._prompt_field])
    for field in keep:
      example[field] = record[field]
    return example

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> dict[str, Any]:
    index = int(index)
    if not -len(self) <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} "
                       "examples.")
    with open(self._path, "rb") as f:
      f.seek(int(self._offsets[index]))
      line = f.readline()
    return self._project(self._parse(line, -1))

  def __repr__(self) -> str:
    return (f"JsonlSource({self._path!r}, prompt_field="
            f"{self._prompt_field!r}, fields={self._fields!r}, "
            f"required_fields={('prompt',) + self._required!r}, "
            f"len={len(self)})")


def read_jsonl(path: str | os.PathLike, *, prompt_field: str = "prompt",
               fields: Sequence[str] | None = None,
               required_fields: Sequence[str] = ("prompt",),
               ) -> list[dict[str, Any]]:
  """All examples of a JSONL file as a list (see ``JsonlSource``)."""
  source = JsonlSource(path, prompt_field=prompt_field, fields=fields,
                       required_fields=required_fields)
  return [source[i] for i in range(len(source))]


def check_answers(examples: Sequence[Mapping[str, Any]], where: str, *,
                  field: str = "answer") -> int:
  """The number of examples with a non-empty ``field``.

  An answer is empty when it is absent, null, or a string, list or dict with
  nothing in it (whitespace only, for a string); ``0`` and ``False`` are
  answers. The caller decides what a count of 0 means (no correctness
  metric can be computed).

  Args:
    examples: dicts, e.g. from ``read_jsonl`` or a task's ``examples``.
    where: names the examples in errors, e.g. the file they came from.
    field: the answer field.

  Returns:
    How many examples have an answer.

  Raises:
    TypeError: naming ``where`` and the index of an example that is not a
      dict.

  Example:
    >>> check_answers([{"answer": "4"}, {"answer": " "}, {"prompt": "x"}],
    ...               "train.jsonl")
    1
  """
  count = 0
  for i, example in enumerate(examples):
    if not isinstance(example, Mapping):
      raise TypeError(f"{where}: example {i} is a {type(example).__name__}; "
                      "a dict of fields is required.")
    value = example.get(field)
    if isinstance(value, str):
      value = value.strip()
    if value is not None and not (isinstance(value, (str, list, tuple, dict))
                                  and len(value) == 0):
      count += 1
  return count
