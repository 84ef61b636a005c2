"""DOTS (``rljax/data/dots.py``, ``train/allocated.dots_examples``): the
attention prediction, the selection law and the queue by hand, a scripted
selection round, config errors, and a DOTS + replay run stopped and
resumed."""

import types

import jax
import numpy as np
import pytest

from rljax.data import dots as dots_lib
from rljax.data import selection as sel
from rljax.rollout import allocated
from rljax.train import build
from tests.test_train import tiny_config


def test_attention_prediction_by_hand():
  ref = np.array([[1.0, 0.0], [0.0, 2.0]])  # cosine ignores the length
  success = np.array([1.0, 0.0])
  # cos((1, 1), .) = 0.707 for both: equal weights.
  np.testing.assert_allclose(
      dots_lib.predict_success(np.array([[1.0, 1.0]]), ref, success, 1.0),
      [0.5])
  # cos((3, 0), .) = 1, 0: weights e / (e + 1) at temperature 1.
  e = np.exp(1.0)
  np.testing.assert_allclose(
      dots_lib.predict_success(np.array([[3.0, 0.0]]), ref, success, 1.0),
      [e / (e + 1.0)])
  # A low temperature picks the nearest reference.
  np.testing.assert_allclose(
      dots_lib.predict_success(np.array([[0.1, 1.0]]), ref, success, 0.01),
      [0.0], atol=1e-12)


def test_leave_one_out_error_by_hand():
  # Orthogonal embeddings: each is predicted by the others' plain mean.
  err = dots_lib.leave_one_out_error(np.eye(3), np.array([1.0, 0.0, 0.5]),
                                     1.0)
  # 0.25 vs 1, 0.75 vs 0, 0.5 vs 0.5.
  np.testing.assert_allclose(err, (0.75 + 0.75 + 0.0) / 3)
  assert np.isnan(dots_lib.leave_one_out_error(np.eye(1), np.ones(1), 1.0))


def test_selection_law_by_hand():
  p = dots_lib.sampling_probabilities(np.array([0.5, 0.0, 1.0, 0.4]), 0.5,
                                      0.1)
  want = np.array([1.0, np.exp(-5), np.exp(-5), np.exp(-1)])
  np.testing.assert_allclose(p, want / want.sum())
  rng = np.random.default_rng(0)
  drawn = dots_lib.draw(p, 4, rng)
  assert sorted(drawn.tolist()) == [0, 1, 2, 3]
  # One draw follows the probabilities (Gumbel top-1 is a categorical).
  probs = np.array([0.7, 0.2, 0.1])
  first = [dots_lib.draw(probs, 1, np.random.default_rng(s))[0]
           for s in range(4000)]
  np.testing.assert_allclose(np.bincount(first, minlength=3) / 4000, probs,
                             atol=0.03)


def test_queue_rounds_and_state():
  d = dots_lib.Dots(batch_size=2, pool_size=10, every=2, reference=4,
                    seed=1)
  assert d.needs_round()
  ref = d.reference_prompts()
  assert len(set(ref.tolist())) == 4 and ref.max() < 10
  predicted = np.linspace(0, 1, 10)  # 0.44 and 0.56 are nearest to 0.5
  queue = d.select(predicted)
  assert len(set(queue.tolist())) == 4 and d.state.round.tolist() == [1]
  assert not d.needs_round()
  assert d.next_prompts().tolist() == queue[:2].tolist()
  other = dots_lib.Dots(batch_size=2, pool_size=10, every=2, reference=4,
                        seed=1)
  other.load_arrays({k: v.copy() for k, v in d.arrays().items()})
  assert other.next_prompts().tolist() == d.next_prompts().tolist()
  assert d.needs_round() and other.needs_round()
  # The next round's reference set is another draw.
  assert d.reference_prompts().tolist() != ref.tolist()
  with pytest.raises(ValueError, match=r"lacks \['round'\]"):
    other.load_arrays({k: v for k, v in d.arrays().items() if k != "round"})
  with pytest.raises(ValueError, match="inconsistent with 10 training"):
    other.load_arrays(dict(d.arrays(), queue=np.array([3, 12])))
  # A low temperature draws the prompts nearest the target.
  sharp = dots_lib.Dots(batch_size=2, pool_size=10, every=1, reference=2,
                        temperature=1e-4)
  assert sorted(sharp.select(predicted).tolist()) == [4, 5]


@pytest.mark.parametrize("kwargs,match", [
    ({"every": 6}, r"rl.selection.dots_every=6 x rl.prompts_per_step=2 "
     r"prompts per round exceed the 10"),
    ({"reference": 3}, r"rl.selection.dots_reference=3: a multiple of "
     r"rl.prompts_per_step=2"),
    ({"reference": 12}, r"rl.selection.dots_reference=12"),
])
def test_bad_settings_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dots_lib.Dots(**{"batch_size": 2, "pool_size": 10, "every": 2, **kwargs})
  with pytest.raises(ValueError, match="pass pool_size"):
    sel.make_selection("dots", seed=0)


