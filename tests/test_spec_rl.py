"""SPEC-RL speculative rollouts (rljax.sampling.speculative) and the draft store."""

import jax
import numpy as np
import pytest
from scipy import stats

from rljax import checkpoint, models, sampling
from tests import compile_count

MC = models.get_preset("tiny")
BUCKETS = (8, 16)
BASE = sampling.SamplerConfig(
    num_samples=3, max_new_tokens=12, cache_dtype="float32",
    method=sampling.SamplingMethod(temperature=0.8, top_k=40),
    training_temperature=1.0, record_policy_logprobs=True, segment_slots=4)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def other_params(params):
  """A nearby policy (as after some RL steps): 30% of another init mixed in."""
  far = models.init_params(MC, jax.random.key(7))
  return jax.tree.map(lambda a, b: 0.7 * a + 0.3 * b, params, far)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, MC.vocab_size, size=n)) for n in (3, 7, 5, 6)]
  return sampling.pad_prompts(lists, BUCKETS)


@pytest.fixture(scope="module")
def eos(params, prompts):
  """A token that ends some samples early but not all: the one in most rows
  of a plain run (key 1) without an EOS, short of every row."""
  tokens, mask = prompts
  plain = jax.device_get(sampling.sample(params, tokens, mask,
                                         jax.random.key(1), model_config=MC,
                                         config=BASE))
  rows = {}
  for row in plain.completion_tokens:
    for token in set(row.tolist()):
      rows[token] = rows.get(token, 0) + 1
  return max((t for t, n in rows.items() if n < len(plain.completion_tokens)),
             key=lambda t: (rows[t], -t))


@pytest.fixture(scope="module")
def samplers(eos):
  config = BASE.replace(eos_ids=(eos,))
  return (sampling.make_sampler(MC, config),
          sampling.make_speculative_sampler(MC, config))


def _draft(rollout):
  return sampling.Draft(rollout.completion_tokens, rollout.completion_mask,
                        rollout.sampler_logprobs)


def _recomputed_logprobs(params, rollout):
  """Full-forward (no cache) logprobs of the completion tokens."""
  tokens, mask = rollout.sequences()
  lp, _ = models.sequence_logprobs(params, MC, tokens, mask)
  return np.asarray(lp)[:, rollout.prompt_tokens.shape[1]:]


@pytest.mark.slow
def test_self_draft_is_all_accepted_and_equals_plain_sampling(
    params, prompts, samplers):
  plain_fn, spec_fn = samplers
  tokens, mask = prompts
  plain = jax.device_get(plain_fn(params, tokens, mask, jax.random.key(1)))
  assert plain.lengths.min() < 12 < plain.lengths.max() + 1  # EOS and not
  spec, accepted = jax.device_get(
      spec_fn(params, tokens, mask, _draft(plain), jax.random.key(2)))
  np.testing.assert_array_equal(accepted, plain.lengths)
  for name in ("completion_tokens", "completion_mask", "lengths", "finished"):
    np.testing.assert_array_equal(getattr(spec, name), getattr(plain, name))
  np.testing.assert_allclose(spec.sampler_logprobs, plain.sampler_logprobs,
                             atol=1e-5)
  m = spec.completion_mask
  np.testing.assert_allclose(spec.policy_logprobs[m],
                             _recomputed_logprobs(params, spec)[m], atol=1e-5)


@pytest.mark.slow
def test_other_policy_draft_keeps_a_prefix_and_logprobs_are_current(
    params, other_params, prompts, samplers):
  plain_fn, spec_fn = samplers
  tokens, mask = prompts
  old = jax.device_get(plain_fn(other_params, tokens, mask, jax.random.key(3)))
  spec, accepted = jax.device_get(
      spec_fn(params, tokens, mask, _draft(old), jax.random.key(4)))
  assert (accepted < old.lengths).any() and (accepted > 0).any()
  for row, a in enumerate(accepted):
    np.testing.assert_array_equal(spec.completion_tokens[row, :a],
                                  old.completion_tokens[row, :a])
  # Every kept token (accepted or drawn) is scored under the current policy.
  m = spec.completion_mask
  np.testing.assert_allclose(spec.policy_logprobs[m],
                             _recomputed_logprobs(params, spec)[m], atol=1e-5)
  assert (spec.lengths >= accepted).all()
  assert ((spec.lengths == 12) | spec.finished).all()


