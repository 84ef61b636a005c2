"""``rljax.rollout.rounds.merge``: the groups a selection plan keeps from
several sampled rounds, as one batch, checked against a NumPy construction
row by row."""

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import rewards, sampling
from rljax.data import selection
from rljax.rewards import evaluation
from rljax.rollout import rounds

G, T, PAD = 2, 5, 7
FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens",
          "completion_mask", "lengths", "finished", "sampler_logprobs")


def _round(seed, groups, width, xp):
  """A scored round of ``groups`` groups, prompts ``width`` wide, its
  rollout arrays on the device (``xp=jnp``) or on the host (``np``, as a
  replayed round's)."""
  rng = np.random.RandomState(seed)
  n = groups * G
  host = {"prompt_tokens": rng.randint(0, 30, (n, width)).astype(np.int32),
          "prompt_mask": rng.rand(n, width) > 0.3,
          "completion_tokens": rng.randint(0, 30, (n, T)).astype(np.int32),
          "completion_mask": rng.rand(n, T) > 0.5,
          "lengths": rng.randint(0, T + 1, n).astype(np.int32),
          "finished": rng.rand(n) > 0.5,
          "sampler_logprobs": rng.randn(n, T).astype(np.float32)}
  rollout = sampling.Rollout(**{k: xp.asarray(v) for k, v in host.items()},
                             policy_logprobs=None)
  rewards_nx1 = rng.rand(n, 1).astype(np.float32)
  counts = {f"reward/r/{kind}": 0 for kind in evaluation._COUNTS}  # pylint: disable=protected-access
  result = rewards.merge_results(
      ("r",), rewards_nx1, np.ones((n, 1), bool), rewards_nx1[:, 0],
      [{**counts, "reward/worker_restarts": 0, "reward/eval_seconds": 0.0}])
  lengths = host["lengths"]
  sampled = rounds.Sampled(
      rollout, {"prompt": [f"p{seed}-{i}" for i in range(groups)]},
      [f"c{seed}-{i}" for i in range(n)], result, result.rewards_NxR,
      np.ones(n, bool), lengths, host["finished"], np.full(n, width),
      lengths, None, {}, 1.0, 0.5)
  return sampled, host


def _expected(hosts, plan, width):
  """The merged rows by hand: each kept group's rows, round by round,
  prompts left-padded (PAD tokens, False mask) to ``width``."""
  out = {name: [] for name in FIELDS}
  for host, groups in zip(hosts, plan.rounds):
    for group in groups:
      for row in range(group * G, group * G + G):
        for name in FIELDS:
          value = host[name][row]
          if name.startswith("prompt_"):
            fill = PAD if name == "prompt_tokens" else False
            value = np.concatenate(
                [np.full(width - len(value), fill, value.dtype), value])
          out[name].append(value)
  return {name: np.stack(v) for name, v in out.items()}


def _merge(samples, plan):
  return rounds.merge(samples, plan, group_rows=G, pad_id=PAD,
                      failed_rewards="exclude")


def test_merge_takes_the_planned_groups_of_device_and_host_rounds():
  fresh, fresh_host = _round(0, 3, 4, jnp)
  replayed, replayed_host = _round(1, 2, 6, np)
  # Informative: groups 1 and 2 of round 0, group 1 of round 1; round 0's
  # group 0 fills the fourth slot.
  plan = selection.plan_batch([np.array([1, 0, 0], np.int8),
                               np.array([2, 0], np.int8)], 4)
  assert [r.tolist() for r in plan.rounds] == [[1, 2, 0], [1]]
  merged = _merge([fresh, replayed], plan)
  want = _expected([fresh_host, replayed_host], plan, 6)
  for name in FIELDS:
    got = np.asarray(getattr(merged.rollout, name))
    assert got.dtype == want[name].dtype, name
    np.testing.assert_array_equal(got, want[name], err_msg=name)
  assert merged.rollout.policy_logprobs is None
  assert merged.rollout.observation_mask is None
  rows = [2, 3, 4, 5, 0, 1, 8, 9]  # the same groups' rows, both rounds
  both = np.concatenate([fresh.result.rewards_NxR, replayed.result.rewards_NxR])
  np.testing.assert_array_equal(merged.rewards_NxR, both[rows])
  assert merged.completions == [f"c0-{i}" for i in (2, 3, 4, 5, 0, 1)] + [
      "c1-2", "c1-3"]
  assert merged.examples["prompt"] == ["p0-1", "p0-2", "p0-0", "p1-1"]


