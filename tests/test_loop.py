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
from rljax import metrics, models
from rljax import objectives as obj
from rljax import optim, train
from rljax import tokenizers as tok_lib
from rljax.train import algorithm as alg_lib
from tests.test_train import tiny_config

# Two rewards, so that GDPO has columns to normalise and every group has
# variance (parity of the completion length).
REWARDS = ("numeric_match", "tests.reward_fixtures:parity")


def loop_config(**overrides):
  c = tiny_config()
  c.sft.num_steps = 0
  c.rl.num_steps = 2
  c.eval.every = 100
  c.eval.greedy = False
  c.checkpoint.every = 100
  c.rewards.names = REWARDS
  c.rewards.weights = (1.0, 0.5)
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


def rl_rows(workdir):
  return [r for r in metrics.read_jsonl(f"{workdir}/metrics.jsonl")
          if r["step"] > 0]


# --- every accepted name trains ---------------------------------------------

ADVANTAGES = (list(alg_lib.ADVANTAGE_PRESETS) + list(alg_lib.ADVANTAGE_TRANSFORMS)
              + ["center_by_group_median+scale_by_group_mad+clip_advantages"])
OTHER_AXES = {
    "rl.objective": alg_lib.OBJECTIVES,
    "rl.is_correction": alg_lib.IS_CORRECTIONS,
    "rl.aggregation": obj.AGGREGATIONS,
    "rl.old_logprobs": train.OLD_LOGPROBS,
    "optimizer.ess_scaling": (None,) + optim.ESS_RULES,
    "rl.is_level": obj.LEVELS,
    "rl.ess_pooling": alg_lib.ESS_POOLINGS,
    "rl.kl_estimator": obj.KL_ESTIMATORS,
    # verl's rollout rejection: off, token, sequence, and a combination.
    "rl.rejection": ("", "token_k1:0.5:2.0", "seq_mean_k3:0.05",
                     "seq_sum_k1:0.5:2.0,seq_max_k2:0.5"),
    "rl.is_batch_normalize": (False, True),
    "rl.count_empty_sequences": (False, True),
    "sampler.speculative": (False, True),
}


# Settings a value needs to mean anything in a 2-step run (e.g. a KL
# estimator trains only with kl_coef > 0). Keys: (axis, value).
CASE_FIXUPS = {
    # The built-in task's parity reward (0.5 after weighting) counts as a pass,
    # so that an untrained policy has informative groups.
    ("rl.advantage", "pass_at_k"): {"rl.pass_threshold": 0.5},
    ("rl.objective", "gspo"): {"rl.aggregation": "sequence_mean_token_mean",
                               "rl.gspo_max_log_ratio": 10.0},
    **{("rl.kl_estimator", k): {"rl.kl_coef": 0.01}
       for k in obj.KL_ESTIMATORS if k != "k3"},
    ("rl.is_batch_normalize", True): {"rl.is_correction": "tis",
                                      "rl.is_floor": 0.5},
}


def _cases():
  """Every advantage name and every value of every other axis appears at
  least once; axes are cycled with different offsets, so pairs vary. The
  number of cases is the longest axis's length."""
  axes = {"rl.advantage": tuple(ADVANTAGES)}
  axes.update((a, tuple(v)) for a, v in OTHER_AXES.items())
  n = max(len(v) for v in axes.values())
  cases = []
  for j in range(n):
    case = {axis: values[(j + i) % len(values)]
            for i, (axis, values) in enumerate(axes.items())}
    for key, value in list(case.items()):
      case.update(CASE_FIXUPS.get((key, value), {}))
    cases.append(case)
  for axis, values in axes.items():
    for value in values:  # A value a fixup overrode gets a case of its own.
      if value not in {c[axis] for c in cases}:
        case = {a: v[0] for a, v in axes.items()}
        case[axis] = value
        case.update(CASE_FIXUPS.get((axis, value), {}))
        cases.append(case)
    assert set(values) <= {c[axis] for c in cases}, axis
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


def _without_clock(row):
  """A metrics row without wall-clock figures and held-out evaluations (a
  run's last step evaluates, so a stop after step 1 adds them there)."""
  return {k: v for k, v in row.items() if not k.startswith(
      ("time/", "tokens_per_s/", "reward/eval_seconds", "eval/"))}


