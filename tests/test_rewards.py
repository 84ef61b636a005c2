"""Tests for rljax.rewards: parsing, verifiers and the parallel evaluator.

The reward functions used by evaluator tests are module-level so that spawned
worker processes can import them. This module must not import JAX (workers
import it to unpickle those functions).
"""

import functools
import math
import os
import pickle
import time
from fractions import Fraction

import numpy as np
import pytest

from rljax import rewards
from rljax.rewards import parsing
from rljax.rewards import verifiers


# ---------------------------------------------------------------- extraction


def test_extractors():
  assert parsing.extract_tag("<answer>1</answer> <answer> 42 </answer>") == "42"
  assert parsing.extract_tag("<answer>unclosed") is None
  assert parsing.extract_tag("<think>a</think>", "think") == "a"
  assert parsing.extract_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == (
      r"\frac{1}{2}")
  assert parsing.extract_boxed(r"\boxed{\frac{1}{2}") is None
  assert parsing.extract_boxed("no box") is None
  assert parsing.extract_hash_answer("work\n#### 1,234\nbye") == "1,234"
  assert parsing.extract_hash_answer("####") is None
  assert parsing.extract_last_number("a 3, then -1,250.5 and .") == "-1,250.5"
  assert parsing.extract_last_number("none") is None
  assert parsing.extract_final_answer(r"<answer>7</answer> \boxed{8}") == "7"
  assert parsing.extract_final_answer("so 12") == "12"
  assert parsing.extract_final_answer(
      "so 12", fallback_to_last_number=False) is None
  with pytest.raises(ValueError, match="tag="):
    parsing.extract_tag("x", "a b")


@pytest.mark.parametrize("text", [
    "0.5", ".5", "1/2", r"\frac{1}{2}", r"\dfrac{1}{2}", r"\frac12", "$0.50",
    r"\left(\frac{1}{2}\right)", "0.5.", "{1/2}",
    " 1 / 2 ", 0.5, Fraction(1, 2), r"\text{0.5}",
])
def test_parse_number_half(text):
  assert parsing.parse_number(text) == Fraction(1, 2)


@pytest.mark.parametrize("text,expected", [
    ("1,234", 1234), ("$1,000", 1000), ("-3/4", Fraction(-3, 4)),
    (r"-\frac{3}{4}", Fraction(-3, 4)), ("42", 42), (7, 7), ("50\\%", 50),
    ("+5", 5),
])
def test_parse_number_forms(text, expected):
  assert parsing.parse_number(text) == expected


@pytest.mark.parametrize("text", [
    "12,34", "1e5", "abc", "1/0", "", "1" * 70, None, True, float("nan"),
    float("inf"), "1/2/3", "--1", r"\frac{1}{0}", "0x10",
])
def test_parse_number_rejects(text):
  assert parsing.parse_number(text) is None


def test_answers_match():
  assert parsing.answers_match(r"\frac{3}{4}", "0.75")
  assert parsing.answers_match("x + 1", "x+1")
  assert not parsing.answers_match("3", "x")
  assert not parsing.answers_match(None, "3")


# ---------------------------------------------------------- safe arithmetic


@pytest.mark.parametrize("expr,expected", [
    ("(3 + 5) * 2", 16), ("7/2", Fraction(7, 2)), ("2-3*4", -10),
    ("-3+5", 2), ("6/(1-3/4)", 24), ("0.1+0.2", Fraction(3, 10)),
    ("(" * 99 + "1" + ")" * 99, 1),
])
def test_evaluate_expression(expr, expected):
  assert parsing.evaluate_expression(expr, allow_decimals=True) == expected


ADVERSARIAL = [
    "__import__('os').system('true')", "2**10", "9**9**9**9", "x + 1",
    "(1).real", "abs(3)", "1_000", "0x10", "[1]", "1 if 1 else 2", "1//2",
    "5%3", "1<<99", "'1'", "1e9", "1 + ", "()", "(" * 150 + "1" + ")" * 150,
    "1" * 19, "1+" * 150 + "1", "999999999*999999999*999999999*999999999",
    "1/0", "(5-5)/(5-5)", "", "   ", "lambda: 1", "1;2", "1\n+2",
]


@pytest.mark.parametrize("expr", ADVERSARIAL)
def test_evaluate_expression_rejects(expr):
  assert parsing.evaluate_expression(expr) is None


