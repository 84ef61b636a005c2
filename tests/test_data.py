"""Tests for rljax.data: generated tasks, JSONL sources, grain pipelines."""

import itertools
import json
import operator
import pickle
from fractions import Fraction

import pytest

from rljax import data
from rljax import rewards
from rljax import tokenizers


def _reachable(numbers):
  """Every value reachable from ``numbers`` (each used at most once), by brute
  force over subsets and binary combinations, with exact rationals."""
  values = {}

  def solve(multiset):
    if multiset in values:
      return values[multiset]
    out = set(multiset)
    items = list(multiset)
    for i, j in itertools.permutations(range(len(items)), 2):
      rest = tuple(sorted(items[k] for k in range(len(items))
                          if k not in (i, j)))
      a, b = items[i], items[j]
      results = [a + b, a - b, a * b] + ([a / b] if b else [])
      for r in results:
        out |= solve(tuple(sorted(rest + (r,))))
    values[multiset] = out
    return out

  reachable = set()
  for k in range(1, len(numbers) + 1):
    for subset in itertools.combinations(numbers, k):
      reachable |= solve(tuple(sorted(Fraction(x) for x in subset)))
  return reachable


# --------------------------------------------------------------------- tasks


@pytest.mark.parametrize("task", [
    data.ArithmeticTask(),
    data.ArithmeticTask(operators=("+", "-", "*", "/"), num_operands=3,
                        allow_negative=True),
    data.CountdownTask(),
    data.CountdownTask(num_numbers=4, use_all=True),
])
def test_examples_are_deterministic_distinct_and_split_disjoint(task):
  train = task.examples("train", 300, seed=3)
  assert train == task.examples("train", 300, seed=3)
  assert train != task.examples("train", 300, seed=4)
  keys = [task._key(e) for e in train]  # pylint: disable=protected-access
  assert len(set(keys)) == len(keys)
  heldout = set()
  for seed in (0, 1, 2):
    heldout |= {task._key(e)  # pylint: disable=protected-access
                for e in task.examples("heldout", 50, seed=seed)}
  train_keys = set(keys)
  for seed in (0, 1):
    train_keys |= {task._key(e)  # pylint: disable=protected-access
                   for e in task.examples("train", 300, seed=seed)}
  assert heldout and train_keys.isdisjoint(heldout)


def test_generation_is_pinned():
  # Regression pin (not hand-derived): generation must not depend on the
  # process (e.g. on Python's randomized str hash) or drift between versions.
  examples = data.ArithmeticTask().examples("train", 2, seed=0)
  assert [e["prompt"] + e["answer"] for e in examples] == [
      "13+0=13", "75+58=133"]
  assert data.split_of("arithmetic:12+34", 0.5) == "heldout"


def test_split_of_holds_out_the_requested_fraction():
  problems = [f"arithmetic:{a}+{b}" for a in range(100) for b in range(100)]
  heldout = [p for p in problems if data.split_of(p, 0.1) == "heldout"]
  assert 800 < len(heldout) < 1200
  assert data.split_of("x", 0.1) == data.split_of("x", 0.1)
  assert {data.split_of(p, 0.5) for p in problems[:50]} == {"train", "heldout"}


def test_arithmetic_default_is_short_two_digit_addition():
  examples = data.ArithmeticTask().examples("train", 2000, seed=0)
  for e in examples:
    a, b = e["expression"].split("+")
    assert e["prompt"] == f"{a}+{b}="
    assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert e["answer"] == str(int(a) + int(b))
  assert max(len(e["prompt"]) for e in examples) == 6


def test_arithmetic_knobs_and_answers():
  task = data.ArithmeticTask(min_digits=3, max_digits=3, num_operands=3,
                             operators=("-", "*", "/"), allow_negative=True,
                             template="Q: {expression} =")
  examples = task.sft_examples("train", 300, seed=0)
  ops = {"-": operator.sub, "*": operator.mul, "/": operator.truediv}
  seen_ops = set()
  for e in examples:
    assert e["prompt"] == f"Q: {e['expression']} ="
    literals = [int(x) for x in e["expression"].replace("-", " ").replace(
        "*", " ").replace("/", " ").split()]
    assert all(100 <= x <= 999 for x in literals)
    seen_ops |= set(e["expression"]) & set(ops)
    assert Fraction(e["answer"]) == rewards.evaluate_expression(
        e["expression"])
    assert e["completion"] == e["answer"]
  assert seen_ops == set(ops)
  assert any(int(e["answer"]) < 0 for e in examples)
  assert all(int(e["answer"]) >= 0 for e in data.ArithmeticTask(
      operators=("-",)).examples("train", 200, seed=0))
  division = data.ArithmeticTask(operators=("/",)).examples("train", 100, 0)
  assert all(Fraction(e["answer"]).denominator == 1 for e in division)


