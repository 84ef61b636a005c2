"""Advantages of issue 10 and the peers' conventions, against the peers' own
formulas written out in NumPy (float64) from reading their code:

* TRL 1.x `trainer/grpo_trainer.py` (`_generate_and_score_completions`,
  `utils.nanstd`);
* verl `trainer/ppo/core_algos.py` (`compute_grpo_outcome_advantage`,
  `compute_rloo_outcome_advantage`, `compute_opo_outcome_advantage`,
  `compute_gpg_outcome_advantage`, the REINFORCE++ estimators) and
  `utils/torch_functional.py` (`masked_whiten`), `reward_manager/dapo.py`;
* the authors' code of Pass@k Training (`code/passk_adv.py`), GPG
  (`grpo_trainer.py`, `inverse_alpha`), KTAE (`compute_key_tokens.py`) and
  VCPO (the README's closed form).
"""

import fractions
import functools
import importlib.util
import itertools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import transform_harness as harness
from rljax import advantages as adv
from rljax import models
from rljax import sampling
from rljax import train
from rljax.train import algorithm as alg_lib
from rljax.train import build as build_lib
from rljax.train import batch_layout
from rljax.rollout import collector as rollout_lib

G = 4
# Three groups of four: mixed binary, constant, mixed; lengths per sample.
R = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0.5], np.float32)
L = np.array([3, 5, 2, 4, 1, 6, 1, 2, 2, 7, 3, 9], np.int32)


def _run(tx, r, group_size=G, **extra):
  r = jnp.asarray(r)
  fn = jax.jit(functools.partial(tx.update, group_size=group_size))
  return np.asarray(fn(r, tx.init(r), **extra)[0], np.float64)


def _chain(name, group_size=G, max_new_tokens=10, **rl):
  """The `rl.advantage` chain of a config, applied to rewards [N, 1]."""
  tx = alg_lib.advantage_chain({"advantage": name, **rl}, group_size,
                               max_new_tokens)

  def apply(r, mask=None, lengths=L, log_ratio=None):
    r = jnp.asarray(r, jnp.float32)[:, None]
    n = r.shape[0]
    extra = alg_lib.advantage_extra_args(
        jnp.asarray(lengths), jnp.zeros(n) if log_ratio is None
        else jnp.asarray(log_ratio, jnp.float32),
        jnp.zeros((n, 1), jnp.int32), jnp.ones((n, 1), bool))
    out = tx.update(r, tx.init(r), group_size=group_size,
                    mask_N=jnp.ones(n, bool) if mask is None
                    else jnp.asarray(mask),
                    reward_weights_R=jnp.ones(1), **extra)[0]
    return np.asarray(out, np.float64)
  return apply


def _torch_std(v):
  """`torch.std` (Bessel) of a 1-d array."""
  return float(np.std(v, ddof=1))


# ----------------------------------------------------------------------------
# The new advantages.


def test_grpo_batch_std_is_trls_scale_rewards_batch():
  # TRL: rewards NaN for unscorable rows; mean = nanmean per group,
  # std = nanstd (Bessel) over the whole batch; (r - mean) / (std + 1e-4);
  # nan_to_num(0).
  mask = np.ones(12, bool)
  mask[5] = False
  r = R.astype(np.float64).copy()
  r[~mask] = np.nan
  grouped = r.reshape(-1, G)
  mean = np.repeat(np.nanmean(grouped, 1), G)
  valid = r[np.isfinite(r)]
  std = np.sqrt(np.mean((valid - valid.mean()) ** 2) * len(valid)
                / (len(valid) - 1))
  expected = np.nan_to_num((r - mean) / (std + 1e-4), nan=0.0)
  np.testing.assert_allclose(_chain("grpo_batch_std")(R, mask), expected,
                             rtol=1e-5, atol=1e-6)


def test_gpg_matches_the_authors_inverse_alpha():
  # Authors: advantages = r - group mean (adjust_gd: no std); the loss is
  # divided by inverse_alpha = n_valid_samples / num_samples, where
  # n_valid_samples counts samples of groups whose rewards are not identical.
  grouped = R.astype(np.float64).reshape(-1, G)
  centred = (grouped - grouped.mean(1, keepdims=True)).reshape(-1)
  informative = np.repeat(grouped.max(1) > grouped.min(1), G)
  inverse_alpha = min(1.0, informative.sum() / len(R))
  np.testing.assert_allclose(_chain("gpg")(R), centred / inverse_alpha,
                             rtol=1e-6, atol=1e-6)
  assert inverse_alpha == 8 / 12


