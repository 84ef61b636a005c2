"""Issue 12: the fast training step computes the same gradients as the old one.

The fast step scores only the completion columns (``RLStepConfig.
completion_length``: the hidden states are sliced before the output
projection), computes the entropy only when it is used, and rematerialises
the logprob chunks only for large logits. The reference below is the old
computation, written out here independently: the decoder's hidden states,
the full ``[N, L - 1, V]`` logits, ``log_softmax``, the entropy at every
position, a zero column 0, and per-token arrays ``[N, L]`` wide. It replaces
``steps._logprobs`` in a reference step, so the two steps differ only in how
the logprobs are computed; one SGD update (learning rate 1) of each gives
the gradient, compared for every objective and every aggregation off-policy
(the sampler's ``old_logprobs`` are perturbed, so ratios clip), and with the
KL, the entropy bonus, minibatches, microbatches and recomputed ``pi_old``.
Each objective runs with one aggregation, cycling through them, so every
name is covered in 13 compiled pairs instead of 78 (the slicing is upstream
of both choices: they only read the per-token logprobs it produces).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models
from rljax import objectives as obj_lib
from rljax import train
from rljax.train import algorithm as algorithm_lib
from rljax.train import steps as steps_lib

MC = models.get_preset("tiny").replace(num_layers=1)  # compiles faster
P, T = 5, 6                      # prompt and completion columns
L = P + T
N = 8
PROMPT_LENGTHS = (5, 2, 3, 5, 1, 4, 5, 3)
COMPLETION_LENGTHS = (6, 3, 0, 5, 1, 4, 6, 2)


def _old_logprobs(params, model_config, tokens, input_mask, cfg,
                  with_entropy=False):
  """The old full-length computation: every position, entropy always."""
  del with_entropy
  positions = jnp.maximum(jnp.cumsum(input_mask.astype(jnp.int32), -1) - 1, 0)
  hidden, _ = models.Decoder(model_config).apply(
      {"params": params}, tokens, positions, input_mask_BxT=input_mask)
  w = params["embedding"].T if model_config.tie_embeddings else params["lm_head"]
  z = jnp.einsum("btd,dv->btv", hidden[:, :-1], w) / cfg.training_temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  lp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], -1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
  real = input_mask.astype(bool)
  scored = real[:, 1:] & real[:, :-1]
  pad = lambda x: jnp.pad(jnp.where(scored, x, 0.0), ((0, 0), (1, 0)))
  return pad(lp), pad(ent)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(3))


@pytest.fixture(scope="module")
def batch(params):
  rng = np.random.RandomState(1)
  tokens = rng.randint(1, MC.vocab_size, (N, L)).astype(np.int32)
  input_mask = np.zeros((N, L), bool)
  loss_mask = np.zeros((N, L), bool)
  for i, (p, t) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)):
    input_mask[i, P - p:P + t] = True
    loss_mask[i, P:P + t] = True
  tokens = np.where(input_mask, tokens, 0).astype(np.int32)
  cfg = train.RLStepConfig()
  lp = np.asarray(jax.jit(lambda p: _old_logprobs(
      p, MC, tokens, input_mask, cfg)[0])(params))
  # Off-policy: pi_old and mu away from pi_theta, so ratios clip.
  old = np.where(loss_mask, lp + rng.normal(0.0, 0.3, (N, L)), 0.0)
  sampler = np.where(loss_mask, old + rng.normal(0.0, 0.3, (N, L)), 0.0)
  # GSPO's sequence ratio must sit inside its narrow band for some rows.
  old[:4] = np.where(loss_mask[:4], lp[:4] + rng.normal(0, 1e-4, (4, L)), 0.0)
  adv = rng.normal(0.0, 1.0, N).astype(np.float32)
  return train.RLBatch(tokens, input_mask, loss_mask, adv,
                       sampler.astype(np.float32), old.astype(np.float32))


def _update(params, batch, cfg, objective, ref_params=None):
  """``params - new_params`` after one SGD(1.0) step: the gradient."""
  # Clip-Cov draws tokens at random: its chain takes a seed.
  coef_tx = (algorithm_lib.coefficient_chain({"objective": objective}, seed=0)
             if objective == "clip_cov" else
             algorithm_lib.coefficient_chain({"objective": objective}))
  step = jax.jit(train.make_rl_step(MC, cfg, optax.sgd(1.0), coef_tx))
  state = train.TrainState(params, optax.sgd(1.0).init(params), None,
                           coef_tx.init(jnp.zeros((1, 1))),
                           jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  new_state, metrics = step(state, batch, ref_params)
  grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params,
                       new_state.params)
  return grads, jax.device_get(metrics)


def _compare(params, batch, cfg, objective, monkeypatch, ref_params=None):
  fast, fast_metrics = _update(params, batch, cfg, objective, ref_params)
  with monkeypatch.context() as m:
    m.setattr(steps_lib, "_logprobs", _old_logprobs)
    old, old_metrics = _update(
        params, batch, dataclasses.replace(cfg, completion_length=None),
        objective, ref_params)
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  fast, old = flat(fast), flat(old)
  scale = np.abs(old).max()
  assert scale > 1e-3, "the reference gradient is zero: the test would be void"
  np.testing.assert_allclose(fast, old, rtol=0, atol=2e-5 * scale)
  for k in ("pg_loss", "ratio_mean", "clip_frac", "coef_mean", "entropy",
            "kl", "grad_norm"):
    if k in old_metrics:
      np.testing.assert_allclose(fast_metrics[k], old_metrics[k], rtol=2e-5,
                                 atol=1e-6, err_msg=k)
  return fast_metrics


CASES = [(o, obj_lib.AGGREGATIONS[i % len(obj_lib.AGGREGATIONS)])
         for i, o in enumerate(algorithm_lib.OBJECTIVES)]


def test_cases_cover_every_objective_and_aggregation():
  assert {o for o, _ in CASES} == set(algorithm_lib.OBJECTIVES)
  assert {a for _, a in CASES} == set(obj_lib.AGGREGATIONS)


@pytest.mark.parametrize("objective, aggregation", CASES)
def test_completion_only_gradients_equal_the_full_length_computation(
    params, batch, objective, aggregation, monkeypatch):
  cfg = train.RLStepConfig(aggregation=aggregation, max_length=T,
                           old_logprobs="sampler", completion_length=T,
                           entropy_metric=False)
  metrics = _compare(params, batch, cfg, objective, monkeypatch)
  assert "entropy" not in metrics
  if objective in ("ppo_clip", "dual_clip"):
    assert metrics["clip_frac"] > 0.05


def test_kl_entropy_minibatches_and_recomputed_old_logprobs(
    params, batch, monkeypatch):
  ref_params = jax.tree.map(lambda x: x * 1.1, params)
  cfg = train.RLStepConfig(num_minibatches=2, num_microbatches=2,
                           max_length=T, kl_coef=0.3, entropy_coef=0.05,
                           completion_length=T, logprob_remat=True,
                           logprob_chunk_size=4)
  metrics = _compare(params, batch._replace(old_logprobs_NxL=None), cfg,
                     "ppo_clip", monkeypatch, ref_params)
  assert metrics["entropy"] > 0 and metrics["kl"] > 0


def test_completion_length_must_be_below_the_row_length(params, batch):
  cfg = train.RLStepConfig(completion_length=L, old_logprobs="sampler")
  with pytest.raises(ValueError, match=f"completion_length={L}"):
    _update(params, batch, cfg, "ppo_clip")
  with pytest.raises(ValueError, match="completion_length=0"):
    train.RLStepConfig(completion_length=0)


def test_sequence_logprobs_num_scored_is_the_tail_of_the_full_result(params,
                                                                    batch):
  full_lp, full_ent = _old_logprobs(params, MC, batch.tokens_NxL,
                                    batch.input_mask_NxL, train.RLStepConfig())
  lp, ent = models.sequence_logprobs(params, MC, batch.tokens_NxL,
                                     batch.input_mask_NxL, num_scored=T)
  np.testing.assert_allclose(lp, full_lp[:, -T:], atol=1e-5)
  np.testing.assert_allclose(ent, full_ent[:, -T:], atol=1e-5)
  lp, ent = models.sequence_logprobs(params, MC, batch.tokens_NxL,
                                     batch.input_mask_NxL, num_scored=L - 1,
                                     with_entropy=False)
  assert ent is None
  np.testing.assert_allclose(lp, full_lp[:, 1:], atol=1e-5)
  with pytest.raises(ValueError, match=f"num_scored={L}"):
    models.sequence_logprobs(params, MC, batch.tokens_NxL,
                             batch.input_mask_NxL, num_scored=L)
