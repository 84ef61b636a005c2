import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sharding
from tests import reference_model

TINY = models.get_preset("tiny")

VARIANTS = {
    "llama": TINY,
    "llama3_rope_scaling": TINY.replace(
        rope_theta=500_000.0,
        rope_scaling=models.RopeScaling(factor=8.0, original_max_position=16)),
    "qwen2_bias_untied": TINY.replace(qkv_bias=True, tie_embeddings=False),
    "qwen3_qk_norm": TINY.replace(qk_norm=True, num_kv_heads=1),
    "gemma_like": TINY.replace(
        norm_offset=1.0, post_norms=True, embed_scale=True, qk_norm=True,
        activation="gelu_tanh", query_scale=0.2, attn_logit_softcap=5.0,
        final_logit_softcap=3.0, sliding_window=3, global_every=2,
        rope_local_theta=100.0),
}


def _perturbed_params(config, seed=0):
  """Random params, with norms and biases moved away from their 0/1 init."""
  params = models.init_params(config, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, leaves)


def assert_close(actual, desired, tol=1e-5):
  """Max abs difference within ``tol`` relative to the logits' scale (>= 1)."""
  actual, desired = np.asarray(actual), np.asarray(desired)
  scale = max(1.0, float(np.abs(desired).max()))
  err = float(np.abs(actual - desired).max())
  assert err <= tol * scale, f"max abs diff {err:.3g} > {tol} x scale {scale:.3g}"


@functools.lru_cache(maxsize=None)
def _apply(config):
  return jax.jit(functools.partial(models.Decoder(config).apply,
                                   return_logits=True))


def _logits(config, params, tokens, mask=None):
  tokens = jnp.asarray(tokens)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
  out, _ = _apply(config)({"params": params}, tokens,
                          models.positions_from_mask(mask), input_mask_BxT=mask)
  return np.asarray(out)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.slow
def test_forward_matches_numpy_reference(name):
  config = VARIANTS[name]
  params = _perturbed_params(config)
  tokens = np.random.RandomState(0).randint(0, config.vocab_size, size=(1, 11))
  ours = _logits(config, params, tokens)[0]
  ref = reference_model.forward(jax.device_get(params), config, tokens[0])
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def tiny_params():
  return _perturbed_params(TINY)


def test_causality(tiny_params):
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, TINY.vocab_size, size=(2, 12))
  base = _logits(TINY, tiny_params, tokens)
  for t in (0, 5, 10):
    changed = tokens.copy()
    changed[:, t + 1:] = rng.randint(0, TINY.vocab_size, size=changed[:, t + 1:].shape)
    out = _logits(TINY, tiny_params, changed)
    np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
    assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-3


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.slow
def test_padded_batch_equals_each_sequence_alone(tiny_params, side):
  rng = np.random.RandomState(2)
  lengths, width = [3, 7, 10], 10
  seqs = [rng.randint(4, TINY.vocab_size, size=n) for n in lengths]
  tokens = np.zeros((3, width), np.int32)
  mask = np.zeros((3, width), bool)
  for i, s in enumerate(seqs):
    sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
    tokens[i, sl], mask[i, sl] = s, True
  batched = _logits(TINY, tiny_params, tokens, mask)
  for i, s in enumerate(seqs):
    alone = _logits(TINY, tiny_params, s[None])[0]
    assert_close(batched[i][mask[i]], alone)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_logprobs_are_zero_where_token_or_predecessor_is_padding(
    tiny_params, side):
  """Each row against the numpy reference model run on the row alone."""
  rng = np.random.RandomState(5)
  lengths, width = [3, 6, 8], 8
  seqs = [rng.randint(4, TINY.vocab_size, size=n) for n in lengths]
  tokens = np.zeros((3, width), np.int32)
  mask = np.zeros((3, width), bool)
  for i, seq in enumerate(seqs):
    sl = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
    tokens[i, sl], mask[i, sl] = seq, True
  logp, ent = jax.jit(models.sequence_logprobs, static_argnums=1)(
      tiny_params, TINY, tokens, mask)
  params = jax.device_get(tiny_params)
  expected_logp = np.zeros((3, width))
  expected_ent = np.zeros((3, width))
  for i, seq in enumerate(seqs):
    z = reference_model.forward(params, TINY, seq).astype(np.float64)[:-1]
    z = z - z.max(-1, keepdims=True)
    lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    start = width - len(seq) if side == "left" else 0
    cols = slice(start + 1, start + len(seq))  # real tokens after the first
    expected_logp[i, cols] = lsm[np.arange(len(seq) - 1), seq[1:]]
    expected_ent[i, cols] = -(np.exp(lsm) * lsm).sum(-1)
  np.testing.assert_allclose(logp, expected_logp, atol=2e-4)
  np.testing.assert_allclose(ent, expected_ent, atol=2e-4)
  # Only the first real token of each row and the padding are zeroed.
  assert (np.asarray(logp) != 0).sum() == sum(n - 1 for n in lengths)


