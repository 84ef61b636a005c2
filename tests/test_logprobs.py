import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import logprobs


def _naive(h, w, y, temperature=1.0, softcap=None):
  """Full-softmax reference in float64 numpy."""
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  if softcap is not None:
    z = softcap * np.tanh(z / softcap)
  z = z / temperature
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  p = np.exp(logp_all)
  lp = np.take_along_axis(logp_all, np.asarray(y)[..., None], -1)[..., 0]
  return lp, -(p * logp_all).sum(-1)


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.RandomState(0)
  b, t, d, v = 2, 13, 16, 50
  h = rng.randn(b, t, d).astype(np.float32)
  w = rng.randn(d, v).astype(np.float32) * 0.5
  y = rng.randint(0, v, (b, t)).astype(np.int32)
  return h, w, y


@pytest.mark.parametrize("chunk, vchunk, temperature, softcap", [
    (4, None, 1.0, None),     # ragged last time chunk
    (13, None, 0.7, None),
    (5, 16, 1.0, None),       # ragged last vocab chunk (50 = 3 x 16 + 2)
    (3, 7, 1.3, 2.0),
])
def test_chunked_equals_naive(inputs, chunk, vchunk, temperature, softcap):
  h, w, y = inputs
  lp, ent = jax.jit(functools.partial(
      logprobs.token_logprobs, chunk_size=chunk, vocab_chunk_size=vchunk,
      temperature=temperature, softcap=softcap))(h, w, y)
  ref_lp, ref_ent = _naive(h, w, y, temperature, softcap)
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vchunk", [None, 16])
@pytest.mark.slow
def test_chunked_gradients_equal_naive_gradients(inputs, vchunk):
  h, w, y = inputs
  def naive_loss(h, w):
    z = jnp.einsum("btd,dv->btv", h, w) / 0.9
    logp = jax.nn.log_softmax(z)
    lp = jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
    ent = -(jnp.exp(logp) * logp).sum(-1)
    return jnp.sum(lp * 1.5) + jnp.sum(ent * 0.3)

  def chunked_loss(h, w):
    lp, ent = logprobs.token_logprobs(h, w, y, temperature=0.9, chunk_size=4,
                                      vocab_chunk_size=vchunk)
    return jnp.sum(lp * 1.5) + jnp.sum(ent * 0.3)

  g_ref = jax.grad(naive_loss, argnums=(0, 1))(h, w)
  g = jax.jit(jax.grad(chunked_loss, argnums=(0, 1)))(h, w)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_chunked_memory_is_far_below_naive_for_a_large_vocab():
  b, t, d, v = 2, 256, 32, 32_768
  h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  y = jax.ShapeDtypeStruct((b, t), jnp.int32)

  def naive(h, w, y):
    logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w))
    lp = jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
    return lp, -(jnp.exp(logp) * logp).sum(-1)

  def chunked(h, w, y):
    return logprobs.token_logprobs(h, w, y, chunk_size=16,
                                   vocab_chunk_size=8192)

  def temp_bytes(fn):
    return jax.jit(fn).lower(h, w, y).compile().memory_analysis().temp_size_in_bytes

  def grad_temp_bytes(fn):
    loss = lambda h, w, y: sum(jnp.sum(x) for x in fn(h, w, y))
    return temp_bytes(jax.grad(loss, argnums=(0, 1)))

  full_logits_bytes = b * t * v * 4  # 64 MiB
  assert temp_bytes(naive) >= full_logits_bytes
  assert temp_bytes(chunked) < full_logits_bytes / 8
  assert grad_temp_bytes(chunked) < grad_temp_bytes(naive) / 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(vocab_chunk_size=-1), "vocab_chunk_size=-1"),
    (dict(temperature=0.0), "temperature=0.0"),
])
def test_bad_arguments(inputs, kwargs, match):
  h, w, y = inputs
  with pytest.raises(ValueError, match=match):
    logprobs.token_logprobs(h, w, y, **kwargs)


def test_shape_errors(inputs):
  h, w, y = inputs
  with pytest.raises(ValueError, match="targets_BxT shape"):
    logprobs.token_logprobs(h, w, y[:, :3])
  with pytest.raises(ValueError, match="w_DxV must have shape"):
    logprobs.token_logprobs(h, w.T, y)
  with pytest.raises(TypeError, match="must be integer"):
    logprobs.token_logprobs(h, w, y.astype(np.float32))
