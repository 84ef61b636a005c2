"""The training loop as a composition: every config name trains, user-built
algorithms train, rewards [N, R] end to end, MC-GRPO, ESS, compile counts.

Loop runs use the tiny config without SFT or evaluation and 2 RL steps;
identical programs across runs come from the session's compilation cache
(tests/conftest.py), so each extra run costs little.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import advantages as adv
from rljax import metrics
from rljax import objectives as obj
from rljax import optim, train
from rljax.train import algorithm as alg_lib
from rljax.train import schema, table
from tests.test_train import tiny_config

# Two rewards, so that GDPO has columns to normalise and every group has
# variance (parity of the completion length).
REWARDS = ("numeric_match", "tests.reward_fixtures:parity")


def loop_config(**overrides):
  c = tiny_config()
  c.sft.num_steps = 0
  c.rl.num_steps = 2
  c.eval.every = 0  # no held-out evaluation: tests that read it set it
  c.eval.greedy = False
  c.checkpoint.every = 100
  c.rewards.names = REWARDS
  c.rewards.weights = (1.0, 0.5)
  for key, value in overrides.items():
    *sections, field = key.split(".")
    node = c
    for section in sections:  # nested sections: rl.selection.name
      node = node[section]
    node[field] = value
  return c


def row_advantages(batch, completion_length=6):
  """Each row's advantage, checking the layout: 0 on the prompt columns, one
  value over the completion's (the tiny config's 6)."""
  a = np.asarray(batch.advantages_NxL)
  t = completion_length
  np.testing.assert_array_equal(a[:, :-t], 0.0)
  np.testing.assert_array_equal(a[:, -t:], np.repeat(a[:, -1:], t, 1))
  return a[:, -1]


def rl_rows(workdir):
  return [r for r in metrics.read_jsonl(f"{workdir}/metrics.jsonl")
          if r["step"] > 0]


# --- every accepted name trains ---------------------------------------------

# Every name of the algorithm table, every choice field of rl.* and
# optimizer.*, and the settings below.
ADVANTAGES = list(table.ADVANTAGES) + [table.EXAMPLE_CHAIN]
NAME_AXES = {axis: tuple(entries) for axis, entries in table.AXES.items()
             if axis not in ("rl.advantage", "rl.rejection")}
CHOICE_AXES = {name: field.choices for name, field in schema.fields().items()
               if field.choices and name.startswith(("rl.", "optimizer."))}
OTHER_AXES = {
    **NAME_AXES, **CHOICE_AXES,
    # verl's rollout rejection: off, token, sequence, and a combination.
    "rl.rejection": ("", "token_k1:0.5:2.0", "seq_mean_k3:0.05",
                     "seq_sum_k1:0.5:2.0,seq_max_k2:0.5"),
    "rl.is_batch_normalize": (False, True),
    "rl.count_empty_sequences": (False, True),
    "sampler.speculative": (False, True),
    "rl.max_staleness": (0, 1),
    "rl.replay.fraction": (0.0, 0.25),
    # Microbatches split by tokens: 96 of the ~160 tokens of a minibatch.
    "rl.microbatch_tokens": (0, 96),
    # Every buffer count its own program (a bucket per count).
    "rl.packing_buckets": (8, 64),
    "model.overrides.remat": ("none", "full", "dots"),
    # The decode batch halves as rows end, down to 2 rows.
    "sampler.shrink_batch_to": (None, 2),
    # The static batch on blocks of 4 slots.
    "sampler.kv_cache": ("dense", "paged"),
}



# Settings a value needs to mean anything in a 2-step run (e.g. a KL
# estimator trains only with kl_coef > 0): the table entries' loop_fixups,
# and these. Keys: (axis, value).
SETTING_FIXUPS = {
    ("rl.is_batch_normalize", True): {"rl.is_correction": "tis",
                                      "rl.is_floor": 0.5},
    # Prompt selection refills the static batch.
    ("rl.selection.name", "dapo"): {"rl.rollout": "static"},
    ("rl.selection.name", "greso"): {"rl.rollout": "static"},
    ("rl.selection.name", "dots"): {"rl.rollout": "static",
                                    "rl.selection.dots_reference": 8},
    ("rl.replay.fraction", 0.25): {"rl.rollout": "static"},
    ("sampler.shrink_batch_to", 2): {"rl.rollout": "static"},
    # The static batch on blocks, halving down to 2 rows (slots on blocks:
    # tests/test_pairs.py, tests/test_paged_slots.py).
    ("sampler.kv_cache", "paged"): {"rl.rollout": "static",
                                    "sampler.shrink_batch_to": 2,
                                    "sampler.kv_block_size": 4},
    # A tree (2 roots, one fork after 4 of the 6 tokens) samples on its own.
    ("rl.rollout", "tree"): {"sampler.speculative": False},
    # LATR branching at every token (an untrained model's distributions
    # are flat), pruning branches 2 tokens old that kept their parent's
    # next token.
    ("rl.rollout", "latr"): {"sampler.speculative": False,
                             "rl.latr.abs_threshold": 0.0,
                             "rl.latr.rel_threshold": 0.0,
                             "rl.latr.lookahead": (2,),
                             "rl.latr.edit_distance": 1.0},
}
# Applied last: an entry's needs win over a setting's (VESPO refuses tis).
TABLE_FIXUPS = {(axis, name): dict(entry.loop_fixups)
                for axis, entries in table.AXES.items()
                for name, entry in entries.items() if entry.loop_fixups}
# A chain that ignores rl.singleton_groups refuses "raw" (build.validate).
for _name, _entry in table.ADVANTAGES.items():
  if _entry.needs_groups and not _entry.singleton_ok:
    TABLE_FIXUPS.setdefault(("rl.advantage", _name), {})[
        "rl.singleton_groups"] = "zero"
TABLE_FIXUPS[("rl.advantage", table.EXAMPLE_CHAIN)] = {
    "rl.singleton_groups": "zero"}


def _allocation_fits(case):
  """Rollout allocation samples rounds of its own: no selection with sGPO,
  no replay (the tiny batch has no rounds for its fresh prompts), SPEC-RL
  or partial rollouts, no pivot or greedy row
  (``rljax/train/combinations.py``)."""
  return ((case.get("rl.selection.name", "none") == "none"
           or case.get("rl.allocation.name") != "sgpo")
          and not case.get("rl.replay.fraction")
          and not case.get("sampler.speculative")
          and case.get("rl.rollout", "static") not in ("partial", "tree",
                                                       "latr")
          and not alg_lib.sampling_needs(case["rl.advantage"])[
              "extra_samples"])


def _fix(case):
  for fixups in (SETTING_FIXUPS, TABLE_FIXUPS):
    for key, value in list(case.items()):
      case.update(fixups.get((key, value), {}))
  if not _allocation_fits(case):  # its values get cases of their own
    case["rl.allocation.name"] = "none"
  if case.get("rl.rollout") == "tree" and (
      case["rl.advantage"] == "remax" or alg_lib.sampling_needs(
          case["rl.advantage"])["extra_samples"]):  # G + 1 rows: no tree
    case["rl.rollout"] = "static"
  if case.get("rl.rollout") == "latr" and alg_lib.sampling_needs(
      case["rl.advantage"])["greedy_baseline"]:  # its greedy row: no tree
    case["rl.rollout"] = "static"
  return case


def _cases():
  """Every advantage name and every value of every other axis appears at
  least once; axes are cycled with different offsets, so pairs vary. The
  number of cases is the longest axis's length."""
  axes = {"rl.advantage": tuple(ADVANTAGES)}
  axes.update((a, tuple(v)) for a, v in OTHER_AXES.items())
  n = max(len(v) for v in axes.values())
  cases = []
  for j in range(n):
    cases.append(_fix({axis: values[(j + i) % len(values)]
                       for i, (axis, values) in enumerate(axes.items())}))
  for axis, values in axes.items():
    for value in values:  # A value a fixup overrode gets a case of its own.
      if value not in {c[axis] for c in cases}:
        case = {a: v[0] for a, v in axes.items()}
        case[axis] = value
        cases.append(_fix(case))
    assert set(values) <= {c[axis] for c in cases}, axis
  for value in axes["rl.tree.branch_by"]:  # each rule grows a tree
    if not any(c["rl.rollout"] == "tree" and c["rl.tree.branch_by"] == value
               for c in cases):
      case = {a: v[0] for a, v in axes.items()}
      case.update({"rl.rollout": "tree", "rl.tree.branch_by": value})
      cases.append(_fix(case))
  return cases


