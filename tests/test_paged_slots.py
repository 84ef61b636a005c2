"""Continuous and partial slots on a paged KV cache (``SlotConfig.paged``,
``rljax/sampling/slot_pages.py``), and SPEC-RL's drafts verified on blocks
from the config.

The reference is the dense slots' sampler (``tests/test_continuous.py``
checks it against the static sampler): the same queue gives the same
tokens, logprobs to float rounding, on every path a fill takes (prompts
shared by a fill's leader or a live slot, a prefill per row, carried rows,
SPEC-RL drafts). Block accounting is checked against counts derived by
hand: every block back when the last row ended, a pool one block short of
what the rows need cuts a row, one of exactly that size cuts none.
"""

import jax
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling import continuous as cb
from rljax.sampling import paged as paged_lib
from tests.test_continuous import B, G, MC, SC

BS = 4  # slots per block: prompts of 16 take 4 blocks, a row 4 + 6
PAGED = paged_lib.PagedConfig(BS)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def queue():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, MC.vocab_size, rng.randint(2, 12)))
           for _ in range(B)]
  tokens, mask = sampling.pad_prompts(lists, SC.prompt_buckets)
  return cb.fresh_queue(tokens, mask, jax.random.key(3), SC)


def _pair(slots, **kw):
  """The dense and the paged slots' samplers of one ``SlotConfig``."""
  return (cb.make_continuous_sampler(MC, SC, cb.SlotConfig(slots, 2, **kw)),
          cb.make_continuous_sampler(MC, SC, cb.SlotConfig(
              slots, 2, paged=PAGED, **kw)))


@pytest.fixture(scope="module")
def slots4():
  return _pair(4)


@pytest.fixture(scope="module")
def shared(params, queue, slots4):
  dense, paged = slots4
  return (jax.device_get(dense(params, queue, B)),
          jax.device_get(paged(params, queue, B)))


def _assert_same_rows(got, want):
  np.testing.assert_array_equal(got.completion_tokens, want.completion_tokens)
  np.testing.assert_array_equal(got.completion_mask, want.completion_mask)
  np.testing.assert_array_equal(got.finished, want.finished)
  np.testing.assert_array_equal(got.done, want.done)
  np.testing.assert_allclose(got.sampler_logprobs, want.sampler_logprobs,
                             atol=2e-5, rtol=0)


def test_paged_slots_give_the_dense_slots_rows_and_free_every_block(shared):
  dense, paged = shared
  assert dense.kv_stats is None
  _assert_same_rows(paged, dense)
  assert int(paged.prefilled_rows) == int(dense.prefilled_rows) < B * G
  stats = paged.kv_stats
  assert stats["rollout/kv_blocks_left"] == 0  # every row ended: all back
  assert stats["rollout/kv_cut_rows"] == 0
  # The pool is the worst case: 4 slots x ceil((16 + 24) / 4) blocks.
  assert stats["rollout/kv_blocks_pool"] == 4 * 10
  assert 0 < stats["rollout/kv_blocks_peak"] <= 40


def test_a_prefill_per_row_holds_more_blocks_than_shared_prompts(
    params, queue, shared):
  """Without sharing every slot writes its own prompt blocks: the same
  rows, and a higher peak than the slots whose groups share theirs."""
  dense, paged = _pair(4, share_prompts=False)
  own_dense = jax.device_get(dense(params, queue, B))
  own = jax.device_get(paged(params, queue, B))
  _assert_same_rows(own, own_dense)
  assert int(own.prefilled_rows) == B * G
  assert (own.kv_stats["rollout/kv_blocks_peak"]
          > shared[1].kv_stats["rollout/kv_blocks_peak"])
  assert own.kv_stats["rollout/kv_blocks_left"] == 0


