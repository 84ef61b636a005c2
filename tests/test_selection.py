"""Prompt selection: DAPO's dynamic sampling and GRESO (rljax/data/selection.py).

Decisions are checked against hand-derived ones on scripted rewards and
histories; the loop runs each name (tests/test_loop.py's every-name test
covers ``rl.selection.name``) and resumes exactly after a SIGKILL.
"""

import json
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.data import selection as sel
from rljax.train import batch_layout
from tests import test_resume
from tests import subprocess_env

E, H, I = sel.EASY, sel.HARD, sel.INFORMATIVE


def test_group_kinds_by_hand():
  # G = 4. Totals per group: all 1 and correct (easy), all 0 (hard), mixed
  # (informative), all 0.5 and not correct (hard), one scored row only
  # (zero variance: hard), two scored rows that differ (informative).
  total = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, .5, .5, .5, .5,
                    1, 0, 0, 0, 1, 0, 7, 7], np.float32)
  valid = np.ones(24, bool)
  valid[17:20] = False
  valid[22:24] = False
  correct = total >= 1
  np.testing.assert_array_equal(sel.group_kinds(total, valid, correct, 4),
                                [E, H, I, H, H, I])


def test_plan_fills_with_informative_groups_in_order_drawn():
  # Round 0: informative groups 0 and 2; round 1: 1, 2 and 3. B = 4: the
  # first four informative groups, 1.3 is dropped, nothing is masked.
  plan = sel.plan_batch([np.array([I, E, I, H]), np.array([H, I, I, I])], 4)
  assert [list(r) for r in plan.rounds] == [[0, 2], [1, 2]]
  np.testing.assert_array_equal(plan.trained, [True] * 4)


def test_plan_masks_zero_variance_fillers_when_rounds_run_out():
  # One informative group in two rounds, B = 3: it, then round 0's
  # zero-variance groups 0 and 2 as masked fillers, batch order by round.
  plan = sel.plan_batch([np.array([E, I, H]), np.array([H, H, E])], 3)
  assert [list(r) for r in plan.rounds] == [[1, 0, 2], []]
  np.testing.assert_array_equal(plan.trained, [True, False, False])
  plan = sel.plan_batch([np.array([E, H]), np.array([I, H])], 2)
  assert [list(r) for r in plan.rounds] == [[0], [0]]
  np.testing.assert_array_equal(plan.trained, [False, True])  # by round


def test_greso_history_and_skip_probabilities_by_hand():
  g = sel.Greso(seed=0, target=0.25, step_size=0.1, min_explore=0.05)
  g.update(["a", "b", "c", "d"], [E, H, I, H])
  # Easy share 1/4 is not above 0.25: p_easy 1 + 0.1 -> 1 (capped); hard
  # share 1/2 is: p_hard 0.9.
  np.testing.assert_allclose(g.state.explore, [1.0, 0.9])
  g.update(["a", "b", "e", "f"], [E, I, E, E])
  # Easy 3/4 > 0.25: 0.9; hard 0: 1.0. a: two easy in a row; b: reset; d:
  # one hard; e: one easy; g: never seen.
  np.testing.assert_allclose(g.state.explore, [0.9, 1.0])
  np.testing.assert_allclose(
      g.skip_probabilities(["a", "b", "c", "d", "e", "g"]),
      [1 - 0.9 ** 2, 0.0, 0.0, 1 - 1.0 ** 1, 1 - 0.9, 0.0])
  for _ in range(200):  # the floor holds
    g.update(["x"] * 4, [E, E, H, H])
  np.testing.assert_allclose(g.state.explore, [0.05, 0.05])


def _examples(names):
  return {"prompt": list(names), "answer": [n.upper() for n in names]}


def test_greso_skips_a_hopeless_prompt_and_refills_from_the_iterator():
  g = sel.Greso(seed=3, min_explore=0.05, max_draws=3)
  for _ in range(300):  # "hot": 300 easy groups in a row, p_easy -> 0.05
    g.update(["hot"], [E])
  assert g.skip_probabilities(["hot"])[0] == 1.0  # 1 - 0.05**300
  more = iter([_examples(["n3", "hot", "n4"])])
  out, m = g.select(_examples(["hot", "n1", "n2"]), lambda: next(more), (0, 0))
  assert out == _examples(["n1", "n2", "n3"])  # fields stay aligned
  assert m["select/skipped_prompts"] == 2 and m["select/prompt_draws"] == 2
  # Draws run out (max_draws=1): the batch is completed with skipped ones.
  g.max_draws = 1
  out, m = g.select(_examples(["hot", "n1", "hot"]), None, (1, 0))
  assert out["prompt"] == ["n1", "hot", "hot"]
  assert m["select/skipped_prompts"] == 2