CASES = _cases()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    str(v) for v in c.values()))
def test_every_config_name_trains(case, tmp_path):
  config = loop_config(**case)
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    bad = {k: v for k, v in r.items()
           if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, bad
    assert r["nonfinite_skipped_total"] == 0
    assert r["grad_norm"] > 0
    if case["rl.microbatch_tokens"]:  # the budget split the minibatches
      assert r["packing/microbatches"] > 1, r["packing/microbatches"]


def _without_clock(row):
  """A metrics row without wall-clock figures and held-out evaluations (a
  run's last step evaluates, so a stop after step 1 adds them there)."""
  return {k: v for k, v in row.items() if not k.startswith(
      ("time/", "tokens_per_s/", "reward/eval_seconds", "eval/"))}


def assert_stop_and_resume_matches(config, rows, workdir, stop_at):
  """Runs ``config`` to ``stop_at`` steps, then resumes it to its own
  ``rl.num_steps`` in ``workdir``: the metrics rows must equal ``rows`` (an
  uninterrupted run's), clocks and evaluations aside."""
  steps = config.rl.num_steps
  config.rl.num_steps = stop_at
  train.run(config, str(workdir))
  config.rl.num_steps = steps
  train.run(config, str(workdir))
  assert ([_without_clock(r) for r in rl_rows(workdir)]
          == [_without_clock(r) for r in rows])


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["static", "tree", "latr"])
def test_spec_rl_drafts_from_the_previous_epoch_and_resumes_exactly(
    tmp_path, rollout):
  """One epoch per step: steps 2 and 3 resample step 1's prompts from their
  drafts (a tree's segments node by node: ``sampling.tree_drafts``; LATR's
  rows sampled as usual). The draft store is checkpointed: a run stopped
  after step 1 and resumed drafts, accepts and trains exactly as the
  uninterrupted one."""
  config = loop_config(**{"sampler.speculative": True, "rl.rollout": rollout})
  if rollout == "latr":  # half the rows a tree, branching at every token
    config.rl.latr.mix_ratio = 0.5
    config.rl.latr.abs_threshold = config.rl.latr.rel_threshold = 0.0
  config.task.num_train = config.rl.prompts_per_step
  config.rl.num_steps = 3
  config.checkpoint.every = 1
  full = tmp_path / "full"
  train.run(config, str(full))
  rows = rl_rows(full)
  n = config.rl.prompts_per_step * config.rl.group_size
  if rollout == "latr":  # the tree's rows draft nothing
    n -= config.rl.prompts_per_step * config.rl.group_size // 2
  assert [r["spec/drafted_rows"] for r in rows] == [0, n, n]
  assert 0 < rows[1]["spec/accept_rate"] <= 1
  assert rows[1]["spec/accepted_tokens/mean"] > 0
  assert all(r["grad_norm"] > 0 and math.isfinite(r["pg_loss"]) for r in rows)
  if rollout == "tree":
    assert all(r["rollout/tree_token_saving"] > 0 for r in rows)
  if rollout == "latr":
    assert all(r["latr/branches"] > 0 for r in rows)

  assert_stop_and_resume_matches(config, rows, tmp_path / "split", 1)


