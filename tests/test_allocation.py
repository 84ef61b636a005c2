"""Rollout allocation (``rljax/data/allocation.py``, ``rollout/allocated.py``):
schedules and choices by hand, a step's rounds on scripted rewards, the
advantages of groups of unequal size against NumPy, config errors, and a
stopped and resumed VIGOR run."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sampling
from rljax.data import allocation as alloc
from rljax.rollout import allocated
from rljax.train import batch_layout, build
from tests.test_train import tiny_config
from tests import subprocess_env


# --- schedules and choices ---------------------------------------------------


def test_vigor_schedule_is_the_papers_for_g_8():
  s = alloc.vigor(32, 8)  # T = 4, m0 = 2, alpha = 1/2, gamma = 2
  assert s.prompts == (32, 16, 8, 4) and s.samples == (2, 4, 8, 16)
  assert s.rows == 32 * 8  # GRPO's budget
  assert s.max_group == 30  # 2 + 4 + 8 + 16: the paper's largest group
  assert s.sampler_samples == 2
  # Every round samples B * m0 rows: one sampler shape.
  assert {p * m for p, m in zip(s.prompts, s.samples)} == {64}
  s = alloc.vigor(9, 6, rounds=2, growth=3)
  assert s.prompts == (9, 3) and s.samples == (3, 9) and s.rows == 54


def test_pilot_commit_schedule():
  s = alloc.pilot_commit(32, 8, pilot_fraction=0.25, commit_fraction=0.25)
  # 2 pilot samples each (64 rows); the other 192 to 8 prompts, 24 each.
  assert s.prompts == (32, 8) and s.samples == (2, 24)
  assert s.rows == 256 and s.max_group == 26 and s.sampler_samples == 2


@pytest.mark.parametrize("call,match", [
    (lambda: alloc.vigor(32, 6), r"rl.group_size=6 does not split into "
     r"rl.allocation.rounds=4"),
    (lambda: alloc.vigor(12, 8), r"rl.prompts_per_step=12 .* a multiple of 8"),
    (lambda: alloc.vigor(8, 8, growth=1), r"rl.allocation.growth=1"),
    (lambda: alloc.pilot_commit(8, 4, 0.1, 0.25),
     r"rl.allocation.pilot_fraction=0.1 gives 0 pilot samples"),
    (lambda: alloc.pilot_commit(8, 4, 0.5, 0.375),
     r"rl.allocation.commit_fraction=0.375 commits to 3 of 8 prompts"),
    (lambda: alloc.make_schedule("vigr", batch_size=8, group_size=4),
     r"rl.allocation.name='vigr'; accepted"),
])
def test_bad_schedules_name_the_field(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_variances_and_choices_by_hand():
  totals = [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0, 1.0, 0.0], [5.0], []]
  np.testing.assert_allclose(alloc.variances(totals),
                             [0.25, 0.0, 0.25, 0.0, 0.0])
  v = alloc.variances(totals)
  np.testing.assert_array_equal(alloc.choose(v, np.arange(5), 2), [0, 2])
  # Ties go to the prompt drawn first.
  np.testing.assert_array_equal(alloc.choose(v, np.arange(5), 3), [0, 1, 2])
  np.testing.assert_array_equal(alloc.choose(v, np.array([1, 3, 4]), 2),
                                [1, 3])
  np.testing.assert_array_equal(alloc.entries(np.array([0, 2]), 4, 2),
                                [0, 0, 2, 2])


# --- one step's rounds on scripted rewards -------------------------------------


class _ScriptedCollector:
  """Stands in for ``Collector``: ``_round`` scores each row with
  ``REWARDS[prompt][k]`` for the prompt's ``k``-th sample of the step."""

  def __init__(self, schedule, rewards):
    self.allocation, self.allocation_sampler = schedule, "sampler"
    self.tokenizer = types.SimpleNamespace()
    self.rewards, self.seen = rewards, []
    self.drawn = {}

  failed_rewards = "exclude"
  speculation = None  # no SPEC-RL drafts
  allocation_fresh = None  # no replay
  selection = None  # no refills
  correct_column = 0  # a reward of 1 or more is correct

  def sample_global(self, params, examples, key, version, on_dispatch=None,
                    *, sampler, samples, longest):
    del params, key, version, on_dispatch
    assert sampler == "sampler" and longest == 3
    prompts = [p for p in examples["prompt"] for _ in range(samples)]
    self.seen.append(sorted(set(examples["prompt"])))
    totals = []
    for p in prompts:
      k = self.drawn.get(p, 0)
      self.drawn[p] = k + 1
      totals.append(self.rewards[p][k])
    n = len(totals)
    return types.SimpleNamespace(
        lengths=np.full(n, 2), result=types.SimpleNamespace(
            total_N=np.asarray(totals, np.float32),
            rewards_NxR=np.asarray(totals, np.float32)[:, None],
            valid_NxR=np.isfinite(np.asarray(totals, np.float32))[:, None]))

  def merge_rounds(self, rounds, plan, group_rows, trees_apart):
    # Entries of sampler_samples rows, each a tree numbered apart.
    assert group_rows == self.allocation.sampler_samples and trees_apart
    self.plan = plan
    return "merged"


