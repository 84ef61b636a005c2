"""verl v0.9.0's `grpo_passk`, the discount of the token-level estimators
(REINFORCE++, ReMax), per-token rewards, `reinforce_pp_token`'s singleton
groups and `agg_loss`'s `dp_size`, against NumPy (float64) ports of verl's
code written out from `trainer/ppo/core_algos.py` (tag v0.9.0, 483b8a0):
`compute_grpo_passk_outcome_advantage`,
`compute_reinforce_plus_plus_outcome_advantage`,
`compute_reinforce_plus_plus_baseline_outcome_advantage`,
`compute_remax_outcome_advantage`, `compute_gae_advantage_return`,
`agg_loss`, and `utils/torch_functional.py` (`masked_whiten`).

verl has no row mask: a row outside rljax's `mask_N` is a row absent from
verl's batch, so the references drop those rows and the results are
compared on the others (the dropped rows must be 0).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import transform_harness as harness
from rljax import advantages as adv
from rljax import objectives as obj

# ----------------------------------------------------------------------------
# NumPy ports of verl v0.9.0.


def _verl_grpo_passk(scores, index, epsilon=1e-6, norm_adv_by_std=True):
  """`compute_grpo_passk_outcome_advantage` (one advantage per row)."""
  advantages = np.zeros(len(scores))
  for idx in dict.fromkeys(index):
    rows = [i for i in range(len(scores)) if index[i] == idx]
    rewards = np.asarray(scores, np.float64)[rows]
    if rewards.size < 2:
      raise ValueError("Pass@k requires at least 2 samples per group.")
    # torch.topk(rewards, 2); for a tied maximum the advantage is 0 whichever
    # tied row it returns.
    topk_idx = np.argsort(-rewards, kind="stable")[:2]
    r_max, r_second_max = rewards[topk_idx[0]], rewards[topk_idx[1]]
    advantage = r_max - r_second_max
    if norm_adv_by_std:
      advantage = advantage / (np.std(rewards, ddof=1) + epsilon)
    advantages[rows[topk_idx[0]]] = advantage
  return advantages


def _masked_mean(values, mask):
  return (values * mask).sum() / (mask.sum() + 1e-8)


def _masked_whiten(values, mask):
  """`verl_F.masked_whiten`: Bessel variance, rsqrt(var + 1e-8)."""
  mean = _masked_mean(values, mask)
  var = _masked_mean((values - mean) ** 2, mask)
  var = var * mask.sum() / (mask.sum() - 1)
  return (values - mean) / np.sqrt(var + 1e-8)


def _verl_rpp_returns(token_level_rewards, response_mask, gamma):
  """The returns loop of v0.9.0's REINFORCE++ (observation tokens skipped)."""
  returns = np.zeros_like(token_level_rewards)
  running_return = np.zeros(token_level_rewards.shape[0])
  for t in reversed(range(token_level_rewards.shape[1])):
    new_running_return = token_level_rewards[:, t] + gamma * running_return
    returns[:, t] = new_running_return * response_mask[:, t]
    running_return = (new_running_return * response_mask[:, t]
                      + running_return * (1 - response_mask[:, t]))
  return returns


def _verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma):
  returns = _verl_rpp_returns(token_level_rewards, response_mask, gamma)
  return _masked_whiten(returns, response_mask) * response_mask


def _verl_rpp_baseline(token_level_rewards, response_mask, index):
  """`compute_reinforce_plus_plus_baseline_outcome_advantage`."""
  scores = token_level_rewards.sum(-1)
  out = scores.copy()
  for idx in dict.fromkeys(index):
    rows = [i for i in range(len(scores)) if index[i] == idx]
    mean = 0.0 if len(rows) == 1 else scores[rows].mean()
    out[rows] = scores[rows] - mean
  tiled = out[:, None] * response_mask
  return _masked_whiten(tiled, response_mask) * response_mask