class _Scripted:
  """A Collector stand-in: prompt ``i`` of the pool is right
  ``RIGHT[i]`` of 4 times; its embedding is the one-hot of ``i``."""

  samples_per_prompt = 4
  buckets = (8,)
  correct_column = 0

  def __init__(self, dots, right):
    self.selection = types.SimpleNamespace(dots=dots)
    self.tokenizer = types.SimpleNamespace(pad_id=0)
    self.right, self.rounds = right, []

  def sample_global(self, params, examples, key, version):
    del params, key, version
    ids = [int(p) for p in examples["prompt"]]
    self.rounds.append(ids)
    rows = [float(k < self.right[i]) for i in ids for k in range(4)]
    return types.SimpleNamespace(
        lengths=np.full(len(rows), 2),
        result=types.SimpleNamespace(rewards_NxR=np.asarray(rows)[:, None]))


def test_a_scripted_round_rolls_out_the_reference_and_draws_near_half(
    monkeypatch):
  """Pool of 8, reference 4, one-hot embeddings and a sharp attention:
  a referenced prompt's prediction is its own success rate, the others'
  the reference's mean; a sharp selection queues the four nearest 0.5
  for two steps."""
  monkeypatch.setattr(allocated.tok_lib, "encode_prompts",
                      lambda tok, prompts: [[int(p) + 1] for p in prompts])
  right = [0, 1, 2, 3, 4, 4, 4, 4]
  d = dots_lib.Dots(batch_size=2, pool_size=8, every=2, reference=4,
                    temperature=1e-4, attention_temperature=1e-3, seed=5)
  d.attach([{"prompt": str(i)} for i in range(8)], 1,
           lambda params, tokens, mask: np.eye(8)[np.asarray(tokens)[:, -1]
                                                  - 1])
  collector = _Scripted(d, right)
  reference = d.reference_prompts()
  success = np.array(right, float)[reference] / 4
  examples, m, tokens = allocated.dots_examples(collector, None,
                                                jax.random.key(0), 0)
  assert collector.rounds == [reference[:2].tolist(), reference[2:].tolist()]
  assert tokens == 4 * 4 * 2  # 16 reference rows of 2 tokens
  predicted = np.full(8, success.mean())
  predicted[reference] = success
  # Queued: four of the prompts nearest 0.5 (ties drawn at random); the
  # step trains the first two.
  distance = np.abs(predicted - 0.5)
  queue = d.state.queue.tolist()
  assert len(set(queue)) == 4
  assert np.all(distance[queue] <= np.sort(distance)[3] + 1e-12), (
      queue, predicted)
  assert [int(p) for p in examples["prompt"]] == queue[:2]
  np.testing.assert_allclose(m["dots/reference_success"], success.mean())
  np.testing.assert_allclose(m["dots/pool_predicted_success"],
                             predicted.mean())
  assert m["dots/round"] == 1
  # The next step takes the queue without a round.
  examples, m2, tokens2 = allocated.dots_examples(collector, None,
                                                  jax.random.key(1), 0)
  assert tokens2 == 0 and "dots/reference_success" not in m2
  assert [int(p) for p in examples["prompt"]] == queue[2:]
  assert d.needs_round()


@pytest.mark.parametrize("rollout", ["static", "continuous", "partial"])
def test_config_accepts_dots_on_every_rollout_plan(rollout):
  """DOTS's reference rounds and the batch are sampled by whichever plan
  runs (tests/test_pairs.py trains DAPO on slots; docs/selection.md)."""
  c = tiny_config()
  c.rl.selection.name = "dots"
  c.rl.rollout = rollout
  build.validate(c)


@pytest.mark.slow
def test_dots_and_replay_run_stopped_after_step_2_resumes_exactly(tmp_path):
  """DOTS (a round every 2 steps, so step 3 runs one from the restored
  queue and round count) with a quarter of each batch replayed: a run
  stopped after step 2 and resumed gives the uninterrupted run's metrics.
  (A SIGKILLed GRESO + replay run: tests/test_selection.py.)"""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{
      "rl.selection.name": "dots", "rl.num_steps": 4,
      "rl.selection.dots_every": 2, "rl.selection.dots_reference": 16,
      "rl.replay.fraction": 0.25})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  assert ["dots/reference_success" in r for r in rows] == [
      True, False, True, False]
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)


@pytest.mark.slow
def test_dots_on_partial_slots_trains(tmp_path):
  """DOTS's reference round and the batch on partial rollouts' slots."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config, rl_rows  # pylint: disable=import-outside-toplevel
  config = loop_config(**{"rl.selection.name": "dots", "rl.rollout": "partial",
                          "rl.selection.dots_reference": 8})
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert "dots/reference_success" in rows[0] and rows[0]["dots/round"] == 1
  assert "rollout/carried_groups" in rows[0]
  assert all(np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0 for r in rows)