@pytest.mark.slow
def test_greedy_speculation_is_exact(params, other_params, prompts):
  """Greedy accepts exactly the current argmax tokens: output == plain greedy."""
  config = BASE.replace(method=sampling.SamplingMethod(greedy=True))
  tokens, mask = prompts
  old = sampling.make_sampler(MC, config)(other_params, tokens, mask,
                                          jax.random.key(0))
  plain = jax.device_get(sampling.make_sampler(MC, config)(
      params, tokens, mask, jax.random.key(0)))
  spec, _ = jax.device_get(sampling.make_speculative_sampler(MC, config)(
      params, tokens, mask, _draft(old), jax.random.key(5)))
  np.testing.assert_array_equal(spec.completion_tokens, plain.completion_tokens)


def _first_token_probs(params, prompt_tokens, prompt_mask, temperature):
  logits, _ = models.Decoder(MC).apply(
      {"params": params}, prompt_tokens, models.positions_from_mask(prompt_mask),
      input_mask_BxT=prompt_mask, return_logits=True)
  z = np.asarray(logits, np.float64)[0, -1] / temperature
  p = np.exp(z - z.max())
  return p / p.sum()


@pytest.mark.parametrize("log_lenience", [0.0, 0.5])
@pytest.mark.slow
def test_different_policy_draft_chi_square(params, other_params, log_lenience):
  """Kept first tokens follow the lenient rule's marginal, measured against
  plain sampling's distribution (the rule is documented as lenient)."""
  g, temperature = 4000, 0.3
  config = sampling.SamplerConfig(
      num_samples=g, max_new_tokens=1, cache_dtype="float32",
      method=sampling.SamplingMethod(temperature=temperature))
  tokens, mask = sampling.pad_prompts([[5, 9, 11]], BUCKETS)
  p = _first_token_probs(params, tokens, mask, temperature)
  q = _first_token_probs(other_params, tokens, mask, temperature)
  old = sampling.make_sampler(MC, config)(other_params, tokens, mask,
                                          jax.random.key(11))
  spec, accepted = jax.device_get(sampling.make_speculative_sampler(
      MC, config, log_lenience=log_lenience)(
          params, tokens, mask, _draft(old), jax.random.key(12)))
  lenience = np.exp(log_lenience)
  keep = np.minimum(1.0, lenience * p / q) * q
  marginal = keep + (1.0 - keep.sum()) * p
  counts = np.bincount(spec.completion_tokens[:, 0], minlength=MC.vocab_size)

  def chi2_pvalue(expected):
    big = expected * g >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum()) * g
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

  assert chi2_pvalue(marginal) > 1e-3
  deviation = 0.5 * np.abs(marginal - p).sum()
  print(f"log_lenience={log_lenience}: acceptance {accepted.mean():.3f}, "
        f"total variation from plain sampling {deviation:.3f}")
  assert 0.02 < deviation < 0.5  # measurable with 4000 draws: p-value below
  assert chi2_pvalue(p) < 1e-3
  np.testing.assert_allclose(accepted.mean(), keep.sum(), atol=0.03)


