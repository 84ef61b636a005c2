"""Length-segmented decode: same bits as one segment, in-place cache, no recompiles."""

import re

import jax
import numpy as np
import pytest

from rljax import models, sampling
from tests import compile_count

MC = models.get_preset("tiny")
BUCKETS = (8, 16)
T = 140  # segments end at 32, 64, 128, 140 steps: caches of 64, 64, 128, 192
BASE = sampling.SamplerConfig(
    num_samples=3, max_new_tokens=T, cache_dtype="float32",
    method=sampling.SamplingMethod(temperature=0.8, top_k=40),
    record_policy_logprobs=True, segment_slots=32)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, MC.vocab_size, size=n)) for n in (3, 7)]
  return sampling.pad_prompts(lists, BUCKETS)


def test_segment_ends():
  assert sampling.segment_ends(128, 32) == (32, 64, 128)
  assert sampling.segment_ends(40, 8) == (8, 16, 32, 40)
  assert sampling.segment_ends(12, 64) == (12,)
  assert sampling.segment_ends(12, None) == (12,)
  with pytest.raises(ValueError, match="sampler.segment_slots=0"):
    sampling.SamplerConfig(segment_slots=0)


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.slow
def test_segmented_decode_is_bitwise_equal_to_one_segment(params, prompts,
                                                           share_prefix):
  tokens, mask = prompts
  config = BASE.replace(share_prefix=share_prefix, eos_ids=(17, 99))
  one, seg = (jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(1), model_config=MC,
      config=config.replace(segment_slots=s))) for s in (None, 32))
  assert one.lengths.min() < T  # some rows end early, some run to T
  for name, a, b in zip(one._fields, one, seg):
    if share_prefix or "logprobs" not in name:
      np.testing.assert_array_equal(a, b, err_msg=name)
    else:
      # Repeated prompts (not the default): XLA:CPU sums these blocks in an
      # order that depends on their count; the tokens stay bitwise equal.
      np.testing.assert_allclose(a, b, atol=3e-6, rtol=0, err_msg=name)


def _while_bodies(hlo: str) -> dict[str, str]:
  names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  bodies, current = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^%?([\w.\-]+) .*\{$", line)
    if m:
      current = m.group(1) if m.group(1) in names else None
      if current:
        bodies[current] = ""
    elif current:
      bodies[current] += line + "\n"
  return bodies


@pytest.mark.slow
def test_the_cache_update_in_the_loop_is_in_place(params, prompts):
  """Inside every decode while-loop body, each layer's [N, K, S, H] cache
  is written by a dynamic-update-slice fusion and never copied."""
  tokens, mask = prompts
  fn = sampling.make_sampler(MC, BASE)
  hlo = fn.lower(params, tokens, mask, jax.random.key(0)).compile().as_text()
  bodies = _while_bodies(hlo)
  n, k, h = 6, MC.num_kv_heads, MC.head_dim
  seen = set()
  for body in bodies.values():
    for s in (64, 128, 192):
      shape = f"f32[{n},{k},{s},{h}]"
      writes = [l for l in body.splitlines() if f"= {shape}" in l]
      if not writes:
        continue
      seen.add(s)
      assert not [l for l in writes if " copy(" in l], body
      updates = [l for l in writes if "dynamic-update-slice" in l]
      assert len(updates) == 2 * MC.num_layers, writes  # k and v per layer
  assert seen == {64, 128, 192}


def test_no_recompile_across_new_prompts_with_segments(params):
  fn = sampling.make_sampler(MC, BASE.replace(max_new_tokens=20))
  rng = np.random.RandomState(5)
  with compile_count.lowerings() as programs:
    for lengths in ((3, 5), (8, 2), (6, 6)):
      tokens, mask = sampling.pad_prompts(
          [list(rng.randint(4, 200, size=n)) for n in lengths], BUCKETS)
      jax.block_until_ready(fn(params, tokens, mask, jax.random.key(0)))
  assert programs["_sample_impl"] == 1, programs
