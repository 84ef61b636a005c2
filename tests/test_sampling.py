import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from rljax import models, sampling, sharding
from tests import compile_count

MC = models.get_preset("tiny")
BUCKETS = (8, 16)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, MC.vocab_size, size=n)) for n in (3, 7, 5, 6)]
  return sampling.pad_prompts(lists, BUCKETS)


BASE = sampling.SamplerConfig(
    num_samples=3, max_new_tokens=12, cache_dtype="float32",
    method=sampling.SamplingMethod(temperature=0.8, top_k=40),
    training_temperature=1.0, record_policy_logprobs=True)


def run(params, prompts, config=BASE, key=1):
  tokens, mask = prompts
  return jax.device_get(sampling.sample(params, tokens, mask, jax.random.key(key),
                                        model_config=MC, config=config))


@pytest.fixture(scope="module")
def base_rollout(params, prompts):
  return run(params, prompts)


def test_rollout_shapes_and_group_layout(base_rollout, prompts):
  r = base_rollout
  n, t = 4 * 3, 12
  assert r.completion_tokens.shape == (n, t)
  assert r.prompt_tokens.shape == (n, 8)
  np.testing.assert_array_equal(r.prompt_tokens, np.repeat(prompts[0], 3, 0))
  np.testing.assert_array_equal(r.lengths, r.completion_mask.sum(-1))


@pytest.mark.slow
def test_policy_logprobs_equal_recomputed_logprobs(params, base_rollout):
  r = base_rollout
  tokens, mask = r.sequences()
  lp, _ = models.sequence_logprobs(params, MC, tokens, mask)
  lp = np.asarray(lp)[:, r.prompt_tokens.shape[1]:]
  m = r.completion_mask
  np.testing.assert_allclose(r.policy_logprobs[m], lp[m], atol=1e-5, rtol=1e-5)
  assert np.all(r.policy_logprobs[~m] == 0)


@pytest.mark.slow
def test_sampler_logprobs_are_under_the_truncated_distribution(params, base_rollout):
  """Recompute log p of each token under temperature 0.8 + top-40 in numpy."""
  r = base_rollout
  tokens, mask = r.sequences()
  p = r.prompt_tokens.shape[1]
  logits, _ = models.Decoder(MC).apply(
      {"params": params}, tokens, models.positions_from_mask(mask),
      input_mask_BxT=mask, return_logits=True)
  z = np.asarray(logits, np.float64)[:, p - 1:-1] / 0.8
  kth = np.sort(z, -1)[..., -40][..., None]
  z = np.where(z >= kth, z, -np.inf)
  logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
  ref = np.take_along_axis(logp, r.completion_tokens[..., None], -1)[..., 0]
  m = r.completion_mask
  np.testing.assert_allclose(r.sampler_logprobs[m], ref[m], atol=1e-4)
  assert np.isfinite(r.sampler_logprobs).all()


def test_same_key_same_samples_different_key_different(params, prompts, base_rollout):
  again = run(params, prompts)
  np.testing.assert_array_equal(again.completion_tokens,
                                base_rollout.completion_tokens)
  other = run(params, prompts, key=2)
  assert (other.completion_tokens != base_rollout.completion_tokens).mean() > 0.5
  # Samples within a group differ (independent draws from one shared prefix).
  group = base_rollout.completion_tokens[:3]
  assert not (group[0] == group[1]).all() and not (group[1] == group[2]).all()


@pytest.mark.slow
def test_greedy_is_deterministic_and_equals_full_forward_argmax(params, prompts):
  config = BASE.replace(method=sampling.SamplingMethod(greedy=True),
                        num_samples=2, max_new_tokens=8)
  r1 = run(params, prompts, config, key=3)
  r2 = run(params, prompts, config, key=4)
  np.testing.assert_array_equal(r1.completion_tokens, r2.completion_tokens)
  # Reference: re-run the full forward on the growing sequence, take argmax.
  tokens, mask = prompts
  apply = jax.jit(functools.partial(models.Decoder(MC).apply, return_logits=True))
  seq, seq_mask = np.asarray(tokens), np.asarray(mask)
  for _ in range(8):
    logits, _ = apply({"params": params}, seq,
                      models.positions_from_mask(seq_mask), input_mask_BxT=seq_mask)
    nxt = np.asarray(logits)[:, -1].argmax(-1)
    seq = np.concatenate([seq, nxt[:, None]], 1)
    seq_mask = np.concatenate([seq_mask, np.ones((len(nxt), 1), bool)], 1)
  np.testing.assert_array_equal(r1.completion_tokens[::2], seq[:, 8:])