def test_countdown_examples_are_solvable():
  task = data.CountdownTask(num_numbers=4, max_number=12, max_target=60)
  for e in task.sft_examples("train", 30, seed=0):
    assert len(e["numbers"]) == 4
    assert all(1 <= x <= 12 for x in e["numbers"])
    assert 1 <= e["target"] <= 60 and e["target"] not in e["numbers"]
    assert Fraction(e["target"]) in _reachable(e["numbers"])
    assert rewards.countdown([e["prompt"]], [e["completion"]],
                             numbers=[e["numbers"]],
                             target=[e["target"]]) == [1.0]
    assert e["prompt"] == (f"Make {e['target']} from "
                           f"{' '.join(map(str, e['numbers']))}:")


def test_countdown_use_all_uses_every_number():
  task = data.CountdownTask(num_numbers=3, use_all=True)
  for e in task.sft_examples("heldout", 50, seed=1):
    assert rewards.countdown([""], [e["completion"]], numbers=[e["numbers"]],
                             target=[e["target"]], use_all=True) == [1.0]


def test_task_validation_and_registry():
  with pytest.raises(ValueError, match=r"operators=\('\^',\): accepted"):
    data.ArithmeticTask(operators=("^",))
  with pytest.raises(ValueError, match="max_digits=1: accepted"):
    data.ArithmeticTask(min_digits=2, max_digits=1)
  with pytest.raises(ValueError, match="heldout_fraction=0.0"):
    data.CountdownTask(heldout_fraction=0.0)
  with pytest.raises(ValueError, match="split='test': accepted"):
    data.ArithmeticTask().examples("test", 1, seed=0)
  with pytest.raises(ValueError, match="seed=-1"):
    data.ArithmeticTask().examples("train", 1, seed=-1)
  with pytest.raises(ValueError, match="only .* distinct 'heldout' problems"):
    data.ArithmeticTask(max_digits=1).examples("heldout", 50, seed=0)
  task = data.get_task("countdown", num_numbers=4, operators=["+", "*"])
  assert task == data.CountdownTask(num_numbers=4, operators=("+", "*"))
  with pytest.raises(ValueError, match=r"unknown knobs \['digits'\]"):
    data.get_task("arithmetic", digits=3)
  with pytest.raises(ValueError, match="task name='sudoku'"):
    data.get_task("sudoku")


def test_tokenizer_corpus_trains_a_tokenizer_that_round_trips():
  task = data.ArithmeticTask()
  corpus = task.tokenizer_corpus(300, seed=0)
  assert corpus == task.tokenizer_corpus(300, seed=0)
  assert set("0123456789+=") <= set("".join(corpus))
  tok = tokenizers.train_sentencepiece(corpus, vocab_size=32)
  for e in task.sft_examples("heldout", 20, seed=0):
    text = e["prompt"] + e["completion"]
    assert tok.decode(tok.encode(text)) == text
  both = data.tokenizer_corpus([task, data.CountdownTask()], 50, seed=0)
  assert "Make" in " ".join(both) and "+" in " ".join(both)