def _passk_reference(val, k):
  """The authors' `calc_adv` (scipy's comb is 0 for a negative top)."""
  comb = lambda a, b: math.comb(a, b) if a >= 0 else 0
  c = int(np.sum(val == 1))
  n = len(val)
  rho = 1 - comb(n - c, k) / comb(n, k)
  sigma = np.sqrt(rho * (1 - rho))
  adv_p = (1 - rho) / (sigma + 1e-6)
  adv_n = (1 - rho - comb(n - c - 1, k - 1) / comb(n - 1, k - 1)) / (
      sigma + 1e-6)
  return np.where(val == 1, adv_p, adv_n)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pass_at_k_matches_the_authors_code(k):
  r = np.array([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1,
                0, 1, 0, 1, 0, 1, 0, 0], np.float32)
  g = 8
  got = _run(adv.pass_at_k_advantages(k), r, g)
  expected = np.concatenate([_passk_reference(v, k)
                             for v in r.astype(np.float64).reshape(-1, g)])
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  if k == 1:  # pass@1 is GRPO with the population std.
    grouped = r.astype(np.float64).reshape(-1, g)
    z = (grouped - grouped.mean(1, keepdims=True)) / (
        grouped.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, z.reshape(-1), rtol=1e-5, atol=1e-5)


def test_pass_at_k_by_enumerating_subsets():
  """Independent of both: the mean advantage over all k-subsets holding i."""
  v = np.array([1, 0, 0, 1, 0, 0], np.float64)
  k = 3
  subsets = list(itertools.combinations(range(6), k))
  rewards = np.array([max(v[list(s)]) for s in subsets])
  mean, std = rewards.mean(), rewards.std()
  expected = [np.mean([(rw - mean) / std for s, rw in zip(subsets, rewards)
                       if i in s]) for i in range(6)]
  got = _run(adv.pass_at_k_advantages(k, eps=0.0), v.astype(np.float32), 6)
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_opo_is_verls_length_weighted_baseline():
  r = R.astype(np.float64).reshape(-1, G)
  length = L.astype(np.float64).reshape(-1, G)
  baseline = (length * r).sum(1, keepdims=True) / length.sum(1, keepdims=True)
  np.testing.assert_allclose(_chain("opo")(R), (r - baseline).reshape(-1),
                             rtol=1e-6, atol=1e-6)


def _masked_whiten(values, mask):
  """verl's `masked_whiten` (unbiased variance, rsqrt(var + 1e-8))."""
  mean = (values * mask).sum() / (mask.sum() + 1e-8)
  var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8)
  var = var * mask.sum() / (mask.sum() - 1)
  return (values - mean) / np.sqrt(var + 1e-8)


def _token_mask(lengths, t=10):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(
      np.float64)


def test_reinforce_pp_token_is_verls_baseline_estimator():
  # verl: scores - group mean, tiled over tokens * response_mask, then
  # masked_whiten over the response mask.
  r = R.astype(np.float64).reshape(-1, G)
  scores = (r - r.mean(1, keepdims=True)).reshape(-1)
  mask = _token_mask(L)
  tokens = _masked_whiten(scores[:, None] * mask, mask) * mask
  got = _chain("reinforce_pp_token")(R)
  np.testing.assert_allclose(got[:, None] * mask, tokens, rtol=1e-5,
                             atol=1e-5)


def test_whiten_by_tokens_is_verls_reinforce_plus_plus():
  # verl's reinforce_plus_plus with an outcome reward at the last token and
  # gamma = 1: every token's return is the reward; then masked_whiten.
  mask = _token_mask(L)
  token_rewards = np.zeros_like(mask)
  token_rewards[np.arange(12), L - 1] = R
  returns = np.flip(np.cumsum(np.flip(token_rewards, 1), 1), 1) * mask
  expected = _masked_whiten(returns, mask) * mask
  got = _chain("whiten_by_tokens")(R)
  np.testing.assert_allclose(got[:, None] * mask, expected, rtol=1e-5,
                             atol=1e-5)


