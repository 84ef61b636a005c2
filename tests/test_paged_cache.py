"""The paged KV cache (``rljax/models/paged_cache.py``) and the static
sampler on it (``rljax/sampling/paged.py``).

References: the dense cache and the dense sampler (same params, same keys),
and a NumPy shadow of every row's slots that a long random run of writes,
forks and releases must keep equal to what the rows read.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.models import paged_cache as pc
from rljax.sampling import paged as paged_lib
from rljax.train import build
from tests.test_loop import loop_config

# The shrinking sampler's tests' model and sampler: rows that end at
# scattered steps, some at T.
from tests.test_sampler_shrink import BASE, TINY


@pytest.fixture(scope="module")
def params():
  return models.init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, TINY.vocab_size, size=n)) for n in (3, 11, 1, 6)]
  return sampling.pad_prompts(lists, (8, 16))


@pytest.fixture(scope="module")
def dense(params, prompts):
  return jax.device_get(sampling.sample(params, *prompts, jax.random.key(3),
                                        model_config=TINY, config=BASE))


# --- the decoder on blocks ---------------------------------------------------


def test_the_decoder_reads_and_writes_blocks_as_a_dense_cache(params):
  model = models.Decoder(TINY)
  rng = np.random.RandomState(1)
  toks = jnp.asarray(rng.randint(4, TINY.vocab_size, (3, 7)))
  mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 0, 0, 0, 1, 1, 1]],
                  bool)
  pos = models.positions_from_mask(jnp.asarray(mask))
  apply = functools.partial(model.apply, {"params": params})
  dense_cache = models.init_cache(TINY, 3, 16, jnp.float32)
  paged_cache = pc.init_paged_cache(TINY, 3, 12, 4, 4, jnp.float32)
  paged_cache, failed = pc.reserve(paged_cache, jnp.ones(3, bool), 7)
  assert not failed.any()
  hd, dense_cache = apply(toks, pos, dense_cache,
                          input_mask_BxT=jnp.asarray(mask))
  hp, paged_cache = apply(toks, pos, paged_cache,
                          input_mask_BxT=jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(hp)[mask], np.asarray(hd)[mask],
                             atol=1e-6)
  for _ in range(3):  # decode steps, the second crossing into a new block
    nxt = jnp.asarray(rng.randint(4, TINY.vocab_size, (3, 1)))
    pos = pos[:, -1:] + 1
    hd, dense_cache = apply(nxt, pos, dense_cache)
    paged_cache, failed = pc.reserve(paged_cache, jnp.ones(3, bool), 1)
    hp, paged_cache = apply(nxt, pos, paged_cache)
    np.testing.assert_allclose(hp, hd, atol=1e-6)
  assert int(pc.blocks_in_use(paged_cache)) == 3 * 3  # 10 slots: 3 blocks


# --- blocks, forks and releases ----------------------------------------------


def _cache(rows=4, blocks=16, size=4, width=4):
  return pc.init_paged_cache(TINY.replace(num_layers=1, num_kv_heads=1,
                                          head_dim=1), rows, blocks, size,
                             width, jnp.float32)


@jax.jit
def _append(cache, rows_R, values_R):
  """Each row of ``rows_R`` appends one slot holding ``values_R``."""
  cache, failed = pc.reserve(cache, rows_R, 1)
  v = values_R.astype(jnp.float32)[:, None, None, None]
  k, vv = pc.write(cache.layers[0].k, cache.layers[0].v, cache.table,
                   cache.lengths, v, -v, cache.block_size)
  mask = pc.write_mask(cache.slot_mask, cache.table, cache.lengths,
                       rows_R[:, None])
  cache = cache._replace(layers=(models.LayerKV(k, vv),), slot_mask=mask,
                         lengths=cache.lengths + rows_R.astype(jnp.int32))
  return cache, failed


def _read(cache):
  """Each row's values in its slots, up to its length."""
  keys = np.asarray(pc.gather(cache.layers[0].k, cache.table))[:, 0, :, 0]
  mask = np.asarray(pc.gather_mask(cache.slot_mask, cache.table))
  lengths = np.asarray(cache.lengths)
  return [keys[r, :lengths[r]][mask[r, :lengths[r]]] for r in range(len(keys))]