def test_a_vigor_step_follows_the_variance_by_hand(monkeypatch):
  """B = 4, G = 4, 2 rounds, growth 2: 2 samples each, then the 2 prompts
  of highest variance get 4 more each."""
  monkeypatch.setattr(allocated.tok_lib, "encode_prompts",
                      lambda tok, prompts: [[1, 2, 3]] * len(prompts))
  rewards = {"a": [1, 1, 0, 0, 0, 0],   # variance 0 after the pilot
             "b": [1, 0, 1, 1, 1, 1],   # 0.25
             "c": [0, 0, 9, 9, 9, 9],   # 0
             "d": [0, 1, 0, 0, 0, 0]}   # 0.25
  collector = _ScriptedCollector(alloc.vigor(4, 4, rounds=2, growth=2),
                                 rewards)
  examples = {"prompt": ["a", "b", "c", "d"]}
  merged, ids, m, trained = allocated.sample(collector, None, examples,
                                             jax.random.key(0), 0, None)
  assert merged == "merged" and trained is None
  assert collector.seen == [["a", "b", "c", "d"], ["b", "d"]]
  # Every entry of every round (4, then 2 x 2 of 2 rows).
  assert [list(r) for r in collector.plan.rounds] == [[0, 1, 2, 3],
                                                      [0, 1, 2, 3]]
  # Round 1: 2 rows per prompt; round 2: b and d, 4 rows each.
  np.testing.assert_array_equal(ids, [0, 0, 1, 1, 2, 2, 3, 3] + [1] * 4
                                + [3] * 4)
  assert m["alloc/rounds"] == 2 and m["alloc/max_group"] == 6
  assert m["alloc/zero_variance_first"] == 0.5  # a and c
  # After all rounds: a, c have zero variance (4 of 16 rows).
  assert m["alloc/zero_variance_prompts"] == 0.5
  assert m["alloc/zero_variance_rows"] == 4 / 16
  assert m["num_generated_tokens"] == 16 * 2


# Pass 1 of a refilled step: e, f and g vary after the pilot, h does not;
# VIGOR's second round takes e and f (ties to the first drawn), so g's
# group is informative with its 2 pilot rows.
_PASS_1 = {"e": [0, 1, 0, 0, 1, 1], "f": [1, 0, 1, 1, 0, 0],
           "g": [0, 1], "h": [1, 1]}


def _refilled(monkeypatch, max_rounds, second_pass):
  monkeypatch.setattr(allocated.tok_lib, "encode_prompts",
                      lambda tok, prompts: [[1, 2, 3]] * len(prompts))
  rewards = {"a": [1, 1], "b": [1, 0, 1, 1, 1, 1], "c": [0, 0],
             "d": [0, 1, 0, 0, 0, 0], **second_pass,
             "i": [0, 1, 1, 1, 1, 1], "j": [1, 0, 0, 0, 0, 0],
             "k": [0, 0], "l": [1, 1]}
  collector = _ScriptedCollector(alloc.vigor(4, 4, rounds=2, growth=2),
                                 rewards)
  collector.selection = types.SimpleNamespace(dots=None, greso=None,
                                              max_rounds=max_rounds)
  batches = iter([{"prompt": list(second_pass)},
                  {"prompt": ["i", "j", "k", "l"]}])
  out = allocated.sample(collector, None, {"prompt": ["a", "b", "c", "d"]},
                         jax.random.key(0), 0, None, lambda: next(batches))
  return collector, out


