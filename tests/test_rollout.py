"""``rljax.rollout.collector``: the Collector turns prompts into an RLBatch.

Advantages of a real rollout (a tiny model, two reward functions) against
NumPy formulas written here: GDPO over rewards [N, R], the reward weights
applied once, rows whose every reward failed left out, MC-GRPO's pivot drop,
and the trainer's layout (0 on the prompt, one value over a completion).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, rollout, train
from rljax import tokenizers as tok_lib
from rljax.rollout import collector as rollout_lib
from tests.test_loop import loop_config, row_advantages


@pytest.fixture(scope="module")
def components():
  c = train.build.build(loop_config())
  params = models.init_params(c.model_config, jax.random.key(0), c.mesh)
  yield c, params
  c.evaluator.close()


def _collect(components, algorithm, seed=0, evaluator=None):
  c, params = components
  collector = rollout.Collector(
      sampler=c.sampler(c.settings.group_size + algorithm.extra_samples),
      tokenizer=c.tokenizer, evaluator=evaluator or c.evaluator,
      postprocess=train.Postprocessor(algorithm),
      group_size=c.settings.group_size, buckets=c.buckets,
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
  np.testing.assert_allclose(row_advantages(out.batch), expected,
                             rtol=1e-4, atol=1e-5)
  assert np.abs(expected).max() > 0.1


def test_weights_are_applied_once(components):
  """GRPO over the weighted sum: (r - mean) / std of w . r per group."""
  out = _collect(components, _from({"rl.advantage": "grpo"}))
  total = out.rewards_NxR @ np.array([1.0, 0.5])
  x = total.reshape(-1, 4)
  std = x.std(1, ddof=1, keepdims=True)
  expected = np.where(std > 0, (x - x.mean(1, keepdims=True)) / (std + 1e-6), 0)
  np.testing.assert_allclose(row_advantages(out.batch),
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
  a = row_advantages(out.batch)
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


@pytest.mark.slow
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
  np.testing.assert_allclose(row_advantages(out.batch), expected_adv,
                             rtol=1e-4, atol=1e-4)
  batch = jax.device_get(out.batch)
  p = batch.tokens_NxL.shape[1] - c.config.sampler.max_new_tokens
  decoded = tok_lib.decode_completions(
      c.tokenizer, batch.tokens_NxL[:, p:], batch.loss_mask_NxL[:, p:],
      c.eos_ids)
  assert decoded == kept_completions


# --- ESS ---------------------------------------------------------------------


def test_scored_rows_follow_failed_rewards():
  valid = np.array([[True, False], [False, False], [False, True]])
  np.testing.assert_array_equal(rollout_lib.scored_rows(valid, "exclude"),
                                [True, False, True])
  np.testing.assert_array_equal(rollout_lib.scored_rows(valid, "zero"),
                                [True, True, True])


def test_a_critic_batch_carries_the_rewards_and_no_advantages(components):
  """With rl.advantage="gae" the chain gives each row's weighted reward,
  which the batch carries as rewards_N for the step's GAE."""
  out = _collect(components, _from({"rl.advantage": "gae"}))
  total = out.rewards_NxR @ np.array([1.0, 0.5])
  np.testing.assert_allclose(np.asarray(out.batch.rewards_N), total,
                             rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(out.batch.advantages_NxL), 0.0)


def test_slot_plans_score_the_trained_groups_own_examples(components):
  """Partial rollouts train groups carried from earlier steps: the rewards
  must read each trained group's own example, not the step's new ones (a
  plan whose trained groups are the step's examples in reverse order)."""
  c, params = components
  g = c.settings.group_size
  seen = []

  def record(prompts, completions, **fields):
    seen.append((list(prompts), list(fields["answer"])))
    return [0.0] * len(prompts)

  class ReversedSlots:
    """Trains the step's groups in reverse (as carried groups come first)."""

    def sample(self, params, prompts, examples, key, version, buckets,
               on_dispatch=None, more=None):
      del params, key, buckets, on_dispatch, more
      order = list(range(len(prompts)))[::-1]
      tokens, mask = rollout_lib.sampling.pad_prompts(
          [prompts[i] for i in order], (16,), c.tokenizer.pad_id)
      n, t = len(order) * g, c.config.sampler.max_new_tokens
      rollout_ = rollout_lib.sampling.Rollout(
          np.repeat(tokens, g, 0), np.repeat(mask, g, 0),
          np.full((n, t), c.tokenizer.pad_id, np.int32),
          np.zeros((n, t), bool), np.zeros(n, np.int32), np.ones(n, bool),
          None, np.zeros((n, t), np.float32))
      trained = {k: [v[i] for i in order] for k, v in examples.items()}
      return rollout_, trained, np.full((n, t), version, np.int32), {}

  class Postprocess:
    extra_samples, failed_rewards = 0, "zero"

  evaluator = rollout_lib.rewards_lib.RewardEvaluator(
      [rollout_lib.rewards_lib.RewardSpec("numeric_match", record)],
      num_workers=0)
  collector = rollout.Collector(
      sampler=None, tokenizer=c.tokenizer, evaluator=evaluator,
      postprocess=Postprocess(), group_size=g, buckets=(16,),
      eos_ids=c.eos_ids, correctness="numeric_match", slots=ReversedSlots())
  examples = {k: [e[k] for e in c.train_examples[:4]]
              for k in c.train_examples[0]}
  sampled = collector.sample_round(params, examples, jax.random.key(0), 0,
                                   None, None)
  [(prompts, answers)] = seen
  want = [(p, a) for p, a in zip(examples["prompt"][::-1],
                                 examples["answer"][::-1]) for _ in range(g)]
  assert list(zip(prompts, answers)) == want
  assert sampled.examples["prompt"] == examples["prompt"][::-1]