def _verl_remax(token_level_rewards, reward_baselines, response_mask):
  """`compute_remax_outcome_advantage` (undiscounted returns). Its values on
  unmasked tokens inside a row (a hole) are not 0, but no loss reads them;
  the tests compare on the response tokens."""
  returns = np.flip(np.cumsum(np.flip(token_level_rewards * response_mask, -1),
                              -1), -1)
  return returns - reward_baselines[:, None] * response_mask


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
  """`compute_gae_advantage_return` before its `masked_whiten`."""
  nextvalues = np.zeros(values.shape[0])
  lastgaelam = np.zeros(values.shape[0])
  advantages_reversed = []
  for t in reversed(range(values.shape[1])):
    delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam_ = delta + gamma * lam * lastgaelam
    m = response_mask[:, t]
    nextvalues = values[:, t] * m + (1 - m) * nextvalues
    lastgaelam = lastgaelam_ * m + (1 - m) * lastgaelam
    advantages_reversed.append(lastgaelam)
  advantages = np.stack(advantages_reversed[::-1], 1)
  return advantages, advantages + values


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1,
                   batch_num_tokens=None, global_batch_size=None,
                   loss_scale_factor=None):
  """`agg_loss` of v0.9.0."""
  masked_sum = lambda v, m: (np.where(m > 0, v, 0.0) * m).sum()
  if loss_agg_mode == "token-mean":
    if batch_num_tokens is None:
      if dp_size > 1:
        raise ValueError("(global) batch_num_tokens is required")
      batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
  if loss_agg_mode == "token-sum":
    return masked_sum(loss_mat, loss_mask) * dp_size
  if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
    seq_losses = (loss_mat * loss_mask).sum(-1)
    seq_mask = (loss_mask.sum(-1) > 0).astype(np.float64)
    if global_batch_size is None:
      if dp_size > 1:
        raise ValueError("global_batch_size is required")
      global_batch_size = seq_mask.sum()
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
      if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
      loss /= loss_scale_factor
    return loss
  assert loss_agg_mode == "seq-mean-token-mean"
  seq_count = loss_mask.sum(-1)
  seq_losses = (loss_mat * loss_mask).sum(-1) / (seq_count + 1e-8)
  seq_mask = (seq_count > 0).astype(np.float64)
  if global_batch_size is None:
    if dp_size > 1:
      raise ValueError("global_batch_size is required")
    global_batch_size = seq_mask.sum()
  return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


# ----------------------------------------------------------------------------
# Hand-built batches.

G = 4
T = 6
# Groups of four: a unique best, a tied best, constant, continuous with its
# two largest rewards masked, and one with a single valid sample.
PASSK_R = np.array([0.2, 1.0, 0.5, 0.7,
                    1.0, 0.0, 1.0, 0.5,
                    0.3, 0.3, 0.3, 0.3,
                    -1.0, 2.5, 9.0, 0.5,
                    7.0, 1.0, 2.0, 3.0], np.float32)
PASSK_MASK = np.ones(20, bool)
PASSK_MASK[[14, 15]] = False  # Group 3 keeps -1.0 and 2.5 (9.0 is masked).
PASSK_MASK[[16, 18, 19]] = False  # group 4: one valid sample.

# Rows of different lengths, two with a hole (a multi-turn observation
# span); 12 rows = 3 groups of 4.
LENGTHS = np.array([3, 6, 2, 4, 1, 6, 5, 2, 2, 6, 3, 4])
R = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0.5], np.float32)


def _completion_mask():
  mask = np.arange(T)[None, :] < LENGTHS[:, None]
  mask[1, 2:4] = False  # A hole: tokens 2 and 3 are an observation.
  mask[9, 1] = False
  return mask


def _run(tx, r, group_size=G, **extra):
  r = jnp.asarray(r)
  fn = jax.jit(functools.partial(tx.update, group_size=group_size))
  out = fn(r, tx.init(r), **{k: jnp.asarray(v) for k, v in extra.items()})[0]
  return np.asarray(out, np.float64)