def test_a_write_after_a_fork_leaves_the_other_branch_unchanged():
  cache = _cache()
  for value in (1, 2, 3):  # row 0: [1, 2, 3] in its first block (of 4)
    cache, _ = _append(cache, jnp.array([True, False, False, False]),
                       jnp.full(4, value))
  cache = pc.fork(cache, jnp.array([0, 0, 2, 3]))  # row 1 shares row 0's
  assert np.asarray(pc.refcounts(cache)).max() == 2
  cache, failed = _append(cache, jnp.array([False, True, False, False]),
                          jnp.full(4, 9))
  assert not failed.any()
  rows = _read(cache)
  np.testing.assert_array_equal(rows[0], [1, 2, 3])  # unchanged
  np.testing.assert_array_equal(rows[1], [1, 2, 3, 9])
  # Row 1 copied the shared block before writing: two blocks, one each.
  assert cache.table[0, 0] != cache.table[1, 0]
  np.testing.assert_array_equal(np.asarray(pc.refcounts(cache))[
      np.asarray(cache.table[:2, 0])], [1, 1])
  cache, _ = _append(cache, jnp.array([True, False, False, False]),
                     jnp.full(4, 7))  # row 0 now writes its own block
  rows = _read(cache)
  np.testing.assert_array_equal(rows[0], [1, 2, 3, 7])
  np.testing.assert_array_equal(rows[1], [1, 2, 3, 9])


def test_rows_share_full_blocks_and_copy_only_the_one_they_write():
  cache = _cache(blocks=8)
  for value in range(6):  # 6 slots: one full block and half of another
    cache, _ = _append(cache, jnp.array([True, False, False, False]),
                       jnp.full(4, value))
  cache = pc.fork(cache, jnp.zeros(4, jnp.int32))  # every row is row 0
  assert int(pc.blocks_in_use(cache)) == 2
  cache, _ = _append(cache, jnp.ones(4, bool), jnp.arange(4) + 10)
  # The full block stays shared; the half block is copied for all four.
  assert int(pc.blocks_in_use(cache)) == 1 + 4
  for r, row in enumerate(_read(cache)):
    np.testing.assert_array_equal(row, [0, 1, 2, 3, 4, 5, 10 + r])


@pytest.mark.parametrize("blocks", [5, 4])
def test_a_block_every_holder_writes_is_kept_by_one_and_copied_by_the_rest(
    blocks):
  """Four rows share a half-full block and all write into it: the lowest
  row writes it in place and three copy it, so a pool with 3 free blocks
  (5 in all) serves every row, and one with 2 (4 in all) fails the last
  row only. A holder that does not write makes every writer copy."""
  cache = _cache(blocks=blocks)
  for value in range(6):
    cache, _ = _append(cache, jnp.array([True, False, False, False]),
                       jnp.full(4, value))
  cache = pc.fork(cache, jnp.zeros(4, jnp.int32))
  half = int(cache.table[0, 1])
  cache, failed = _append(cache, jnp.ones(4, bool), jnp.arange(4) + 10)
  np.testing.assert_array_equal(failed, [False] * 3 + [blocks == 4])
  assert int(cache.table[0, 1]) == half  # row 0 kept it
  served = 4 - (blocks == 4)
  assert len(set(np.asarray(cache.table[:served, 1]))) == served
  # The row that failed let go of the block, so its write did not land in
  # the block row 0 writes in place.
  assert blocks == 5 or int(cache.table[3, 1]) == -1
  for r, row in enumerate(_read(cache)[:served]):
    np.testing.assert_array_equal(row, [0, 1, 2, 3, 4, 5, 10 + r])
  if blocks == 5:  # rows 1-3 share row 0's again; row 3 does not write
    cache = pc.fork(cache, jnp.array([0, 0, 0, 0]))
    before = int(cache.table[0, 1])
    cache, failed = _append(cache, jnp.array([True, True, True, False]),
                            jnp.arange(4) + 20)
    assert not failed.any()
    assert before not in set(np.asarray(cache.table[:3, 1]))
    assert int(cache.table[3, 1]) == before
    np.testing.assert_array_equal(_read(cache)[3], [0, 1, 2, 3, 4, 5, 10])