def test_overlong_penalty_is_dapos_reward_manager():
  max_len, buffer, factor = 10, 4, 0.5
  exceed = L - (max_len - buffer)
  penalty = np.minimum(-exceed / buffer * factor, 0)
  got = _run(adv.overlong_penalty(max_len, buffer, factor), R,
             lengths_N=jnp.asarray(L))
  np.testing.assert_allclose(got, R + penalty, rtol=1e-6)
  # From the config: rl.overlong_buffer defaults to a fifth of the budget.
  chain = _chain("overlong_penalty", max_new_tokens=10,
                 overlong_penalty_factor=1.0)
  np.testing.assert_allclose(
      chain(R), R + np.minimum(-(L - 8) / 2, 0), rtol=1e-6)


def test_vcpo_min_variance_baseline():
  # README: b* = sum w^2 |g|^2 R / sum w^2 |g|^2, |g|^2 ~ length here;
  # scripts: norm_by_std with the population std when it exceeds 1e-8.
  log_w = np.linspace(-0.5, 0.7, 12)
  r = R.astype(np.float64).reshape(-1, G)
  w = (np.exp(2 * log_w) * L).reshape(-1, G)
  b = (w * r).sum(1, keepdims=True) / w.sum(1, keepdims=True)
  sigma = r.std(1, keepdims=True)
  expected = np.where(sigma > 1e-8, (r - b) / np.where(sigma > 0, sigma, 1),
                      0.0).reshape(-1)
  np.testing.assert_allclose(_chain("vcpo")(R, log_ratio=log_w), expected,
                             rtol=1e-5, atol=1e-6)
  # Exact gradient norms, when given, replace the length proxy.
  norms = np.arange(1, 13, dtype=np.float32)
  tx = adv.center_by_min_variance_baseline(norm_by_std=False)
  w = (np.exp(2 * log_w) * norms).reshape(-1, G)
  b = (w * r).sum(1, keepdims=True) / w.sum(1, keepdims=True)
  expected = np.where(r.max(1, keepdims=True) > r.min(1, keepdims=True),
                      r - b, 0.0).reshape(-1)
  np.testing.assert_allclose(
      _run(tx, R, seq_log_ratio_N=jnp.asarray(log_w, jnp.float32),
           sq_grad_norms_N=jnp.asarray(norms), lengths_N=jnp.asarray(L)),
      expected, rtol=1e-5, atol=1e-6)


def _ktae_group_reference(tokens, mask, rewards):
  """The authors' `ComputeKeyTokens` for one group, in float64 Python, with
  Fisher's test in exact rational arithmetic."""
  correct = [i for i, r in enumerate(rewards) if r > 0]
  wrong = [i for i, r in enumerate(rewards) if r <= 0]
  if not correct or not wrong:
    return {}
  seen = lambda i: {v for v, m in zip(tokens[i], mask[i]) if m}
  count = lambda rows, v: sum(v == u for i in rows
                              for u, m in zip(tokens[i], mask[i]) if m)
  len_c = sum(sum(mask[i]) for i in correct)
  len_w = sum(sum(mask[i]) for i in wrong)
  avg = (len_c + len_w) / 2
  k_c, k_w = 2 * (0.5 + 0.5 * len_c / avg), 2 * (0.5 + 0.5 * len_w / avg)
  ent = lambda p: -p * math.log2(p) if p > 0 else 0.0
  cond = lambda x, y: ent(x / (x + y)) + ent(y / (x + y)) if x + y else 0.0
  weights = {}
  for v in set().union(*(seen(i) for i in range(len(rewards)))):
    a = sum(v in seen(i) for i in correct)
    b = sum(v in seen(i) for i in wrong)
    c, d = len(correct) - a, len(wrong) - b
    n, r1, c1 = a + b + c + d, a + b, a + c
    p_k = lambda k: fractions.Fraction(
        math.comb(c1, k) * math.comb(n - c1, r1 - k), math.comb(n, r1))
    p = sum(p_k(k) for k in range(max(0, r1 + c1 - n), min(r1, c1) + 1)
            if p_k(k) <= p_k(a))
    fisher = math.exp(-2 * p) if p != 1 else 0.0
    ig = ent((a + c) / n) + ent((b + d) / n) - (
        (a + b) / n * cond(a, b) + (c + d) / n * cond(c, d))
    h = (math.asin(math.sqrt(a / (a + c + 1e-10)))
         - math.asin(math.sqrt(b / (b + d + 1e-10))))
    f_c, f_w = count(correct, v) / len_c, count(wrong, v) / len_w
    tf_c, tf_w = f_c * 3 / (f_c + k_c), f_w * 3 / (f_w + k_w)
    key = (fisher + ig) * (h + tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)) / 2
    weights[v] = math.tanh(key / 2)  # (sigmoid(key) - 0.5) * 2
  return weights