# --- a user-built algorithm --------------------------------------------------

def user_algorithm():
  """Median centring + MAD scaling + rank weights, PPO clip + TIS: a chain no
  config name gives."""
  return train.Algorithm(
      advantage=optax.chain(adv.sum_rewards(), adv.center_by_group_median(),
                            adv.scale_by_group_mad(),
                            adv.rank_weights(adv.median_rank_weights(3))),
      coefficient=optax.chain(obj.ppo_clip(0.2, 0.28),
                              obj.truncated_is(cap=2.0)),
      optimizer=optim.make_optimizer("adamw", 1e-3, max_grad_norm=1.0))


@pytest.mark.slow
def test_user_built_algorithm_trains_and_moves_the_weights(tmp_path):
  config = loop_config()
  config.checkpoint.every = 1
  summary = train.run(config, str(tmp_path), algorithm=user_algorithm())
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  # MAD scaling gives a group whose rewards mostly tie advantage 0: a step
  # may have no gradient at all (step 2 with this seed), not every step.
  assert all(math.isfinite(r["pg_loss"]) for r in rows)
  assert any(r["grad_norm"] > 0 for r in rows)
  assert any(r["adv/advantage_abs_max"] > 0 for r in rows)
  assert not summary["preempted"]
  # eval.every=0 (loop_config): no held-out evaluation, before, during or
  # after RL.
  assert summary["before"] == summary["after"] == {}
  assert not [k for r in metrics.read_jsonl(f"{tmp_path}/metrics.jsonl")
              for k in r if k.startswith("eval/")]
  # The second update moved the weights.
  one, two = (train.load_policy(str(tmp_path), step) for step in (1, 2))
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(one.params), jax.tree.leaves(two.params))]
  assert max(moved) > 1e-5


def nan_on_odd_rows():
  """A buggy user link: NaN advantages on every odd row."""
  def update(updates, state, params=None, **unused):
    del params, unused
    odd = jnp.arange(updates.shape[0]) % 2 == 1
    return jnp.where(odd, jnp.nan, updates), state
  return optax.GradientTransformationExtraArgs(lambda p: (), update)