def test_on_a_mesh_the_bookkeeping_runs_whole_on_each_device():
  """``reserve``, ``write`` and ``write_mask`` jitted on a 2 x 4 mesh, with
  the rows' arrays sharded over it, give the tables, counts and pool of the
  same calls without a mesh (``sharding.whole_on_each_device``), the keep
  rule included (four rows writing one shared half block), and their
  compiled program holds no collective inside the reservation's loop."""
  from rljax import sharding  # pylint: disable=import-outside-toplevel
  def steps(cache):
    for value in range(6):
      cache, _ = _append(cache, jnp.array([True, False, False, False]),
                         jnp.full(4, value))
    cache = pc.fork(cache, jnp.zeros(4, jnp.int32))
    return _append(cache, jnp.ones(4, bool), jnp.arange(4) + 10)

  want, want_failed = steps(_cache(blocks=5))
  mesh = sharding.make_mesh(data=2, fsdp=4)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      ("data", "fsdp")))
  with jax.set_mesh(mesh):
    cache = _cache(rows=8, blocks=5)
    cache = cache._replace(table=jax.device_put(cache.table, rows),
                           lengths=jax.device_put(cache.lengths, rows))
    got, got_failed = steps(jax.tree.map(
        lambda x: x[:4] if x.shape[0] == 8 else x, cache))
    hlo = _append.lower(cache, jnp.ones(8, bool), jnp.arange(8)).compile(
        ).as_text()
  np.testing.assert_array_equal(got_failed, want_failed)
  np.testing.assert_array_equal(got.table, want.table)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_array_equal(pc.refcounts(got), pc.refcounts(want))
  np.testing.assert_array_equal(got.layers[0].k, want.layers[0].k)
  np.testing.assert_array_equal(got.slot_mask, want.slot_mask)
  body = hlo[hlo.find("while"):]
  assert "while" in hlo and not any(
      op in body for op in ("all-reduce(", "all-to-all(",
                            "collective-permute(")), body[:2000]


def test_a_full_pool_fails_the_rows_beyond_it_and_only_those():
  cache = _cache(rows=4, blocks=3, size=2, width=2)
  cache, failed = _append(cache, jnp.ones(4, bool), jnp.arange(4))
  np.testing.assert_array_equal(failed, [False, False, False, True])
  # A table of 2 blocks of 2: a row's fifth slot fails too.
  cache = _cache(rows=1, blocks=8, size=2, width=2)
  for value in range(4):
    cache, failed = _append(cache, jnp.ones(1, bool), jnp.full(1, value))
    assert not failed.any()
  cache, failed = _append(cache, jnp.ones(1, bool), jnp.full(1, 4))
  assert failed.all()


def test_a_thousand_refills_leak_no_block_and_alias_no_row():
  """Random appends, forks and releases, checked against a NumPy shadow of
  every row's slots after each; every block is free once every row is
  released."""
  rows, size = 6, 3
  cache = _cache(rows=rows, blocks=rows * 4, size=size, width=4)
  shadow = [[] for _ in range(rows)]
  rng = np.random.RandomState(0)
  release = jax.jit(pc.release)
  fork = jax.jit(pc.fork)
  for i in range(1000):
    op = rng.randint(3)
    if op == 0:  # append to rows with room
      pick = rng.rand(rows) < 0.5
      pick &= np.array([len(s) < 4 * size for s in shadow])
      cache, failed = _append(cache, jnp.asarray(pick),
                              jnp.full(rows, float(i)))
      assert not np.asarray(failed).any(), i
      for r in np.flatnonzero(pick):
        shadow[r].append(float(i))
    elif op == 1:  # release some rows (their last rows end)
      pick = rng.rand(rows) < 0.3
      cache = release(cache, jnp.asarray(pick))
      for r in np.flatnonzero(pick):
        shadow[r] = []
    else:  # refill some rows as forks of others
      src = np.where(rng.rand(rows) < 0.3, rng.randint(rows, size=rows),
                     np.arange(rows))
      cache = fork(cache, jnp.asarray(src))
      shadow = [list(shadow[s]) for s in src]
    if i % 50 == 0 or i == 999:
      for r, row in enumerate(_read(cache)):
        np.testing.assert_array_equal(row, shadow[r], err_msg=f"{i} row {r}")
      counts = np.asarray(pc.refcounts(cache))
      table = np.asarray(cache.table)
      for block in range(cache.num_blocks):
        assert counts[block] == np.sum(table == block)
  cache = release(cache, jnp.ones(rows, bool))
  assert int(pc.blocks_in_use(cache)) == 0