@pytest.mark.slow
def test_ktae_matches_the_authors_code():
  rng = np.random.default_rng(0)
  g, t = 4, 6
  r = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 2, 1, 0, 0, 0, 0, 0], np.float32)
  tokens = rng.integers(0, 7, (16, t))
  mask = np.arange(t)[None] < rng.integers(1, t + 1, 16)[:, None]
  tx = adv.ktae_advantages()
  got = np.asarray(tx.update(jnp.asarray(r), tx.init(jnp.asarray(r)),
                             group_size=g, tokens_NxT=jnp.asarray(tokens),
                             completion_mask_NxT=jnp.asarray(mask))[0])
  expected = np.zeros((16, t))
  for start in range(0, 16, g):
    rows = slice(start, start + g)
    v = r[rows].astype(np.float64)
    z = ((v - v.mean()) / (v.std(ddof=1) + 1e-6) if v.max() > v.min()
         else np.zeros(g))
    w = _ktae_group_reference(tokens[rows].tolist(), mask[rows].tolist(),
                              v.tolist())
    for i in range(g):
      for j in range(t):
        if mask[start + i, j]:
          expected[start + i, j] = z[i] + w.get(tokens[start + i, j], 0.0)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert np.any(np.abs(got - np.repeat(got[:, :1], t, 1))[mask] > 0.05)
  # From the config, through the Collector's extra arguments.
  tx = alg_lib.advantage_chain({"advantage": "ktae"}, g)
  out = tx.update(jnp.asarray(r)[:, None], tx.init(jnp.asarray(r)[:, None]),
                  group_size=g, mask_N=jnp.ones(16, bool),
                  reward_weights_R=jnp.ones(1), **alg_lib.advantage_extra_args(
                      jnp.asarray(mask.sum(1)), jnp.zeros(16),
                      jnp.asarray(tokens), jnp.asarray(mask)))[0]
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_remax_is_verls_greedy_baseline():
  # verl: advantages = returns - reward_baselines (the greedy completion's
  # reward), no scaling. Groups of G + 1 = 3: two samples, then the greedy.
  r = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 3.0, 1.0], np.float32)
  mask = np.ones(9, bool)
  expected = np.array([0.5, -0.5, 0, 0, 0, 0, -1, 2, 0])
  np.testing.assert_allclose(_run(adv.center_by_greedy_baseline(), r, 3),
                             expected, atol=1e-7)
  mask[8] = False  # No greedy reward: no baseline, advantage 0.
  got = _run(adv.center_by_greedy_baseline(), r, 3, mask_N=jnp.asarray(mask))
  np.testing.assert_array_equal(got[6:], 0.0)


@pytest.mark.slow
def test_greedy_every_decodes_the_last_row_of_each_group_greedily():
  logits = jax.random.normal(jax.random.key(0), (6, 11))
  key = jax.random.key(1)
  plain = sampling.SamplingMethod(temperature=0.7)
  remax = sampling.SamplingMethod(temperature=0.7, greedy_every=3)
  tokens, logp = plain.get_next_tokens(logits, key)
  got_tokens, got_logp = remax.get_next_tokens(logits, key)
  greedy_rows = np.array([2, 5])
  sampled_rows = np.array([0, 1, 3, 4])
  np.testing.assert_array_equal(got_tokens[greedy_rows],
                                np.argmax(logits, -1)[greedy_rows])
  np.testing.assert_array_equal(got_logp[greedy_rows], 0.0)
  np.testing.assert_array_equal(got_tokens[sampled_rows], tokens[sampled_rows])
  np.testing.assert_array_equal(got_logp[sampled_rows], logp[sampled_rows])
  with pytest.raises(ValueError, match="greedy_every=-1"):
    sampling.SamplingMethod(greedy_every=-1)