def _last_token(r, mask):
  out = np.zeros(mask.shape)
  for i, row in enumerate(mask):
    if row.any():
      out[i, np.nonzero(row)[0][-1]] = r[i]
  return out


# ----------------------------------------------------------------------------
# 1. grpo_passk.


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_is_verls(norm_by_std):
  got = _run(adv.grpo_passk(norm_by_std=norm_by_std), PASSK_R,
             mask_N=PASSK_MASK)
  keep = np.nonzero(PASSK_MASK[:16])[0]  # verl's batch: groups 0-3.
  expected = _verl_grpo_passk(PASSK_R[keep].astype(np.float64), keep // G,
                              norm_adv_by_std=norm_by_std)
  np.testing.assert_allclose(got[keep], expected, rtol=1e-6, atol=1e-7)
  assert np.all(got[~PASSK_MASK] == 0)
  # Only the unique best gets a value: group 0's row 1 (1.0 over 0.7), group
  # 3's row 13 (2.5 over -1.0); the tied and constant groups are 0.
  np.testing.assert_array_equal(np.nonzero(got)[0], [1, 13])
  std = np.std([0.2, 1.0, 0.5, 0.7], ddof=1) + 1e-6 if norm_by_std else 1.0
  np.testing.assert_allclose(got[1], 0.3 / std, rtol=1e-6)
  # verl raises for a group of one; here it is 0.
  with pytest.raises(ValueError, match="at least 2"):
    _verl_grpo_passk(PASSK_R[[17]], [0])
  assert np.all(got[16:] == 0)


def test_grpo_passk_errors():
  # eps = 0: tied, constant and lone groups stay 0, not NaN.
  got = _run(adv.grpo_passk(eps=0.0), PASSK_R, mask_N=PASSK_MASK)
  assert np.all(np.isfinite(got)) and np.count_nonzero(got) == 2
  r = jnp.zeros(4)
  tx = adv.grpo_passk()
  with pytest.raises(ValueError, match="group_size=1 must be at least 2"):
    tx.update(r, tx.init(r), group_size=1)
  with pytest.raises(ValueError, match="eps=-1"):
    adv.grpo_passk(eps=-1.0)


