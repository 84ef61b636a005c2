"""``rljax.data.prepare`` and ``python -m launch.prepare_data``: dataset
files on disk (parquet, JSON Lines, JSON) -> a JSONL task.

The inputs are GSM8K rows copied from its train split (``question`` and a
worked ``answer`` ending in ``#### <number>``); every expected row is
written out by hand.
"""

import builtins
import json
import os
import re
import subprocess
import sys

import pytest

from rljax import data

ROOT = os.path.join(os.path.dirname(__file__), "..")

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then "
                 "she sold half as many clips in May. How many clips did "
                 "Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold "
               "48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
               "#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just "
                 "did 50 minutes of babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 "
               "minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
]

EXPECTED_GSM8K = [
    {"prompt": "Natalia sold clips to 48 of her friends in April, and then "
               "she sold half as many clips in May. How many clips did "
               "Natalia sell altogether in April and May? Let's think step "
               "by step and output the final answer after \"####\".",
     "answer": "72"},
    {"prompt": "Weng earns $12 an hour for babysitting. Yesterday, she just "
               "did 50 minutes of babysitting. How much did she earn? Let's "
               "think step by step and output the final answer after "
               "\"####\".",
     "answer": "10"},
]


def _read_lines(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _write_parquet(path, rows):
  pq = pytest.importorskip("pyarrow.parquet")
  pa = pytest.importorskip("pyarrow")
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def _write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return str(path)


def test_gsm8k_parquet_becomes_prompts_and_final_answers(tmp_path):
  source = _write_parquet(tmp_path / "train-00000-of-00001.parquet",
                          GSM8K_ROWS)
  output = tmp_path / "data" / "gsm8k" / "train.jsonl"  # directories made
  assert data.prepare_jsonl(source, output, preset="gsm8k") == 2
  assert _read_lines(output) == EXPECTED_GSM8K


def test_gsm8k_jsonl_gives_the_same_rows(tmp_path):
  source = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
  output = tmp_path / "out.jsonl"
  assert data.prepare_jsonl(source, output, preset="gsm8k") == 2
  assert _read_lines(output) == EXPECTED_GSM8K
  # What the training loop reads back: prompt and answer of every line.
  assert data.read_jsonl(output, required_fields=("prompt", "answer")) == (
      EXPECTED_GSM8K)


def test_a_flag_overrides_the_preset(tmp_path):
  source = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[1:])
  output = tmp_path / "out.jsonl"
  data.prepare_jsonl(source, output, preset="gsm8k",
                     instruction="Answer after ####.")
  assert _read_lines(output) == [{
      "prompt": "Weng earns $12 an hour for babysitting. Yesterday, she just "
                "did 50 minutes of babysitting. How much did she earn? "
                "Answer after ####.",
      "answer": "10"}]


def test_json_list_with_named_fields_is_copied_as_is(tmp_path):
  source = tmp_path / "problems.json"
  source.write_text(json.dumps([
      {"id": 1, "problem": "What is 3/4 as a decimal?", "final": "0.75"},
      {"id": 2, "problem": "Compute 6*7.", "final": 42}]))
  output = tmp_path / "out.jsonl"
  assert data.prepare_jsonl(source, output, prompt_field="problem",
                            answer_field="final") == 2
  assert _read_lines(output) == [
      {"prompt": "What is 3/4 as a decimal?", "answer": "0.75"},
      {"prompt": "Compute 6*7.", "answer": 42}]


def test_a_json_file_holding_json_lines_is_read(tmp_path):
  # ``datasets.Dataset.to_json`` writes JSON Lines under a .json name.
  source = tmp_path / "train.json"
  source.write_text('{"prompt": "1+1=", "answer": "2"}\n'
                    '{"prompt": "2+2=", "answer": "4"}\n')
  output = tmp_path / "out.jsonl"
  assert data.prepare_jsonl(source, output) == 2
  assert _read_lines(output) == [{"prompt": "1+1=", "answer": "2"},
                                 {"prompt": "2+2=", "answer": "4"}]