@pytest.mark.slow
def test_spec_rl_drafts_from_the_previous_epoch_and_resumes_exactly(tmp_path):
  """One epoch per step: steps 2 and 3 resample step 1's prompts from their
  drafts. The draft store is checkpointed: a run stopped after step 1 and
  resumed drafts, accepts and trains exactly as the uninterrupted one."""
  config = loop_config(**{"sampler.speculative": True})
  config.task.num_train = config.rl.prompts_per_step
  config.rl.num_steps = 3
  config.checkpoint.every = 1
  full = tmp_path / "full"
  train.run(config, str(full))
  rows = rl_rows(full)
  n = config.rl.prompts_per_step * config.rl.group_size
  assert [r["spec/drafted_rows"] for r in rows] == [0, n, n]
  assert 0 < rows[1]["spec/accept_rate"] <= 1
  assert rows[1]["spec/accepted_tokens/mean"] > 0
  assert all(r["grad_norm"] > 0 and math.isfinite(r["pg_loss"]) for r in rows)

  split = tmp_path / "split"
  config.rl.num_steps = 1
  train.run(config, str(split))
  config.rl.num_steps = 3
  train.run(config, str(split))
  assert ([_without_clock(r) for r in rl_rows(split)]
          == [_without_clock(r) for r in rows])


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
  assert all(r["grad_norm"] > 0 and math.isfinite(r["pg_loss"]) for r in rows)
  assert any(r["adv/advantage_abs_max"] > 0 for r in rows)
  assert not summary["preempted"]
  # The second update moved the weights.
  one, two = (train.load_policy(str(tmp_path), step) for step in (1, 2))
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(one.params), jax.tree.leaves(two.params))]
  assert max(moved) > 1e-5


def test_user_algorithm_with_wrong_advantage_shape_fails_before_compile():
  bad = train.Algorithm(advantage=adv.grpo(),  # [N] transforms, no head
                        coefficient=obj.ppo_clip(0.2),
                        optimizer=optax.sgd(1e-3))
  with pytest.raises(ValueError, match=r"sum_rewards"):
    train.build.build(loop_config(), algorithm_override=bad)


# --- collecting: rewards [N, R], GDPO, all-failed rows, MC-GRPO ------------------

@pytest.fixture(scope="module")
def components():
  c = train.build.build(loop_config())
  params = models.init_params(c.model_config, jax.random.key(0), c.mesh)
  yield c, params
  c.evaluator.close()


def _collect(components, algorithm, seed=0, evaluator=None):
  c, params = components
  collector = train.Collector(
      sampler=c.sampler(c.settings.group_size + algorithm.extra_samples),
      tokenizer=c.tokenizer, evaluator=evaluator or c.evaluator,
      algorithm=algorithm, group_size=c.settings.group_size, buckets=c.buckets,
      eos_ids=c.eos_ids, correctness="numeric_match", mesh=c.mesh)
  examples = {k: [e[k] for e in c.train_examples[:8]]
              for k in c.train_examples[0]}
  state = algorithm.advantage.init(jnp.zeros((1, 2)))
  return collector.collect(params, examples, jax.random.key(seed), state)


def _from(config_overrides):
  config = loop_config(**config_overrides)
  return train.algorithm_from_config(config.rl, config.optimizer)


def _numpy_gdpo(rewards_NxR, weights, g, eps=1e-4):
  x = rewards_NxR.reshape(-1, g, rewards_NxR.shape[1]).astype(np.float64)
  mean = x.mean(1, keepdims=True)
  std = x.std(1, ddof=1, keepdims=True)
  z = np.where(x.max(1, keepdims=True) > x.min(1, keepdims=True),
               (x - mean) / (std + eps), 0.0)
  a = (z * np.asarray(weights)).sum(-1).reshape(-1)
  return a / (a.std(ddof=1) + eps)


def test_gdpo_advantages_of_the_loop_equal_the_formula_on_rewards_NxR(components):
  out = _collect(components, _from({"rl.advantage": "gdpo"}))
  assert out.rewards_NxR.shape == (32, 2)
  assert np.isfinite(out.rewards_NxR).all()
  expected = _numpy_gdpo(out.rewards_NxR, (1.0, 0.5), 4)
  np.testing.assert_allclose(np.asarray(out.batch.advantages_N), expected,
                             rtol=1e-4, atol=1e-5)
  assert np.abs(expected).max() > 0.1