def test_dapo_refills_allocated_groups_by_hand(monkeypatch):
  """B = 4, G = 4, VIGOR's 2 rounds (16 rows). Pass 0 keeps b and d (6
  rows each; a and c have no variance). Pass 1 (new prompts) has e and f of
  6 rows, too large for the 4 rows left, and g of 2, kept. The last 2 rows
  are a masked filler: pass 0's first dropped entry, a's."""
  collector, (_, ids, m, trained) = _refilled(monkeypatch, 2, _PASS_1)
  assert collector.seen == [["a", "b", "c", "d"], ["b", "d"],
                            ["e", "f", "g", "h"], ["e", "f"]]
  # Entries taken, round by round: a (filler), b, d; b, b, d, d; g; none.
  assert [list(r) for r in collector.plan.rounds] == [[0, 1, 3],
                                                      [0, 1, 2, 3], [2], []]
  np.testing.assert_array_equal(ids, [-1, -1, 0, 0, 1, 1] + [0] * 4
                                + [1] * 4 + [2, 2])
  np.testing.assert_array_equal(trained, [False] * 2 + [True] * 14)
  assert m["select/rounds"] == 2 and m["select/masked_rows"] == 2
  assert m["select/zero_variance_before"] == 0.5  # a and c
  assert m["select/zero_variance_after"] == 2 / 16
  assert m["alloc/max_group"] == 6 and m["alloc/zero_variance_prompts"] == 0
  assert m["num_generated_tokens"] == 2 * 16 * 2  # both passes' rows


def test_refill_passes_stop_when_the_rows_left_hold_no_group(monkeypatch):
  """The stop rule on both sides of its bound: 2 rows left (= the smallest
  group, the pilot's 2) draw a third pass when max_rounds allows; 0 rows
  left draw none."""
  collector, (_, ids, m, _) = _refilled(monkeypatch, 3, _PASS_1)
  assert m["select/rounds"] == 3 and len(collector.seen) == 6
  # Pass 2: i and j vary (6 rows each, too many), k and l do not: the
  # filler is still a's.
  assert ids[0] == -1 and m["select/masked_rows"] == 2
  # Pass 1 where every prompt varies: e and f take 6 rows each (too many),
  # g and h 2 each: the 16 rows are full, and no third pass is drawn.
  fills = {"e": [0, 1, 0, 0, 1, 1], "f": [1, 0, 1, 1, 0, 0], "g": [0, 1],
           "h": [1, 0]}
  collector, (_, ids, m, trained) = _refilled(monkeypatch, 5, fills)
  assert m["select/rounds"] == 2 and m["select/masked_rows"] == 0
  assert trained.all() and sorted(set(ids.tolist())) == [0, 1, 2, 3]


def test_a_group_whose_rewards_are_nan_is_a_masked_filler(monkeypatch):
  """A reward function that returns NaN for all of b's rows: b has no
  scored row, so no variance, and is dropped like a and c; with no pass
  left (max_rounds=1) the 10 rows beside d's group are masked fillers, in
  the order drawn (a, b, c of the pilot, then a's second-round rows)."""
  monkeypatch.setattr(allocated.tok_lib, "encode_prompts",
                      lambda tok, prompts: [[1, 2, 3]] * len(prompts))
  nan = float("nan")
  collector = _ScriptedCollector(alloc.vigor(4, 4, rounds=2, growth=2), {
      "a": [1] * 6, "b": [nan, nan], "c": [0, 0], "d": [0, 1, 0, 0, 0, 0]})
  collector.selection = types.SimpleNamespace(dots=None, greso=None,
                                              max_rounds=1)
  _, ids, m, trained = allocated.sample(
      collector, None, {"prompt": ["a", "b", "c", "d"]}, jax.random.key(0),
      0, None, lambda: pytest.fail("max_rounds=1 draws no refill"))
  assert collector.seen == [["a", "b", "c", "d"], ["a", "d"]]
  np.testing.assert_array_equal(ids, [-1] * 6 + [0, 0] + [-1] * 4 + [0] * 4)
  np.testing.assert_array_equal(trained, ids >= 0)
  assert m["select/masked_rows"] == 10 and m["select/rounds"] == 1


def test_the_batch_must_match_the_schedule(monkeypatch):
  monkeypatch.setattr(allocated.tok_lib, "encode_prompts",
                      lambda tok, prompts: [[1]] * len(prompts))
  collector = _ScriptedCollector(alloc.vigor(4, 4, rounds=2), {})
  with pytest.raises(ValueError, match="a batch of 3 prompts for a schedule "
                     "of 4"):
    allocated.sample(collector, None, {"prompt": ["a", "b", "c"]},
                     jax.random.key(0), 0, None)