def _without_pyarrow_in_prepare(monkeypatch):
  """``import pyarrow...`` fails inside ``rljax.data.prepare`` only (pandas
  still reads parquet through it)."""
  real_import = builtins.__import__

  def fake_import(name, globals_=None, *args, **kwargs):
    caller = (globals_ or {}).get("__name__")
    if name.startswith("pyarrow") and caller == "rljax.data.prepare":
      raise ImportError(f"No module named {name!r} (test)")
    return real_import(name, globals_, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", fake_import)


def test_parquet_through_pandas_without_pyarrow(tmp_path, monkeypatch):
  pytest.importorskip("pandas")
  source = _write_parquet(tmp_path / "p.parquet", [
      {"problem": "Compute 6*7.", "final": [42, 42]},
      {"problem": "Compute 2**10.", "final": [1024, 1000]}])
  _without_pyarrow_in_prepare(monkeypatch)
  output = tmp_path / "out.jsonl"
  assert data.prepare_jsonl(source, output, prompt_field="problem",
                            answer_field="final") == 2
  # pandas gives a list column's cells as NumPy arrays; JSON gets lists.
  assert _read_lines(output) == [
      {"prompt": "Compute 6*7.", "answer": [42, 42]},
      {"prompt": "Compute 2**10.", "answer": [1024, 1000]}]


def test_parquet_without_pyarrow_or_pandas_says_what_to_install(
    tmp_path, monkeypatch):
  source = _write_parquet(tmp_path / "p.parquet", GSM8K_ROWS)
  _without_pyarrow_in_prepare(monkeypatch)
  monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas fails
  with pytest.raises(ImportError, match=r"p.parquet: reading parquet needs "
                     r"pyarrow \(`pip install pyarrow`\)"):
    data.prepare_jsonl(source, tmp_path / "out.jsonl", preset="gsm8k")
  assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_input_is_named(tmp_path):
  missing = tmp_path / "gsm8k" / "train.parquet"
  with pytest.raises(FileNotFoundError, match=(
      rf"--input='{missing}': no such file")):
    data.prepare_jsonl(missing, tmp_path / "out.jsonl", preset="gsm8k")
  assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_field_lists_the_fields_the_file_has(tmp_path):
  source = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
  with pytest.raises(ValueError, match=(
      r"--prompt_field='prompt' is not a field of .*train.jsonl \(row 1\); "
      r"its fields: \['answer', 'question'\]")):
    data.prepare_jsonl(source, tmp_path / "out.jsonl")
  rows = GSM8K_ROWS + [{"question": "Is this row complete?"}]
  source = _write_jsonl(tmp_path / "train.jsonl", rows)
  with pytest.raises(ValueError, match=(
      r"--answer_field='answer' is not a field of .*train.jsonl \(row 3\); "
      r"its fields: \['question'\]")):
    data.prepare_jsonl(source, tmp_path / "out.jsonl", preset="gsm8k")
  assert not (tmp_path / "out.jsonl").exists()


def test_an_empty_input_writes_nothing(tmp_path):
  source = tmp_path / "empty.jsonl"
  source.write_text("\n")
  with pytest.raises(ValueError, match=r"empty.jsonl has no rows"):
    data.prepare_jsonl(source, tmp_path / "out.jsonl")
  assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("answer", ["She earned $10.", "#### ", None])
def test_a_gsm8k_answer_without_a_final_answer(tmp_path, answer):
  source = _write_jsonl(tmp_path / "t.jsonl",
                        [GSM8K_ROWS[0], {"question": "Q?", "answer": answer}])
  with pytest.raises(ValueError, match=re.escape(
      f"t.jsonl, row 2: --answer_field='answer' is {answer!r}, with no final "
      "answer after '####'")):
    data.prepare_jsonl(source, tmp_path / "out.jsonl", preset="gsm8k")


@pytest.mark.parametrize("row,match", [
    ({"prompt": 3, "answer": "3"}, r"--prompt_field='prompt' is 3; a "
     r"non-empty string"),
    ({"prompt": "1+1=", "answer": None}, r"--answer_field='answer' is None"),
    ({"prompt": "1+1=", "answer": " "}, r"--answer_field='answer' is ' '"),
])
def test_a_row_the_task_cannot_use_is_named(tmp_path, row, match):
  source = _write_jsonl(tmp_path / "t.jsonl", [row])
  with pytest.raises(ValueError, match=r"t.jsonl, row 1: " + match):
    data.prepare_jsonl(source, tmp_path / "out.jsonl")


def test_unknown_format_and_output_over_input_are_refused(tmp_path):
  source = _write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS)
  with pytest.raises(ValueError, match=r"--format='gsm9k'; accepted: '' or "
                     r"\('gsm8k',\)"):
    data.prepare_jsonl(source, tmp_path / "out.jsonl", preset="gsm9k")
  with pytest.raises(ValueError, match=r"--output=.*t.jsonl' is the input"):
    data.prepare_jsonl(source, source, preset="gsm8k")
  assert _read_lines(source) == GSM8K_ROWS
  csv = tmp_path / "t.csv"
  csv.write_text("a,b\n1,2\n")
  with pytest.raises(ValueError, match=r"a \.csv file; accepted"):
    data.prepare_jsonl(csv, tmp_path / "out.jsonl")


def test_the_launcher_writes_the_task(tmp_path):
  source = _write_parquet(tmp_path / "train-00000-of-00001.parquet",
                          GSM8K_ROWS)
  output = tmp_path / "data" / "gsm8k" / "train.jsonl"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "launch.prepare_data", "--format=gsm8k",
       f"--input={source}", f"--output={output}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.strip() == f"wrote 2 examples to {output}"
  assert _read_lines(output) == EXPECTED_GSM8K