# ----------------------------------------------------------------------------
# 2. The discount of REINFORCE++ and ReMax, and per-token rewards.


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_whiten_by_tokens_gamma_is_verls_reinforce_plus_plus(gamma):
  mask = _completion_mask()
  valid = np.ones(12, bool)
  valid[[4, 7]] = False
  keep = np.nonzero(valid)[0]
  m = mask[keep].astype(np.float64)
  expected = _verl_reinforce_plus_plus(_last_token(R[keep], mask[keep]), m,
                                       gamma)
  got = _run(adv.whiten_by_tokens(gamma=gamma), R, mask_N=valid,
             lengths_N=mask.sum(1), completion_mask_NxT=mask)
  if gamma == 1.0:  # Today's [N] output: each token's value.
    assert got.shape == (12,)
    got = got[:, None] * mask
  assert got.shape == (12, T)
  np.testing.assert_allclose(got[keep], expected, rtol=1e-5, atol=1e-6)
  assert np.all(got[~valid] == 0) and np.all(got[~mask] == 0)
  if gamma < 1:  # Discounting gives distinct values within a row.
    assert np.ptp(got[5][mask[5]]) > 0.05


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_token_rewards_are_verls_token_level_rewards(gamma):
  rng = np.random.default_rng(0)
  mask = _completion_mask()
  token_r = np.where(mask, rng.normal(size=(12, T)), 0.0)
  token_r[~mask] = 5.0  # Outside the response: not read (as verl).
  token_r = token_r.astype(np.float32)
  m = mask.astype(np.float64)
  tr64 = token_r.astype(np.float64)
  # REINFORCE++: the row rewards are not read.
  got = _run(adv.whiten_by_tokens(gamma=gamma), rng.normal(size=12)
             .astype(np.float32), completion_mask_NxT=mask,
             token_rewards_NxT=token_r, lengths_N=mask.sum(1))
  np.testing.assert_allclose(
      got, _verl_reinforce_plus_plus(tr64, m, gamma), rtol=1e-5, atol=1e-5)
  # ReMax, groups of 3 (two samples, then the greedy one); the baseline is
  # the greedy row's token-reward sum (verl: rm_scores.sum(-1)).
  got = _run(adv.center_by_greedy_baseline(gamma=gamma), R, 3,
             completion_mask_NxT=mask, token_rewards_NxT=token_r)
  baselines = np.repeat((tr64 * m)[2::3].sum(-1), 3)
  if gamma == 1.0:
    expected = _verl_remax(tr64, baselines, m) * m
  else:
    expected = _verl_rpp_returns(tr64 * m, m, gamma) - baselines[:, None] * m
  sampled = np.arange(12) % 3 != 2
  np.testing.assert_allclose(got[sampled], expected[sampled], rtol=1e-5,
                             atol=1e-5)
  assert np.all(got[~sampled] == 0)
  # reinforce_pp_token does not read them (verl's baseline estimator reads
  # only the row sums, which the caller passes as rewards).
  tx = adv.reinforce_pp_token()
  np.testing.assert_array_equal(
      _run(tx, R, lengths_N=mask.sum(1), completion_mask_NxT=mask,
           token_rewards_NxT=token_r),
      _run(tx, R, lengths_N=mask.sum(1), completion_mask_NxT=mask))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_remax_gamma_is_verls_formula_with_discounted_returns(gamma):
  # Groups of 3: two samples, then the greedy one. Group 2's greedy row has
  # no reward (no baseline: 0); row 3 is padding.
  r = np.array([1, 0, 0.5, 7, 1, 1, 1, 1, 0, -1, 1, 0.5], np.float32)
  mask = _completion_mask()
  valid = np.ones(12, bool)
  valid[[3, 8]] = False
  got = _run(adv.center_by_greedy_baseline(gamma=gamma), r, 3, mask_N=valid,
             completion_mask_NxT=mask)
  m = mask.astype(np.float64)
  b = np.repeat(r[2::3].astype(np.float64), 3)
  token_r = _last_token(r.astype(np.float64), mask)
  if gamma == 1.0:
    assert got.shape == (12,)
    got = got[:, None] * mask
    expected = _verl_remax(token_r, b, m) * m
  else:
    # verl's ReMax formula, the returns discounted as its REINFORCE++ does.
    expected = _verl_rpp_returns(token_r, m, gamma) - b[:, None] * m
  rows = np.array([0, 1, 4, 9, 10])  # Sampled rows of groups with a baseline.
  np.testing.assert_allclose(got[rows], expected[rows], rtol=1e-6, atol=1e-6)
  others = np.setdiff1d(np.arange(12), rows)
  assert np.all(got[others] == 0)
  if gamma < 1:  # Row 10: reward 1 on token 2, greedy reward 0.5.
    assert got.shape == (12, T)
    assert got[10, 0] == pytest.approx(0.9 ** 2 * 1 - 0.5, rel=1e-6)
    # Row 4's reward equals its greedy one: 0 on its (only) token.
    assert got[4, 0] == 0