# --- advantages of groups of unequal size --------------------------------------


def test_unequal_groups_get_each_groups_own_grpo_advantages():
  """Rows of 3 prompts in a scrambled order (sizes 2, 5, 1), through
  ``postprocess`` with group ids: each row's advantage is its group's
  ``(r - mean) / (std + 1e-6)`` (Bessel), the singleton's 0."""
  ids = np.array([1, 0, 1, 2, 1, 0, 1, 1])
  r = np.array([1.0, 0.0, 0.0, 3.0, 1.0, 1.0, 0.5, 2.0], np.float32)
  n, p, t = len(ids), 2, 3
  rng = np.random.RandomState(0)
  rollout = sampling.Rollout(
      jnp.asarray(rng.randint(1, 9, (n, p)), jnp.int32), jnp.ones((n, p), bool),
      jnp.asarray(rng.randint(1, 9, (n, t)), jnp.int32), jnp.ones((n, t), bool),
      jnp.full((n,), t, jnp.int32), jnp.ones((n,), bool), None,
      jnp.zeros((n, t), jnp.float32))
  alg = build.algorithm(tiny_config())  # GRPO
  alg = build.with_allocation(_vigor_config(), alg)  # 8 groups of <= 15
  want = np.zeros(n)
  for g in range(3):
    x = r[ids == g].astype(np.float64)
    if len(x) > 1:
      want[ids == g] = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
  rewards = jnp.asarray(r[:, None])
  batch, _, metrics = batch_layout.postprocess(
      rollout, rewards, jnp.ones(n, bool), jnp.ones(1, jnp.float32),
      alg.advantage.init(rewards), None, jnp.asarray(ids, jnp.int32),
      algorithm=alg, group_size=4, groups=(8, 15))
  np.testing.assert_allclose(np.asarray(batch.advantages_NxL)[:, -1], want,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(batch.advantages_NxL)[:, :p], 0)
  # Groups 0 (0, 1) and 1 vary; the singleton 2 does not: 1 of 3.
  np.testing.assert_allclose(metrics["frac_zero_variance_groups"], 1 / 3)
  np.testing.assert_allclose(metrics["reward_mean"], r.mean(), rtol=1e-6)
  # The same chain without ids refuses to guess.
  with pytest.raises(ValueError, match="group_ids_N"):
    alg.advantage.update(rewards, alg.advantage.init(rewards), group_size=4)


# --- config ----------------------------------------------------------------


def _vigor_config(**overrides):
  c = tiny_config()  # B = 8, G = 4: rounds of 1, 2, 4, 8 samples
  c.rl.allocation.name = "vigor"
  for k, v in overrides.items():
    section, field = k.rsplit(".", 1)
    node = c
    for part in section.split("."):
      node = node[part]
    node[field] = v
  return c


@pytest.mark.parametrize("overrides,match", [
    ({"rl.rollout": "partial"}, r"with rl.rollout='partial': allocation "
     r"chooses each round's prompts"),
    ({"rl.advantage": "mc_grpo"}, r"with rl.advantage='mc_grpo': the "
     r"advantage samples a pivot or greedy row"),
    ({"rl.allocation.rounds": 3}, r"rl.group_size=4 does not split into "
     r"rl.allocation.rounds=3"),
    ({"rl.allocation.growth": 3}, r"rl.prompts_per_step=8 cannot keep 1/3"),
])
def test_config_errors_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    build.validate(_vigor_config(**overrides))


def test_unknown_allocation_name_is_refused():
  c = tiny_config()
  c.rl.allocation.name = "vigour"
  with pytest.raises(ValueError, match=r"rl.allocation.name='vigour'"):
    build.validate(c)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vigor", "sgpo"])
