"""sGPO's curriculum of group sizes (``rljax/data/allocation.py``'s
``Sgpo``, ``rollout/allocated.py``): sizes, pool and curriculum by hand, its
state, a scripted step that profiles then follows the curriculum, config
errors, and a run with replay stopped and resumed."""

import types

import jax
import numpy as np
import pytest

from rljax.data import allocation as alloc
from rljax.rollout import allocated
from rljax.train import build
from tests.test_allocation import _ScriptedCollector, _vigor_config


def test_sgpo_group_sizes_by_hand():
  # w = 1 / max(p, 1/16) = 2, 4, 16 (sum 22); 24 w / 22 = 2.18, 4.36,
  # 17.45 -> clipped 16; floors 2, 4, 16 (22); the 2 rows left go to the
  # largest remainders: 0.36 (second), 0.18 (first).
  np.testing.assert_array_equal(
      alloc.group_sizes(np.array([0.5, 0.25, 0.0]), 24, 16), [3, 5, 16])
  np.testing.assert_array_equal(alloc.group_sizes(np.full(4, 0.5), 32, 32),
                                [8, 8, 8, 8])
  # Trivial prompts still get the minimum of 2.
  sizes = alloc.group_sizes(np.array([1.0, 1.0, 0.1]), 12, 8)
  assert sizes.sum() == 12 and sizes.min() >= 2 and sizes[2] == 8
  with pytest.raises(ValueError, match="a budget of 5 rows cannot give 3"):
    alloc.group_sizes(np.ones(3), 5, 8)


def test_sgpo_pool_and_curriculum_by_hand():
  p = np.array([1.0, 0.5, 0.0, 0.25, 0.5, 0.0, 0.75])
  sgpo = alloc.Sgpo(batch_size=2, group_size=4, unsolved_keep=0.0)
  sgpo.set_profile(p)
  order = sgpo.state.order.tolist()
  # Trivial 0 and unsolved 2, 5 leave; easy to hard: 6, {1, 4}, 3.
  assert order[0] == 6 and set(order[1:3]) == {1, 4} and order[3] == 3
  idx, sizes = sgpo.next_prompts()
  assert idx.tolist() == order[:2] and sizes.sum() == 8
  # 0.75 and 0.5: w = 4/3, 2 -> 3.2, 4.8 -> 3, 5.
  assert sizes.tolist() == [3, 5]
  idx, _ = sgpo.next_prompts()
  assert idx.tolist() == order[2:4]
  idx, _ = sgpo.next_prompts()  # wraps around
  assert idx.tolist() == order[:2]
  everyone = alloc.Sgpo(batch_size=2, group_size=4, unsolved_keep=1.0)
  everyone.set_profile(p)
  assert set(everyone.state.order[-2:].tolist()) == {2, 5}
  with pytest.raises(ValueError, match=r"only 1 of 3 training prompts"):
    alloc.Sgpo(batch_size=2, group_size=4, unsolved_keep=0.0).set_profile(
        np.array([1.0, 0.5, 0.0]))


def test_sgpo_sizes_fewer_prompts_from_their_share_of_the_budget():
  """A step that replays R of B groups asks for B - R prompts: the
  curriculum's next B - R, sized from (B - R) * G rows; the position moves
  on by B - R. B - R = 1 and B are accepted, 0 and B + 1 are not."""
  p = np.array([0.75, 0.5, 0.25, 0.5, 0.6])
  sgpo = alloc.Sgpo(batch_size=3, group_size=4, unsolved_keep=0.0)
  sgpo.set_profile(p)
  order = sgpo.state.order.tolist()  # easy to hard
  idx, sizes = sgpo.next_prompts(2)
  assert idx.tolist() == order[:2] and sizes.sum() == 8
  # 0.75 and 0.6: w = 4/3, 5/3 -> 8 * 4/9, 8 * 5/9 = 3.56, 4.44 -> 4, 4.
  assert sizes.tolist() == [4, 4]
  assert int(sgpo.state.cursor[0]) == 2
  idx, sizes = sgpo.next_prompts(1)
  assert idx.tolist() == order[2:3] and sizes.tolist() == [4]
  idx, sizes = sgpo.next_prompts(3)  # B itself; wraps around
  assert idx.tolist() == order[3:] + order[:1] and sizes.sum() == 12
  for bad in (0, 4):
    with pytest.raises(ValueError, match=rf"sGPO: {bad} prompts for a step "
                       r"of rl.prompts_per_step=3: 1 to 3 are accepted"):
      sgpo.next_prompts(bad)


def test_sgpo_state_round_trips_and_refuses_bad_arrays():
  sgpo = alloc.Sgpo(batch_size=2, group_size=4, seed=3)
  sgpo.set_profile(np.array([0.5, 0.25, 0.75, 0.5]))
  sgpo.next_prompts()
  other = alloc.Sgpo(batch_size=2, group_size=4, seed=3)
  other.load_arrays({k: v.copy() for k, v in sgpo.arrays().items()})
  assert [a.tolist() for a in other.next_prompts()] == [
      a.tolist() for a in sgpo.next_prompts()]
  arrays = sgpo.arrays()
  with pytest.raises(ValueError, match=r"lacks \['cursor'\]"):
    other.load_arrays({k: v for k, v in arrays.items() if k != "cursor"})
  with pytest.raises(ValueError, match="inconsistent"):
    other.load_arrays(dict(arrays, order=np.array([0, 9])))


