"""Microbatches split by tokens (``rl.microbatch_tokens``, verl's dynamic
batch size): the host's balanced regrouping against hand-derived splits, and
the packed step on the regrouped microbatches against the padded step."""

import numpy as np
import pytest

from rljax import train
from rljax.train import build
from rljax.train import packing as train_packing
from tests.test_packing import (N, PROMPTS, COMPLETIONS, T, _assert_same,
                                _batch, _step, params)  # noqa: F401
from tests.test_train import tiny_config

# Real tokens per row of tests/test_packing.py's batch: prompt + completion.
LENGTHS = np.add(PROMPTS, COMPLETIONS)  # 10 2 1 6 4 5 10 8 (46)


def test_balanced_split_by_hand():
  # Longest first, each to the lightest group with room (ties: the lower):
  # 0(8)->g0, 6(8)->g1, 7(5)->g0 (13), 4(3)->g1 (11), 3(2)->g1 (13),
  # 1(1)->g0 (14), 5(1)->g1 (14, full), 2(0)->g0.
  groups = train_packing.balanced_split(np.array([8, 1, 0, 2, 3, 1, 8, 5]), 2)
  np.testing.assert_array_equal(groups, [[0, 1, 2, 7], [3, 4, 5, 6]])
  # Consecutive rows would give 11 and 14 + 3 = 17 tokens: no balance.
  np.testing.assert_array_equal(
      train_packing.balanced_split(np.arange(4), 1), [[0, 1, 2, 3]])
  with pytest.raises(ValueError, match="8 rows do not split into 3 groups"):
    train_packing.balanced_split(np.ones(8), 3)


def test_microbatch_counts_are_divisors_fitting_the_mesh():
  assert train_packing.microbatch_counts(8, 1) == [1, 2, 4, 8]
  assert train_packing.microbatch_counts(8, 2, row_multiple=2) == [2, 4]
  assert train_packing.microbatch_counts(12, 1, row_multiple=4) == [1, 3]


@pytest.mark.parametrize("budget,count,groups", [
    (46, 1, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    # ceil(46 / 30) = 2: 0,6 -> g0,g1; 7 -> g0 (18); 3 -> g1 (16);
    # 5 -> g1 (21); 4 -> g0 (22); 1 -> g1 (23, full); 2 -> g0 (23).
    (30, 2, [[0, 2, 4, 7], [1, 3, 5, 6]]),
    # ceil(46 / 20) = 3 does not divide 8: 4 groups of 2, at most 12 tokens.
    (20, 4, [[0, 1], [2, 6], [4, 7], [3, 5]]),
    # A row of 10 never fits 5 tokens: the most microbatches there are.
    (5, 8, [[0], [1], [2], [3], [4], [5], [6], [7]]),
])
def test_split_by_tokens_by_hand(budget, count, groups):
  order = np.arange(N, dtype=np.int32).reshape(1, 1, N)
  split = train_packing.split_by_tokens(order, LENGTHS, budget)
  assert split.shape == (1, count, N // count)
  assert sorted(map(sorted, split[0].tolist())) == sorted(groups)
  if budget >= 10:
    assert LENGTHS[split[0]].sum(-1).max() <= budget


def test_one_count_serves_every_update_and_minimum_holds():
  # Two minibatches: rows 0-3 (19 tokens) and 4-7 (27). Budget 16: both
  # need 2 microbatches (11 + 8 and 14 + 13 tokens).
  order = np.arange(N, dtype=np.int32).reshape(2, 1, 4)
  split = train_packing.split_by_tokens(order, LENGTHS, 16)
  assert split.shape == (2, 2, 2)
  assert set(split[0].ravel()) == {0, 1, 2, 3}
  assert set(split[1].ravel()) == {4, 5, 6, 7}
  assert LENGTHS[split].sum(-1).max() <= 16
  # rl.num_microbatches is the minimum: a budget of everything still gives 2.
  split = train_packing.split_by_tokens(order.reshape(2, 2, 2), LENGTHS, 1000)
  assert split.shape == (2, 2, 2)
  # A budget one minibatch cannot meet: the largest count for all updates.
  split = train_packing.split_by_tokens(order, LENGTHS, 9)
  assert split.shape == (2, 4, 1)


def test_the_step_on_token_microbatches_equals_the_padded_step(params):  # noqa: F811
  """Two microbatches chosen by the budget against the padded step's one:
  the minibatch normalisers make the gradient the same."""
  batch = _batch(params)
  padded_cfg = train.RLStepConfig(completion_length=T, old_logprobs="sampler",
                                  ess_pooling="minibatch")
  cfg = train.RLStepConfig(completion_length=T, old_logprobs="sampler",
                           ess_pooling="minibatch", microbatch_tokens=30)
  padded = _step(params, padded_cfg, batch, False)[:2]
  new, metrics, step = _step(params, cfg, batch, True)
  assert step.last_microbatches == 2
  _assert_same(padded, (new, metrics))
  assert metrics["grad_norm"] > 1e-3


def test_config_refuses_a_budget_without_padding_free():
  c = tiny_config()
  c.rl.microbatch_tokens = 64
  c.rl.padding_free = False
  with pytest.raises(ValueError, match=r"rl.microbatch_tokens=64 needs "
                     r"rl.padding_free=True"):
    build.validate(c)
  c.rl.microbatch_tokens = -1
  c.rl.padding_free = True
  with pytest.raises(ValueError, match=r"rl.microbatch_tokens"):
    build.validate(c)
  with pytest.raises(ValueError, match=r"rl.microbatch_tokens=-2"):
    train.RLStepConfig(microbatch_tokens=-2)


def test_config_refuses_buckets_without_padding_free():
  c = tiny_config()
  c.rl.packing_buckets, c.rl.padding_free = 16, False
  with pytest.raises(ValueError, match=r"rl.packing_buckets=16 needs "
                     r"rl.padding_free=True"):
    build.validate(c)
  c.rl.packing_buckets = 8  # the default: accepted either way
  build.validate(c)
  c.rl.packing_buckets, c.rl.padding_free = 0, True
  with pytest.raises(ValueError, match=r"rl.packing_buckets=0"):
    build.validate(c)


@pytest.mark.slow
def test_two_epochs_of_two_minibatches_with_kl_and_the_critic(params):  # noqa: F811
  """The host's shuffle, then each minibatch regrouped by tokens: the same
  updates as the padded step's 2 epochs x 2 minibatches x 2 microbatches."""
  import jax  # pylint: disable=import-outside-toplevel
  from rljax.train import critic as critic_lib  # pylint: disable=import-outside-toplevel
  ref = jax.tree.map(lambda x: x * 1.1, params)
  cfg = train.RLStepConfig(
      num_epochs=2, num_minibatches=2, num_microbatches=2,
      aggregation="sequence_mean_token_sum", completion_length=T, kl_coef=0.3,
      entropy_coef=0.05, critic=critic_lib.CriticConfig(),
      ess_pooling="minibatch")
  batch = _batch(params, off_policy=False)
  padded = _step(params, cfg, batch, False, ref=ref, lr=0.01)[:2]
  token_cfg = train.RLStepConfig(**{
      **cfg.__dict__, "num_microbatches": 1, "microbatch_tokens": 16})
  new, metrics, step = _step(params, token_cfg, batch, True, ref=ref, lr=0.01)
  assert step.last_microbatches >= 2
  _assert_same(padded, (new, metrics))