def test_reinforce_pp_token_gamma():
  """gamma = 1: verl's baseline estimator ([N]); gamma < 1: the centred
  reward on the last token, discounted by verl's REINFORCE++ returns."""
  mask = _completion_mask()
  m = mask.astype(np.float64)
  index = np.arange(12) // G
  kw = dict(lengths_N=mask.sum(1), completion_mask_NxT=mask)
  got = _run(adv.reinforce_pp_token(), R, **kw)
  assert got.shape == (12,)
  expected = _verl_rpp_baseline(_last_token(R.astype(np.float64), mask), m,
                                index)
  np.testing.assert_allclose(got[:, None] * m, expected, rtol=1e-5, atol=1e-6)
  got = _run(adv.reinforce_pp_token(gamma=0.7), R, **kw)
  r = R.astype(np.float64).reshape(-1, G)
  centred = (r - r.mean(1, keepdims=True)).reshape(-1)
  expected = _masked_whiten(
      _verl_rpp_returns(_last_token(centred, mask), m, 0.7), m) * m
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_gamma_one_keeps_todays_results():
  mask = _completion_mask()
  kw = dict(lengths_N=mask.sum(1), completion_mask_NxT=mask)
  for make in (adv.whiten_by_tokens, adv.reinforce_pp_token):
    np.testing.assert_array_equal(_run(make(), R, **kw),
                                  _run(make(gamma=1.0), R, **kw))
  r = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0], np.float32)
  np.testing.assert_array_equal(
      _run(adv.center_by_greedy_baseline(gamma=1), r, 3),
      [0.5, -0.5, 0, 0, 0, 0])


def test_gae_takes_per_token_rewards():
  rng = np.random.default_rng(1)
  mask = _completion_mask()
  m = mask.astype(np.float64)
  values = rng.normal(size=(12, T)).astype(np.float32)
  token_r = np.where(mask, rng.normal(size=(12, T)), 0.0).astype(np.float32)
  gamma, lam = 0.9, 0.8
  got_adv, got_ret = adv.gae_advantages(jnp.asarray(token_r),
                                        jnp.asarray(values), jnp.asarray(mask),
                                        gamma, lam)
  want_adv, want_ret = _verl_gae(token_r.astype(np.float64),
                                 values.astype(np.float64), m, gamma, lam)
  np.testing.assert_allclose(got_adv, want_adv * m, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_ret, want_ret * m, rtol=1e-5, atol=1e-5)
  # A row reward is the same as that reward on the last token.
  row = adv.gae_advantages(jnp.asarray(R), jnp.asarray(values),
                           jnp.asarray(mask), gamma, lam)[0]
  token = adv.gae_advantages(adv.terminal_rewards(jnp.asarray(R),
                                                  jnp.asarray(mask)),
                             jnp.asarray(values), jnp.asarray(mask), gamma,
                             lam)[0]
  np.testing.assert_array_equal(row, token)
  with pytest.raises(ValueError, match="per-token rewards"):
    adv.gae_advantages(jnp.zeros((12, 3)), jnp.asarray(values),
                       jnp.asarray(mask))


def test_gamma_and_token_reward_errors():
  r = jnp.zeros(8)
  for bad in (1.5, -0.1):
    with pytest.raises(ValueError, match=f"gamma={bad}"):
      adv.whiten_by_tokens(gamma=bad)
    with pytest.raises(ValueError, match=f"gamma={bad}"):
      adv.center_by_greedy_baseline(gamma=bad)
  with pytest.raises(TypeError, match="gamma=True"):
    adv.reinforce_pp_token(gamma=True)
  tx = adv.whiten_by_tokens(gamma=0.9)
  with pytest.raises(ValueError, match="completion_mask_NxT"):
    tx.update(r, tx.init(r), lengths_N=jnp.ones(8))
  tx = adv.center_by_greedy_baseline()
  with pytest.raises(ValueError, match="token_rewards_NxT must have"):
    tx.update(r, tx.init(r), group_size=4,
              completion_mask_NxT=jnp.ones((8, 3), bool),
              token_rewards_NxT=jnp.ones((8, 2)))


# ----------------------------------------------------------------------------
# 3. reinforce_pp_token's singleton groups.