def test_greso_draws_are_a_function_of_seed_and_step():
  g = sel.Greso(seed=1)
  g.update(["p"] * 1, [E])
  g.state = g.state._replace(explore=np.array([0.5, 0.5]))  # skip p at 1/2
  batch = _examples(["p"] * 64)
  first = g.select(batch, None, (5, 0))[1]["select/skipped_prompts"]
  again = g.select(batch, None, (5, 0))[1]["select/skipped_prompts"]
  other = g.select(batch, None, (6, 0))[1]["select/skipped_prompts"]
  u = np.random.default_rng((1, 5, 0, 0)).random(64)
  assert first == again == float(np.sum(u < 0.5))
  assert 10 < first < 54 and other != first


def test_greso_state_round_trips_and_refuses_bad_arrays():
  g = sel.Greso(seed=0)
  g.update(["a", "b", "c"], [E, I, H])
  g2 = sel.Greso(seed=0)
  g2.load_arrays(g.arrays())
  for a, b in zip(g.state, g2.state):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(g2.skip_probabilities(["a", "b", "c"]),
                                g.skip_probabilities(["a", "b", "c"]))
  bad = g.arrays()
  del bad["explore"]
  with pytest.raises(ValueError, match="lacks \\['explore'\\]"):
    g2.load_arrays(bad)
  bad = dict(g.arrays(), zero_runs=np.zeros(5, np.int32))
  with pytest.raises(ValueError, match="inconsistent shapes"):
    g2.load_arrays(bad)


def test_prompt_keys_are_stable_and_distinct():
  assert sel.prompt_key("1+1=") == sel.prompt_key("1+1=")
  assert sel.prompt_key("1+1=") != sel.prompt_key("1+2=")
  assert 0 <= sel.prompt_key([1, 2, 3]) < 2 ** 63


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "dynamic"}, "rl.selection.name='dynamic' is not one of"),
    ({"name": "dapo", "max_rounds": 0}, "rl.selection.max_rounds=0"),
    ({"name": "greso", "greso_target": 1.5}, "greso_target=1.5"),
])
def test_bad_settings_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sel.make_selection(seed=0, **kwargs)


def test_masked_fillers_have_no_loss_tokens():
  """``batch_layout.postprocess`` with ``trained_N``: a filler group's rows keep their
  tokens but no loss mask; the other rows are as without it."""
  from rljax import sampling  # pylint: disable=import-outside-toplevel
  from rljax.train import build  # pylint: disable=import-outside-toplevel
  from tests.test_train import tiny_config  # pylint: disable=import-outside-toplevel
  n, p, t = 8, 3, 4
  rng = np.random.RandomState(0)
  rollout = sampling.Rollout(
      jnp.asarray(rng.randint(1, 9, (n, p)), jnp.int32), jnp.ones((n, p), bool),
      jnp.asarray(rng.randint(1, 9, (n, t)), jnp.int32), jnp.ones((n, t), bool),
      jnp.full((n,), t, jnp.int32), jnp.ones((n,), bool), None,
      jnp.asarray(rng.randn(n, t), jnp.float32))
  alg = build.algorithm(tiny_config())  # GRPO
  rewards = jnp.asarray(rng.rand(n, 1), jnp.float32)
  args = (rollout, rewards, jnp.ones(n, bool), jnp.ones(1, jnp.float32),
          alg.advantage.init(rewards))
  full, _, _ = batch_layout.postprocess(*args, algorithm=alg, group_size=4)
  trained = np.repeat([True, False], 4)
  part, _, _ = batch_layout.postprocess(*args, jnp.asarray(trained),
                                        algorithm=alg, group_size=4)
  np.testing.assert_array_equal(part.loss_mask_NxL[4:], False)
  np.testing.assert_array_equal(part.loss_mask_NxL[:4], full.loss_mask_NxL[:4])
  np.testing.assert_array_equal(part.tokens_NxL, full.tokens_NxL)
  np.testing.assert_array_equal(part.advantages_NxL, full.advantages_NxL)