def test_a_run_stopped_after_step_1_resumes_exactly(tmp_path, name):
  """VIGOR keeps no state; sGPO's profile and curriculum position are
  checkpointed: a run stopped after step 1 and resumed gives the
  uninterrupted run's metrics (every alloc/* figure included), and the
  resumed run does not profile again."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{"rl.allocation.name": name, "rl.num_steps": 3})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  if name == "vigor":
    assert all(r["alloc/rounds"] == 4 and r["alloc/max_group"] <= 15
               for r in rows)
  else:  # profiled once, at the first step
    assert ["alloc/pool" in r for r in rows] == [True, False, False]
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 1)


@pytest.mark.slow
def test_allocation_with_replay_trains_replayed_groups_and_resumes(tmp_path):
  """VIGOR (2 rounds) with replay (R = 2 of 8 groups): once the buffer
  holds two informative groups, a step samples 6 fresh prompts in VIGOR's
  rounds of 6 (6 * G rows) and trains the 2 replayed groups, of G rows,
  as groups of their own; the stored groups are G rows of informative
  allocated groups. Stopped after step 2 and resumed, the run is the
  uninterrupted one (the buffer is checkpointed)."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{"rl.allocation.name": "vigor",
                          "rl.allocation.rounds": 2,
                          "rl.replay.fraction": 0.25, "rl.num_steps": 4})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  replayed = [r for r in rows if r["replay/fraction"] > 0]
  assert replayed, [r["replay/stored_groups"] for r in rows]
  g = config.rl.group_size
  for r in rows:
    assert r["alloc/rounds"] == 2 and np.isfinite(r["pg_loss"])
    # VIGOR's groups: g/2 samples for all, then g for the better half.
    assert r["alloc/max_group"] == g // 2 + g
  for r in replayed:
    assert r["replay/fraction"] == 0.25 and r["replay/mean_age"] >= 1
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)


