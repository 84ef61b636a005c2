"""``rljax.train.sft``: the warm-up's step, data and loop.

The step's gradient is checked against cross-entropy written here from the
decoder's logits (``log_softmax`` over the vocabulary, the completion tokens
only); the data layout against hand-built rows; the near-miss labels against
their definition.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import data as data_lib
from rljax import models, sharding
from rljax import tokenizers as tok_lib
from rljax.train import sft

MC = models.get_preset("tiny")


class _CharTokenizer:
  """One id per character; pad 0, EOS 1, no BOS."""

  pad_id, eos_id, bos_id, vocab_size = 0, 1, None, 64

  def encode(self, text):
    return [2 + (ord(ch) % 60) for ch in text]


def test_sft_arrays_lay_out_prompt_completion_and_eos():
  tok = _CharTokenizer()
  tokens, input_mask, loss_mask = sft.sft_arrays(
      tok, ["ab", "c"], ["7", "42"], width=6)
  p0 = tok_lib.encode_prompts(tok, ["ab"])[0]
  row0 = p0 + tok.encode("7") + [tok.eos_id]
  np.testing.assert_array_equal(tokens[0, :len(row0)], row0)
  assert (tokens[0, len(row0):] == tok.pad_id).all()
  np.testing.assert_array_equal(input_mask[0], np.arange(6) < len(row0))
  # The loss covers the completion and its EOS, not the prompt.
  np.testing.assert_array_equal(loss_mask[0], (np.arange(6) >= len(p0))
                                & (np.arange(6) < len(row0)))


def test_a_row_longer_than_the_width_is_cut():
  tok = _CharTokenizer()
  tokens, input_mask, loss_mask = sft.sft_arrays(tok, ["abcd"], ["123456"], 5)
  assert tokens.shape == (1, 5) and input_mask.all()
  assert loss_mask.sum() == 5 - len(tok_lib.encode_prompts(tok, ["abcd"])[0])


def test_noisy_completions_replace_the_given_fraction_by_near_misses():
  completions = [str(i) for i in range(1000)] + ["x y"]
  out = sft.noisy_completions(completions, 0.3, np.random.default_rng(0),
                              max_offset=9)
  changed = [(int(a), int(b)) for a, b in zip(completions, out) if a != b]
  assert abs(len(changed) / 1000 - 0.3) < 0.05
  assert all(0 < abs(a - b) <= 18 and b >= 0 for a, b in changed)
  assert out[-1] == "x y"  # not an integer: kept
  assert sft.noisy_completions(completions, 0.0,
                               np.random.default_rng(0)) == completions


def _reference_loss(params, tokens, input_mask, loss_mask):
  positions = jnp.maximum(jnp.cumsum(input_mask, -1) - 1, 0)
  hidden, _ = models.Decoder(MC).apply({"params": params}, tokens, positions,
                                       input_mask_BxT=input_mask)
  logits = models.compute_logits(hidden, models.output_projection(params, MC))
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
  lp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  m = loss_mask[:, 1:].astype(jnp.float32)
  return -jnp.sum(lp * m) / jnp.sum(m)


@pytest.mark.slow
def test_sft_step_is_sgd_on_completion_cross_entropy():
  params = models.init_params(MC, jax.random.key(0))
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(2, MC.vocab_size, (4, 8)), jnp.int32)
  input_mask = jnp.ones((4, 8), bool)
  loss_mask = jnp.asarray(np.arange(8)[None] >= np.array([[3], [5], [4], [7]]))
  step = jax.jit(sft.make_sft_step(MC, optax.sgd(1.0)))
  new, _, metrics = step(params, optax.sgd(1.0).init(params), tokens,
                         input_mask, loss_mask)
  loss, grads = jax.value_and_grad(_reference_loss)(params, tokens,
                                                    input_mask, loss_mask)
  np.testing.assert_allclose(metrics["sft_loss"], loss, rtol=1e-5)
  for p, n, g in zip(jax.tree.leaves(params), jax.tree.leaves(new),
                     jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(p) - np.asarray(n), g, rtol=2e-3,
                               atol=2e-6)


def test_run_sft_with_no_steps_returns_the_params_untouched():
  params = {"w": jnp.ones(3)}
  out = sft.run_sft(params, sft.SFTConfig(num_steps=0), task=None,
                    tokenizer=None, model_config=MC, mesh=None,
                    param_shardings=None)
  assert out is params


def test_run_sft_without_a_built_in_task_names_the_field():
  with pytest.raises(ValueError, match="sft.num_steps > 0 needs a built-in"):
    sft.run_sft({}, sft.SFTConfig(num_steps=2), task=None, tokenizer=None,
                model_config=MC, mesh=None, param_shardings=None)


@pytest.mark.slow
def test_run_sft_lowers_the_loss_on_the_task():
  task = data_lib.get_task("arithmetic", min_digits=1, max_digits=1)
  examples = task.sft_examples("train", 60, 0)
  tokenizer = tok_lib.train_sentencepiece(task.tokenizer_corpus(60, 0), 32)
  mc = MC.replace(vocab_size=tokenizer.vocab_size)
  mesh = sharding.mesh_from_config({"data": 1, "fsdp": -1, "tensor": 1})
  params = models.init_params(mc, jax.random.key(0), mesh)
  cfg = sft.SFTConfig(num_steps=30, batch_size=16, num_examples=60,
                      max_length=16, learning_rate=3e-3)
  arrays = sft.sft_arrays(tokenizer, [e["prompt"] for e in examples],
                          [e["completion"] for e in examples], 16)
  loss = jax.jit(sft.make_sft_step(mc, optax.sgd(0.0)))
  before = float(loss(params, optax.sgd(0.0).init(params), *arrays)[2][
      "sft_loss"])
  trained = sft.run_sft(jax.tree.map(jnp.copy, params), cfg, task=task,
                        tokenizer=tokenizer, model_config=mc, mesh=mesh,
                        param_shardings=models.param_shardings(mc, mesh))
  after = float(loss(trained, optax.sgd(0.0).init(trained), *arrays)[2][
      "sft_loss"])
  assert after < 0.7 * before, (before, after)