# ------------------------------------------------------------------ pipeline


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_iterator_is_deterministic_and_shuffles_each_epoch():
  examples = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]
  batches = _take(data.make_prompt_iterator(examples, 5, seed=7), 6)
  assert batches == _take(data.make_prompt_iterator(examples, 5, seed=7), 6)
  assert batches != _take(data.make_prompt_iterator(examples, 5, seed=8), 6)
  epochs = [sum((b["prompt"] for b in batches[2 * k:2 * k + 2]), [])
            for k in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == sorted(e["prompt"] for e in examples)
  assert epochs[0] != epochs[1]
  assert batches[0]["answer"] == [p[1:] for p in batches[0]["prompt"]]


def test_iterator_epochs_remainder_and_no_shuffle():
  examples = [{"prompt": f"p{i}"} for i in range(7)]
  it = data.make_prompt_iterator(examples, 3, seed=0, num_epochs=1,
                                 shuffle=False, drop_remainder=False)
  assert [b["prompt"] for b in it] == [["p0", "p1", "p2"], ["p3", "p4", "p5"],
                                       ["p6"]]
  it = data.make_prompt_iterator(examples, 3, seed=0, num_epochs=2)
  assert len(list(it)) == 4  # 14 examples, remainder dropped.
  with pytest.raises(ValueError, match="batch_size=8 exceeds the 7"):
    data.make_prompt_iterator(examples, 8, seed=0, num_epochs=1)
  with pytest.raises(ValueError, match="num_epochs=0"):
    data.make_prompt_iterator(examples, 2, seed=0, num_epochs=0)


def test_iterator_state_restores_exactly():
  examples = data.CountdownTask().examples("train", 50, seed=0)
  it = data.make_prompt_iterator(examples, 8, seed=1)
  _take(it, 9)  # Past the first epoch.
  state = it.get_state()
  assert json.loads(json.dumps(state)) == state
  expected = _take(it, 10)
  resumed = data.make_prompt_iterator(examples, 8, seed=1)
  resumed.set_state(state)
  assert _take(resumed, 10) == expected
  assert expected[0]["numbers"] and isinstance(expected[0]["target"][0], int)


def test_sharding_is_disjoint_and_complete():
  examples = [{"prompt": f"p{i}"} for i in range(10)]
  shards = [
      sum((b["prompt"] for b in data.make_prompt_iterator(
          examples, 1, seed=0, num_epochs=1, shard_index=k, shard_count=2)),
          []) for k in range(2)
  ]
  assert set(shards[0]).isdisjoint(shards[1])
  assert sorted(shards[0] + shards[1]) == sorted(e["prompt"] for e in examples)
  with pytest.raises(ValueError, match="shard_index=2, shard_count=2"):
    data.make_prompt_iterator(examples, 1, seed=0, shard_index=2,
                              shard_count=2)


def test_collate_and_format_prompt():
  with pytest.raises(ValueError, match="example 1 of the batch has fields"):
    data.collate_to_lists([{"prompt": "a"}, {"prompt": "b", "x": 1}])
  fmt = data.FormatPrompt("Q: {question}\nA:")
  assert pickle.loads(pickle.dumps(fmt)) == fmt
  it = data.make_prompt_iterator([{"prompt": "", "question": "2+2?"}], 1,
                                 seed=0, transform=fmt)
  assert next(it)["prompt"] == ["Q: 2+2?\nA:"]
  with pytest.raises(ValueError, match="names field 'nope'"):
    data.FormatPrompt("{nope}")({"prompt": "x"})
  assert data.repeat_each({"prompt": ["a", "b"], "n": [[1], [2]]}, 2) == {
      "prompt": ["a", "a", "b", "b"], "n": [[1], [1], [2], [2]]}


# --------------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path):
  path = tmp_path / "d.jsonl"
  examples = [{"question": "Wie viel ist 2+2? \u00e9\u20ac", "answer": "4",
               "numbers": [1, 2]},
              {"question": "3*3", "answer": "9", "numbers": []}]
  assert data.write_jsonl(path, examples) == 2
  with open(path, "a", encoding="utf-8") as f:
    f.write("\n")  # Blank lines are skipped.
  source = data.JsonlSource(path, prompt_field="question")
  assert len(source) == 2
  assert [source[i] for i in range(2)] == [
      {"prompt": e["question"], "answer": e["answer"],
       "numbers": e["numbers"]} for e in examples]
  assert source[-1]["prompt"] == "3*3"
  only = data.read_jsonl(path, prompt_field="question", fields=["answer"])
  assert only == [{"prompt": e["question"], "answer": e["answer"]}
                  for e in examples]
  restored = pickle.loads(pickle.dumps(source))
  batch = next(data.make_prompt_iterator(restored, 2, seed=0, shuffle=False))
  assert batch["prompt"] == [e["question"] for e in examples]
  with pytest.raises(IndexError):
    source[2]


@pytest.mark.parametrize("lines,match", [
    (['{"prompt": "a"}', "[1, 2]"], r"d.jsonl:2: a JSON object is required"),
    (['{"prompt": "a"}', '{"text": "b"}'],
     r"d.jsonl:2: prompt_field='prompt' is missing.*\['text'\]"),
    (['{"prompt": 3}'], r"d.jsonl:1: prompt_field='prompt' is 3"),
    (['{"prompt": "a"', ], r"d.jsonl:1: not valid JSON"),
    ([""], "no examples"),
])
def test_jsonl_errors_name_the_line(tmp_path, lines, match):
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  with pytest.raises(ValueError, match=match):
    data.JsonlSource(path)


def test_jsonl_missing_kept_field(tmp_path):
  path = tmp_path / "d.jsonl"
  data.write_jsonl(path, [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
  with pytest.raises(ValueError, match="d.jsonl:2: field 'answer' is missing"):
    data.JsonlSource(path, fields=["answer"])


def test_jsonl_required_fields_name_the_file_line_and_field(tmp_path):
  # Without required_fields the missing answer used to surface later as a
  # bare KeyError: 'answer', with no file or line.
  path = tmp_path / "d.jsonl"
  data.write_jsonl(path, [{"prompt": "a", "answer": "1"}, {"prompt": "b"},
                          {"prompt": "c", "answer": None}])
  assert len(data.read_jsonl(path)) == 3  # the default requires the prompt only
  with pytest.raises(ValueError, match=r"d.jsonl:2: required field 'answer' "
                     r"is missing \(required_fields=\('prompt', 'answer'\)\); "
                     r"fields present: \['prompt'\]"):
    data.read_jsonl(path, required_fields=("prompt", "answer"))
  data.write_jsonl(path, [{"prompt": "a", "answer": "1"},
                          {"prompt": "c", "answer": None}])
  with pytest.raises(ValueError, match=r"d.jsonl:2: required field 'answer' "
                     r"is null"):
    data.JsonlSource(path, required_fields=["answer"])
  with pytest.raises(TypeError, match=r"required_fields='answer'"):
    data.JsonlSource(path, required_fields="answer")


def test_jsonl_required_fields_are_kept(tmp_path):
  path = tmp_path / "d.jsonl"
  data.write_jsonl(path, [{"q": "a", "answer": "1", "extra": 2}])
  assert data.read_jsonl(path, prompt_field="q", fields=[],
                         required_fields=("prompt", "answer")) == [
                             {"prompt": "a", "answer": "1"}]


def test_jsonl_non_utf8_byte_names_the_file_and_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')  # Latin-1 e-acute
  with pytest.raises(ValueError, match=r"d.jsonl:2: not valid UTF-8 \(invalid "
                     r"continuation byte: byte b'\\xe9' at column 16\)"):
    data.read_jsonl(path)


def test_check_answers_counts_non_empty_answers():
  from rljax.data.sources import check_answers  # pylint: disable=import-outside-toplevel
  examples = [{"answer": "4"}, {"answer": 0}, {"answer": "  "}, {"answer": ""},
              {"answer": None}, {"answer": []}, {"prompt": "no answer"},
              {"target": 24}]
  assert check_answers(examples, "train.jsonl") == 2
  assert check_answers(examples, "train.jsonl", field="target") == 1
  assert check_answers([], "train.jsonl") == 0
  with pytest.raises(TypeError, match=r"train.jsonl: example 1 is a str; a "
                     "dict of fields is required"):
    check_answers([{"answer": "1"}, "2"], "train.jsonl")


def test_process_blocks_are_exactly_the_one_process_batches():
  """Block k of K of every batch (one process of K): together the blocks
  are the batches of one process, in order; the state is the global batch
  index, so a run resumes on another process count."""
  examples = [{"prompt": f"p{i}"} for i in range(10)]
  whole = data.make_prompt_iterator(examples, 4, seed=3)
  blocks = [data.make_prompt_iterator(examples, 4, seed=3, block=(k, 2))
            for k in range(2)]
  for _ in range(7):  # past an epoch boundary
    want = next(whole)["prompt"]
    assert sum((next(it)["prompt"] for it in blocks), []) == want
  assert blocks[0].get_state() == blocks[1].get_state() == whole.get_state()
  resumed = data.make_prompt_iterator(examples, 4, seed=3, block=(1, 4))
  resumed.set_state(whole.get_state())
  assert next(resumed)["prompt"] == next(whole)["prompt"][1:2]
  with pytest.raises(ValueError, match="batch_size=4 does not split into 3"):
    data.make_prompt_iterator(examples, 4, seed=0, block=(0, 3))
  with pytest.raises(ValueError, match=r"block=\(2, 2\)"):
    data.make_prompt_iterator(examples, 4, seed=0, block=(2, 2))