@pytest.mark.slow
def test_greso_and_replay_run_killed_after_step_2_resumes_exactly(tmp_path):
  """GRESO on 8 prompts (every step resamples them, so the history
  decides) and a quarter of each batch replayed: SIGKILL after step 2's
  checkpoint, resume, and steps 3-4 (replaying groups the checkpoint's
  buffer holds) and the final params equal the uninterrupted run's."""
  flags = ["--config.rl.selection.name=greso", "--config.rl.num_steps=4",
           "--config.task.num_train=8",  # one batch: every step, same prompts
           "--config.rl.selection.greso_step_size=0.5",
           "--config.rl.replay.fraction=0.25",
           # A second reward that varies within groups: informative groups
           # to replay (the tiny policy's accuracy is 0).
           "--config.rewards.names=('numeric_match', "
           "'tests.reward_fixtures:parity')",
           "--config.rewards.weights=(1.0, 0.5)"]
  full = str(tmp_path / "full")
  proc = test_resume._launch(full, *flags)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  killed = str(tmp_path / "killed")
  proc = test_resume._launch(killed, *flags)
  test_resume._wait_for_step(killed, 2, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert os.path.isdir(os.path.join(killed, "checkpoints", "2"))
  resumed = test_resume._launch(killed, *flags)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0 and "resumed from step" in out, out
  a, b = test_resume._by_step(full), test_resume._by_step(killed)
  assert sorted(b) == [1, 2, 3, 4]
  assert any(a[s]["select/skipped_prompts"] > 0 for s in a), a  # it decided
  assert a[3]["replay/fraction"] == 0.25, a[3]  # step 3 replays
  for step in (3, 4):
    assert b[step] == a[step], step
  for x, y in zip(jax.tree.leaves(test_resume._final_params(full)),
                  jax.tree.leaves(test_resume._final_params(killed))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- launch/bench_data_efficiency.py -----------------------------------------


def test_bench_methods_are_config_flags():
  from launch import data_efficiency as bench  # pylint: disable=import-outside-toplevel
  sel = "--config.rl.selection.name="
  assert bench.method_flags("dapo", 0.25) == [sel + "dapo"]
  assert bench.method_flags("replay", 0.5) == [
      sel + "none", "--config.rl.replay.fraction=0.5"]
  assert bench.method_flags("vigor", 0.25) == [
      sel + "none", "--config.rl.allocation.name=vigor"]
  assert bench.method_flags("vigor+greso+replay", 0.25) == [
      sel + "greso", "--config.rl.allocation.name=vigor",
      "--config.rl.replay.fraction=0.25"]
  for bad in ("dapo+greso", "vigor+sgpo", "vigour", "dapo+replay+replay"):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
      bench.method_flags(bad, 0.25)


def test_bench_curves_and_summary_by_hand(tmp_path):
  from launch import data_efficiency as bench  # pylint: disable=import-outside-toplevel
  runs = []
  for seed, accs in enumerate(((0.5, 0.7, 0.9), (0.6, 0.8, 0.85))):
    d = tmp_path / f"s{seed}"
    d.mkdir()
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    for step in (1, 2, 3, 4):
      rows.append({"step": step, "num_generated_tokens": 100.0 * (seed + 1),
                   "time/step": 2.0})
    rows[2]["eval/accuracy"] = accs[1]  # after step 2
    rows.append({"step": 4, "eval/accuracy": accs[2]})  # a second row
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    runs.append(bench.curve(str(d)))
  assert runs[0] == {"steps": [0, 2, 4], "accuracy": [0.5, 0.7, 0.9],
                     "tokens": [0.0, 200.0, 400.0],
                     "seconds": [0.0, 4.0, 8.0]}
  s = bench.summarize({"none": runs}, target=0.8)["none"]
  np.testing.assert_allclose(s["accuracy"]["mean"], [0.55, 0.75, 0.875])
  # Sample std of two values: |a - b| / sqrt(2).
  np.testing.assert_allclose(s["accuracy"]["std"],
                             np.array([0.1, 0.1, 0.05]) / np.sqrt(2))
  np.testing.assert_allclose(s["tokens"]["mean"], [0.0, 300.0, 600.0])
  # Seed 0 reaches 0.8 after step 4 (400 tokens), seed 1 after step 2 (400).
  assert [t["step"] for t in s["to_target"]] == [4, 2]
  assert s["tokens_to_target_mean"] == 400.0 and s["seeds_reaching_target"] == 2
  np.testing.assert_allclose([s["gain_mean"], s["gain_std"]],
                             [0.325, 0.15 / np.sqrt(2)])
  assert bench.summarize({"x": runs}, target=0.95)["x"][
      "tokens_to_target_mean"] is None


@pytest.mark.slow
def test_bench_quick_runs_every_method_and_writes_the_plot(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  env = subprocess_env.one_device_env()
  result = subprocess.run(
      [sys.executable, "-m", "launch.bench_data_efficiency", "--quick",
       f"--workdir={tmp_path}"], cwd=root, env=env, capture_output=True,
      text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  [png] = [f for f in os.listdir(tmp_path) if f.endswith(".png")]
  assert os.path.getsize(tmp_path / png) > 10_000
  [record] = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
  figures = json.loads((tmp_path / record).read_text())["figures"]
  assert sorted(figures["summary"]) == ["dapo", "greso", "none"]
  for method, runs in figures["curves"].items():
    assert runs[0]["steps"] == [0, 2, 4, 6], method
    assert np.all(np.diff(runs[0]["tokens"]) > 0), method


# --- the replay buffer --------------------------------------------------------


def _group(value, width=3, g=2, t=4):
  return {"prompt_tokens": np.full((g, width), value, np.int32),
          "prompt_mask": np.ones((g, width), bool),
          "completion_tokens": np.full((g, t), value, np.int32),
          "completion_mask": np.ones((g, t), bool),
          "lengths": np.full(g, t, np.int32), "finished": np.ones(g, bool),
          "sampler_logprobs": np.full((g, t), -float(value), np.float32),
          "rewards_NxR": np.arange(g, dtype=np.float32)[:, None],
          "valid_NxR": np.ones((g, 1), bool),
          "total_N": np.arange(g, dtype=np.float32),
          "prompt_tokens_N": np.full(g, width), "completion_tokens_N":
          np.full(g, t)}


def test_replay_takes_the_newest_young_groups_once():
  buf = sel.ReplayBuffer(fraction=0.25, max_age=2, capacity=5, batch_size=8)
  assert buf.count == 2
  assert buf.take(0) is None  # empty
  buf.push([_group(1), _group(2)], version=0)
  buf.push([_group(3)], version=1)
  groups, versions = buf.take(2)  # newest first: 3 (v1), then 2 (v0)
  assert [int(g["prompt_tokens"][0, 0]) for g in groups] == [3, 2]
  assert versions == [1, 0] and len(buf) == 1  # each replayed once
  assert buf.take(2) is None  # one left, two needed
  assert buf.take(3) is None and len(buf) == 0  # group 1 (v0) is too old
  buf.push([_group(v) for v in range(10, 17)], version=5)  # capacity 5
  assert len(buf) == 5
  groups, _ = buf.take(5)
  assert [int(g["prompt_tokens"][0, 0]) for g in groups] == [16, 15]


def test_replay_state_round_trips_with_each_groups_prompt_width():
  buf = sel.ReplayBuffer(fraction=0.5, max_age=3, capacity=8, batch_size=4)
  buf.push([_group(1, width=3), _group(2, width=5)], version=2)
  buf.push([_group(3, width=4)], version=3)
  again = sel.ReplayBuffer(fraction=0.5, max_age=3, capacity=8, batch_size=4)
  again.load_arrays(buf.arrays())
  assert again.versions == buf.versions
  for a, b in zip(again.groups, buf.groups):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # shapes too
  empty = sel.ReplayBuffer(fraction=0.5, max_age=3, capacity=8, batch_size=4)
  again.load_arrays(empty.arrays())
  assert len(again) == 0
  bad = buf.arrays()
  del bad["prompt_width"]
  with pytest.raises(ValueError, match="lacks \\['prompt_width'\\]"):
    again.load_arrays(bad)
  bad = dict(buf.arrays(), total_N=np.zeros((2, 2)))
  with pytest.raises(ValueError, match="'total_N' has 2 groups"):
    again.load_arrays(bad)


@pytest.mark.parametrize("kwargs,match", [
    ({"fraction": 1.0}, "rl.replay.fraction=1.0"),
    ({"fraction": 0.95}, "replays all 4 groups"),
    ({"max_age": 0}, "rl.replay.max_age=0"),
])
def test_bad_replay_settings_are_named(kwargs, match):
  args = {"fraction": 0.25, "max_age": 2, "capacity": 8, "batch_size": 4}
  with pytest.raises(ValueError, match=match):
    sel.ReplayBuffer(**{**args, **kwargs})


@pytest.mark.slow
def test_replayed_groups_train_with_their_own_rows_versions_and_is_weights():
  """Step 1 fills the buffer with its informative groups; step 2 (another
  policy) samples 6 fresh prompts and appends the 2 newest stored groups:
  their tokens, rewards (GRPO advantages from their own rewards) and
  sampler logprobs are the stored ones, their tokens carry version 0, and
  TIS weights against the new policy equal min(exp(lp_new - lp_old), 2)."""
  from rljax import models, objectives, rollout, train  # pylint: disable=import-outside-toplevel
  from rljax.train import build  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config  # pylint: disable=import-outside-toplevel
  config = loop_config()
  c = build.build(config)
  try:
    alg = build.algorithm(config)
    g = c.settings.group_size
    buf = sel.ReplayBuffer(fraction=0.25, max_age=2, capacity=64,
                           batch_size=8)
    collector = rollout.Collector(
        sampler=c.sampler(g), tokenizer=c.tokenizer, evaluator=c.evaluator,
        postprocess=train.Postprocessor(alg), group_size=g,
        buckets=c.buckets, eos_ids=c.eos_ids, correctness="numeric_match", mesh=c.mesh, replay=buf)
    ex = [{k: [e[k] for e in c.train_examples[i:i + 8]]
           for k in c.train_examples[0]} for i in (0, 8, 16)]
    state = alg.advantage.init(jnp.zeros((1, 2)))
    params0 = models.init_params(c.model_config, jax.random.key(0), c.mesh)
    out = collector.collect(params0, ex[0], jax.random.key(0), state)
    totals = out.rewards_NxR @ np.asarray(c.evaluator.weights)
    informative = int(np.sum(np.ptp(totals.reshape(-1, g), 1) > 0))
    assert len(buf) == informative >= 2, informative
    for step in (1, 2):  # a first replay may find too few young groups
      newest = [dict(x) for x in buf.groups[-2:][::-1]]
      params = models.init_params(c.model_config, jax.random.key(step),
                                  c.mesh)
      out = collector.collect(params, ex[step], jax.random.key(step), state,
                              version=step)
      if out.metrics["replay/fraction"]:
        break
    assert out.metrics["replay/fraction"] == 0.25
    b = out.batch
    # Generated this step: the 6 fresh groups' tokens only.
    fresh_mask = np.asarray(b.loss_mask_NxL)[:6 * g]
    assert out.metrics["num_generated_tokens"] == fresh_mask.sum()
    t = c.settings.max_new_tokens if hasattr(c.settings, "max_new_tokens") \
        else newest[0]["completion_tokens"].shape[1]
    rows = slice(6 * g, 8 * g)
    np.testing.assert_array_equal(
        np.asarray(b.tokens_NxL)[rows, -t:],
        np.concatenate([x["completion_tokens"] for x in newest]))
    s = np.asarray(b.sampler_logprobs_NxL)[rows, -t:]
    np.testing.assert_array_equal(
        s, np.concatenate([x["sampler_logprobs"] for x in newest]))
    stored_totals = np.concatenate([x["total_N"] for x in newest])
    want = []
    for r in stored_totals.reshape(-1, g).astype(np.float64):
      want += list((r - r.mean()) / (r.std(ddof=1) + 1e-6))
    np.testing.assert_allclose(np.asarray(b.advantages_NxL)[rows, -1], want,
                               rtol=1e-5, atol=1e-6)
    versions = out.token_versions[rows]
    mask = np.asarray(b.loss_mask_NxL)[rows, -t:]
    assert np.all(versions[mask] == 0) and np.all(versions[~mask] == -1)
    assert np.all(out.token_versions[:6 * g][
        np.asarray(b.loss_mask_NxL)[:6 * g, -t:]] == step)
    lp, _ = models.sequence_logprobs(params, c.model_config, b.tokens_NxL,
                                     b.input_mask_NxL)
    lp = np.asarray(lp)[rows, -t:]
    tis = objectives.truncated_is(cap=2.0)
    weights, _ = tis.update(jnp.ones_like(jnp.asarray(lp)), tis.init(None),
                            sampler_logprobs_BxT=jnp.asarray(s),
                            old_logprobs_BxT=jnp.asarray(lp),
                            mask_BxT=jnp.asarray(mask))
    want = np.minimum(np.exp(lp.astype(np.float64) - s), 2.0)
    np.testing.assert_allclose(np.asarray(weights)[mask], want[mask],
                               rtol=1e-5)
    assert np.abs(want[mask] - 1).max() > 1e-3  # another policy: not 1
  finally:
    c.close()