@pytest.mark.slow
def test_no_recompile_across_new_prompts_in_a_bucket(params):
  config = BASE.replace(max_new_tokens=6)
  plain_fn = sampling.make_sampler(MC, config)
  spec_fn = sampling.make_speculative_sampler(MC, config)
  rng = np.random.RandomState(5)
  with compile_count.lowerings() as programs:
    for lengths in ((3, 5, 2, 4), (8, 2, 6, 1), (6, 6, 7, 3)):
      tokens, mask = sampling.pad_prompts(
          [list(rng.randint(4, 200, size=n)) for n in lengths], BUCKETS)
      old = plain_fn(params, tokens, mask, jax.random.key(0))
      jax.block_until_ready(spec_fn(params, tokens, mask, _draft(old),
                                    jax.random.key(1)))
  assert programs["_speculative_impl"] == 1, programs
  assert programs["_sample_impl"] == 1, programs


def test_draft_store_is_bounded_and_keyed_by_prompt():
  store = sampling.DraftStore(max_prompts=2)
  rows = lambda v: (np.full((2, 3), v), np.ones((2, 3), bool),  # noqa: E731
                    np.full((2, 3), -1.0))
  store.update([[1], [2]], *(np.concatenate([a, b]) for a, b in
                             zip(rows(10), rows(20))))
  assert store.lookup([[3]], 2, 3) is None
  draft = store.lookup([[2], [3]], 2, 3)
  np.testing.assert_array_equal(draft.tokens, [[20] * 3] * 2 + [[0] * 3] * 2)
  np.testing.assert_array_equal(draft.mask.any(1), [True, True, False, False])
  assert store.lookup([[2]], 2, 4) is None  # another max_new_tokens: no draft
  store.update([[3]], *rows(30))  # evicts [1], the least recently used
  assert len(store) == 2 and store.lookup([[1]], 2, 3) is None
  assert store.lookup([[2]], 2, 3) is not None
  with pytest.raises(ValueError, match="spec_store_prompts=0"):
    sampling.DraftStore(max_prompts=0)
  with pytest.raises(ValueError, match="spec_log_lenience=-1"):
    sampling.make_speculative_sampler(MC, BASE, log_lenience=-1)


def test_draft_store_round_trips_through_a_checkpoint(tmp_path):
  """``arrays()`` saved as a checkpoint item and loaded into a new store:
  same drafts for every prompt (of any length), same LRU order."""
  rng = np.random.RandomState(0)
  store = sampling.DraftStore(max_prompts=3)
  prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [0, 3]]  # the first is evicted
  for p in prompts:
    store.update([p], rng.randint(0, 50, (2, 4)), rng.rand(2, 4) < 0.5,
                 rng.randn(2, 4).astype(np.float32))
  store.lookup([[8]], 2, 4)  # [8] becomes the most recently used
  manager = checkpoint.CheckpointManager(tmp_path / "ckpt", async_save=False)
  manager.save(1, {"x": np.zeros(2)}, {}, host_arrays={
      "drafts": store.arrays()})
  manager.save(2, {"x": np.zeros(2)}, {}, host_arrays={"drafts": None})
  assert manager.restore_host_arrays(2, "drafts") is None
  again = sampling.DraftStore(max_prompts=3)
  again.load_arrays(manager.restore_host_arrays(1, "drafts"))
  manager.close()
  assert len(again) == 3 and again.lookup([[5, 6, 7]], 2, 4) is None
  for p in prompts[1:]:
    want, got = store.lookup([p], 2, 4), again.lookup([p], 2, 4)
    for a, b in zip(want, got):
      np.testing.assert_array_equal(a, b)
  # LRU order survives: [9..12] and [0, 3] were looked up last just now, so
  # one more prompt evicts [8] from both.
  for s in (store, again):
    s.update([[1, 1]], np.zeros((2, 4)), np.ones((2, 4), bool), np.zeros((2, 4)))
  assert store.lookup([[8]], 2, 4) is None and again.lookup([[8]], 2, 4) is None



