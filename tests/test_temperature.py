"""A training temperature other than 1 (T = 1.5), end to end.

The sampler's recorded logprobs and the trainer's ``sequence_logprobs`` are
checked against ``log_softmax(logits / T)`` of the float64 numpy forward in
``tests/reference_model.py``; one ``rl_step`` is checked against the gradient
of a loss that applies the temperature itself to the model's raw logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models, sampling, train
from tests import reference_model

MC = models.get_preset("tiny")
TEMPERATURE = 1.5
LR = 1.0
NUM_SAMPLES, MAX_NEW_TOKENS = 2, 4
ADVANTAGES = (1.0, -0.6, 0.3, -1.2)
SAMPLER = sampling.SamplerConfig(
    num_samples=NUM_SAMPLES, max_new_tokens=MAX_NEW_TOKENS,
    training_temperature=TEMPERATURE,
    method=sampling.SamplingMethod(temperature=TEMPERATURE),
    record_policy_logprobs=True, cache_dtype="float32")


def np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(1))


@pytest.fixture(scope="module")
def rollout(params):
  rng = np.random.RandomState(0)
  prompts = [list(rng.randint(1, MC.vocab_size, size=n)) for n in (3, 5)]
  tokens, mask = sampling.pad_prompts(prompts, (8,))
  return jax.device_get(sampling.sample(params, tokens, mask, jax.random.key(2),
                                        model_config=MC, config=SAMPLER))


@pytest.fixture(scope="module")
def reference_logits(params, rollout):
  """float64 numpy logits ``[N, L, V]`` of each unpadded row, aligned to its
  slots (NaN at padding)."""
  tokens, mask = (np.asarray(x) for x in rollout.sequences())
  host = jax.device_get(params)
  out = np.full(tokens.shape + (MC.vocab_size,), np.nan)
  for i in range(len(tokens)):
    slots = np.flatnonzero(mask[i])
    out[i, slots] = reference_model.forward(host, MC, tokens[i, slots])
  return out


def _reference_logprobs(reference_logits, rollout, temperature):
  """``[N, L]`` log p(token t | tokens < t) at ``temperature``, NaN where
  undefined (padding, or the first real token of a row)."""
  tokens, mask = (np.asarray(x) for x in rollout.sequences())
  logp = np_log_softmax(reference_logits / temperature)
  out = np.full(tokens.shape, np.nan)
  for i in range(len(tokens)):
    slots = np.flatnonzero(mask[i])
    for prev, cur in zip(slots[:-1], slots[1:]):
      out[i, cur] = logp[i, prev, tokens[i, cur]]
  return out


def test_rollout_is_long_enough(rollout):
  assert rollout.completion_mask.all()  # no EOS: every slot is sampled
  assert rollout.completion_tokens.shape == (2 * NUM_SAMPLES, MAX_NEW_TOKENS)


def test_sampler_logprobs_at_the_training_temperature(reference_logits,
                                                      rollout):
  p = rollout.prompt_tokens.shape[1]
  want = _reference_logprobs(reference_logits, rollout, TEMPERATURE)[:, p:]
  untempered = _reference_logprobs(reference_logits, rollout, 1.0)[:, p:]
  assert np.abs(want - untempered).max() > 0.05  # the temperature matters
  np.testing.assert_allclose(rollout.policy_logprobs, want, atol=2e-4, rtol=0)
  # Sampled at T = 1.5 with no truncation: the same distribution.
  np.testing.assert_allclose(rollout.sampler_logprobs, want, atol=2e-4, rtol=0)


def test_sequence_logprobs_at_the_training_temperature(params, reference_logits,
                                                       rollout):
  tokens, mask = rollout.sequences()
  got = np.asarray(jax.jit(lambda p, t, m: models.sequence_logprobs(
      p, MC, t, m, temperature=TEMPERATURE)[0])(params, tokens, mask))
  want = _reference_logprobs(reference_logits, rollout, TEMPERATURE)
  defined = ~np.isnan(want)
  assert defined.sum() >= 20
  np.testing.assert_allclose(got[defined], want[defined], atol=2e-4, rtol=0)
  untempered = _reference_logprobs(reference_logits, rollout, 1.0)
  assert np.abs(got[defined] - untempered[defined]).max() > 0.05


def _batch(rollout):
  tokens, mask = rollout.sequences()
  p = rollout.prompt_tokens.shape[1]
  loss_mask = np.zeros(tokens.shape, bool)
  loss_mask[:, p:] = rollout.completion_mask
  sampler_lp = np.zeros(tokens.shape, np.float32)
  sampler_lp[:, p:] = rollout.sampler_logprobs
  return train.RLBatch(jnp.asarray(tokens), jnp.asarray(mask),
                       jnp.asarray(loss_mask),
                       jnp.asarray(ADVANTAGES, jnp.float32),
                       jnp.asarray(sampler_lp))


def _reference_grads(params, batch, temperature):
  """Gradient of the token-mean loss ``-A * log_softmax(logits / T)[y]``."""
  mask = np.asarray(batch.input_mask_NxL)
  positions = jnp.asarray(np.maximum(np.cumsum(mask, -1) - 1, 0))

  def loss(p):
    hidden, _ = models.Decoder(MC).apply({"params": p}, batch.tokens_NxL,
                                         positions,
                                         input_mask_BxT=batch.input_mask_NxL)
    logits = models.compute_logits(hidden, models.output_projection(p, MC))
    logp = jax.nn.log_softmax(logits[:, :-1] / temperature, -1)
    lp = jnp.take_along_axis(logp, batch.tokens_NxL[:, 1:, None], -1)[..., 0]
    m = batch.loss_mask_NxL[:, 1:].astype(jnp.float32)
    return jnp.sum(-batch.advantages_NxL[:, None] * lp * m) / jnp.sum(m)

  return jax.device_get(jax.jit(jax.grad(loss))(params))


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _sgd_step(params, batch, temperature):
  cfg = train.RLStepConfig(training_temperature=temperature,
                           completion_length=MAX_NEW_TOKENS)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  step = jax.jit(train.make_rl_step(MC, cfg, optax.sgd(LR), coef_tx))
  state = train.TrainState(
      params, optax.sgd(LR).init(params), None,
      coef_tx.init(jnp.zeros(batch.tokens_NxL.shape, jnp.float32)),
      jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
  new_state, _ = step(state, batch, None)
  return _flat(new_state.params) - _flat(params)


@pytest.mark.slow
def test_rl_step_at_the_training_temperature(params, rollout):
  batch = _batch(rollout)
  want = -LR * _flat(_reference_grads(params, batch, TEMPERATURE))
  got = _sgd_step(params, batch, TEMPERATURE)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 1e-4 * scale
  # The temperature changes the update: T = 1 would not pass the check above.
  at_one = _sgd_step(params, batch, 1.0)
  assert np.abs(at_one - want).max() > 0.05 * scale
  want_at_one = -LR * _flat(_reference_grads(params, batch, 1.0))
  assert np.abs(at_one - want_at_one).max() <= 1e-4 * np.abs(want_at_one).max()