def _fake_rollout(n, p=2, t=3, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, n).astype(np.int32)
  mask = np.arange(t)[None] < lengths[:, None]
  return sampling.Rollout(
      prompt_tokens=jnp.asarray(rng.integers(1, 9, (n, p)), jnp.int32),
      prompt_mask=jnp.ones((n, p), bool),
      completion_tokens=jnp.asarray(rng.integers(1, 9, (n, t)), jnp.int32),
      completion_mask=jnp.asarray(mask), lengths=jnp.asarray(lengths),
      finished=jnp.ones((n,), bool), policy_logprobs=None,
      sampler_logprobs=jnp.asarray(np.where(mask, -0.5, 0.0), jnp.float32))


@pytest.mark.slow
def test_collector_drops_remax_greedy_rows_and_places_ktae_tokens():
  opt = {"name": "sgd", "learning_rate": 0.1}
  remax = alg_lib.from_config({"advantage": "remax", "group_size": 2,
                               "num_steps": 1}, opt)
  assert remax.extra_samples == 1 and remax.greedy_baseline
  r = np.array([[1.0], [0.0], [0.5], [2.0], [0.0], [1.0]], np.float32)
  rollout = _fake_rollout(6)
  batch, _, _ = batch_layout.postprocess(
      rollout, jnp.asarray(r), jnp.ones(6, bool), jnp.ones(1),
      remax.advantage.init(jnp.asarray(r)), algorithm=remax, group_size=2)
  # One advantage per row over its completion columns, 0 on the prompt's.
  np.testing.assert_array_equal(batch.advantages_NxL[:, :2], 0.0)
  np.testing.assert_allclose(batch.advantages_NxL[:, 2:], np.repeat(
      np.array([[0.5], [-0.5], [1.0], [-1.0]]), 3, 1))
  kept = np.array([0, 1, 3, 4])
  np.testing.assert_array_equal(batch.tokens_NxL[:, 2:],
                                rollout.completion_tokens[kept])
  ktae = alg_lib.from_config({"advantage": "ktae", "group_size": 3,
                              "num_steps": 1}, opt)
  batch, _, metrics = batch_layout.postprocess(
      rollout, jnp.asarray(r), jnp.ones(6, bool), jnp.ones(1),
      ktae.advantage.init(jnp.asarray(r)), algorithm=ktae, group_size=3)
  assert batch.advantages_NxL.shape == (6, 5)
  np.testing.assert_array_equal(batch.advantages_NxL[:, :2], 0.0)
  direct = adv.ktae_advantages().update(
      jnp.asarray(r[:, 0]), None, group_size=3,
      tokens_NxT=rollout.completion_tokens,
      completion_mask_NxT=rollout.completion_mask)[0]
  np.testing.assert_allclose(batch.advantages_NxL[:, 2:], direct, rtol=1e-6)
  assert all(np.isfinite(float(v)) for k, v in metrics.items()
             if not k.startswith("rows/"))
  # Each row's advantage for the histograms: the token mean over its
  # completion.
  mask = np.asarray(rollout.completion_mask)
  np.testing.assert_allclose(
      metrics["rows/advantage"],
      (np.asarray(direct) * mask).sum(1) / np.maximum(mask.sum(1), 1),
      rtol=1e-5)