# --- the sampler on blocks ---------------------------------------------------


def test_the_paged_sampler_draws_the_dense_samplers_rows(params, prompts,
                                                         dense):
  fn = paged_lib.make_paged_sampler(TINY, BASE,
                                    paged_lib.PagedConfig(block_size=4))
  got, stats = fn.with_metrics(params, *prompts, jax.random.key(3))
  got = jax.device_get(got)
  np.testing.assert_array_equal(got.completion_tokens, dense.completion_tokens)
  np.testing.assert_array_equal(got.completion_mask, dense.completion_mask)
  np.testing.assert_array_equal(got.finished, dense.finished)
  for name in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(got, name), getattr(dense, name),
                               atol=1e-5, err_msg=name)
  assert stats["rollout/kv_cut_rows"] == 0
  assert stats["rollout/kv_blocks_left"] == 0  # every block came back
  # Peak blocks: below the worst case the pool is sized for (rows end).
  assert 0 < stats["rollout/kv_blocks_peak"] < stats["rollout/kv_blocks_pool"]


def test_on_a_mesh_the_paged_sampler_draws_the_same_rows(params, prompts,
                                                         dense):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1),
                           ("data", "fsdp", "tensor"))
  fn = paged_lib.make_paged_sampler(TINY, BASE,
                                    paged_lib.PagedConfig(block_size=8), mesh)
  got = jax.device_get(fn(params, *prompts, jax.random.key(3)))
  np.testing.assert_array_equal(got.completion_tokens, dense.completion_tokens)


def test_a_pool_below_the_peak_cuts_rows_and_counts_them(params, prompts,
                                                         dense):
  config = paged_lib.PagedConfig(block_size=4)
  fn = paged_lib.make_paged_sampler(TINY, BASE, config)
  _, stats = fn.with_metrics(params, *prompts, jax.random.key(3))
  peak = int(stats["rollout/kv_blocks_peak"])
  # A pool of the peak: nothing is cut; one block fewer: a row is.
  at = paged_lib.make_paged_sampler(TINY, BASE, paged_lib.PagedConfig(
      block_size=4, num_blocks=peak))
  got, stats = at.with_metrics(params, *prompts, jax.random.key(3))
  assert stats["rollout/kv_cut_rows"] == 0
  np.testing.assert_array_equal(jax.device_get(got).completion_tokens,
                                dense.completion_tokens)
  below = paged_lib.make_paged_sampler(TINY, BASE, paged_lib.PagedConfig(
      block_size=4, num_blocks=peak - 1))
  got, stats = below.with_metrics(params, *prompts, jax.random.key(3))
  got = jax.device_get(got)
  assert stats["rollout/kv_cut_rows"] >= 1
  cut = got.lengths < dense.lengths
  assert cut.any() and not got.finished[cut].any()  # truncated, not ended
  # A cut row keeps the dense row's tokens up to where it stopped.
  for r in np.flatnonzero(cut):
    n = got.lengths[r]
    np.testing.assert_array_equal(got.completion_tokens[r, :n],
                                  dense.completion_tokens[r, :n])


