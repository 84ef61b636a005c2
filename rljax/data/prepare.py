r"""Dataset files on disk -> a JSONL task (``prompt``, ``answer`` per line).

``prepare_jsonl`` reads a file the user already has (a Hugging Face hub
parquet file, JSON Lines, or a JSON list of objects; nothing is downloaded),
takes one field as the prompt and one as the answer, and writes the JSONL
file that ``task.path`` / ``task.heldout_path`` name (``write_jsonl``). A
preset (``DATASET_PRESETS``) fixes the fields of a known dataset:

* ``gsm8k``: GSM8K's ``question`` / ``answer`` (``main/*.parquet``). Its
  answer is a worked solution ending in ``#### 72``; the task's answer is
  what follows the last ``####`` (``rewards.parsing.extract_hash_answer``,
  as ``math_answer`` reads a reference), and each prompt asks for the answer
  after ``####`` with verl's GSM8K instruction, since ``math_answer`` scores
  an unmarked completion 0.

Example:
  >>> row = {"question": "2+2?", "answer": "2+2=4\n#### 4"}
  >>> task_examples([row], DATASET_PRESETS["gsm8k"])[0]["answer"]
  '4'

References:
  Cobbe et al., "Training Verifiers to Solve Math Word Problems" (GSM8K),
  https://arxiv.org/abs/2110.14168. The instruction is verl's
  ``examples/data_preprocess/gsm8k.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rljax.data.sources import write_jsonl
from rljax.rewards import parsing

SUFFIXES = (".parquet", ".jsonl", ".json")
"""The input files ``read_records`` reads, by name."""


@dataclasses.dataclass(frozen=True)
class DatasetPreset:
  """The fields of a known dataset and how its rows become examples.

  Attributes:
    prompt_field: the input field that becomes ``prompt``.
    answer_field: the input field that becomes ``answer``.
    instruction: appended to each prompt after a space ('' for none).
    hash_answer: the answer is what follows the last ``####`` of the field.
  """
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  instruction: str = ""
  hash_answer: bool = False


GSM8K_INSTRUCTION = ("Let's think step by step and output the final answer "
                     "after \"####\".")

DATASET_PRESETS = {
    "gsm8k": DatasetPreset("question", "answer", GSM8K_INSTRUCTION,
                           hash_answer=True),
}
"""A dataset's name (``launch.prepare_data --format``) -> its fields."""


def _plain(value: Any) -> Any:
  """A NumPy array or scalar of a pandas row as the list or number JSON can
  write (pandas gives a list column's cells as arrays)."""
  return value.tolist() if hasattr(value, "tolist") else value


def _read_parquet(path: str) -> list[dict[str, Any]]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  except ImportError:
    pq = None
  if pq is not None:
    return pq.read_table(path).to_pylist()
  try:
    import pandas as pd  # pylint: disable=import-outside-toplevel
    frame = pd.read_parquet(path)
  except ImportError as e:  # no pandas, or pandas without a parquet engine
    raise ImportError(f"{path}: reading parquet needs pyarrow (`pip install "
                      f"pyarrow`); {e}") from e
  return [{k: _plain(v) for k, v in row.items()}
          for row in frame.to_dict("records")]


def _read_json_lines(path: str, text: str) -> list[Any]:
  records = []
  for number, line in enumerate(text.splitlines(), start=1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}).") from e
  return records


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The rows of a local dataset file, as dicts.

  Args:
    path: a ``.parquet`` file (read with pyarrow, else pandas), a ``.jsonl``
      file (one JSON object per line), or a ``.json`` file holding a list of
      objects (or JSON Lines, as ``datasets.Dataset.to_json`` writes).

  Returns:
    One dict per row, in file order.

  Raises:
    FileNotFoundError: naming the path (and its absolute form).
    ValueError: for another suffix, a line that is not JSON, or a row that
      is not an object (naming the file and the row).
    ImportError: a parquet file with neither pyarrow nor pandas.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--input={path!r}: no such file "
                            f"({os.path.abspath(path)}).")
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in SUFFIXES:
    raise ValueError(f"--input={path!r}: a {suffix or 'suffix-less'} file; "
                     f"accepted: {SUFFIXES}.")
  if suffix == ".parquet":
    records = _read_parquet(path)
  else:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if suffix == ".jsonl":
      records = _read_json_lines(path, text)
    else:
      try:
        records = json.loads(text)
      except json.JSONDecodeError:
        records = _read_json_lines(path, text)
      if not isinstance(records, list):
        raise ValueError(f"{path}: a JSON list of objects (or JSON Lines) is "
                         f"required, got a {type(records).__name__}.")
  for i, record in enumerate(records):
    if not isinstance(record, dict):
      raise ValueError(f"{path}: row {i + 1} is a {type(record).__name__}; "
                       "a JSON object per row is required.")
  return records