class _ScriptedSgpoCollector(_ScriptedCollector):
  """Row ``k`` of prompt ``x`` is right when ``k < CORRECT[x]`` (of 4)."""

  correct_column = 0

  def sample_global(self, params, examples, key, version, on_dispatch=None,
                    *, sampler, samples, longest):
    del params, key, version, on_dispatch
    assert sampler == "sampler" and samples == 1 and longest == 7
    self.seen.append(list(examples["prompt"]))
    right = []
    for x in examples["prompt"]:
      k = self.drawn.get(x, 0)
      self.drawn[x] = k + 1
      right.append(float(k % 4 < self.rewards[x]))
    n = len(right)
    return types.SimpleNamespace(
        lengths=np.full(n, 3), result=types.SimpleNamespace(
            rewards_NxR=np.asarray(right)[:, None]))


def test_an_sgpo_step_profiles_then_follows_the_curriculum():
  """Pool a..f, right 4, 2, 0, 1, 3, 2 of 4 times; B = 2, G = 4: the
  profiling pass samples 2 prompts x 4 per call (8 entries, the step's
  shape), then the step trains e (0.75) and one of b, f (0.5)."""
  correct = {"a": 4, "b": 2, "c": 0, "d": 1, "e": 3, "f": 2}
  sgpo = alloc.Sgpo(batch_size=2, group_size=4, profile_samples=4,
                    unsolved_keep=0.0)
  sgpo.attach([{"prompt": x} for x in "abcdef"], longest=7)
  collector = _ScriptedSgpoCollector(sgpo, correct)
  batch, ids, m, _ = allocated.sample(collector, None, {"prompt": ["z"] * 2},
                                   jax.random.key(0), 0, None)
  assert collector.seen[:3] == [list("aaaabbbb"), list("ccccdddd"),
                                list("eeeeffff")]
  np.testing.assert_allclose(sgpo.state.success,
                             [1.0, 0.5, 0.0, 0.25, 0.75, 0.5])
  assert m["alloc/profile_trivial"] == 1 / 6
  assert m["alloc/profile_unsolved"] == 1 / 6 and m["alloc/pool"] == 4
  # The step: e gets 3 rows and b or f 5 (w = 4/3, 2).
  step = collector.seen[3]
  assert step[:3] == ["e"] * 3 and step[3:] in (["b"] * 5, ["f"] * 5)
  np.testing.assert_array_equal(ids, [0, 0, 0, 1, 1, 1, 1, 1])
  assert m["alloc/max_group"] == 5 and m["alloc/min_group"] == 3
  # 24 profiling rows and the step's 8, 3 tokens each.
  assert m["num_generated_tokens"] == (24 + 8) * 3
  assert batch.lengths.tolist() == [3] * 8
  # The next step does not profile again.
  _, _, m2, _ = allocated.sample(collector, None, {"prompt": ["z"] * 2},
                              jax.random.key(1), 0, None)
  assert "alloc/pool" not in m2 and len(collector.seen) == 5
  # A step that replays one group: one fresh prompt, G = 4 rows of it.
  _, ids3, m3, _ = allocated.sample(collector, None, {"prompt": ["z"]},
                                 jax.random.key(2), 0, None)
  assert len(collector.seen[5]) == 4 and len(set(collector.seen[5])) == 1
  np.testing.assert_array_equal(ids3, [0, 0, 0, 0])
  assert m3["num_generated_tokens"] == 4 * 3


@pytest.mark.parametrize("overrides,match", [
    ({"rl.allocation.max_group": 3}, r"rl.allocation.max_group=3 with "
     r"rl.group_size=4"),
])
def test_sgpo_config_errors_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    build.validate(_vigor_config(**{"rl.allocation.name": "sgpo",
                                    **overrides}))


@pytest.mark.slow
def test_sgpo_with_replay_trains_replayed_groups_and_resumes(tmp_path):
  """sGPO with replay (R = 2 of 8 groups): once the buffer holds two
  informative groups, a step samples the curriculum's next 6 prompts from
  6 * G rows and trains the 2 replayed groups of G rows; the curriculum and
  the buffer are checkpointed, so a run stopped after step 2 resumes
  exactly."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{"rl.allocation.name": "sgpo",
                          "rl.replay.fraction": 0.25, "rl.num_steps": 4})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  replayed = [r for r in rows if r["replay/fraction"] > 0]
  assert replayed, [r["replay/stored_groups"] for r in rows]
  for r in rows:
    assert np.isfinite(r["pg_loss"]) and r["alloc/min_group"] >= 2
  for r in replayed:
    assert r["replay/fraction"] == 0.25 and r["replay/mean_age"] >= 1
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)
