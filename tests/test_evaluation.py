"""Evaluation metrics against brute force and hand-computed values."""

import itertools

import numpy as np
import pytest

from rljax.train import evaluation


def _brute_pass_at_k(correct, k):
  """Fraction of the k-subsets of the samples that hold a correct one."""
  subsets = list(itertools.combinations(correct, k))
  return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_equals_enumeration_over_all_subsets(n):
  for c in range(n + 1):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      assert evaluation.pass_at_k(n, c, k) == pytest.approx(
          _brute_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_large_n_is_finite():
  assert evaluation.pass_at_k(4, 1, 2) == pytest.approx(0.5)   # 1 - 3/6
  assert evaluation.pass_at_k(5, 2, 2) == pytest.approx(0.7)   # 1 - 3/10
  assert evaluation.pass_at_k(6, 0, 3) == 0.0
  assert evaluation.pass_at_k(6, 4, 3) == 1.0                  # n - c < k
  # C(1000, 500) overflows a float; the product form does not.
  got = evaluation.pass_at_k(1000, 1, 500)
  assert got == pytest.approx(0.5)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_rejects_out_of_range(n, c, k):
  with pytest.raises(ValueError, match=r"[ck]="):
    evaluation.pass_at_k(n, c, k)


@pytest.mark.parametrize("n, expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
    (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12])])
def test_reported_budgets(n, expected):
  assert evaluation.pass_ks(n) == expected


def test_group_metrics_hand_computed():
  correct = np.array([[1, 0, 0, 0],
                      [1, 1, 0, 1],
                      [0, 0, 0, 0]], bool)
  answers = [["7", "3", "3", "5"],   # majority "3": wrong
             ["9", "9", "2", "9"],   # majority "9": right
             ["1", "2", "1", "2"]]   # tie "1" vs "2", "1" first: wrong
  got = evaluation.group_metrics(correct, answers)
  assert set(got) == {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"}
  assert got["avg@4"] == pytest.approx(4 / 12)
  assert got["pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
  # pass@2: 1 - C(3,2)/C(4,2) = 1/2; 1 - C(1,2)/C(4,2) = 1; 0.
  assert got["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
  assert got["pass@4"] == pytest.approx(2 / 3)
  assert got["maj@4"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("answers, correct, expected", [
    (["a", "b"], [True, False], 1.0),            # 1-1 tie: the first, "a"
    (["b", "a"], [False, True], 0.0),            # 1-1 tie: the first, "b"
    (["x", "y", "y", "x"], [False, True, True, False], 0.0),  # "x" first
    (["y", "x", "x", "y"], [True, False, False, True], 1.0),  # "y" first
    (["x", "y", "z", "z"], [False, False, True, True], 1.0),  # no tie
])
def test_maj_ties_go_to_the_answer_sampled_first(answers, correct, expected):
  got = evaluation.group_metrics(np.array([correct]), [answers])
  assert got[f"maj@{len(answers)}"] == expected


def test_one_sample_gives_pass1_equal_to_accuracy():
  correct = np.array([[True], [False], [True]])
  got = evaluation.group_metrics(correct, [["1"], ["2"], ["3"]])
  assert got == {"avg@1": pytest.approx(2 / 3), "pass@1": pytest.approx(2 / 3),
                 "maj@1": pytest.approx(2 / 3)}