def task_examples(records: Sequence[Mapping[str, Any]], preset: DatasetPreset,
                  where: str = "the input") -> list[dict[str, Any]]:
  """``{"prompt", "answer"}`` of each record, as ``preset`` says.

  Args:
    records: rows, e.g. from ``read_records``.
    preset: the fields to read and how (``DatasetPreset``).
    where: names the rows in errors, e.g. the file they came from.

  Returns:
    One example per record, in order.

  Raises:
    ValueError: naming the row for a missing field (with the fields it has),
      a prompt that is not a string, a null or empty answer, or (with
      ``hash_answer``) an answer without ``####``; or for no records.
  """
  if not records:
    raise ValueError(f"{where} has no rows: the task would be empty.")
  examples = []
  for i, record in enumerate(records, start=1):
    for flag, field in (("--prompt_field", preset.prompt_field),
                        ("--answer_field", preset.answer_field)):
      if field not in record:
        raise ValueError(f"{flag}={field!r} is not a field of {where} (row "
                         f"{i}); its fields: {sorted(record)}.")
    prompt, answer = record[preset.prompt_field], record[preset.answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
      raise ValueError(f"{where}, row {i}: --prompt_field="
                       f"{preset.prompt_field!r} is {prompt!r}; a non-empty "
                       "string is required.")
    if preset.hash_answer:
      found = (parsing.extract_hash_answer(answer)
               if isinstance(answer, str) else None)
      if not found:
        raise ValueError(f"{where}, row {i}: --answer_field="
                         f"{preset.answer_field!r} is {answer!r}, with no "
                         "final answer after '####'.")
      answer = found
    if answer is None or (isinstance(answer, str) and not answer.strip()):
      raise ValueError(f"{where}, row {i}: --answer_field="
                       f"{preset.answer_field!r} is {answer!r}; the rewards "
                       "compare completions with it.")
    if preset.instruction:
      prompt = f"{prompt} {preset.instruction}"
    examples.append({"prompt": prompt, "answer": answer})
  return examples


def prepare_jsonl(input_path: str | os.PathLike, output_path: str | os.PathLike,
                  *, preset: str = "", prompt_field: str | None = None,
                  answer_field: str | None = None,
                  instruction: str | None = None) -> int:
  """Writes a local dataset file as a JSONL task; returns the rows written.

  Args:
    input_path: the dataset file (see ``read_records``).
    output_path: the JSONL file to write (its directory is made); it must
      not be the input.
    preset: a name of ``DATASET_PRESETS``, or '' for the plain fields.
    prompt_field: overrides the preset's prompt field (default ``prompt``).
    answer_field: overrides the preset's answer field (default ``answer``).
    instruction: overrides the preset's instruction.

  Returns:
    The number of examples written.

  Raises:
    ValueError: an unknown preset, the output naming the input, or what
      ``read_records`` and ``task_examples`` raise. Nothing is written then.
  """
  if preset and preset not in DATASET_PRESETS:
    raise ValueError(f"--format={preset!r}; accepted: '' or "
                     f"{tuple(DATASET_PRESETS)}.")
  chosen = DATASET_PRESETS[preset] if preset else DatasetPreset()
  changes = {k: v for k, v in (("prompt_field", prompt_field),
                               ("answer_field", answer_field),
                               ("instruction", instruction)) if v is not None}
  chosen = dataclasses.replace(chosen, **changes)
  input_path, output_path = os.fspath(input_path), os.fspath(output_path)
  if os.path.abspath(input_path) == os.path.abspath(output_path):
    raise ValueError(f"--output={output_path!r} is the input file; give "
                     "another path.")
  examples = task_examples(read_records(input_path), chosen, input_path)
  os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
  return write_jsonl(output_path, examples)
