"""``model.remat="full"``: the blocks recomputed in the backward pass
(``transformer.recompute_in_backward``), with the gradients of no remat and
one block's activations alive at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora
from tests.test_lora import _with_random_b

TINY = models.get_preset("tiny")
GEMMA_LIKE = TINY.replace(
    norm_offset=1.0, post_norms=True, embed_scale=True, qk_norm=True,
    activation="gelu_tanh", attn_logit_softcap=5.0, final_logit_softcap=3.0,
    sliding_window=3, global_every=2, rope_local_theta=100.0)
LORA = TINY.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
INT8 = TINY.replace(lora=models.LoraConfig(rank=4, alpha=8.0,
                                           quantize_base="int8"))


def _inputs(packed: bool):
  rng = np.random.RandomState(3)
  tokens = jnp.asarray(rng.randint(0, TINY.vocab_size, (2, 10)))
  mask = np.ones((2, 10), bool)
  mask[1, :3] = False  # a left-padded row
  segments = None
  if packed:  # two segments in row 0, positions restarting at the second
    segments = jnp.asarray(np.array([[1] * 4 + [2] * 6, [1] * 10]))
    pos = jnp.asarray(np.array([list(range(4)) + list(range(6)),
                                list(range(10))]))
  else:
    pos = models.positions_from_mask(jnp.asarray(mask))
  return tokens, pos, jnp.asarray(mask), segments


def _trained_and_frozen(config, params):
  if config.lora is None:
    return params, {}
  return lora.split(params)


def _grads(config, params, packed):
  tokens, pos, mask, segments = _inputs(packed)
  trained, frozen = _trained_and_frozen(config, params)

  def loss(trained):
    out, _ = models.Decoder(config).apply(
        {"params": lora.merge(frozen, trained)}, tokens, pos,
        input_mask_BxT=mask, segment_ids_BxT=segments, return_logits=True)
    w = jnp.asarray(np.random.RandomState(4).randn(*out.shape[:2]),
                    jnp.float32)
    return jnp.sum(w * jax.nn.log_softmax(out)[..., 1]), out

  return jax.jit(jax.grad(loss, has_aux=True))(trained)


@pytest.mark.parametrize("name, config, packed", [
    ("llama", TINY, False),
    ("gemma_like_sliding_window", GEMMA_LIKE, False),
    ("packed_segments", TINY, True),
    ("lora", LORA, False),
    ("lora_int8_base", INT8, True),
], ids=lambda x: x if isinstance(x, str) else "")
def test_full_remat_has_the_gradients_and_outputs_of_no_remat(
    name, config, packed):
  del name
  params = _with_random_b(models.init_params(config, jax.random.key(1)))
  g0, out0 = _grads(config, params, packed)
  g1, out1 = _grads(config.replace(remat="full"), params, packed)
  np.testing.assert_array_equal(np.asarray(out1), np.asarray(out0))
  assert jax.tree.structure(g1) == jax.tree.structure(g0)
  assert jax.tree.leaves(g0)  # something is trained
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert np.isfinite(np.asarray(b)).all()
    # float32 rounding of other fusions: within 1e-5 of the leaf's scale.
    scale = float(np.abs(np.asarray(a)).max())
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0,
                               atol=1e-5 * max(scale, 1e-3))


def test_a_nan_cotangent_gives_nan_gradients_not_an_error():
  """The recomputation's tie to the cotangent (``x + 0 * g``) passes a
  non-finite cotangent on as non-finite gradients, as no remat does."""
  config = TINY.replace(remat="full")
  params = models.init_params(config, jax.random.key(1))
  tokens, pos, mask, _ = _inputs(False)

  def loss(params):
    out, _ = models.Decoder(config).apply({"params": params}, tokens, pos,
                                          input_mask_BxT=mask,
                                          return_logits=True)
    return jnp.sum(out) * jnp.float32(np.nan)

  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(grads))


def _temp_bytes(config, rows, length):
  shapes = models.param_shapes(config)
  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
  pos = models.positions_from_mask(jnp.ones((rows, length), jnp.int32))

  def loss(params, tokens):
    out, _ = models.Decoder(config).apply({"params": params}, tokens, pos)
    return jnp.sum(out * out)

  compiled = jax.jit(jax.grad(loss)).lower(shapes, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_keeps_activations_of_one_block_at_a_time():
  """On XLA:CPU ``jax.checkpoint``'s recomputation merges back into the
  forward pass (its barrier is removed before CSE), so remat saved nothing
  there; recomputed in the backward pass, 8 blocks' temporaries are a
  fraction of no remat's (compiled, not run)."""
  config = TINY.replace(num_layers=8, d_model=64, mlp_dim=512,
                        vocab_size=32)
  none = _temp_bytes(config, 4, 128)
  full = _temp_bytes(config.replace(remat="full"), 4, 128)
  assert full < 0.5 * none, (full, none)


@pytest.mark.slow  # two loop runs
def test_full_remat_trains_in_the_loop_as_no_remat_does(tmp_path):
  """The launcher's path (``model.overrides.remat``), sharded on the tests'
  8-device mesh with two minibatches and KL: the same metrics as without
  remat, to float rounding."""
  from tests.test_loop import loop_config, rl_rows  # pylint: disable=g-import-not-at-top
  from rljax import train  # pylint: disable=g-import-not-at-top
  rows = {}
  for remat in ("none", "full"):
    config = loop_config(**{"model.overrides.remat": remat,
                            "rl.kl_coef": 0.05, "rl.num_minibatches": 2})
    train.run(config, str(tmp_path / remat))
    rows[remat] = rl_rows(tmp_path / remat)
  assert [r["step"] for r in rows["full"]] == [1, 2]
  for a, b in zip(rows["none"], rows["full"]):
    for key in ("pg_loss", "grad_norm", "kl", "reward/total/mean"):
      assert key in a, sorted(a)
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6,
                                 err_msg=key)