@pytest.mark.parametrize("smallest", [2, 8])
def test_a_shrinking_paged_batch_draws_the_same_rows_in_smaller_loops(
    params, prompts, dense, smallest):
  """``sampler.shrink_batch_to`` on blocks: the live rows' tables move to
  the smaller batches (one decode loop per level, as the dense sampler's:
  ``tests/test_sampler_shrink.py``) and the rows are the dense sampler's,
  every block back at the end."""
  from tests.test_sampler_shrink import T, decode_loops  # pylint: disable=import-outside-toplevel
  fn = paged_lib.make_paged_sampler(TINY, BASE.replace(
      shrink_batch_to=smallest), paged_lib.PagedConfig(block_size=4))
  got, stats = fn.with_metrics(params, *prompts, jax.random.key(3))
  got = jax.device_get(got)
  np.testing.assert_array_equal(got.completion_tokens, dense.completion_tokens)
  np.testing.assert_array_equal(got.finished, dense.finished)
  for name in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(got, name), getattr(dense, name),
                               atol=1e-5, err_msg=name)
  assert stats["rollout/kv_blocks_left"] == 0
  assert stats["rollout/kv_cut_rows"] == 0
  assert T == BASE.max_new_tokens
  loops = decode_loops(fn.jitted, params, *prompts, jax.random.key(3))
  assert loops == ({16: 1, 8: 1, 4: 1, 2: 1} if smallest == 2
                   else {16: 1, 8: 1}), loops


@pytest.fixture(scope="module")
def spec_dense(params, prompts, dense):
  """SPEC-RL on the dense cache: the dense rows as drafts, verified by
  moved params (some kept, some rejected), the batch halving to 2 rows."""
  draft = sampling.Draft(
      np.where(dense.completion_mask, dense.completion_tokens, 0),
      dense.completion_mask, dense.sampler_logprobs)
  moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(
      jax.random.key(8), x.shape, x.dtype), params)
  config = BASE.replace(shrink_batch_to=2)
  fn = sampling.make_speculative_sampler(TINY, config)
  return draft, moved, config, jax.device_get(
      fn(moved, *prompts, draft, jax.random.key(5)))


@pytest.mark.slow  # two speculative programs: CI, not the fast tier
@pytest.mark.parametrize("pool", [176, 175])
def test_spec_rl_on_blocks_accepts_and_decodes_as_the_dense_cache(
    prompts, spec_dense, pool):
  """The verification pass writes every row's whole draft: 16 rows x 11
  blocks (prompt blocks shared, the one a prompt ends in copied) = 176 at
  the peak, the worst-case pool. A pool of 176 cuts no row; of 175 the
  last row runs out of blocks for its draft and is cut (no token, counted);
  every other row is the dense cache's, and every block comes back."""
  draft, moved, config, (want, want_accepted) = spec_dense
  assert 0 < want_accepted.sum() < draft.mask.sum()  # some rejected
  fn = sampling.make_speculative_sampler(
      TINY, config, paged=paged_lib.PagedConfig(4, pool))
  got, accepted, stats = jax.device_get(
      fn(moved, *prompts, draft, jax.random.key(5)))
  cut = 1 if pool == 175 else 0
  assert stats["rollout/kv_cut_rows"] == cut
  # (the cut row held blocks until it failed: the pool is full at the peak)
  assert stats["rollout/kv_blocks_peak"] == (pool or 176)
  assert stats["rollout/kv_blocks_left"] == 0
  keep = np.arange(len(accepted)) < len(accepted) - cut
  np.testing.assert_array_equal(accepted[keep], want_accepted[keep])
  np.testing.assert_array_equal(got.completion_tokens[keep],
                                want.completion_tokens[keep])
  np.testing.assert_array_equal(got.finished[keep], want.finished[keep])
  for name in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(got, name)[keep],
                               getattr(want, name)[keep], atol=1e-5,
                               err_msg=name)
  if cut:
    assert got.lengths[-1] == 0 and not got.finished[-1]
    assert accepted[-1] == 0


# --- the config --------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("kv_block_size", 0),
                                         ("kv_blocks", 0)])
def test_a_bad_pool_is_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=rf"sampler\.{field}={value}"):
    build.validate(loop_config(**{"sampler.kv_cache": "paged",
                                  f"sampler.{field}": value}))