@pytest.mark.slow
def test_nan_advantages_never_reach_the_update(tmp_path):
  """A chain that returns NaN for some rows, with a plain optimizer (no
  non-finite guard): the rows are out of the loss and counted, and every
  parameter stays finite (issue 25: all NaN before)."""
  alg = train.Algorithm(
      advantage=optax.chain(adv.sum_rewards(), adv.grpo(), nan_on_odd_rows()),
      coefficient=obj.ppo_clip(0.2), optimizer=optax.adamw(1e-3))
  config = loop_config()
  config.checkpoint.every = 1
  train.run(config, str(tmp_path), algorithm=alg)
  rows = rl_rows(tmp_path)
  n = config.rl.prompts_per_step * config.rl.group_size
  assert [r["adv/nonfinite_rows"] for r in rows] == [n // 2, n // 2]
  assert all(math.isfinite(r["pg_loss"]) and r["grad_norm"] > 0
             for r in rows)
  params = train.load_policy(str(tmp_path), 2).params
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_user_algorithm_with_wrong_advantage_shape_fails_before_compile():
  bad = train.Algorithm(advantage=adv.grpo(),  # [N] transforms, no head
                        coefficient=obj.ppo_clip(0.2),
                        optimizer=optax.sgd(1e-3))
  with pytest.raises(ValueError, match=r"sum_rewards"):
    train.build.build(loop_config(), algorithm_override=bad)


def test_a_chain_whose_second_axis_does_not_follow_t_is_refused():
  """[N, R + 1] once passed as per-token ([N, T] with T = R + 1) and crashed
  after SFT and evaluation (issue 25)."""

  def with_extra_column():
    def update(updates, state, params=None, **unused):
      del params, unused
      return jnp.concatenate([updates, updates[:, :1]], 1), state
    return optax.GradientTransformationExtraArgs(lambda p: (), update)

  bad = train.Algorithm(advantage=optax.chain(with_extra_column()),
                        coefficient=obj.ppo_clip(0.2),
                        optimizer=optax.sgd(1e-3))
  for r in (1, 2, 3):
    with pytest.raises(ValueError, match=r"following T"):
      bad.check_advantage_shapes(32, r, 4)


# --- collecting: rewards [N, R], GDPO, all-failed rows, MC-GRPO ------------------

@pytest.mark.slow
def test_ess_acts_in_a_loop_where_sampler_and_trainer_differ(tmp_path):
  config = loop_config(**{"rl.objective": "ess", "rl.num_epochs": 2,
                          "optimizer.ess_scaling": "sqrt",
                          "sampler.top_p": 0.8})
  train.run(config, str(tmp_path))
  for r in rl_rows(tmp_path):
    assert r["ess/token"] < 1.0 and r["ess/sequence"] < 1.0
    assert r["ess_scale"] < 1.0 and r["ess_kl"] > 0
    assert r["mismatch/abs_logp_mean"] > 0 and r["mismatch/kl_k3"] > 0


# --- compiles ----------------------------------------------------------------

@pytest.mark.slow
def test_the_loop_compiles_nothing_after_the_first_step_of_a_bucket(
    tmp_path, monkeypatch):
  compiles = []

  def listener(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(kwargs.get("fun_name", "?"))

  marks = {}
  original = metrics.MetricWriter.write

  def write(self, step, values, histograms=None):
    marks[step] = len(compiles)
    return original(self, step, values, histograms)

  monkeypatch.setattr(metrics.MetricWriter, "write", write)
  # Padding-free: each step's packed shape (its bucket of buffers).
  from rljax.train import packing  # pylint: disable=import-outside-toplevel
  shapes = []
  plan = packing.PaddingFree.plan

  def recorded(self, state, batch):
    out = plan(self, state, batch)
    shapes.append(out.packing.segment_BpxLp.shape)
    return out

  monkeypatch.setattr(packing.PaddingFree, "plan", recorded)
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel
  jax.monitoring.register_event_duration_secs_listener(listener)
  steps = 10
  try:
    config = loop_config(**{"rl.num_steps": steps})
    config.sampler.prompt_buckets = (16,)  # one bucket: shapes never change
    train.run(config, str(tmp_path))
  finally:
    monitoring.unregister_event_duration_listener(listener)
  first = compiles[:marks[1]]  # the set-up's and the first step's (no eval)
  assert 0 not in marks  # eval.every=0: no row before RL
  assert first.count("jit(rl_step)") == 1, first
  assert first.count("jit(_sample_impl)") == 1, first  # one bucket, one program
  # Later steps compile the step only for a bucket not seen before, never
  # anything else; at most NUM_BUCKETS programs per buffer length.
  assert len(shapes) == steps, shapes
  new_buckets = len(set(shapes)) - 1
  assert compiles[marks[1]:marks[steps]] == ["jit(rl_step)"] * new_buckets, (
      compiles[marks[1]:], shapes)
  for length in {shape[-1] for shape in shapes}:
    assert len({s for s in shapes if s[-1] == length}) <= packing.NUM_BUCKETS
