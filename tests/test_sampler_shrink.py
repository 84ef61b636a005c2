"""A decode batch that shrinks as rows end (``sampler.shrink_batch_to``).

The reference is the sampler with every row decoding to the end: the same
key gives the same tokens (draws are keyed by row and column), and the
logprobs agree to float rounding (a smaller batch may round its matmuls
differently).
"""

import re

import jax
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling.speculative import Draft
from rljax.train import build
from tests.test_loop import loop_config

TINY = models.get_preset("tiny")
# Alternating sliding-window and global layers: a shrunk batch copies a
# group's prefix in front of its own slots, and the window must still count
# the same slots.
GEMMA_LIKE = TINY.replace(sliding_window=3, global_every=2,
                          rope_local_theta=100.0)
T = 40
# Many end ids, so that rows end at scattered steps (some run to T).
BASE = sampling.SamplerConfig(
    num_samples=4, max_new_tokens=T, cache_dtype="float32",
    method=sampling.SamplingMethod(temperature=1.0),
    eos_ids=tuple(range(20, 36)), stop_sequences=((7, 9),),
    prompt_buckets=(8, 16), segment_slots=8, record_policy_logprobs=True,
    training_temperature=1.3)


@pytest.fixture(scope="module")
def params():
  return models.init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, TINY.vocab_size, size=n)) for n in (3, 11, 1, 6)]
  return sampling.pad_prompts(lists, (8, 16))


def assert_same_rows(ref, got):
  for name, a, b in zip(ref._fields, ref, got):
    if a is None:
      assert b is None, name
    elif "logprobs" in name:
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)


def test_shrink_levels():
  assert sampling.shrink_levels(64, 8) == (64, 32, 16, 8)
  assert sampling.shrink_levels(64, 9) == (64, 32, 16)
  assert sampling.shrink_levels(64, None) == (64,)
  assert sampling.shrink_levels(7, 1) == (7, 4, 2, 1)
  assert sampling.shrink_levels(48, 8, multiple=8) == (48, 24, 16, 8)
  assert sampling.shrink_levels(16, 1, multiple=8) == (16, 8)
  assert sampling.shrink_levels(8, 1, multiple=8) == (8,)
  assert sampling.shrink_levels(4, 8) == (4,)


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", True])
def test_a_bad_size_is_refused_naming_the_field(value):
  with pytest.raises(ValueError, match=re.escape(
      f"sampler.shrink_batch_to={value!r}")):
    sampling.SamplerConfig(shrink_batch_to=value)


@pytest.mark.parametrize("field,value", [("rl.rollout", "continuous"),
                                         ("rl.rollout", "partial")])
def test_rollouts_without_a_static_batch_refuse_it(field, value):
  config = loop_config(**{"sampler.shrink_batch_to": 4, field: value})
  with pytest.raises(ValueError, match="sampler.shrink_batch_to=4"):
    build.validate(config)


def test_the_config_reaches_the_sampler():
  class Tokenizer:  # what sampler_config reads of a tokenizer
    eos_id, eos_ids, pad_id = 2, (2,), 0

  for value in (None, 4):
    config = loop_config(**{"sampler.shrink_batch_to": value})
    assert build.sampler_config(config, Tokenizer(), 2).shrink_batch_to == value


@pytest.mark.parametrize("share_prefix", [True, False])
def test_shrinking_keeps_every_token(params, prompts, share_prefix):
  tokens, mask = prompts
  config = BASE.replace(share_prefix=share_prefix)
  ref, got = (jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(3), model_config=TINY,
      config=config.replace(shrink_batch_to=s))) for s in (None, 2))
  lengths = ref.lengths
  # Rows end all along the budget: the batch shrinks at least twice before
  # the last row ends, and some rows still run to T after it did.
  assert np.sum(lengths < T // 2) >= 8, lengths
  assert np.sum(lengths == T) >= 1, lengths
  assert ref.finished.any() and not ref.finished.all()
  assert_same_rows(ref, got)


@pytest.mark.slow
def test_shrinking_keeps_the_sliding_window(prompts):
  tokens, mask = prompts
  p = models.init_params(GEMMA_LIKE, jax.random.key(1))
  ref, got = (jax.device_get(sampling.sample(
      p, tokens, mask, jax.random.key(5), model_config=GEMMA_LIKE,
      config=BASE.replace(shrink_batch_to=s))) for s in (None, 1))
  assert len(set(ref.lengths.tolist())) >= 6, ref.lengths
  assert_same_rows(ref, got)


def decode_loops(fn, *args, t: int = T) -> dict[int, int]:
  """``{rows: decode while-loops}`` of a sampler's program: the loops that
  carry a ``[rows, t]`` int32 token buffer (``t`` new tokens)."""
  loops = {}
  for line in fn.lower(*args).as_text().splitlines():
    if "stablehlo.while" in line:
      for rows in set(re.findall(rf"tensor<(\d+)x{t}xi32>", line)):
        loops[int(rows)] = loops.get(int(rows), 0) + 1
  return loops


def test_each_level_is_one_more_decode_loop(params, prompts):
  """The full batch decodes in one loop per length segment, each smaller
  batch of ``shrink_levels`` in one loop of its own."""
  tokens, mask = prompts
  segments = len(sampling.segment_ends(T, BASE.segment_slots))
  loops = {s: decode_loops(sampling.make_sampler(
      TINY, BASE.replace(shrink_batch_to=s)), params, tokens, mask,
                            jax.random.key(0)) for s in (None, 2, 8)}
  assert loops == {None: {16: segments}, 2: {16: segments, 8: 1, 4: 1, 2: 1},
                   8: {16: segments, 8: 1}}


@pytest.mark.slow
def test_speculative_decoding_shrinks_the_same_way(params, prompts):
  tokens, mask = prompts
  first = jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(7), model_config=TINY, config=BASE))
  draft = Draft(first.completion_tokens, first.completion_mask,
                first.sampler_logprobs)
  (ref, ref_accepted), (got, got_accepted) = (jax.device_get(
      sampling.make_speculative_sampler(
          TINY, BASE.replace(shrink_batch_to=s), log_lenience=0.5)(
              params, tokens, mask, draft, jax.random.key(8)))
      for s in (None, 2))
  assert 0 < ref_accepted.mean() < T  # part of each draft kept, then decoded
  np.testing.assert_array_equal(ref_accepted, got_accepted)
  assert_same_rows(ref, got)


@pytest.mark.slow
def test_on_a_mesh_the_levels_keep_whole_rows_per_device(params, prompts):
  """32 rows over 8 devices shrink to 16 and 8 (one per device), not
  below; the tokens are those of the unsharded sampler."""
  tokens, mask = (np.concatenate([x, x[::-1]]) for x in prompts)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1),
                           ("data", "fsdp", "tensor"))
  sharded = sampling.make_sampler(TINY, BASE.replace(shrink_batch_to=1), mesh)
  with jax.set_mesh(mesh):
    loops = decode_loops(sharded.jitted, params, tokens, mask,
                          jax.random.key(3))
  segments = len(sampling.segment_ends(T, BASE.segment_slots))
  assert loops == {32: segments, 16: 1, 8: 1}
  got = jax.device_get(sharded(params, tokens, mask, jax.random.key(3)))
  ref = jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(3), model_config=TINY,
      config=BASE))
  assert np.sum(ref.lengths < T // 2) >= 16, ref.lengths  # 16 rows end early
  assert_same_rows(ref, got)