@pytest.mark.slow
def test_gemma_variant_left_padding_with_sliding_window():
  config = VARIANTS["gemma_like"]
  params = _perturbed_params(config)
  rng = np.random.RandomState(3)
  s = rng.randint(0, config.vocab_size, size=6)
  tokens = np.zeros((1, 9), np.int32)
  tokens[0, 3:] = s
  mask = tokens > -1
  mask[0, :3] = False
  batched = _logits(config, params, tokens, mask)[0, 3:]
  alone = _logits(config, params, s[None])[0]
  assert_close(batched, alone)


def _decode_step_by_step(config, params, tokens, mask, prompt_len, prefix_groups=None):
  """Prefill ``prompt_len`` slots, then feed the rest one token at a time."""
  apply = jax.jit(functools.partial(models.Decoder(config).apply,
                                    return_logits=True))
  b, t = tokens.shape
  positions = models.positions_from_mask(jnp.asarray(mask))
  cache = models.init_cache(config, b, t, dtype=jnp.float32)
  out, cache = apply({"params": params}, tokens[:, :prompt_len],
                     positions[:, :prompt_len], cache,
                     input_mask_BxT=mask[:, :prompt_len])
  steps = [np.asarray(out)]
  for i in range(prompt_len, t):
    out, cache = apply({"params": params}, tokens[:, i:i + 1],
                       positions[:, i:i + 1], cache,
                       input_mask_BxT=mask[:, i:i + 1])
    steps.append(np.asarray(out))
  return np.concatenate(steps, 1)


def test_kv_cache_decoding_equals_full_forward(tiny_params):
  rng = np.random.RandomState(4)
  tokens = rng.randint(4, TINY.vocab_size, size=(3, 12)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  mask[0, :4] = False  # left-padded, ragged prompts of lengths 2, 6, 4
  mask[2, :2] = False
  full = _logits(TINY, tiny_params, tokens, mask)
  stepped = _decode_step_by_step(TINY, tiny_params, jnp.asarray(tokens),
                                 jnp.asarray(mask), prompt_len=6)
  assert_close(stepped[mask], full[mask])


@pytest.mark.parametrize("name", ["llama", "gemma_like"])
@pytest.mark.slow
def test_shared_prefix_cache_equals_repeated_prompts(name):
  config = VARIANTS[name]
  params = _perturbed_params(config)
  rng = np.random.RandomState(5)
  groups, g, p, n = 2, 3, 5, 4
  prompts = rng.randint(4, config.vocab_size, size=(groups, p)).astype(np.int32)
  pmask = np.ones_like(prompts, bool)
  pmask[1, :2] = False
  cont = rng.randint(4, config.vocab_size, size=(groups * g, n)).astype(np.int32)
  apply = jax.jit(functools.partial(models.Decoder(config).apply,
                                    return_logits=True))
  # Reference: the full sequences, each prompt repeated G times.
  tokens = np.concatenate([np.repeat(prompts, g, 0), cont], 1)
  mask = np.concatenate([np.repeat(pmask, g, 0), np.ones_like(cont, bool)], 1)
  full = _logits(config, params, tokens, mask)[:, p:]
  # Shared prefix: prefill the G-times-smaller prompt batch once.
  prefix = models.init_cache(config, groups, p, dtype=jnp.float32)
  _, prefix = apply({"params": params}, prompts,
                    models.positions_from_mask(jnp.asarray(pmask)), prefix,
                    input_mask_BxT=pmask)
  cache = models.init_cache(config, groups * g, n, dtype=jnp.float32,
                            prefix=prefix)
  start = np.repeat(pmask.sum(1), g)[:, None]
  positions = start + np.arange(n)[None]
  out, cache = apply({"params": params}, cont, positions, cache)
  assert_close(out, full)
  assert cache.prefix.layers[0].k.shape[0] == groups


def _numpy_attention(q, k, v, mask, scale, softcap):
  """Softmax attention in float64 numpy; ``k``/``v`` are ``[B, S, N, H]``."""
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if softcap is not None:
    s = softcap * np.tanh(s / softcap)
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)