def test_weights_are_applied_once(components):
  """GRPO over the weighted sum: (r - mean) / std of w . r per group."""
  out = _collect(components, _from({"rl.advantage": "grpo"}))
  total = out.rewards_NxR @ np.array([1.0, 0.5])
  x = total.reshape(-1, 4)
  std = x.std(1, ddof=1, keepdims=True)
  expected = np.where(std > 0, (x - x.mean(1, keepdims=True)) / (std + 1e-6), 0)
  np.testing.assert_allclose(np.asarray(out.batch.advantages_N),
                             expected.reshape(-1), rtol=1e-4, atol=1e-5)
  assert out.metrics["reward/total/mean"] == pytest.approx(total.mean(), 1e-5)


def test_rows_whose_every_reward_failed_are_masked_out(components):
  from rljax import rewards as rewards_lib
  from tests import reward_fixtures
  specs = [rewards_lib.RewardSpec("numeric_match",
                                  rewards_lib.get_reward_fn("numeric_match")),
           rewards_lib.RewardSpec("parity", reward_fixtures.parity),
           rewards_lib.RewardSpec("first_none", reward_fixtures.none_on_first_row)]
  with rewards_lib.RewardEvaluator(specs, num_workers=0) as ev:
    # Make row 0 fail everywhere: numeric_match and parity are never None, so
    # poison them through the evaluator result instead.
    original = ev.evaluate

    def evaluate(*args, **kwargs):
      result = original(*args, **kwargs)
      rewards = result.rewards_NxR.copy()
      rewards[0] = np.nan
      rewards[1, 0] = np.nan  # row 1 keeps two rewards
      return result.__class__(result.names, rewards, ~np.isnan(rewards),
                              result.total_N, result.metrics, result.messages)

    ev.evaluate = evaluate
    out = _collect(components, _from({"rl.advantage": "grpo"}), evaluator=ev)
  assert out.metrics["reward/all_failed"] == 1.0
  a = np.asarray(out.batch.advantages_N)
  assert a[0] == 0.0
  # Group 0's statistics are those of rows 1..3 only.
  total = np.nan_to_num(out.rewards_NxR) @ np.ones(3)
  x = total[1:4]
  std = x.std(ddof=1)
  expected = (x - x.mean()) / (std + 1e-6) if std > 0 else np.zeros(3)
  np.testing.assert_allclose(a[1:4], expected, rtol=1e-4, atol=1e-5)


