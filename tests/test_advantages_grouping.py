"""Groups of unequal size (rljax/advantages/grouping.py): rows tagged with
group ids give each group the advantages it gets on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import advantages as adv
from rljax.advantages.grouping import by_group_ids, group_slots

SIZES = (3, 1, 4, 2, 4)  # G_max = 4; the group of one gets 0
G_MAX = 4


def _batch(seed=0):
  """Rows of every group, shuffled, with their ids, rewards and lengths."""
  rng = np.random.RandomState(seed)
  ids = np.concatenate([np.full(s, k) for k, s in enumerate(SIZES)])
  rewards = rng.randint(0, 3, len(ids)).astype(np.float32)
  rewards[len(ids) - 4:] = 1.0  # the last group: zero variance
  lengths = rng.randint(1, 9, len(ids)).astype(np.int32)
  order = rng.permutation(len(ids))
  return ids[order], rewards[order], lengths[order]


def test_grpo_on_unequal_groups_equals_numpy_per_group():
  ids, rewards, _ = _batch()
  tx = by_group_ids(adv.grpo(eps=1e-6), len(SIZES), G_MAX)
  r = jnp.asarray(rewards)
  got = tx.update(r, tx.init(r), group_ids_N=jnp.asarray(ids))[0]
  want = np.zeros_like(rewards)
  for k in range(len(SIZES)):
    r = rewards[ids == k].astype(np.float64)
    if len(r) > 1 and r.std() > 0:
      want[ids == k] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


PER_GROUP = {
    "grpo": adv.grpo, "dr_grpo": adv.dr_grpo, "rloo": adv.rloo,
    "mc_grpo": adv.mc_grpo, "opo": adv.opo,
    "median": lambda: adv.center_by_group_median(),
    "grpo_raw_singletons": lambda: adv.grpo(singleton="raw"),
}


@pytest.mark.parametrize("name", sorted(PER_GROUP))
def test_every_per_group_preset_equals_each_group_on_its_own(name):
  ids, rewards, lengths = _batch(1)
  chain = PER_GROUP[name]()
  tx = by_group_ids(chain, len(SIZES), G_MAX)
  got = jax.jit(lambda r, i, n: tx.update(r, tx.init(r), group_ids_N=i,
                                          lengths_N=n)[0])(
                                              jnp.asarray(rewards),
                                              jnp.asarray(ids),
                                              jnp.asarray(lengths))
  want = np.zeros_like(rewards)
  for k, size in enumerate(SIZES):
    rows = ids == k
    r = jnp.asarray(rewards[rows])
    alone, _ = chain.update(r, chain.init(r), group_size=size,
                            lengths_N=jnp.asarray(lengths[rows]))
    want[rows] = np.asarray(alone)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_masked_rows_and_rows_beyond_the_layout_get_zero():
  ids, rewards, _ = _batch(2)
  mask = np.ones(len(ids), bool)
  mask[0] = False
  tx = by_group_ids(adv.grpo(), len(SIZES), G_MAX)
  r = jnp.asarray(rewards)
  state = tx.init(r)
  masked = tx.update(r, state, group_ids_N=jnp.asarray(ids),
                     mask_N=jnp.asarray(mask))[0]
  assert masked[0] == 0.0
  # The masked row is out of its group's statistics: its group equals the
  # group without it.
  k = ids[0]
  rest = (ids == k) & mask
  tx_alone = adv.grpo()
  r_rest = jnp.asarray(rewards[rest])
  alone = tx_alone.update(r_rest, tx_alone.init(r_rest),
                          group_size=int(rest.sum()))[0]
  np.testing.assert_allclose(np.asarray(masked)[rest], np.asarray(alone),
                             rtol=1e-6, atol=1e-6)
  # An id out of range, and a fifth row in a group of G_max = 4: zero.
  bad = ids.copy()
  bad[1] = len(SIZES)
  extra_row = np.append(ids, 2)  # group 2 already has 4 rows
  out = tx.update(r, state, group_ids_N=jnp.asarray(bad))[0]
  assert out[1] == 0.0
  out = tx.update(jnp.append(r, 5.0), state,
                  group_ids_N=jnp.asarray(extra_row))[0]
  assert out[-1] == 0.0


def test_group_slots_by_hand():
  slot, kept = group_slots(jnp.array([1, 0, 1, 1, 0, 2]), 2, 2)
  # Group 1: rows 0, 2 (row 3 is a third: dropped); group 0: rows 1, 4;
  # id 2 is out of range.
  np.testing.assert_array_equal(kept, [1, 1, 1, 0, 1, 0])
  np.testing.assert_array_equal(np.asarray(slot)[np.asarray(kept)],
                                [2, 0, 3, 1])


def test_bad_arguments_are_named():
  tx = by_group_ids(adv.grpo(), 2, 2)
  with pytest.raises(ValueError, match="group_ids_N .* is required"):
    tx.update(jnp.ones(4), tx.init(jnp.ones(4)))
  with pytest.raises(ValueError, match="group_ids_N has shape"):
    tx.update(jnp.ones(4), tx.init(jnp.ones(4)),
              group_ids_N=jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match="num_groups=0"):
    by_group_ids(adv.grpo(), 0, 2)