def test_reinforce_pp_token_singleton():
  # Group 1 keeps one valid sample (rows 5-7 are padding): verl's batch has
  # a group of one there, whose baseline is 0 (id2mean = 0).
  mask = _completion_mask()
  valid = np.ones(12, bool)
  valid[[5, 6, 7]] = False
  keep = np.nonzero(valid)[0]
  kw = dict(mask_N=valid, lengths_N=mask.sum(1), completion_mask_NxT=mask)
  m = mask[keep].astype(np.float64)
  expected = _verl_rpp_baseline(_last_token(R[keep].astype(np.float64),
                                            mask[keep]), m, keep // G)
  raw = _run(adv.reinforce_pp_token(singleton="raw"), R, **kw)
  np.testing.assert_allclose(raw[keep, None] * m, expected, rtol=1e-5,
                             atol=1e-6)
  zero = _run(adv.reinforce_pp_token(), R, **kw)
  # "zero": the lone sample's centred value is 0 before the whitening.
  centred = R[keep].astype(np.float64) - np.array(
      [0.5] * 4 + [0.0] + [0.625] * 4)
  centred[4] = 0.0
  want = _masked_whiten(centred[:, None] * m, m) * m
  np.testing.assert_allclose(zero[keep, None] * m, want, rtol=1e-5, atol=1e-6)
  assert abs(raw[4] - zero[4]) > 0.1
  # G = 1 (every group a singleton) with "raw": verl's whitened rewards.
  one = _run(adv.reinforce_pp_token(singleton="raw"), R, 1,
             lengths_N=mask.sum(1), completion_mask_NxT=mask)
  m = mask.astype(np.float64)
  np.testing.assert_allclose(
      one[:, None] * m,
      _verl_rpp_baseline(_last_token(R.astype(np.float64), mask), m,
                         np.arange(12)), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="singleton='one'"):
    adv.reinforce_pp_token(singleton="one")


# ----------------------------------------------------------------------------
# 4. agg_loss of verl v0.9.0 and dp_size.

LOSS = np.array([[1., 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12],
                 [-2, 0.5, 3, 1]])
LOSS_MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0],
                      [1, 0, 0, 0]], bool)
MODES = {"token-mean": "token_mean", "token-sum": "token_sum",
         "seq-mean-token-sum": "sequence_mean_token_sum",
         "seq-mean-token-mean": "sequence_mean_token_mean",
         "seq-mean-token-sum-norm": "sequence_mean_token_sum_norm"}


def _ours(mode, **kw):
  return float(obj.aggregate_loss(jnp.asarray(LOSS, jnp.float32),
                                  jnp.asarray(LOSS_MASK), mode, **kw))


@pytest.mark.parametrize("verl_mode", list(MODES))
def test_agg_loss_is_verl_0_9(verl_mode):
  mode, m = MODES[verl_mode], LOSS_MASK.astype(np.float64)
  # One rank (dp_size = 1), every normaliser from the batch: the defaults
  # agree (seq-mean-token-sum-norm: non-empty rows x the padded width).
  np.testing.assert_allclose(_ours(mode), _verl_agg_loss(LOSS, m, verl_mode),
                             rtol=1e-6)
  # One rank of dp = 3 with the global normalisers.
  dp, tokens, rows, scale = 3, 20.0, 9.0, 16.0
  verl = _verl_agg_loss(LOSS, m, verl_mode, dp_size=dp,
                        batch_num_tokens=tokens, global_batch_size=rows,
                        loss_scale_factor=scale)
  ours = _ours(mode, dp_size=dp, num_tokens=tokens, num_sequences=rows,
               max_length=scale)
  np.testing.assert_allclose(ours, verl, rtol=1e-6)
  # The mean over the ranks of the per-rank losses is rljax's global loss:
  # three identical ranks give the loss of the batch tiled three times.
  tiled = float(obj.aggregate_loss(
      jnp.asarray(np.tile(LOSS, (dp, 1)), jnp.float32),
      jnp.asarray(np.tile(LOSS_MASK, (dp, 1))), mode, max_length=scale))
  np.testing.assert_allclose(
      _ours(mode, dp_size=dp, num_tokens=dp * LOSS_MASK.sum(),
            num_sequences=dp * 3.0, max_length=scale), tiled, rtol=1e-6)
  # As verl: a per-rank count is rejected with dp_size > 1.
  if mode != "token_sum":
    with pytest.raises(ValueError, match="dp_size=3"):
      _ours(mode, dp_size=dp)
    with pytest.raises(ValueError, match="required"):
      _verl_agg_loss(LOSS, m, verl_mode, dp_size=dp)