@pytest.mark.slow
def test_rl_step_with_per_token_advantages_is_the_gradient_of_the_surrogate():
  """RLBatch.advantages_NxL of [N, L] (KTAE): one SGD step of the reinforce
  objective, token_mean, on the last T columns, equals jax.grad of
  -sum_t A_t log pi_t m_t / sum_t m_t."""
  mc = models.get_preset("tiny")
  params = models.init_params(mc, jax.random.key(1))
  n, p, t = 4, 3, 4
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, mc.vocab_size, (n, p + t)), jnp.int32)
  input_mask = np.ones((n, p + t), bool)
  loss_mask = np.zeros((n, p + t), bool)
  for i, length in enumerate((4, 2, 3, 1)):
    loss_mask[i, p:p + length] = True
    input_mask[i, p + length:] = False
  adv_NxL = jnp.asarray(np.where(loss_mask, rng.normal(size=(n, p + t)), 0.0),
                        jnp.float32)
  batch = train.RLBatch(tokens, jnp.asarray(input_mask),
                        jnp.asarray(loss_mask), adv_NxL,
                        jnp.zeros((n, p + t), jnp.float32))
  coef = alg_lib.coefficient_chain({"objective": "reinforce"})
  cfg = train.RLStepConfig(completion_length=t)
  step = jax.jit(train.make_rl_step(mc, cfg, optax.sgd(1.0), coef))
  state = train.TrainState(params, optax.sgd(1.0).init(params), None,
                           coef.init(jnp.zeros((n, t), jnp.float32)),
                           jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  new_state, _ = step(state, batch, None)

  def surrogate(params):
    lp = models.sequence_logprobs(params, mc, tokens,
                                  jnp.asarray(input_mask))[0]
    m = jnp.asarray(loss_mask, jnp.float32)
    return -jnp.sum(adv_NxL * lp * m) / jnp.sum(m)

  grads = jax.jit(jax.grad(surrogate))(params)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in
                                      jax.tree.leaves(tree)])
  delta = flat(new_state.params) - flat(params)
  want = -flat(grads)
  assert np.abs(want).max() > 0
  np.testing.assert_allclose(delta, want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", ["grpo_batch_std", "gpg", "pass_at_k", "opo",
                                  "reinforce_pp_token", "vcpo", "ktae"])
@pytest.mark.slow
def test_masked_rows_are_ignored_and_zero(name):
  mask = np.ones(12, bool)
  mask[[1, 6, 11]] = False
  garbage = R.copy()
  garbage[~mask] = [np.nan, 1e30, -7.0]
  fn = _chain(name)
  clean = fn(R, mask)
  np.testing.assert_array_equal(fn(garbage, mask), clean)
  assert np.all(clean[~mask] == 0) and np.all(np.isfinite(clean))
  assert np.all(fn(np.full(12, 0.3, np.float32)) == 0)  # Constant groups.


def test_errors():
  r = jnp.zeros(8)
  with pytest.raises(ValueError, match="lengths_N"):
    tx = adv.opo()
    tx.update(r, tx.init(r), group_size=4)
  with pytest.raises(ValueError, match="buffer_length=0"):
    adv.overlong_penalty(10, 0)
  with pytest.raises(ValueError, match="k=5 must be at most group_size=4"):
    tx = adv.pass_at_k_advantages(5)
    tx.update(r, tx.init(r), group_size=4)
  with pytest.raises(ValueError, match="singleton='one'"):
    adv.center_by_group_mean("one")


# ----------------------------------------------------------------------------
# Conventions: each option reproduces the peer's number.