def test_evaluate_expression_is_fast_on_adversarial_inputs():
  start = time.perf_counter()
  for expr in ADVERSARIAL * 20:
    parsing.evaluate_expression(expr)
  assert time.perf_counter() - start < 1.0


def test_evaluate_expression_unary_and_decimals_switches():
  assert parsing.evaluate_expression("-3+5", allow_unary=False) is None
  assert parsing.evaluate_expression("0.5*4") is None
  assert parsing.evaluate_expression("0.5*4", allow_decimals=True) == 2


# ---------------------------------------------------------------- verifiers


def test_numeric_match():
  completions = ["46", "12+34=46", "<answer>46</answer>", "47", "",
                 "forty-six", "46 or 47", r"\boxed{46}", "46.0"]
  got = verifiers.numeric_match([""] * 9, completions, answer=["46"] * 9)
  assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_numeric_match_equivalent_forms_and_missing_reference():
  completions = ["1/2", r"\boxed{\frac{1}{2}}", ".5", "0.50", "2/4", "0.51"]
  assert verifiers.numeric_match([""] * 6, completions, answer=["0.5"] * 6) == [
      1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
  assert verifiers.numeric_match(["", ""], ["1", "1"]) == [None, None]
  assert verifiers.numeric_match(["", ""], ["1", "1"],
                                 answer=[None, "x"]) == [None, None]
  assert verifiers.numeric_match(["", ""], ["so 1", "1"], answer=[1, 1],
                                 fallback_to_last_number=False) == [0.0, 0.0]
  with pytest.raises(ValueError, match="'answer' has 1 values for 2"):
    verifiers.numeric_match(["", ""], ["1", "1"], answer=["1"])


def test_exact_match():
  got = verifiers.exact_match(["", "", "", ""],
                              [" Paris ", "<answer>Paris</answer>", "paris",
                               "Paris"], answer=["Paris", "Paris", "Paris",
                                                 None])
  assert got == [1.0, 1.0, 0.0, None]


def test_math_answer():
  completions = [
      r"so \boxed{\frac{3}{4}}", "#### 0.75", r"<answer>3/4</answer>",
      "0.75", r"\boxed{0.7}", r"\boxed{\$1,000}", "#### 1,000",
      r"\boxed{x + 1}", r"\boxed{\frac{3}{4}", r"\boxed{}",
  ]
  answers = ["0.75"] * 5 + ["1000", "$1000", "x+1", "0.75", "0.75"]
  got = verifiers.math_answer([""] * 10, completions, answer=answers)
  assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
  gsm8k_reference = "Janet has 3 + 4 = 7 eggs.\n#### 7"
  assert verifiers.math_answer([""], ["#### 7"],
                               answer=[gsm8k_reference]) == [1.0]
  assert verifiers.math_answer([""], ["#### 7"], answer=[None]) == [None]


def test_arithmetic():
  prompts = ["12+34=", "Compute 3*(4+5)=", "7/2=", "7/2=", "12+34=", "hello=",
             "2-9="]
  completions = ["46", "27", "3.5", "7/2", "45", "1", "-7"]
  got = verifiers.arithmetic(prompts, completions)
  assert got == [1.0, 1.0, 1.0, 1.0, 0.0, None, 1.0]
  assert verifiers.arithmetic(["ignored"], ["6"], expression=["2*3"]) == [1.0]
  assert verifiers.arithmetic(["1/0="], ["0"]) == [None]


def _countdown(completions, numbers, target, **options):
  n = len(completions)
  return verifiers.countdown([""] * n, completions, numbers=[numbers] * n,
                             target=[target] * n, **options)


def test_countdown_correct_and_wrong():
  got = _countdown(["(3+5)*2", "(3+5)*2 = 16", "<answer>2*(5+3)</answer>",
                    "I think\n2*(3+5)", "(3+5)*2 = 17", "3+5+2",
                    "(3+5)*2=16=16", ""], [2, 3, 5], 16)
  assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
  assert _countdown([" 2 * 8 "], [2, 3, 5, 8], 16) == [1.0]
  # Exact rational intermediates are legal: 6 / (1 - 3/4) = 24.
  assert _countdown(["6/(1-3/4)"], [1, 3, 4, 6], 24) == [1.0]


def test_countdown_number_usage():
  numbers = [2, 3, 5]
  assert _countdown(["5+5", "2*5", "4*4", "2*2*3", "10"], numbers, 10) == [
      0.0, 1.0, 0.0, 0.0, 0.0]
  assert _countdown(["(5+5)"], [5, 5, 1], 10) == [1.0]
  assert _countdown(["2*5", "(3-2)*5*2"], numbers, 10, use_all=True) == [
      0.0, 0.0]
  assert _countdown(["(3+5)*2"], numbers, 16, use_all=True) == [1.0]


@pytest.mark.parametrize("completion", [
    "__import__('os').system('true')", "2**4", "2**3*2", "9**9**9**9",
    "(2).__class__", "x", "-2+18", "16", "2*8.0", "int('16')", "2 * 8 * 1",
    "1" * 300, "(((((((((((((((3+5)))))))))))))))*2" + "+0" * 100,
    "eval('16')", "[2,8]",
])
def test_countdown_adversarial(completion):
  assert _countdown([completion], [2, 3, 5, 8], 16) == [0.0]


def test_countdown_missing_and_malformed_fields():
  assert verifiers.countdown(["", ""], ["2*8", "2*8"]) == [None, None]
  assert verifiers.countdown([""], ["2*8"], numbers=[None], target=[16]) == [
      None]
  with pytest.raises(ValueError, match="'numbers'='2 8'"):
    verifiers.countdown([""], ["2*8"], numbers=["2 8"], target=[16])


def test_format_match_and_registry():
  completions = ["<think>hm</think> <answer>4</answer>", "<answer>4</answer>",
                 "<think>\nmulti\nline</think>\n<answer>4</answer>\n"]
  assert verifiers.format_match([""] * 3, completions) == [1.0, 0.0, 1.0]
  fn = rewards.get_reward_fn("format", pattern=r"<answer>\d+</answer>")
  assert fn([""] * 3, completions) == [0.0, 1.0, 0.0]
  assert pickle.loads(pickle.dumps(fn))([""], ["<answer>1</answer>"]) == [1.0]
  assert rewards.get_reward_fn("countdown") is verifiers.countdown
  with pytest.raises(ValueError, match="accepted.*'countdown'"):
    rewards.get_reward_fn("nope")
  with pytest.raises(ValueError, match=r"unknown options \['use_al'\]"):
    rewards.get_reward_fn("countdown", use_al=True)
  with pytest.raises(ValueError, match=r"unknown options \['answer'\]"):
    rewards.get_reward_fn("numeric_match", answer=["1"])


# --------------------------------------------------------------- evaluation


def chaotic(prompts, completions, *, pid_file=None, **unused):
  """Misbehaves according to the completion (one sample per call here)."""
  del prompts, unused
  words = {c.split()[0] for c in completions if c.split()}
  if "HANG" in words:
    with open(pid_file[0], "w") as f:
      f.write(str(os.getpid()))
    time.sleep(60)
  if "DIE" in words:
    os._exit(3)
  if "RAISE" in words:
    raise RuntimeError("reward exploded")
  return [None if c.startswith("NONE") else float(len(c)) for c in completions]


def odd_values(prompts, completions, **unused):
  """One value per completion, of a kind chosen by its text."""
  del prompts, unused
  table = {"a": 0.5, "b": "x", "c": math.inf, "d": math.nan, "e": True}
  return [table.get(c[:1], 1.0) for c in completions]


def wrong_length(prompts, completions, **unused):
  del prompts, unused
  return [1.0] * (len(completions) + 1)


def _pid_alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_combine_rewards():
  r = np.array([[1.0, np.nan], [0.5, 2.0], [np.nan, np.nan]])
  np.testing.assert_allclose(rewards.combine_rewards(r, [2.0, 0.5]),
                             [2.0, 2.0, 0.0])
  np.testing.assert_allclose(
      rewards.combine_rewards(r, [2.0, 0.5], missing="nan"),
      [np.nan, 2.0, np.nan])
  # A zero weight never turns a missing reward into a NaN total.
  np.testing.assert_allclose(
      rewards.combine_rewards(r, [2.0, 0.0], missing="nan"),
      [2.0, 1.0, np.nan])
  with pytest.raises(ValueError, match="missing='drop'"):
    rewards.combine_rewards(r, [1.0, 1.0], missing="drop")


def test_in_process_evaluation():
  specs = [rewards.RewardSpec("chaotic", chaotic, weight=2.0),
           rewards.reward_spec("numeric_match", weight=0.5),
           rewards.RewardSpec("lam", lambda p, c, **kw: [1.0] * len(c))]
  with rewards.RewardEvaluator(specs, num_workers=0) as evaluator:
    result = evaluator.evaluate(["q"] * 3, ["ab", "NONE", "7"],
                                {"answer": ["2", "4", "7"]})
    # One call covers the batch, so the raise costs all three samples.
    raised = evaluator.evaluate(["q"] * 3, ["ab", "RAISE", "7"],
                                {"answer": ["2", "4", "7"]})
  np.testing.assert_array_equal(result.rewards_NxR,
                                [[2, 0, 1], [np.nan, 0, 1], [1, 1, 1]])
  np.testing.assert_allclose(result.total_N, [5.0, 1.0, 3.5])
  assert result.metrics["reward/chaotic/none"] == 1
  assert result.metrics["reward/chaotic/mean"] == 1.5
  assert result.names == ("chaotic", "numeric_match", "lam")
  assert raised.metrics["reward/chaotic/errors"] == 3
  assert "reward exploded" in raised.messages[0]
  np.testing.assert_allclose(raised.total_N, [1.0, 1.0, 1.5])


def test_process_pool_survives_raise_hang_death_and_none(tmp_path):
  pid_file = str(tmp_path / "hung.pid")
  specs = [rewards.RewardSpec("chaotic", chaotic, weight=1.0),
           rewards.reward_spec("numeric_match", weight=10.0),
           rewards.RewardSpec("odd", odd_values, weight=0.0),
           rewards.RewardSpec("wrong_length", wrong_length, weight=0.0)]
  completions = ["7", "RAISE 5", "HANG 0", "DIE 3", "NONE 4"]
  fields = {"answer": ["7", "5", "4", "3", "4"], "pid_file": [pid_file] * 5}
  evaluator = rewards.RewardEvaluator(specs, num_workers=2, timeout_s=2.0,
                                      chunk_size=1)
  try:
    start = time.monotonic()
    result = evaluator.evaluate(["p"] * 5, completions, fields)
    assert time.monotonic() - start < 20  # The hung call sleeps 60 s.
    nan = np.nan
    np.testing.assert_array_equal(result.rewards_NxR[:, :2], [
        [1, 1], [nan, 1], [nan, 0], [nan, 1], [nan, 1]])
    np.testing.assert_allclose(result.total_N, [11, 10, 0, 10, 10])
    m = result.metrics
    assert (m["reward/chaotic/errors"], m["reward/chaotic/timeouts"],
            m["reward/chaotic/none"]) == (2, 1, 1)
    assert m["reward/chaotic/valid_frac"] == pytest.approx(0.2)
    assert sum(m[f"reward/numeric_match/{kind}"]
               for kind in ("errors", "timeouts", "none")) == 0
    assert m["reward/wrong_length/errors"] == 5
    assert m["reward/worker_restarts"] == 2  # The hung and the dead worker.
    assert any("died" in s for s in result.messages)
    # The hung call's process is gone, not merely abandoned.
    with open(pid_file) as f:
      assert not _pid_alive(int(f.read()))

    # The evaluator keeps working on the next call.
    odd = ["a", "b", "c", "d", "e"]
    result = evaluator.evaluate(["p"] * 5, odd, {"answer": ["1"] * 5})
    np.testing.assert_array_equal(result.rewards_NxR[:, 0], [1] * 5)
    np.testing.assert_array_equal(result.rewards_NxR[:, 2],
                                  [0.5, nan, nan, nan, 1.0])
    # "x" cannot be converted (an error); inf converts but is no usable
    # reward (invalid); NaN is no reward (none).
    assert (result.metrics["reward/odd/errors"],
            result.metrics["reward/odd/invalid"],
            result.metrics["reward/odd/none"]) == (1, 1, 1)
    assert result.metrics["reward/worker_restarts"] == 0
    # pylint: disable-next=protected-access
    processes = [w.process for w in evaluator._pool._workers]
  finally:
    evaluator.close()
  evaluator.close()
  assert processes and not any(p.is_alive() for p in processes)


def test_evaluator_rejects_bad_configuration():
  spec = rewards.reward_spec("countdown")
  with pytest.raises(ValueError, match="cannot be pickled"):
    rewards.RewardEvaluator(
        [rewards.RewardSpec("lam", lambda p, c, **kw: [1.0] * len(c))],
        num_workers=1)
  with pytest.raises(ValueError, match="appear more than once"):
    rewards.RewardEvaluator([spec, spec], num_workers=0)
  with pytest.raises(ValueError, match="start_method='fork'"):
    rewards.RewardEvaluator([spec], num_workers=1, start_method="fork")
  with pytest.raises(ValueError, match="RewardSpec.name='a b'"):
    rewards.RewardSpec("a b", verifiers.countdown)
  with rewards.RewardEvaluator([spec], num_workers=0) as evaluator:
    with pytest.raises(ValueError, match="'target' has 1 values for 2"):
      evaluator.evaluate(["", ""], ["1", "2"],
                         {"numbers": [[1], [2]], "target": [1]})
    with pytest.raises(ValueError, match="prompts has 1 items"):
      evaluator.evaluate([""], ["1", "2"])
    empty = evaluator.evaluate([], [])
  assert empty.rewards_NxR.shape == (0, 1)


def test_partial_options_reach_workers():
  specs = [rewards.reward_spec("countdown", name="all", use_all=True),
           rewards.RewardSpec("some", functools.partial(verifiers.countdown))]
  with rewards.RewardEvaluator(specs, num_workers=1, timeout_s=10) as ev:
    result = ev.evaluate([""], ["2*5"], {"numbers": [[2, 3, 5]],
                                         "target": [10]})
  np.testing.assert_array_equal(result.rewards_NxR, [[0.0, 1.0]])


def test_merge_results_of_blocks_is_the_whole_batch():
  """Blocks of a batch scored apart (one per process) merge into the
  metrics of the batch scored at once: means over all rows, failure counts
  summed, the slowest block's time."""
  specs = [rewards.RewardSpec("chaotic", chaotic, weight=2.0),
           rewards.reward_spec("numeric_match", weight=0.5)]
  completions = ["ab", "NONE", "7", "RAISE", "5", "x"]
  answers = {"answer": ["2", "4", "7", "1", "5", "3"]}
  with rewards.RewardEvaluator(specs, num_workers=0) as evaluator:
    whole = evaluator.evaluate(["q"] * 6, completions, answers)
    blocks = [evaluator.evaluate(["q"] * 3, completions[s],
                                 {"answer": answers["answer"][s]})
              for s in (slice(0, 3), slice(3, 6))]
  merged = rewards.merge_results(
      whole.names, *(np.concatenate([getattr(b, f) for b in blocks])
                     for f in ("rewards_NxR", "valid_NxR", "total_N")),
      [b.metrics for b in blocks])
  # The second block's RAISE fails its whole call: different rows than the
  # whole batch's one call, so compare with what the blocks scored.
  np.testing.assert_array_equal(merged.rewards_NxR, np.concatenate(
      [b.rewards_NxR for b in blocks]))
  valid = merged.valid_NxR
  for j, name in enumerate(merged.names):
    column = merged.rewards_NxR[valid[:, j], j]
    assert merged.metrics[f"reward/{name}/mean"] == pytest.approx(
        column.mean() if column.size else math.nan, nan_ok=True)
    for kind in ("errors", "none", "timeouts"):
      assert merged.metrics[f"reward/{name}/{kind}"] == sum(
          b.metrics[f"reward/{name}/{kind}"] for b in blocks)
  assert merged.metrics["reward/chaotic/errors"] == 3  # the RAISE block
  finite = merged.total_N[np.isfinite(merged.total_N)]
  assert merged.metrics["reward/total/mean"] == pytest.approx(finite.mean())
  assert merged.metrics["reward/total/std"] == pytest.approx(finite.std())
  assert merged.metrics["reward/eval_seconds"] == max(
      b.metrics["reward/eval_seconds"] for b in blocks)
  # Without failures the merge is the whole batch's result.
  ok = ["ab", "7", "5", "x"]
  fields = {"answer": ["2", "7", "5", "3"]}
  with rewards.RewardEvaluator(specs, num_workers=0) as evaluator:
    whole = evaluator.evaluate(["q"] * 4, ok, fields)
    halves = [evaluator.evaluate(["q"] * 2, ok[s], {"answer":
                                                    fields["answer"][s]})
              for s in (slice(0, 2), slice(2, 4))]
  merged = rewards.merge_results(
      whole.names, *(np.concatenate([getattr(b, f) for b in halves])
                     for f in ("rewards_NxR", "valid_NxR", "total_N")),
      [b.metrics for b in halves])
  for k, v in whole.metrics.items():
    if k != "reward/eval_seconds":
      assert merged.metrics[k] == pytest.approx(v, nan_ok=True), k