def test_dp_size_default_is_bitwise_and_forwarded():
  loss, mask = jnp.asarray(LOSS, jnp.float32), jnp.asarray(LOSS_MASK)
  for mode in MODES.values():
    assert (obj.aggregate_loss(loss, mask, mode)
            == obj.aggregate_loss(loss, mask, mode, dp_size=1))
  assert obj.aggregate_loss(loss, mask, "token_sum") == jnp.sum(
      jnp.where(mask, loss, 0.0))
  # policy_gradient_loss forwards dp_size: token_sum of one rank.
  lp = jnp.asarray(LOSS * 0.1, jnp.float32)
  a = jnp.asarray([1.0, -2.0, 0.5, 3.0])
  one = obj.policy_gradient_loss(jnp.ones_like(lp), a, lp, mask, "token_sum")
  four = obj.policy_gradient_loss(jnp.ones_like(lp), a, lp, mask, "token_sum",
                                  dp_size=4)
  np.testing.assert_allclose(four, 4 * one, rtol=1e-6)
  assert float(one) != 0


# ----------------------------------------------------------------------------
# Shared property harness.


def _inputs(seed):
  rng = np.random.default_rng(seed)
  r = jnp.asarray(rng.integers(0, 2, 12) + rng.normal(size=12) * 0.1,
                  jnp.float32)
  m = rng.random(12) < 0.8
  m[0] = True
  cmask = rng.random((12, 4)) < 0.8
  cmask[:, 0] = True
  return r, {"mask_N": jnp.asarray(m),
             "completion_mask_NxT": jnp.asarray(cmask),
             "lengths_N": jnp.asarray(cmask.sum(1), jnp.int32),
             "tokens_NxT": jnp.asarray(rng.integers(0, 5, (12, 4)), jnp.int32)}


def _token_inputs(seed):
  r, extra = _inputs(seed)
  rng = np.random.default_rng(seed + 10)
  extra["token_rewards_NxT"] = jnp.asarray(rng.normal(size=(12, 4)),
                                           jnp.float32)
  return r, extra


def _case(name, factory, static_args=(), make_inputs=_inputs, **kwargs):
  return harness.Case(name, factory, kwargs, make_inputs,
                      static_extra={"group_size": 4}, static_args=static_args)


HARNESS_CASES = [
    _case("grpo_passk", adv.grpo_passk, static_args=("norm_by_std",),
          eps=1e-6, norm_by_std=True),
    _case("grpo_passk_no_std", adv.grpo_passk, static_args=("norm_by_std",),
          eps=1e-6, norm_by_std=False),
    _case("whiten_by_tokens_gamma", adv.whiten_by_tokens, eps=1e-8,
          gamma=0.9),
    _case("whiten_by_tokens_token_rewards", adv.whiten_by_tokens,
          make_inputs=_token_inputs, eps=1e-8, gamma=0.95),
    _case("reinforce_pp_token_gamma", adv.reinforce_pp_token, eps=1e-8,
          singleton="raw", gamma=0.9),
    _case("reinforce_pp_token_gamma_one", adv.reinforce_pp_token,
          static_args=("gamma",), eps=1e-8, singleton="raw", gamma=1.0),
    _case("remax_gamma", adv.center_by_greedy_baseline, gamma=0.9),
    _case("remax_token_rewards", adv.center_by_greedy_baseline,
          static_args=("gamma",), make_inputs=_token_inputs, gamma=1.0),
]


@pytest.mark.parametrize("check", harness.ALL_CHECKS,
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", HARNESS_CASES, ids=str)
@pytest.mark.slow
def test_harness(case, check):
  check(case)