@pytest.mark.slow  # compiles the carried fill: CI, not the fast tier
def test_carried_rows_resume_on_blocks_as_on_the_dense_cache(params, queue,
                                                             slots4, shared):
  """A partial stop (one group ended), then the unfinished rows prefilled
  with their tokens (8 slots: carried rows fill the first fill)."""
  first = shared[0]
  dense_first = jax.device_get(slots4[0](params, queue, 1))
  done = np.asarray(dense_first.done)
  assert 0 < done.sum() < B * G
  # Stopped on blocks: the same rows, and the stopped rows' blocks back.
  paged_first = jax.device_get(slots4[1](params, queue, 1))
  _assert_same_rows(paged_first, dense_first)
  assert paged_first.kv_stats["rollout/kv_blocks_left"] == 0
  order = np.argsort(done, stable=True)
  carried = cb.Queue(
      prompt_tokens=queue.prompt_tokens[order],
      prompt_mask=queue.prompt_mask[order],
      tokens=dense_first.completion_tokens[order],
      length=dense_first.lengths[order],
      sampler_logprobs=dense_first.sampler_logprobs[order],
      policy_logprobs=None, keys=queue.keys[order],
      sample=queue.sample[order], group=queue.group[order],
      done=done[order], finished=dense_first.finished[order],
      num_pending=np.int32((~done).sum()))
  dense, paged = _pair(B * G, carried=True)
  want = jax.device_get(dense(params, carried, B))
  got = jax.device_get(paged(params, carried, B))
  _assert_same_rows(got, want)
  assert got.kv_stats["rollout/kv_blocks_left"] == 0
  back = np.argsort(order)  # and the rows of the run never stopped
  np.testing.assert_array_equal(got.completion_tokens[back],
                                first.completion_tokens)


@pytest.mark.slow  # compiles the drafts' fill: CI, not the fast tier
def test_drafts_are_verified_on_blocks_as_on_the_dense_cache(params, queue,
                                                             shared):
  """SPEC-RL: the rows of a run as drafts, under moved params (some kept,
  some rejected): the same acceptances and rows as the dense slots'."""
  draft = shared[0]
  q = queue._replace(
      tokens=np.where(draft.completion_mask, draft.completion_tokens, 0),
      length=draft.lengths.astype(np.int32),
      sampler_logprobs=draft.sampler_logprobs, verify=draft.lengths > 0)
  moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(
      jax.random.key(8), x.shape, x.dtype), params)
  dense, paged = _pair(4, carried=True, log_lenience=0.0)
  want = jax.device_get(dense(moved, q, B))
  got = jax.device_get(paged(moved, q, B))
  np.testing.assert_array_equal(got.accepted, want.accepted)
  assert 0 < want.accepted.sum() < draft.lengths.sum()
  _assert_same_rows(got, want)
  assert got.kv_stats["rollout/kv_blocks_left"] == 0


def _one_group(rows_tokens=6):
  """One prompt of 4 tokens (one block), ``G`` rows that never end early
  (no EOS): each needs its prompt block, shared, plus ceil(T / 4) blocks
  of its own, the first a copy of the shared one."""
  sc = sampling.SamplerConfig(num_samples=G, max_new_tokens=rows_tokens,
                              eos_ids=(), pad_id=0, cache_dtype="float32",
                              prompt_buckets=(4,), segment_slots=None)
  tokens, mask = sampling.pad_prompts([[5, 6, 7, 8]], sc.prompt_buckets)
  return sc, cb.fresh_queue(tokens, mask, jax.random.key(1), sc)


@pytest.mark.parametrize("pool,cut", [(9, 0), (8, 1)])
def test_a_pool_at_the_rows_need_cuts_none_and_one_block_short_cuts_one(
    params, pool, cut):
  """4 slots, one group of 4 rows of 6 tokens after a 4-token prompt (one
  block, full): the prompt's block, shared, plus 2 blocks per row (slots
  4-7 and 8-9) = 9 at the peak. A pool of 9 cuts no row; of 8, the last row
  to reserve its second block finds none and ends there, counted."""
  sc, q = _one_group()
  fn = cb.make_continuous_sampler(MC, sc, cb.SlotConfig(
      4, 2, paged=paged_lib.PagedConfig(BS, pool)))
  out = jax.device_get(fn(params, q, 1))
  stats = out.kv_stats
  assert stats["rollout/kv_cut_rows"] == cut
  assert stats["rollout/kv_blocks_peak"] == min(pool, 9)
  assert stats["rollout/kv_blocks_left"] == 0
  assert out.done.all()
  lengths = np.sort(out.lengths)
  assert list(lengths[cut:]) == [6] * (G - cut)  # the others are whole
  if cut:  # the cut row kept the tokens its blocks held: slots 4-7
    assert lengths[0] == 4 and not out.finished[np.argmin(out.lengths)]