def test_pivot_rows_match_numpy_stable_lower_median():
  rng = np.random.default_rng(0)
  g1 = 5
  rewards = rng.integers(0, 3, (6, g1)).astype(np.float32)
  valid = np.ones_like(rewards, bool)
  valid[2, :2] = False
  valid[3] = False
  rows = np.asarray(train.pivot_rows(rewards.reshape(-1), valid.reshape(-1), g1))
  assert rows.shape == (6 * (g1 - 1),)
  for k in range(6):
    v = np.flatnonzero(valid[k])
    if v.size:
      order = v[np.argsort(rewards[k, v], kind="stable")]
      pivot = order[(v.size - 1) // 2]
    else:
      pivot = g1 - 1
    expected = [k * g1 + j for j in range(g1) if j != pivot]
    assert rows[k * (g1 - 1):(k + 1) * (g1 - 1)].tolist() == expected


def test_mc_grpo_samples_g_plus_one_and_trains_g_rows_without_the_pivot(components):
  c, _ = components
  algorithm = _from({"rl.advantage": "mc_grpo"})
  assert algorithm.extra_samples == 1 and algorithm.drop_pivot
  out = _collect(components, algorithm)
  g = c.settings.group_size
  assert len(out.completions) == 8 * (g + 1)
  assert out.batch.tokens_NxL.shape[0] == 8 * g
  total = out.rewards_NxR @ np.array([1.0, 0.5])
  kept_completions, expected_adv = [], []
  for k in range(8):
    x = total[k * (g + 1):(k + 1) * (g + 1)]
    order = np.argsort(x, kind="stable")
    pivot = order[(g + 1 - 1) // 2]
    med = x[pivot]
    mad = np.sort(np.abs(x - med))[(g + 1 - 1) // 2]
    for j in range(g + 1):
      if j != pivot:
        kept_completions.append(out.completions[k * (g + 1) + j])
        expected_adv.append((x[j] - med) / (mad + 1e-3))
  np.testing.assert_allclose(np.asarray(out.batch.advantages_N), expected_adv,
                             rtol=1e-4, atol=1e-4)
  batch = jax.device_get(out.batch)
  p = batch.tokens_NxL.shape[1] - c.config.sampler.max_new_tokens
  decoded = tok_lib.decode_completions(
      c.tokenizer, batch.tokens_NxL[:, p:], batch.loss_mask_NxL[:, p:],
      c.eos_ids)
  assert decoded == kept_completions


# --- ESS ---------------------------------------------------------------------

MC = models.get_preset("tiny")


@pytest.fixture(scope="module")
def ess_batch():
  """A batch whose sampler logprobs differ from the policy's."""
  params = models.init_params(MC, jax.random.key(5))
  rng = np.random.RandomState(1)
  n, length = 8, 10
  tokens = rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32)
  input_mask = np.ones((n, length), bool)
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 5:] = True
  loss_mask[2, 8:] = False
  lp = np.asarray(models.sequence_logprobs(params, MC, tokens, input_mask)[0])
  sampler = np.where(loss_mask, lp + rng.normal(0, 0.4, lp.shape), 0.0)
  batch = train.RLBatch(tokens, input_mask, loss_mask,
                        rng.randn(n).astype(np.float32),
                        sampler.astype(np.float32))
  return params, lp, batch


def _numpy_ess(w):
  return w.sum() ** 2 / (w.size * (w ** 2).sum())


@pytest.mark.parametrize("pooling, micro", [("microbatch", 1),
                                            ("minibatch", 2)])
def test_ess_statistics_of_the_step_equal_the_formulas(ess_batch, pooling, micro):
  params, lp, batch = ess_batch
  m = batch.loss_mask_NxL
  rl = {"objective": "ess", "group_size": 4, "num_steps": 1,
        "ess_pooling": pooling}
  algorithm = train.algorithm_from_config(
      rl, {"name": "sgd", "learning_rate": 0.1, "max_grad_norm": None,
           "ess_scaling": "sqrt"})
  cfg = train.RLStepConfig(num_microbatches=micro, ess_pooling=pooling,
                           ess_kl_coef=1.0)
  step = jax.jit(train.make_rl_step(MC, cfg, algorithm.optimizer,
                                    algorithm.coefficient))
  state = train.TrainState(params, algorithm.optimizer.init(params),
                           optax.EmptyState(), algorithm.coefficient.init(
                               jnp.zeros((1, 1))), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  _, out = step(state, batch)
  # FeynRL: token weights pi_theta / mu over the valid tokens of the minibatch.
  w_tok = np.exp(lp - batch.sampler_logprobs_NxL)[m]
  # VCPO: trajectory weights pi_old(y) / mu(y); pi_old = pi_theta here.
  w_seq = np.exp(np.where(m, lp - batch.sampler_logprobs_NxL, 0).sum(-1))
  assert _numpy_ess(w_tok) < 0.99 and _numpy_ess(w_seq) < 0.99
  np.testing.assert_allclose(out["ess/token"], _numpy_ess(w_tok), rtol=1e-4)
  np.testing.assert_allclose(out["ess/sequence"], _numpy_ess(w_seq), rtol=1e-4)
  np.testing.assert_allclose(out["ess_scale"], np.sqrt(_numpy_ess(w_seq)),
                             rtol=1e-4)
  assert out["ess_kl"] > 0


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

  def write(self, step, values):
    marks[step] = len(compiles)
    return original(self, step, values)

  monkeypatch.setattr(metrics.MetricWriter, "write", write)
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    config = loop_config(**{"rl.num_steps": 4})
    config.sampler.prompt_buckets = (16,)  # one bucket: shapes never change
    train.run(config, str(tmp_path))
  finally:
    monitoring.unregister_event_duration_listener(listener)
  first = compiles[marks[0]:marks[1]]
  assert first.count("jit(rl_step)") == 1, first
  assert first.count("jit(_sample_impl)") == 1, first  # one bucket, one program
  assert compiles[marks[1]:marks[4]] == [], compiles[marks[1]:]