@pytest.mark.slow
def test_vigor_with_greso_refills_trains_and_resumes_exactly(tmp_path):
  """VIGOR's 4 rounds (B = 8, G = 4: 8 prompts of 1 sample, 4 of 2, 2 of
  4, 1 of 8) with GRESO's selection and DAPO's refills: the prompts the
  pilot alone sampled have one row, so no variance, and every step refills
  (a second pass at least). The batch keeps 32 rows, fillers masked; a run
  stopped after step 1 resumes exactly (GRESO's history is
  checkpointed)."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{"rl.allocation.name": "vigor", "rl.num_steps": 3,
                          "rl.selection.name": "greso"})
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  for r in rows:
    assert r["alloc/rounds"] == 4 and r["select/rounds"] >= 2, r
    assert r["select/rollouts"] == 32 * r["select/rounds"]
    assert 0 <= r["select/masked_rows"] < 32 and r["grad_norm"] > 0
    assert r["select/zero_variance_after"] == r["select/masked_rows"] / 32
    assert "select/skipped_prompts" in r
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 1)


def test_allocation_with_replay_needs_rounds_for_the_fresh_prompts():
  from tests.test_loop import loop_config  # pylint: disable=import-outside-toplevel
  # 8 prompts, 2 replayed: VIGOR's 4 rounds keep half 3 times (a multiple
  # of 8); 6 fresh prompts are refused, naming both fields.
  c = loop_config(**{"rl.allocation.name": "vigor",
                     "rl.replay.fraction": 0.25})
  with pytest.raises(ValueError, match=r"rl.replay.fraction=0.25 replays 2 "
                     r"of rl.prompts_per_step=8 groups and leaves 6 fresh.*"
                     r"a multiple of 8"):
    build.validate(c)
  build.validate(loop_config(**{"rl.allocation.name": "vigor",
                                "rl.allocation.rounds": 2,
                                "rl.replay.fraction": 0.25}))


@pytest.mark.slow
def test_allocation_runs_on_every_plan_of_the_training_rows(tmp_path):
  """VIGOR's rounds on continuous slots allocate and train the rows of the
  static batch (each row's draws are its own): the same alloc/* and reward
  figures, the same loss to float rounding; on an environment's episodes
  on slots the rounds are episodes, and their slot figures cover every
  round."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_env_loop import QUICK, env_config  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config, rl_rows  # pylint: disable=import-outside-toplevel
  rows = {}
  for plan in ("static", "continuous"):
    config = loop_config(**{"rl.allocation.name": "vigor", "rl.num_steps": 1,
                            "rl.rollout": plan, "rl.rollout_slots":
                                None if plan == "static" else 8})
    train.run(config, str(tmp_path / plan))
    [rows[plan]] = rl_rows(tmp_path / plan)
  static, slots = rows["static"], rows["continuous"]
  assert static["alloc/rounds"] == 4 and static["alloc/max_group"] > 4
  for key, value in static.items():
    if key.startswith(("alloc/", "reward/")) and "seconds" not in key:
      assert slots[key] == value, key
  assert slots["num_generated_tokens"] == static["num_generated_tokens"]
  assert slots["pg_loss"] == pytest.approx(static["pg_loss"], abs=1e-5)
  assert slots["rollout/prefills"] == 4  # one per round of 8 entries
  config = env_config("calculator", **QUICK, **{
      "rl.num_steps": 1, "eval.every": 0, "rl.rollout": "continuous",
      "rl.rollout_slots": 8})
  config.rl.allocation.name, config.rl.allocation.rounds = "vigor", 2
  train.run(config, str(tmp_path / "episodes"))
  [row] = rl_rows(tmp_path / "episodes")
  assert row["alloc/rounds"] == 2 and row["env/turns/mean"] >= 1
  assert row["env/failed_episodes"] == 0 and np.isfinite(row["pg_loss"])
  # 8 x 2 episodes, then 4 x 4: 32 rows, each prefilled at least once.
  assert row["rollout/prefills"] >= 32 and row["rollout/slots"] == 8
  assert 0 < row["rollout/slot_utilization"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["static", "continuous"])
def test_vigor_rounds_draft_from_the_previous_step_and_resume(tmp_path, plan):
  """SPEC-RL with VIGOR's rounds: one epoch per step, so from step 2 every
  prompt entry's rows draft from its prompt's last entry (verified by the
  static speculative sampler, or in the slots' prefills); the draft store
  is checkpointed: a run stopped after step 1 resumes exactly."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import (  # pylint: disable=import-outside-toplevel
      assert_stop_and_resume_matches, loop_config, rl_rows)
  config = loop_config(**{"rl.allocation.name": "vigor", "rl.num_steps": 3,
                          "sampler.speculative": True, "rl.rollout": plan,
                          "rl.rollout_slots": None if plan == "static" else 8})
  config.task.num_train = config.rl.prompts_per_step
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  assert rows[0]["spec/drafted_rows"] == 0
  for r in rows[1:]:
    assert r["spec/drafted_rows"] > 0 and 0 < r["spec/accept_rate"] <= 1, r
    assert r["alloc/rounds"] == 4 and r["grad_norm"] > 0
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 1)


@pytest.mark.slow
def test_vigor_samples_the_prompts_dots_chooses(tmp_path):
  """DOTS picks each step's prompts (after its reference round at step 1),
  VIGOR spends the step's rows on them in its rounds."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config, rl_rows  # pylint: disable=import-outside-toplevel
  config = loop_config(**{"rl.allocation.name": "vigor", "rl.num_steps": 2,
                          "rl.selection.name": "dots",
                          "rl.selection.dots_reference": 8})
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  assert "dots/reference_success" in rows[0]
  for r in rows:
    assert r["dots/round"] >= 1 and r["alloc/rounds"] == 4
    assert r["alloc/max_group"] > config.rl.group_size // 4
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0


@pytest.mark.slow
def test_bench_quick_runs_vigor_and_refuses_bad_overrides(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  env = subprocess_env.one_device_env()

  def bench(methods, *extra):
    return subprocess.run(
        [sys.executable, "-m", "launch.bench_data_efficiency", "--quick",
         f"--methods={methods}", f"--workdir={tmp_path}", *extra], cwd=root,
        env=env, capture_output=True, text=True, timeout=900)

  # --override: a field the bench sets, or a flag instead of FIELD=VALUE.
  result = bench("vigor", "--override=seed=3")
  assert result.returncode != 0
  assert "--override='seed=3': seed is set by the bench" in result.stderr
  result = bench("vigor", "--override=--config.task.num_train=64")
  assert result.returncode != 0
  assert "FIELD=VALUE is accepted" in result.stderr
  assert not os.listdir(tmp_path)  # refused before any run
  result = bench("vigor", "--override=task.kwargs.max_digits=3")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  [record] = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
  record = json.loads((tmp_path / record).read_text())
  figures = record["figures"]
  assert sorted(figures["summary"]) == ["vigor"]
  assert figures["curves"]["vigor"][0]["steps"] == [0, 2, 4, 6]
  assert record["config"]["overrides"] == ["task.kwargs.max_digits=3"]
  run_config = json.loads((tmp_path / "vigor_seed0" / "config.json").read_text())
  assert run_config["task"]["kwargs"]["max_digits"] == 3