def test_std_eps_reproduces_trls_grpo():
  # TRL scale_rewards="group": (r - nanmean_g) / (nanstd_g + 1e-4).
  r = R.astype(np.float64).reshape(-1, G)
  expected = ((r - r.mean(1, keepdims=True))
              / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
  got = _chain("grpo", std_eps=1e-4)(R)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  default = _chain("grpo")(R)
  assert abs(default[0] - got[0]) > 1e-5  # verl's 1e-6 differs visibly.


def test_singleton_groups_raw_reproduces_verl():
  # verl grpo: a group of one has mean 0, std 1 -> r / (1 + 1e-6);
  # rloo leaves a group of one unchanged; rl.group_size = 1.
  r = np.array([0.5, -2.0, 3.0], np.float32)
  lengths = np.ones(3, np.int32)
  np.testing.assert_allclose(
      _chain("grpo", group_size=1, singleton_groups="raw")(r, lengths=lengths),
      r / (1 + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(
      _chain("rloo", group_size=1, singleton_groups="raw")(r, lengths=lengths),
      r, rtol=1e-6)
  np.testing.assert_array_equal(
      _chain("grpo", group_size=1)(r, lengths=lengths), 0.0)  # TRL: 0.


def test_failed_rewards_zero_reproduces_trl_before_5902():
  # Old TRL: nansum over reward functions turns an all-None row into 0, and it
  # stays in every statistic. rljax's Collector marks the row valid
  # (Algorithm.failed_rewards="zero"); sum_rewards then scores it 0.
  r_nr = np.array([[1.0], [np.nan], [0.0], [1.0]], np.float32)
  summed = np.nansum(r_nr.astype(np.float64), 1)
  expected = (summed - summed.mean()) / (np.std(summed, ddof=1) + 1e-4)
  tx = alg_lib.advantage_chain({"advantage": "grpo", "std_eps": 1e-4}, 4)
  got = tx.update(jnp.asarray(r_nr), tx.init(jnp.asarray(r_nr)), group_size=4,
                  mask_N=jnp.ones(4, bool), reward_weights_R=jnp.ones(1))[0]
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  algorithm = alg_lib.from_config(
      {"advantage": "grpo", "group_size": 4, "num_steps": 1,
       "failed_rewards": "zero"}, {})
  assert algorithm.failed_rewards == "zero"
  # The Collector's mask_N: the all-failed row stays in with "zero" only.
  valid_NxR = np.isfinite(r_nr)
  np.testing.assert_array_equal(
      rollout_lib.scored_rows(valid_NxR, "zero"), [True] * 4)
  np.testing.assert_array_equal(
      rollout_lib.scored_rows(valid_NxR, "exclude"), [True, False, True, True])
  with pytest.raises(ValueError, match="failed_rewards"):
    alg_lib.Algorithm(advantage=tx, coefficient=tx, optimizer=tx,
                      failed_rewards="nan")


def _tiny_config(**rl):
  path = os.path.join(os.path.dirname(__file__), "..", "configs",
                      "arithmetic_grpo.py")
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("tiny")
  for key, value in rl.items():
    config.rl[key] = value
  return config


@pytest.mark.parametrize("overrides, message", [
    ({"singleton_groups": "one"}, "rl.singleton_groups='one'"),
    ({"failed_rewards": "drop"}, "rl.failed_rewards='drop'"),
    ({"advantage": "pass_at_k", "pass_k": 9}, "rl.pass_k=9"),
    ({"advantage": "overlong_penalty+center_by_group_mean",
      "overlong_buffer": 99}, "rl.overlong_buffer=99"),
    ({"std_eps": -1.0}, "rl.std_eps=-1.0"),
    ({"advantage": "grpo", "group_size": 1}, "singleton_groups='raw'"),
])
def test_config_checks_name_the_field(overrides, message):
  config = _tiny_config(**overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    build_lib.validate(config)


def test_config_accepts_group_size_one_with_raw_singletons_and_rejects_remax_eval():
  build_lib.validate(_tiny_config(group_size=1, singleton_groups="raw",
                                  prompts_per_step=8))
  config = _tiny_config(advantage="remax")
  config.eval.num_samples = config.rl.group_size + 1
  with pytest.raises(ValueError, match="eval.num_samples"):
    build_lib.validate(config)


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed):
  rng = np.random.default_rng(seed)
  r = jnp.asarray(rng.integers(0, 2, 12) + rng.normal(size=12) * 0.1,
                  jnp.float32)
  m = rng.random(12) < 0.8
  m[0] = True
  return r, {"mask_N": jnp.asarray(m),
             "tokens_NxT": jnp.asarray(rng.integers(0, 5, (12, 3)), jnp.int32),
             "completion_mask_NxT": jnp.asarray(rng.random((12, 3)) < 0.8),
             "lengths_N": jnp.asarray(rng.integers(1, 9, 12), jnp.int32),
             "seq_log_ratio_N": jnp.asarray(rng.normal(size=12) * 0.3,
                                            jnp.float32)}


def _case(name, factory, static_args=(), **kwargs):
  return harness.Case(name, factory, kwargs, _inputs,
                      static_extra={"group_size": 4}, static_args=static_args)


HARNESS_CASES = [
    _case("grpo_batch_std", adv.grpo_batch_std, eps=1e-4),
    _case("gpg", adv.gpg),
    _case("pass_at_k", adv.pass_at_k_advantages, static_args=("k",), k=2,
          threshold=0.5),
    _case("opo", adv.opo),
    _case("whiten_by_tokens", adv.whiten_by_tokens, eps=1e-8),
    _case("overlong_penalty", adv.overlong_penalty,
          static_args=("max_length", "buffer_length"), max_length=8,
          buffer_length=3, penalty_factor=0.5),
    _case("ktae", adv.ktae_advantages, static_args=("use_tf",), eps=1e-6),
    _case("remax", adv.center_by_greedy_baseline),
    _case("vcpo_baseline", adv.center_by_min_variance_baseline,
          static_args=("norm_by_std",), norm_by_std=True),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
@pytest.mark.slow
def test_harness(case, check):
  check(case)
