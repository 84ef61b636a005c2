"""Multi-turn episodes on a paged KV cache (rljax/rollout/turn_pages.py).

The reference is the same episodes on the dense cache: every plan (the
static batch, a shrinking one, slots, SPEC-RL drafts, carried partial
episodes) must give the dense cache's tokens exactly and its logprobs to
float rounding, and hand every block back. The pool's figures are checked
against hand counts (a prompt's blocks held once per example) and against
a pool sized at the measured peak and one block below it.
"""

import jax
import numpy as np
import pytest

from rljax import envs, models, sampling
from rljax.models import paged_cache as pc
from rljax.rollout import episode_carry
from rljax.rollout import multi_turn as mt
from rljax.rollout import turns as turns_lib
from rljax.sampling import sampler as sampler_lib
from tests import env_fixtures
from tests.test_envs import EXAMPLES, MC, O, SC, TOK, assert_same_episodes

TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=O,
                      max_turn_tokens=6)
BLOCK = 4

@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _run(params, *, paged=None, config=SC, env=None, runs=1, key=3,
         moved=False, **kwargs):
  """``runs`` runs of one sampler (a store of drafts, a carry: each run
  after the first sees what the one before left), each run's episodes;
  ``moved``: the runs after the first with params moved (drafts partly
  rejected)."""
  runner = envs.EnvRunner(env or env_fixtures.Graded(), num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, config, TURNS, runner, TOK, (8, 16),
                                  paged=paged, **kwargs)
    out = []
    for i in range(runs):
      if moved and i:
        params = jax.tree.map(lambda x: x * 1.3, params)
      out.append(jax.device_get(sampler.run(
          params, EXAMPLES, jax.random.key(key + i), version=i,
          more=(lambda: EXAMPLES) if "carry" in kwargs else None)))
    return out
  finally:
    runner.close()


PLANS = {
    "static": dict(),
    "shrinking": dict(config=SC.replace(shrink_batch_to=2)),
    "slots": dict(slots=2, refill_rows=1),
    "spec": dict(drafts="store", runs=2, moved=True),
    "partial": dict(slots=2, carry="carry", runs=2),
}


def _plan(name):
  kw = dict(PLANS[name])
  if kw.get("drafts") == "store":
    kw["drafts"] = sampling.DraftStore(max_prompts=8)
  if kw.get("carry") == "carry":
    kw["carry"] = episode_carry.EpisodeCarry(2, max_age=2, max_carried=2)
  return kw


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_paged_episodes_are_the_dense_episodes_and_free_every_block(
    params, plan):
  dense = _run(params, **_plan(plan))
  paged = _run(params, paged=sampling.PagedConfig(block_size=BLOCK),
               **_plan(plan))
  if plan == "partial":  # the second step restores carried histories
    assert paged[0].metrics["rollout/carried_groups"] > 0
  if plan == "spec":  # drafts kept in part: their rejected tails released
    assert 0 < paged[1].metrics["spec/accept_rate"] < 1
  for got, want in zip(paged, dense):
    assert_same_episodes(got, want)
    m = got.metrics
    assert m["rollout/kv_cut_rows"] == 0
    assert m["rollout/kv_blocks_left"] == 0
    assert 0 < m["rollout/kv_blocks_peak"] <= m["rollout/kv_blocks_pool"]
    for k, v in want.metrics.items():
      if not k.startswith("time/"):
        assert m[k] == v, k


def test_a_groups_prompt_is_held_once_and_its_last_block_copied_on_write(
    params):
  """``start`` with 2 examples of 3 rows each, 6-token prompts in blocks of
  4: each example's 2 prompt blocks once (4 blocks), every row pointing to
  its example's; after a turn's decode each row has its own copy of the
  block its prompt ends in, and its own blocks after it: 2 shared blocks
  and ``ceil(length / 4) - 1`` per row."""
  tokens = np.full((2, 6), 5, np.int32)
  tokens[1] = 7
  mask = np.ones((2, 6), bool)
  source = np.repeat(np.arange(2), 3).astype(np.int32)
  keys = np.asarray(jax.random.key_data(sampler_lib.row_keys(
      jax.random.key(0), 6)))
  state = turns_lib.start(params, tokens, mask, source, keys,
                          np.arange(6, dtype=np.int32), mc=MC, sc=SC,
                          obs_width=O, paged=sampling.PagedConfig(BLOCK))
  table = np.asarray(state.cache.table)
  assert int(pc.blocks_in_use(state.cache)) == 4
  for row in range(6):
    np.testing.assert_array_equal(table[row, :2], table[3 * (row // 3), :2])
  assert len({tuple(table[r, :2]) for r in range(6)}) == 2
  np.testing.assert_array_equal(state.cache.lengths, 6)
  stepped = turns_lib.decode_turn(
      params, state, np.zeros(6, bool), np.int32(6), np.int32(5), mc=MC,
      sc=SC, turns=TURNS, prompt_width=6)
  table = np.asarray(stepped.cache.table)
  lengths = np.asarray(stepped.cache.lengths)
  assert (lengths > 6).all()
  assert int(pc.blocks_in_use(stepped.cache)) == 2 + sum(
      -(-lengths // BLOCK) - 1)
  assert len({int(table[r, 1]) for r in range(6)}) == 6  # copied on write
  assert len({int(table[r, 0]) for r in range(6)}) == 2  # still shared


def test_a_pool_at_the_peak_cuts_nothing_and_one_block_less_cuts(params):
  """A pool of exactly the blocks an unlimited run peaked at gives the same
  episodes; one block fewer cuts an episode, which ends (truncated, not
  finished) while the others play on, and every block comes back."""
  unlimited, = _run(params, paged=sampling.PagedConfig(block_size=BLOCK))
  peak = int(unlimited.metrics["rollout/kv_blocks_peak"])
  at_peak, = _run(params, paged=sampling.PagedConfig(BLOCK, peak))
  assert_same_episodes(at_peak, unlimited)
  assert at_peak.metrics["rollout/kv_cut_rows"] == 0
  assert at_peak.metrics["rollout/kv_blocks_pool"] == peak
  below, = _run(params, paged=sampling.PagedConfig(BLOCK, peak - 1))
  cut = below.metrics["rollout/kv_cut_rows"]
  assert cut >= 1
  assert below.metrics["rollout/kv_blocks_left"] == 0
  assert below.metrics["rollout/kv_blocks_peak"] <= peak - 1
  shorter = below.rollout.lengths < unlimited.rollout.lengths
  assert 1 <= shorter.sum() <= cut
  assert not below.rollout.finished[shorter].any()


def test_a_pool_too_small_for_one_prompt_cuts_every_episode(params):
  """1 block of 4 slots for 8-slot prompts: every episode is cut before
  its first token, counted, and the run returns."""
  got, = _run(params, paged=sampling.PagedConfig(BLOCK, 1))
  n = SC.num_samples * len(EXAMPLES["prompt"])
  assert got.metrics["rollout/kv_cut_rows"] == n
  assert got.metrics["rollout/kv_blocks_left"] == 0
  assert not got.rollout.completion_mask.any()
  assert not got.rollout.finished.any()