def test_a_frozen_store_drafts_each_entry_from_rows_of_its_own():
  """Rollout allocation's step: a prompt sampled in several entries of one
  row each. Inside ``frozen`` the c-th entry of a prompt drafts its stored
  rows' c-th block, entries past the stored rows (c + 1 > 3 rows here)
  get no draft, and the step's own rows are not drafted from until it
  ends; then the prompt's entry is all its rows of the step, in order, and
  survives a checkpoint's arrays with entries of other row counts."""
  store = sampling.DraftStore(max_prompts=4)
  row = lambda v: (np.full((1, 2), v), np.ones((1, 2), bool),  # noqa: E731
                   np.full((1, 2), -0.5 * v))
  # Three rows for prompt [7], stored as one group of G = 3.
  store.update([[7]], np.array([[1, 1], [2, 2], [3, 3]]),
               np.ones((3, 2), bool), np.zeros((3, 2)))
  assert store.lookup([[7]], 1, 2) is None  # outside: [G, T] must match
  with store.frozen():
    first = store.lookup([[7], [7]], 1, 2)  # entries 0 and 1
    np.testing.assert_array_equal(first.tokens, [[1, 1], [2, 2]])
    store.update([[7], [7]], *(np.concatenate(x) for x in zip(row(8), row(9))))
    third = store.lookup([[7], [7]], 1, 2)  # entry 2: row 3; entry 3: none
    np.testing.assert_array_equal(third.tokens, [[3, 3], [0, 0]])
    np.testing.assert_array_equal(third.mask.any(1), [True, False])
    assert store.lookup([[7]], 1, 2) is None  # entry 4: past the rows
    store.update([[7]], *row(10))
    with pytest.raises(RuntimeError, match="not reentrant"):
      with store.frozen():
        pass
  # The step's rows, in order: 8, 9, 10 (the waiting updates applied).
  with store.frozen():
    again = store.lookup([[7], [7], [7], [7]], 1, 2)
  np.testing.assert_array_equal(again.tokens, [[8, 8], [9, 9], [10, 10],
                                               [0, 0]])
  store.update([[4]], np.full((2, 2), 4), np.ones((2, 2), bool),
               np.zeros((2, 2)))  # another row count
  loaded = sampling.DraftStore(max_prompts=4)
  loaded.load_arrays(store.arrays())
  for s in (store, loaded):
    np.testing.assert_array_equal(s.lookup([[4]], 2, 2).tokens, [[4, 4]] * 2)
    with s.frozen():
      np.testing.assert_array_equal(
          s.lookup([[7], [7], [7], [7]], 1, 2).tokens,
          [[8, 8], [9, 9], [10, 10], [0, 0]])

@pytest.mark.slow
def test_prompt_count_not_dividing_the_mesh_is_padded_and_trimmed(
    params, prompts, samplers, eos):
  """3 prompts (and their drafts) on 8 batch shards: the speculative call
  pads rows and drafts alike and returns the rows of an unsharded call."""
  import ml_collections
  from rljax import sharding
  plain_fn, spec_fn = samplers
  mesh = sharding.mesh_from_config(
      ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1}))
  assert mesh.shape["fsdp"] == 8
  params8 = models.init_params(MC, jax.random.key(0), mesh)
  config = BASE.replace(eos_ids=(eos,))
  spec8 = sampling.make_speculative_sampler(
      MC, config, mesh, models.param_shardings(MC, mesh))
  tokens, mask = (x[:3] for x in prompts)
  plain = jax.device_get(plain_fn(params, tokens, mask, jax.random.key(1)))
  draft = _draft(plain)
  want, want_acc = jax.device_get(
      spec_fn(params, tokens, mask, draft, jax.random.key(2)))
  got, got_acc = jax.device_get(
      spec8(params8, tokens, mask, draft, jax.random.key(2)))
  assert got.completion_tokens.shape == (3 * config.num_samples, 12)
  np.testing.assert_array_equal(got_acc, want_acc)
  for g, w in zip(got, want):
    if w is None:  # fields the sampler does not fill (observation_mask)
      assert g is None
      continue
    np.testing.assert_allclose(g, w, atol=1e-5)