def test_eos_and_stop_sequences_end_a_sample(params, prompts, base_rollout):
  ref = base_rollout.completion_tokens
  eos = int(ref[0, 4])
  first = int(np.argmax(ref[0] == eos))
  stop = (int(ref[4, 6]), int(ref[4, 7]))
  r = run(params, prompts, BASE.replace(eos_ids=(eos,), stop_sequences=(stop,)))
  for row in range(ref.shape[0]):
    hits = [j for j in range(12) if ref[row, j] == eos]
    hits += [j for j in range(1, 12) if (ref[row, j - 1], ref[row, j]) == stop]
    end = min(hits) + 1 if hits else 12
    assert r.lengths[row] == end, row
    assert bool(r.finished[row]) == bool(hits)
    np.testing.assert_array_equal(r.completion_tokens[row, :end], ref[row, :end])
    assert (r.completion_tokens[row, end:] == 0).all()
    assert r.completion_mask[row, :end].all() and not r.completion_mask[row, end:].any()
    assert (r.policy_logprobs[row, end:] == 0).all()
  assert r.lengths[0] == first + 1 and r.lengths[4] <= 8


@pytest.mark.slow
def test_shared_prefix_equals_repeated_prompts_and_prefills_b_rows(params, prompts, base_rollout):
  repeated = run(params, prompts, BASE.replace(share_prefix=False))
  np.testing.assert_array_equal(repeated.completion_tokens,
                                base_rollout.completion_tokens)
  np.testing.assert_allclose(repeated.policy_logprobs,
                             base_rollout.policy_logprobs, atol=1e-5)
  # The prefill's embedded prompt batch is [B, P, D] = [4, 8, 64] when shared
  # and [B*G, P, D] = [12, 8, 64] when not.
  tokens, mask = prompts
  def jaxpr(config):
    return str(jax.make_jaxpr(functools.partial(
        sampling.sampler._sample_impl, model_config=MC, config=config))(
            params, tokens, mask, jax.random.key(0)))
  shared, unshared = jaxpr(BASE), jaxpr(BASE.replace(share_prefix=False))
  assert "f32[4,8,64]" in shared and "f32[12,8,64]" not in shared
  assert "f32[12,8,64]" in unshared


@pytest.mark.slow
def test_no_recompile_for_new_prompts_in_the_same_bucket(params):
  config = BASE.replace(max_new_tokens=4, num_samples=2)
  fn = sampling.make_sampler(MC, config)
  rng = np.random.RandomState(5)
  with compile_count.lowerings() as programs:
    for lengths in ((3, 5), (8, 2), (6, 6)):
      tokens, mask = sampling.pad_prompts(
          [list(rng.randint(4, 200, size=n)) for n in lengths], BUCKETS)
      jax.block_until_ready(fn(params, tokens, mask, jax.random.key(0)))
    assert programs["_sample_impl"] == 1, programs
    tokens, mask = sampling.pad_prompts([[5] * 12, [6] * 3], BUCKETS)
    fn(params, tokens, mask, jax.random.key(0))
  assert programs["_sample_impl"] == 2, programs  # a new bucket compiles once


@pytest.mark.slow
def test_sharded_sampling_equals_single_device(params, prompts, base_rollout):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  params8 = models.init_params(MC, jax.random.key(0), mesh)
  fn = sampling.make_sampler(MC, BASE, mesh, models.param_shardings(MC, mesh))
  tokens, mask = prompts
  r = fn(params8, tokens, mask, jax.random.key(1))
  assert r.completion_tokens.sharding.spec[0] == ("data", "fsdp")
  np.testing.assert_array_equal(np.asarray(r.completion_tokens),
                                base_rollout.completion_tokens)
  np.testing.assert_allclose(np.asarray(r.policy_logprobs),
                             base_rollout.policy_logprobs, atol=1e-5)


@pytest.mark.slow
def test_prompt_count_not_dividing_the_mesh_is_padded_and_trimmed(params, prompts):
  """3 prompts on 8 batch shards: the rows equal an unsharded call's."""
  mesh = sharding.mesh_from_config(
      ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1}))
  assert mesh.shape["fsdp"] == 8
  params8 = models.init_params(MC, jax.random.key(0), mesh)
  fn = sampling.make_sampler(MC, BASE, mesh, models.param_shardings(MC, mesh))
  tokens, mask = prompts
  expected = run(params, (tokens[:3], mask[:3]))
  r = jax.device_get(fn(params8, tokens[:3], mask[:3], jax.random.key(1)))
  assert r.completion_tokens.shape == (3 * BASE.num_samples, BASE.max_new_tokens)
  for got, want in zip(r, expected):
    if want is None:  # fields the sampler does not fill (observation_mask)
      assert got is None
      continue
    np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(r.prompt_tokens, np.repeat(tokens[:3], 3, 0))
  assert r.completion_mask.any(1).all()


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_cache_dtype_defaults_to_the_model_compute_dtype(params, prompts):
  """A float32 model's default cache is float32: recorded logprobs equal a
  full float32 forward to 1e-5, which a bfloat16 cache does not reach."""
  assert sampling.SamplerConfig().cache_dtype is None
  tokens, mask = prompts

  def error(cache_dtype):
    r = run(params, prompts, BASE.replace(cache_dtype=cache_dtype))
    seq, seq_mask = r.sequences()
    logits, _ = models.Decoder(MC).apply(
        {"params": params}, seq, models.positions_from_mask(seq_mask),
        input_mask_BxT=seq_mask, return_logits=True)
    z = np.asarray(logits, np.float64)[:, tokens.shape[1] - 1:-1]
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ref = np.take_along_axis(logp, r.completion_tokens[..., None], -1)[..., 0]
    m = r.completion_mask
    return np.abs(r.policy_logprobs[m] - ref[m]).max()

  assert error(None) < 1e-5
  assert error("bfloat16") > 1e-4
  with pytest.raises(ValueError, match="cache_dtype='float8'"):
    sampling.SamplerConfig(cache_dtype="float8")