def _dense_attention(q, k, v, mask, scale, softcap):
  """Masked softmax attention over all ``T x S`` (``jnp``, differentiated by
  JAX): the reference for ``attend``'s blocks and hand-written backward."""
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("t,softcap", [(120, None), (120, 4.0), (9, None)])
def test_attend_and_its_gradients_equal_dense_attention(t, softcap):
  """``attend(causal=True)`` (3 query blocks at T=120, one at T=9; GQA) on
  left-padded rows and two packed segments: the outputs against float64
  NumPy attention, the hand-written gradients of q, k and v against JAX's
  gradients of dense masked attention. Padding queries (every key masked)
  get a zero cotangent: nothing reads them."""
  b, n, kh, h = 3, 4, 2, 8
  rng = np.random.RandomState(t)
  q = rng.randn(b, t, n, h).astype(np.float32)
  k, v = (rng.randn(b, t, kh, h).astype(np.float32) for _ in range(2))
  real = np.ones((b, t), bool)
  real[1, :t // 3] = False  # left padding
  segment = np.where(np.arange(t) < t // 2, 1, 2)  # row 2: two packed rows
  mask = np.tril(np.ones((t, t), bool))[None] & real[:, None, :]
  mask[2] &= segment[:, None] == segment[None, :]
  weight = rng.randn(b, t, n, h).astype(np.float32) * real[:, :, None, None]

  def loss(f, q, k, v):
    return jnp.sum(f(q, k, v, jnp.asarray(mask), 0.3, softcap) * weight)

  blocked = lambda *a: models.transformer.attend(*a[:4], scale=a[4],
                                                 softcap=a[5], causal=True)
  got = blocked(q, k, v, jnp.asarray(mask), 0.3, softcap)
  want = _numpy_attention(q.astype(np.float64),
                          np.repeat(k, n // kh, 2).astype(np.float64),
                          np.repeat(v, n // kh, 2).astype(np.float64), mask,
                          0.3, softcap)
  real4 = real[:, :, None, None]
  np.testing.assert_allclose(np.where(real4, got, 0), np.where(real4, want, 0),
                             atol=2e-6)
  grads = jax.grad(functools.partial(loss, blocked), (0, 1, 2))(q, k, v)
  dense = jax.grad(functools.partial(loss, _dense_attention),
                   (0, 1, 2))(q, k, v)
  for name, a, d in zip("qkv", grads, dense):
    scale = np.max(np.abs(np.asarray(d)))
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(d) / scale,
                               atol=2e-6, err_msg=name)


def test_attend_blocks_keep_bfloat16_and_its_gradients_follow_float32():
  """bfloat16 q, k, v through the blocks' hand-written backward: outputs and
  gradients stay bfloat16 and within bfloat16's rounding of float32's."""
  b, t, n, kh, h = 2, 120, 4, 2, 8
  rng = np.random.RandomState(1)
  q, k, v = (rng.randn(b, t, m, h).astype(np.float32) for m in (n, kh, kh))
  mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
  weight = rng.randn(b, t, n, h).astype(np.float32)

  def loss(q, k, v):
    out = models.transformer.attend(q, k, v, mask, scale=0.3, causal=True)
    return jnp.sum(out.astype(jnp.float32) * weight), out.dtype

  grads32, _ = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  grads16, dtype = jax.grad(loss, (0, 1, 2), has_aux=True)(*bf)
  assert dtype == jnp.bfloat16
  for g16, g32 in zip(grads16, grads32):
    assert g16.dtype == jnp.bfloat16
    scale = np.max(np.abs(np.asarray(g32)))
    np.testing.assert_allclose(np.asarray(g16, np.float32) / scale,
                               np.asarray(g32) / scale, atol=3e-2)


def test_the_attention_benchmarks_baseline_is_attend_differentiated_by_jax():
  """``launch/bench_attention.py`` times ``attend`` against the same blocks
  differentiated by JAX: the two give the same outputs and gradients."""
  from launch import bench_attention  # pylint: disable=import-outside-toplevel
  b, t, n, kh, h = 2, 120, 4, 2, 8
  rng = np.random.RandomState(2)
  q, k, v = (rng.randn(b, t, m, h).astype(np.float32) for m in (n, kh, kh))
  mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
  weight = rng.randn(b, t, n, h).astype(np.float32)

  def loss(f, q, k, v):
    return jnp.sum(f(q, k, v, mask, scale=0.3, causal=True) * weight)

  for a, d in zip(
      jax.grad(functools.partial(loss, models.transformer.attend),
               (0, 1, 2))(q, k, v),
      jax.grad(functools.partial(loss, bench_attention.autodiff_blocks),
               (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(d), atol=1e-5)


@pytest.mark.parametrize("t", [1, 5])  # the no-dot path, and the dot path
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.slow
def test_decode_attend_equals_numpy_softmax_attention(t, with_prefix):
  """``decode_attend`` on a ``[B, K, S, H]`` cache (with 3 blocks of 4 slots,
  masked slots, GQA and a soft-cap) against dense float64 attention."""
  b, n, kh, h, s, sp, groups = 4, 4, 2, 8, 12, 5, 2
  rng = np.random.RandomState(t)
  q = rng.randn(b, t, n, h).astype(np.float32)
  k, v = (rng.randn(b, kh, s, h).astype(np.float32) for _ in range(2))
  mask = rng.rand(b, t, s) < 0.6
  mask[:, :, 0] = True
  keys = np.repeat(np.transpose(k, (0, 2, 1, 3)), n // kh, axis=2)
  values = np.repeat(np.transpose(v, (0, 2, 1, 3)), n // kh, axis=2)
  full_mask, prefix = mask, None
  if with_prefix:
    pk, pv = (rng.randn(groups, kh, sp, h).astype(np.float32) for _ in range(2))
    pmask = rng.rand(groups, t, sp) < 0.7
    prefix = (jnp.asarray(pk), jnp.asarray(pv), jnp.asarray(pmask))
    rows = np.arange(b) // (b // groups)
    expand = lambda x: np.repeat(np.transpose(x, (0, 2, 1, 3)), n // kh, 2)[rows]
    keys = np.concatenate([expand(pk), keys], 1)
    values = np.concatenate([expand(pv), values], 1)
    full_mask = np.concatenate([pmask[rows], mask], 2)
  got = models.transformer.decode_attend(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
      scale=0.3, softcap=4.0, prefix=prefix, block=4)
  want = _numpy_attention(q.astype(np.float64), keys, values, full_mask, 0.3,
                          4.0)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sharded_forward_equals_single_device_and_params_follow_rules():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  config = TINY.replace(qkv_bias=True, tie_embeddings=False)
  params1 = models.init_params(config, jax.random.key(7))
  params8 = models.init_params(config, jax.random.key(7), mesh)
  # The same values, created directly with the shardings the rules ask for.
  for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params8)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  P = jax.sharding.PartitionSpec
  assert params8["layers_0"]["attn"]["q_kernel"].sharding.spec == P(
      "fsdp", "tensor", None)
  assert params8["layers_0"]["attn"]["o_kernel"].sharding.spec == P(
      "tensor", None, "fsdp")
  assert params8["layers_0"]["mlp"]["down_kernel"].sharding.spec == P(
      "tensor", "fsdp")
  assert params8["embedding"].sharding.spec == P("tensor", "fsdp")
  assert params8["lm_head"].sharding.spec == P("fsdp", "tensor")
  q = params8["layers_0"]["attn"]["q_kernel"]
  assert {s.data.shape for s in q.addressable_shards} == {(32, 2, 16)}

  tokens = np.random.RandomState(8).randint(0, config.vocab_size, (8, 10))
  mask = np.ones_like(tokens, bool)
  mask[:4, :3] = False
  expected = _logits(config, params1, tokens, mask)
  batch = sharding.shard_batch({"t": tokens, "m": mask}, mesh)
  with jax.set_mesh(mesh):
    out, _ = jax.jit(functools.partial(models.Decoder(config).apply,
                                       return_logits=True))(
        {"params": params8}, batch["t"],
        models.positions_from_mask(batch["m"]), input_mask_BxT=batch["m"])
  assert out.sharding.spec[0] == ("data", "fsdp")
  assert_close(out, expected)


@pytest.mark.slow
def test_bf16_params_and_compute_track_fp32(tiny_params):
  config = TINY.replace(param_dtype="bfloat16", dtype="bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  tokens = np.random.RandomState(9).randint(0, TINY.vocab_size, (2, 8))
  out16 = _logits(config, params16, tokens)
  out32 = _logits(TINY, tiny_params, tokens)
  assert out16.dtype == np.float32  # logits are always fp32
  assert models.init_params(config, jax.random.key(0))["embedding"].dtype == jnp.bfloat16
  scale = np.abs(out32).max()
  assert np.abs(out16 - out32).max() < 0.05 * scale


@pytest.mark.slow
def test_remat_gives_the_same_gradients(tiny_params):
  tokens = jnp.asarray(np.random.RandomState(10).randint(0, 256, (2, 8)))
  pos = models.positions_from_mask(jnp.ones_like(tokens))

  def loss(params, config):
    out, _ = models.Decoder(config).apply({"params": params}, tokens, pos,
                                          return_logits=True)
    return jnp.mean(jax.nn.log_softmax(out)[..., 0])

  g0 = jax.jit(jax.grad(loss), static_argnums=1)(tiny_params, TINY)
  for policy in ("full", "dots"):
    g1 = jax.jit(jax.grad(loss), static_argnums=1)(
        tiny_params, TINY.replace(remat=policy))
    # Recomputed activations may fuse differently: equal to float rounding
    # (an Intel Xeon of family 6 differs by 1.6e-6 on one element of 0.147).
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                 atol=1e-6)


# Published parameter counts of the real checkpoints.
@pytest.mark.parametrize("name, expected", [
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen3-0.6b", 596_049_920),
    ("llama-3.2-1b", 1_235_814_400),
])
def test_real_presets_have_the_published_parameter_counts(name, expected):
  config = models.get_preset(name)
  shapes = models.param_shapes(config)  # abstract: nothing allocated
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == expected
  assert config.num_params() == expected


@pytest.mark.parametrize("field, value, match", [
    ("num_heads", 6, "num_heads=6 is not a multiple of model.num_kv_heads=4"),
    ("activation", "relu", "model.activation='relu'"),
    ("param_dtype", "float8", "model.param_dtype='float8'"),
    ("d_model", 0, "model.d_model=0"),
    ("remat", "yes", "model.remat='yes'"),
])
def test_config_validation(field, value, match):
  with pytest.raises(ValueError, match=match):
    TINY.replace(num_kv_heads=4, **{field: value})


def test_unknown_preset():
  with pytest.raises(ValueError, match="accepted: \\["):
    models.get_preset("gpt5")