@pytest.mark.slow  # 1,000 refills of one slot: CI, not the fast tier
def test_no_block_leaks_after_a_thousand_refills(params):
  """1,000 rows of 2 tokens through 2 slots refilled one row at a time
  (two prompts, 500 rows each: a fill shares the other slot's prompt
  blocks, or prefills its own at the switch): the peak stays at what two
  live rows hold, and every block is back at the end."""
  sc = sampling.SamplerConfig(num_samples=1, max_new_tokens=2, eos_ids=(),
                              pad_id=0, cache_dtype="float32",
                              prompt_buckets=(4,), segment_slots=None)
  prompts = [[5, 6, 7]] * 500 + [[8, 6, 7]] * 500
  tokens, mask = sampling.pad_prompts(prompts, sc.prompt_buckets)
  q = cb.fresh_queue(tokens, mask, jax.random.key(2), sc)
  fn = cb.make_continuous_sampler(MC, sc, cb.SlotConfig(
      2, 1, paged=paged_lib.PagedConfig(BS)))
  out = jax.device_get(fn(params, q, len(prompts)))
  assert out.done.all() and int(out.prefills) >= 1000 - 1
  stats = out.kv_stats
  assert stats["rollout/kv_blocks_left"] == 0
  assert stats["rollout/kv_cut_rows"] == 0
  # Two slots, each its prompt's block (shared but at the start and the
  # switch) and one more for its 2 tokens.
  assert 3 <= stats["rollout/kv_blocks_peak"] <= 4
  assert int(out.prefilled_rows) < 10  # the fills shared, but a few
  assert np.all(out.lengths == 2)


@pytest.mark.slow  # a loop run: CI, not the fast tier
@pytest.mark.parametrize("rollout", ["static", "continuous"])
def test_spec_rl_drafts_verified_on_blocks_train_from_the_config(tmp_path,
                                                                 rollout):
  """From the config, on a paged cache: SPEC-RL drafting step 2's rows from
  step 1's (one epoch per step), verified on blocks by the static batch's
  verification pass or in the slots' prefills; both steps report the pool
  (step 1 samples plainly), every block back after each."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config, rl_rows  # pylint: disable=import-outside-toplevel
  slots = {"rl.rollout_slots": 8} if rollout == "continuous" else {}
  config = loop_config(**{"rl.rollout": rollout, **slots,
                          "sampler.kv_cache": "paged",
                          "sampler.kv_block_size": 4,
                          "sampler.speculative": True})
  config.task.num_train = config.rl.prompts_per_step
  config.rl.num_steps = 2
  train.run(config, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["spec/drafted_rows"] > 0 for r in rows] == [False, True]
  for r in rows:
    assert r["rollout/kv_blocks_left"] == 0 and r["rollout/kv_cut_rows"] == 0
    assert 0 < r["rollout/kv_blocks_peak"] <= r["rollout/kv_blocks_pool"]
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0


def test_a_pool_smaller_than_one_prompt_cuts_every_row_and_ends(params,
                                                               queue):
  """Prompts of 16 slots need 4 blocks; a pool of 3 holds none: every row
  is cut at its fill (no token, counted), the loop still ends, and nothing
  is held."""
  fn = cb.make_continuous_sampler(MC, SC, cb.SlotConfig(
      4, 2, paged=paged_lib.PagedConfig(BS, 3)))
  out = jax.device_get(fn(params, queue, B))
  assert out.done.all() and not out.finished.any()
  assert (out.lengths == 0).all()
  assert out.kv_stats["rollout/kv_cut_rows"] == B * G
  assert out.kv_stats["rollout/kv_blocks_left"] == 0