@pytest.mark.slow
def test_bf16_cache_runs_and_stays_close(params, prompts, base_rollout):
  """A bfloat16 cache's logprobs stay within bf16 rounding of a float32
  full forward over the same tokens (teacher-forced, so no near-tie in the
  greedy path can change which tokens are compared)."""
  r = run(params, prompts, BASE.replace(cache_dtype="bfloat16",
                                        method=sampling.SamplingMethod(greedy=True)))
  assert r.completion_tokens.shape == base_rollout.completion_tokens.shape
  assert np.isfinite(r.policy_logprobs).all()
  seq, seq_mask = r.sequences()
  lp, _ = models.sequence_logprobs(params, MC, seq, seq_mask)
  ref = np.asarray(lp, np.float64)[:, r.prompt_tokens.shape[1]:]
  diff = np.abs(r.policy_logprobs - ref)[r.completion_mask]
  print(f"bf16 cache: |logprob - fp32| max {diff.max():.2e} mean {diff.mean():.2e}")
  assert diff.max() < 2e-2 and diff.mean() < 5e-3
  assert diff.max() > 1e-6  # the cache really is bfloat16


# --- sampling distributions -------------------------------------------------

PROBS = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.06, 0.04, 0.02, 0.01])


def _exact(method):
  """Sequential truncation (each step sees the previous one's survivors)."""
  z = np.log(PROBS) / method.temperature

  def probs(z):
    q = np.where(np.isfinite(z), np.exp(z - z[np.isfinite(z)].max()), 0.0)
    return q / q.sum()

  if method.top_k is not None:
    z = np.where(z >= np.sort(z)[::-1][method.top_k - 1], z, -np.inf)
  if method.top_p is not None:
    p = probs(z)
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(len(z), bool)
    keep[order[mass_before < method.top_p]] = True
    z = np.where(keep, z, -np.inf)
  if method.min_p is not None:
    p = probs(z)
    z = np.where(p >= method.min_p * p.max(), z, -np.inf)
  return probs(z)


@pytest.mark.parametrize("method", [
    sampling.SamplingMethod(temperature=1.0),
    sampling.SamplingMethod(temperature=0.6),
    sampling.SamplingMethod(temperature=1.5, top_k=4),
    sampling.SamplingMethod(temperature=1.0, top_p=0.7),
    sampling.SamplingMethod(temperature=1.2, min_p=0.2),
    sampling.SamplingMethod(temperature=0.9, top_k=6, top_p=0.8, min_p=0.1),
], ids=str)
def test_sampling_distribution_chi_square(method):
  n = 20_000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, len(PROBS)))
  tokens, logp = jax.jit(method.get_next_tokens)(logits, jax.random.key(42))
  expected = _exact(method)
  counts = np.bincount(np.asarray(tokens), minlength=len(PROBS))
  support = expected > 0
  assert counts[~support].sum() == 0
  _, pvalue = stats.chisquare(counts[support], n * expected[support])
  assert pvalue > 1e-3
  np.testing.assert_allclose(np.exp(np.asarray(logp)), expected[np.asarray(tokens)],
                             rtol=1e-5)


def test_config_errors():
  with pytest.raises(ValueError, match="sampler.temperature=0"):
    sampling.SamplingMethod(temperature=0)
  with pytest.raises(ValueError, match="sampler.top_p=1.5"):
    sampling.SamplingMethod(top_p=1.5)
  with pytest.raises(ValueError, match="sampler.num_samples=0"):
    sampling.SamplerConfig(num_samples=0)
  with pytest.raises(ValueError, match="longer than the largest"):
    sampling.pad_prompts([[1] * 20], (8, 16))


def test_policy_logprobs_are_not_computed_unless_asked(params, prompts,
                                                       base_rollout):
  r = run(params, prompts, BASE.replace(record_policy_logprobs=False))
  assert r.policy_logprobs is None
  # Everything else is the same rollout.
  np.testing.assert_array_equal(r.completion_tokens,
                                base_rollout.completion_tokens)
  np.testing.assert_allclose(r.sampler_logprobs, base_rollout.sampler_logprobs,
                             atol=1e-6)