def test_a_new_plan_over_rounds_of_the_same_sizes_compiles_nothing():
  """One program gathers every field; its shapes follow the rounds' sizes,
  not how many groups the plan keeps from each round (a gather per field
  and round compiled one program per field for each new count)."""
  a, a_host = _round(2, 3, 4, jnp)
  b, b_host = _round(3, 3, 4, jnp)
  first = selection.plan_batch([np.array([0, 1, 1], np.int8),
                                np.array([0, 0, 1], np.int8)], 3)
  second = selection.plan_batch([np.array([0, 0, 0], np.int8),
                                 np.array([1, 1, 1], np.int8)], 3)
  assert [r.tolist() for r in first.rounds] == [[0], [0, 1]]
  assert [r.tolist() for r in second.rounds] == [[0, 1, 2], []]
  _merge([a, b], first)
  compiled = rounds._take_rows._cache_size()  # pylint: disable=protected-access
  merged = _merge([a, b], second)
  assert rounds._take_rows._cache_size() == compiled  # pylint: disable=protected-access
  want = _expected([a_host, b_host], second, 4)
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(merged.rollout, name)),
                                  want[name], err_msg=name)


def test_merge_keeps_each_tokens_version_and_replay_stores_them():
  """Rounds decoded on slots carry each token's policy version: the merged
  batch takes the kept rows' versions (a NumPy construction), a group
  stored for replay keeps them through ``host_groups`` / ``from_groups``,
  and rounds that disagree on having them are refused; counts of work add
  up over the rounds, means are weighted."""
  a, _ = _round(1, 3, 4, jnp)
  b, _ = _round(2, 2, 6, jnp)
  rng = np.random.RandomState(0)
  va = rng.randint(-1, 5, (6, T)).astype(np.int32)
  vb = rng.randint(-1, 5, (4, T)).astype(np.int32)
  a = a._replace(token_versions=va, spec_metrics={
      "rollout/decode_steps": 3.0, "rollout/slot_utilization": 0.5})
  b = b._replace(token_versions=vb, spec_metrics={
      "rollout/decode_steps": 4.0, "rollout/slot_utilization": 0.75})
  plan = selection.Plan((np.array([2, 0]), np.array([1])),
                        np.ones(3, bool))
  merged = rounds.merge([a, b], plan, group_rows=G, pad_id=PAD,
                        failed_rewards="zero")
  want = np.concatenate([va[4:6], va[0:2], vb[2:4]])
  np.testing.assert_array_equal(merged.token_versions, want)
  # Utilization over both rounds' decode steps: (0.5 * 3 + 0.75 * 4) / 7.
  assert merged.spec_metrics == {"rollout/decode_steps": 7.0,
                                 "rollout/slot_utilization": 4.5 / 7}
  stored = rounds.host_groups(merged, [2], G)
  np.testing.assert_array_equal(stored[0]["token_versions"], vb[2:4])
  back = rounds.from_groups(stored, merged, pad_id=PAD,
                            failed_rewards="zero")
  np.testing.assert_array_equal(back.token_versions, vb[2:4])
  with pytest.raises(ValueError, match="token_versions"):
    rounds.merge([a, b._replace(token_versions=None)], plan, group_rows=G,
                 pad_id=PAD, failed_rewards="zero")


def test_merged_sampling_metrics_add_counts_and_weight_means_by_hand():
  """Two rounds of 4 and 12 rows: counts add up, the turns' mean is
  weighted by rows, slot utilization by decode steps, the longest episode
  is the longest of both, and a state (restarts so far) is the last's."""
  first = {"env/failed_episodes": 1.0, "env/turns/mean": 2.0,
           "env/turns/max": 5.0, "rollout/decode_steps": 10.0,
           "rollout/slot_utilization": 0.5, "env/worker_restarts": 1.0,
           "spec/accept_rate": 0.25}
  second = {"env/failed_episodes": 2.0, "env/turns/mean": 4.0,
            "env/turns/max": 3.0, "rollout/decode_steps": 30.0,
            "rollout/slot_utilization": 0.9, "env/worker_restarts": 2.0}
  got = rounds.merge_metrics([first, second], [4, 12])
  assert got["env/failed_episodes"] == 3.0
  assert got["env/turns/mean"] == pytest.approx((2 * 4 + 4 * 12) / 16)
  assert got["env/turns/max"] == 5.0
  assert got["rollout/decode_steps"] == 40.0
  assert got["rollout/slot_utilization"] == pytest.approx(
      (0.5 * 10 + 0.9 * 30) / 40)
  assert got["env/worker_restarts"] == 2.0
  assert got["spec/accept_rate"] == 0.25  # only the first round has it
  assert rounds.merge_metrics([first], [4]) == first
