"""``rljax.train.steps``: one SGD update of ``rl_step`` against an independently
written loss, for every aggregation, with and without gradient accumulation;
the completion-only scoring against the full-length computation; the step's
ESS statistics against their formulas.

The reference loss takes the per-token logprobs from the model's forward
(``models.sequence_logprobs``) and writes the aggregation out from its
definition over the whole minibatch; its gradient comes from ``jax.grad``.
On-policy (one update, pi_old = sg(pi_theta)) every coefficient is 1, so the
per-token loss is ``-A_b * log pi(y_t)``.
"""

import dataclasses
import functools

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

MC = models.get_preset("tiny")
LR = 1.0
P, T = 4, 6                    # prompt and completion columns
L = P + T                      # row length (10)
MAX_LENGTH = T                 # the generation budget: not the row length
PROMPT_LENGTHS = (4, 2, 3, 4, 1, 4)
COMPLETION_LENGTHS = (5, 3, 0, 5, 1, 4)  # a short row, a row with none
ADVANTAGES = (1.0, -0.5, 2.0, 0.7, -1.3, 0.4)
N = len(ADVANTAGES)
AGGREGATIONS = obj_lib.AGGREGATIONS


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(1))


def _make_batch():
  """Left-padded prompts then right-padded completions, ``[N, L]``."""
  rng = np.random.RandomState(0)
  tokens = rng.randint(1, MC.vocab_size, size=(N, L)).astype(np.int32)
  input_mask = np.zeros((N, L), bool)
  loss_mask = np.zeros((N, L), bool)
  for i, (p, t) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)):
    input_mask[i, P - p:P + t] = True
    loss_mask[i, P:P + t] = True
  tokens = np.where(input_mask, tokens, 0).astype(np.int32)
  # Not used on-policy with no ESS pull; random so that a leak would show.
  sampler_lp = np.where(loss_mask, -rng.uniform(0.5, 6.0, (N, L)), 0.0)
  return train.RLBatch(
      jnp.asarray(tokens), jnp.asarray(input_mask), jnp.asarray(loss_mask),
      jnp.asarray(ADVANTAGES, jnp.float32),
      jnp.asarray(sampler_lp, jnp.float32))


BATCH = _make_batch()


def test_batch_layout():
  m = np.asarray(BATCH.loss_mask_NxL)
  np.testing.assert_array_equal(m.sum(-1), COMPLETION_LENGTHS)
  assert not m[2].any() and max(COMPLETION_LENGTHS) < MAX_LENGTH < L
  assert np.all(np.asarray(BATCH.input_mask_NxL)[m])


@functools.lru_cache(maxsize=None)
def _step(cfg, objective):
  coef_tx = train.coefficient_chain({"objective": objective})
  return jax.jit(train.make_rl_step(MC, cfg, optax.sgd(LR), coef_tx)), coef_tx


def _run_step(params, cfg, batch=BATCH, objective="ppo_clip"):
  step, coef_tx = _step(cfg, objective)
  micro_rows = N // (cfg.num_minibatches * cfg.num_microbatches)
  state = train.TrainState(
      params, optax.sgd(LR).init(params), None,
      coef_tx.init(jnp.zeros((micro_rows, L), jnp.float32)),
      jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
  new_state, metrics = step(state, batch, None)
  return new_state, metrics


def _reference_loss(params, aggregation, temperature=1.0):
  """Written from the definitions, over the whole minibatch."""
  lp = models.sequence_logprobs(params, MC, BATCH.tokens_NxL,
                                BATCH.input_mask_NxL,
                                temperature=temperature)[0]
  m = BATCH.loss_mask_NxL.astype(jnp.float32)
  loss_tok = -BATCH.advantages_NxL[:, None] * lp * m   # masked per-token loss
  lengths = m.sum(-1)
  has_tokens = lengths > 0
  num_seqs = has_tokens.sum()
  if aggregation == "token_mean":
    return loss_tok.sum() / m.sum()
  if aggregation == "sequence_mean_token_mean":
    per_seq = jnp.where(has_tokens,
                        loss_tok.sum(-1) / jnp.where(has_tokens, lengths, 1.0),
                        0.0)
    return per_seq.sum() / num_seqs
  if aggregation == "sequence_mean_token_sum":
    return loss_tok.sum() / num_seqs
  if aggregation in ("sequence_mean_token_sum_norm",
                     "sequence_mean_token_scale"):  # Dr.GRPO's = Tunix's
    return loss_tok.sum() / (num_seqs * MAX_LENGTH)
  if aggregation == "token_sum":
    return loss_tok.sum()
  raise AssertionError(aggregation)


@pytest.fixture(scope="module")
def reference_grads(params):
  grads = jax.jit(lambda p: {a: jax.grad(_reference_loss)(p, a)
                             for a in AGGREGATIONS})(params)
  return jax.device_get(grads)


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def assert_sgd_update(params, new_params, grads, rtol=1e-4):
  """``new = params - LR * grads``, compared on the update, scaled by its size."""
  delta = _flat(new_params) - _flat(params)
  want = -LR * _flat(grads)
  scale = np.abs(want).max()
  assert scale > 0
  err = np.abs(delta - want).max()
  assert err <= rtol * scale, f"max abs error {err:.3g} vs update scale {scale:.3g}"


@pytest.mark.slow
def test_reference_aggregations_differ(reference_grads):
  """The four references are far apart, so a wrong normaliser cannot pass."""
  flat = {a: _flat(g) for a, g in reference_grads.items()}
  same = {("sequence_mean_token_sum_norm", "sequence_mean_token_scale")}
  for i, a in enumerate(AGGREGATIONS):
    for b in AGGREGATIONS[i + 1:]:
      if (a, b) in same:  # one formula under two peers' names
        continue
      rel = np.abs(flat[a] - flat[b]).max() / np.abs(flat[a]).max()
      assert rel > 0.05, (a, b, rel)
  # Dr.GRPO normalised by the row length L would be off by L / MAX_LENGTH.
  assert L / MAX_LENGTH > 1.5


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.slow
def test_one_sgd_update_equals_reference_gradient(params, reference_grads,
                                                  aggregation,
                                                  num_microbatches):
  cfg = train.RLStepConfig(num_minibatches=1,
                           num_microbatches=num_microbatches,
                           aggregation=aggregation, completion_length=MAX_LENGTH)
  new_state, metrics = _run_step(params, cfg)
  assert_sgd_update(params, new_state.params, reference_grads[aggregation])
  assert int(new_state.step) == 1
  np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, atol=1e-5)
  np.testing.assert_allclose(float(metrics["coef_mean"]), 1.0, atol=1e-5)


@pytest.mark.slow
def test_reinforce_coefficient_gives_the_same_update(params, reference_grads):
  cfg = train.RLStepConfig(num_microbatches=2,
                           aggregation="sequence_mean_token_mean",
                           completion_length=MAX_LENGTH)
  new_state, _ = _run_step(params, cfg, objective="reinforce")
  assert_sgd_update(params, new_state.params,
                    reference_grads["sequence_mean_token_mean"])


@pytest.mark.slow
def test_sampler_old_logprobs_at_current_params_equal_recompute(params):
  logprobs = jax.jit(lambda p: models.sequence_logprobs(
      p, MC, BATCH.tokens_NxL, BATCH.input_mask_NxL)[0])
  old = jnp.where(BATCH.loss_mask_NxL, logprobs(params), 0.0)
  recompute = train.RLStepConfig(completion_length=MAX_LENGTH)
  sampler = train.RLStepConfig(completion_length=MAX_LENGTH, old_logprobs="sampler")
  want, _ = _run_step(params, recompute)
  got, _ = _run_step(params, sampler, batch=BATCH._replace(old_logprobs_NxL=old))
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  # The update is not trivially zero.
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(want.params), jax.tree.leaves(params))) > 1e-4


@pytest.mark.slow
def test_each_rows_log_ratio_is_the_trainers_logprobs_minus_the_samplers(
    params):
  """``rows/log_ratio`` (the histograms' input): log pi_old(y) - log mu(y)
  summed over each row's trained tokens, pi_old recomputed at the params
  (two minibatches: the second update's ratio is against it); NaN for a row
  with no trained token."""
  rng = np.random.default_rng(1)
  sampler = jnp.asarray(rng.normal(-2.0, 0.5, BATCH.sampler_logprobs_NxL.shape),
                        jnp.float32)
  _, metrics = _run_step(params, train.RLStepConfig(
      completion_length=MAX_LENGTH, num_minibatches=2), batch=BATCH._replace(
          sampler_logprobs_NxL=sampler))
  lp = np.asarray(models.sequence_logprobs(
      params, MC, BATCH.tokens_NxL, BATCH.input_mask_NxL)[0], np.float64)
  m = np.asarray(BATCH.loss_mask_NxL)
  want = np.where(m.any(1), np.sum((lp - np.asarray(sampler)) * m, 1), np.nan)
  assert np.isnan(want).sum() == 1  # the batch's row without a trained token
  np.testing.assert_allclose(np.asarray(metrics["rows/log_ratio"]), want,
                             rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_dro_step_is_the_gradient_of_verls_dro_loss(params):
  """rl.objective="dro": one SGD update equals jax.grad of verl's
  compute_policy_loss_dro, -(logp A - 0.5 beta (logp - old)^2), token mean
  over the minibatch, with pi_old away from pi_theta."""
  beta = 0.7
  lp_fn = jax.jit(lambda p: models.sequence_logprobs(
      p, MC, BATCH.tokens_NxL, BATCH.input_mask_NxL)[0])
  mask = BATCH.loss_mask_NxL
  rng = np.random.RandomState(2)
  old = jnp.where(mask, lp_fn(params) + rng.normal(0, 0.5, mask.shape), 0.0)

  def verl_loss(p):
    lp = lp_fn(p)
    a = jnp.asarray(ADVANTAGES)[:, None]
    per_token = -(lp * a - 0.5 * beta * (lp - old) ** 2)
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)

  cfg = train.RLStepConfig(completion_length=MAX_LENGTH, old_logprobs="sampler",
                           dro_beta=beta)
  new_state, metrics = _run_step(
      params, cfg, batch=BATCH._replace(old_logprobs_NxL=old.astype(
          jnp.float32)), objective="dro")
  assert metrics["dro_penalty"] > 0
  assert_sgd_update(params, new_state.params, jax.grad(verl_loss)(params))


@pytest.mark.parametrize("field, value, message", [
    ("advantages_NxL", jnp.zeros((L,)), "advantages_NxL has shape"),
    ("advantages_NxL", jnp.zeros((L, N)), "advantages_NxL has shape"),
    ("sampler_logprobs_NxL", jnp.zeros((N, L - 1)), "sampler_logprobs_NxL"),
    ("loss_mask_NxL", jnp.zeros((L, N), bool), "loss_mask_NxL"),
    ("rewards_N", jnp.zeros((N, 1)), "rewards_N has shape"),
])
def test_a_batch_whose_shape_only_looks_right_is_refused(field, value, message):
  with pytest.raises(ValueError, match=message):
    train.check_batch(BATCH._replace(**{field: value}))
  train.check_batch(BATCH)


def test_sampler_old_logprobs_are_required_in_sampler_mode(params):
  cfg = train.RLStepConfig(completion_length=MAX_LENGTH, old_logprobs="sampler")
  with pytest.raises(ValueError, match="old_logprobs_NxL"):
    _run_step(params, cfg)


def test_mismatch_statistics_match_numpy():
  rng = np.random.RandomState(3)
  shape = (5, 7)
  sampler_lp = -rng.uniform(0.1, 5.0, shape)
  d = rng.normal(0.0, 0.4, shape)
  d[0, :4] = [0.05, -0.09, 0.15, -0.3]         # both sides of the 0.1 line
  d[1, 1] = 3.0                               # a large positive gap
  trainer_lp = sampler_lp + d
  mask = rng.uniform(size=shape) < 0.7
  mask[0, :4] = True
  mask[1, 1] = True
  mask[4] = False                             # a row with no tokens
  trainer_lp[~mask] = 50.0                    # garbage outside the mask

  got = jax.device_get(jax.jit(train.mismatch_statistics)(
      jnp.asarray(trainer_lp, jnp.float32), jnp.asarray(sampler_lp, jnp.float32),
      jnp.asarray(mask)))

  dm = (trainer_lp - sampler_lp)[mask]
  want = {"abs": np.abs(dm).sum(), "k3": (np.exp(dm) - 1 - dm).sum(),
          "large": float((np.abs(dm) > 0.1).sum()), "count": float(mask.sum()),
          "max_abs": np.abs(dm).max()}
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-5, err_msg=k)
  assert want["max_abs"] == pytest.approx(3.0, abs=1e-6)


# --- issue 10: rejection and row counting in the step ------------------------


def _current_logprobs(params):
  lp = jax.jit(lambda p: models.sequence_logprobs(
      p, MC, BATCH.tokens_NxL, BATCH.input_mask_NxL)[0])(params)
  return jnp.where(BATCH.loss_mask_NxL, lp, 0.0)


def _masked_reference_grads(params, keep, num_sequences=None):
  """token_mean (or sequence_mean_token_mean over `num_sequences` rows)
  of -A * logp over the tokens `keep`, from the definitions."""
  keep = jnp.asarray(keep, jnp.float32)

  def loss(p):
    lp = models.sequence_logprobs(p, MC, BATCH.tokens_NxL,
                                  BATCH.input_mask_NxL)[0]
    tok = -BATCH.advantages_NxL[:, None] * lp * keep
    if num_sequences is None:
      return tok.sum() / keep.sum()
    n = keep.sum(-1)
    return jnp.where(n > 0, tok.sum(-1) / jnp.maximum(n, 1), 0).sum() \
        / num_sequences

  return jax.device_get(jax.jit(jax.grad(loss))(params))


@pytest.mark.slow
def test_rejected_tokens_leave_the_step_normaliser(params):
  """verl's rollout rejection (token_k1 in [log 0.8, log 1.25] of mu /
  pi_old): rejected tokens get no gradient and leave the token count."""
  old = _current_logprobs(params)
  m = np.asarray(BATCH.loss_mask_NxL)
  delta = np.where(m, np.random.RandomState(5).uniform(-0.4, 0.4, m.shape), 0)
  sampler = old + jnp.asarray(delta, jnp.float32)
  keep = m & (delta >= np.log(0.8)) & (delta <= np.log(1.25))  # k1 = -d
  assert 0 < keep.sum() < m.sum()
  cfg = train.RLStepConfig(
      completion_length=MAX_LENGTH, old_logprobs="sampler",
      rejection=obj_lib.parse_rejection("token_k1:0.8:1.25"))
  new_state, metrics = _run_step(params, cfg, batch=BATCH._replace(
      old_logprobs_NxL=old, sampler_logprobs_NxL=sampler))
  assert_sgd_update(params, new_state.params,
                    _masked_reference_grads(params, keep))
  np.testing.assert_allclose(float(metrics["rejection/frac_tokens"]),
                             1 - keep.sum() / m.sum(), rtol=1e-6)


@pytest.mark.slow
def test_count_empty_sequences_divides_by_every_row(params):
  """TRL's grpo loss: the mean over all N rows (row 2 has no token)."""
  cfg = train.RLStepConfig(completion_length=MAX_LENGTH,
                           aggregation="sequence_mean_token_mean",
                           count_empty_sequences=True)
  new_state, _ = _run_step(params, cfg)
  assert_sgd_update(params, new_state.params, _masked_reference_grads(
      params, np.asarray(BATCH.loss_mask_NxL), num_sequences=float(N)))


# ----------------------------------------------------------------------------
# Accumulation and the on-policy update on random batches.

def _random_batch(n=8, length=10, seed=0):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32)
  input_mask = np.ones((n, length), bool)
  input_mask[:3, :2] = False
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 5:] = True
  loss_mask[1, 8:] = False
  adv = rng.randn(n).astype(np.float32)
  return train.RLBatch(tokens, input_mask, loss_mask, adv,
                       np.zeros((n, length), np.float32))


def _fresh_state(optimizer, coef_tx, params):
  return train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                          coef_tx.init(jnp.zeros((1, 1))), jnp.zeros((), jnp.int32),
                          jax.random.key_data(jax.random.key(0)))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean",
                                         "sequence_mean_token_sum_norm"])
@pytest.mark.slow
def test_microbatch_accumulation_equals_whole_batch(aggregation):
  params = models.init_params(MC, jax.random.key(1))
  optimizer = optax.sgd(1.0)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  batch = _random_batch()
  out = []
  for micro in (1, 4):
    cfg = train.RLStepConfig(num_microbatches=micro, aggregation=aggregation,
                             completion_length=5)
    step = jax.jit(train.make_rl_step(MC, cfg, optimizer, coef_tx))
    state, m = step(_fresh_state(optimizer, coef_tx, params), batch)
    out.append((state.params, m))
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_allclose(a, b, atol=2e-6)
  np.testing.assert_allclose(out[0][1]["pg_loss"], out[1][1]["pg_loss"], atol=1e-6)


@pytest.mark.slow
def test_on_policy_update_equals_reinforce_gradient():
  """One SGD step of rl_step == params - lr * grad of -mean(A * logp)."""
  params = models.init_params(MC, jax.random.key(2))
  optimizer = optax.sgd(0.1)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  batch = _random_batch(seed=3)
  step = jax.jit(train.make_rl_step(MC, train.RLStepConfig(), optimizer, coef_tx))
  state, _ = step(_fresh_state(optimizer, coef_tx, params), batch)

  def reinforce(p):
    lp, _ = models.sequence_logprobs(p, MC, batch.tokens_NxL, batch.input_mask_NxL)
    m = batch.loss_mask_NxL
    return -jnp.sum(jnp.where(m, batch.advantages_NxL[:, None] * lp, 0.0)) / m.sum()

  grads = jax.grad(reinforce)(params)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert int(state.step) == 1


# ----------------------------------------------------------------------------
# The step's ESS statistics against their formulas.

@pytest.fixture(scope="module")
def ess_batch():
  """A batch whose sampler logprobs differ from the policy's."""
  params = models.init_params(MC, jax.random.key(5))
  rng = np.random.RandomState(1)
  n, length = 8, 10
  tokens = rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32)
  input_mask = np.ones((n, length), bool)
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 5:] = True
  loss_mask[2, 8:] = False
  lp = np.asarray(models.sequence_logprobs(params, MC, tokens, input_mask)[0])
  sampler = np.where(loss_mask, lp + rng.normal(0, 0.4, lp.shape), 0.0)
  batch = train.RLBatch(tokens, input_mask, loss_mask,
                        rng.randn(n).astype(np.float32),
                        sampler.astype(np.float32))
  return params, lp, batch


def _numpy_ess(w):
  return w.sum() ** 2 / (w.size * (w ** 2).sum())


@pytest.mark.parametrize("pooling, micro", [("microbatch", 1),
                                            ("minibatch", 2)])
@pytest.mark.slow
def test_ess_statistics_of_the_step_equal_the_formulas(ess_batch, pooling, micro):
  params, lp, batch = ess_batch
  m = batch.loss_mask_NxL
  rl = {"objective": "ess", "group_size": 4, "num_steps": 1,
        "ess_pooling": pooling}
  algorithm = train.algorithm_from_config(
      rl, {"name": "sgd", "learning_rate": 0.1, "max_grad_norm": None,
           "ess_scaling": "sqrt"})
  cfg = train.RLStepConfig(num_microbatches=micro, ess_pooling=pooling,
                           ess_kl_coef=1.0)
  step = jax.jit(train.make_rl_step(MC, cfg, algorithm.optimizer,
                                    algorithm.coefficient))
  state = train.TrainState(params, algorithm.optimizer.init(params),
                           optax.EmptyState(), algorithm.coefficient.init(
                               jnp.zeros((1, 1))), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  _, out = step(state, batch)
  # FeynRL: token weights pi_theta / mu over the valid tokens of the minibatch.
  w_tok = np.exp(lp - batch.sampler_logprobs_NxL)[m]
  # VCPO: trajectory weights pi_old(y) / mu(y); pi_old = pi_theta here.
  w_seq = np.exp(np.where(m, lp - batch.sampler_logprobs_NxL, 0).sum(-1))
  assert _numpy_ess(w_tok) < 0.99 and _numpy_ess(w_seq) < 0.99
  np.testing.assert_allclose(out["ess/token"], _numpy_ess(w_tok), rtol=1e-4)
  np.testing.assert_allclose(out["ess/sequence"], _numpy_ess(w_seq), rtol=1e-4)
  np.testing.assert_allclose(out["ess_scale"], np.sqrt(_numpy_ess(w_seq)),
                             rtol=1e-4)
  assert out["ess_kl"] > 0


# ----------------------------------------------------------------------------
# Completion-only scoring: the fast step's gradients equal the full-length
# computation.
#
# Issue 12: the fast training step computes the same gradients as the old one.
#
# The fast step scores only the completion columns (``RLStepConfig.
# completion_length``: the hidden states are sliced before the output
# projection), computes the entropy only when it is used, and rematerialises
# the logprob chunks only for large logits. The reference below is the old
# computation, written out here independently: the decoder's hidden states,
# the full ``[N, L - 1, V]`` logits, ``log_softmax``, the entropy at every
# position, a zero column 0, and per-token arrays ``[N, L]`` wide. It replaces
# ``steps._scored_logprobs`` in a reference step, so the two steps differ only in how
# the logprobs are computed; one SGD update (learning rate 1) of each gives
# the gradient, compared for every objective and every aggregation off-policy
# (the sampler's ``old_logprobs`` are perturbed, so ratios clip), and with the
# KL, the entropy bonus, minibatches, microbatches and recomputed ``pi_old``.
# Each objective runs with one aggregation, cycling through them, so every
# name is covered in 13 compiled pairs instead of 78 (the slicing is upstream
# of both choices: they only read the per-token logprobs it produces).

MC_1L = models.get_preset("tiny").replace(num_layers=1)  # compiles faster
P_OFF, T_OFF = 5, 6                      # prompt and completion columns
L_OFF = P_OFF + T_OFF
N_OFF = 8
OFF_PROMPT_LENGTHS = (5, 2, 3, 5, 1, 4, 5, 3)
OFF_COMPLETION_LENGTHS = (6, 3, 0, 5, 1, 4, 6, 2)


def _full_length_logprobs(params_1l, model_config, tokens, input_mask, cfg,
                  with_entropy=False, packing=None):
  """The old full-length computation: every position, entropy always (on
  padded rows: these tests pass no packing plan)."""
  del with_entropy
  assert packing is None
  positions = jnp.maximum(jnp.cumsum(input_mask.astype(jnp.int32), -1) - 1, 0)
  hidden, _ = models.Decoder(model_config).apply(
      {"params": params_1l}, tokens, positions, input_mask_BxT=input_mask)
  w = params_1l["embedding"].T if model_config.tie_embeddings else params_1l["lm_head"]
  z = jnp.einsum("btd,dv->btv", hidden[:, :-1], w) / cfg.training_temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  lp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], -1)[..., 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
  real = input_mask.astype(bool)
  scored = real[:, 1:] & real[:, :-1]
  pad = lambda x: jnp.pad(jnp.where(scored, x, 0.0), ((0, 0), (1, 0)))
  return pad(lp), pad(ent)


@pytest.fixture(scope="module")
def params_1l():
  return models.init_params(MC_1L, jax.random.key(3))


@pytest.fixture(scope="module")
def off_batch(params_1l):
  rng = np.random.RandomState(1)
  tokens = rng.randint(1, MC_1L.vocab_size, (N_OFF, L_OFF)).astype(np.int32)
  input_mask = np.zeros((N_OFF, L_OFF), bool)
  loss_mask = np.zeros((N_OFF, L_OFF), bool)
  for i, (p, t) in enumerate(zip(OFF_PROMPT_LENGTHS, OFF_COMPLETION_LENGTHS)):
    input_mask[i, P_OFF - p:P_OFF + t] = True
    loss_mask[i, P_OFF:P_OFF + t] = True
  tokens = np.where(input_mask, tokens, 0).astype(np.int32)
  cfg = train.RLStepConfig()
  lp = np.asarray(jax.jit(lambda p: _full_length_logprobs(
      p, MC_1L, tokens, input_mask, cfg)[0])(params_1l))
  # Off-policy: pi_old and mu away from pi_theta, so ratios clip.
  old = np.where(loss_mask, lp + rng.normal(0.0, 0.3, (N_OFF, L_OFF)), 0.0)
  sampler = np.where(loss_mask, old + rng.normal(0.0, 0.3, (N_OFF, L_OFF)), 0.0)
  # GSPO's sequence ratio must sit inside its narrow band for some rows.
  old[:4] = np.where(loss_mask[:4], lp[:4] + rng.normal(0, 1e-4, (4, L_OFF)), 0.0)
  adv = rng.normal(0.0, 1.0, N_OFF).astype(np.float32)
  return train.RLBatch(tokens, input_mask, loss_mask, adv,
                       sampler.astype(np.float32), old.astype(np.float32))


def _sgd_update(params_1l, off_batch, cfg, objective, ref_params=None):
  """``params_1l - new_params`` after one SGD(1.0) step: the gradient."""
  # Clip-Cov draws tokens at random: its chain takes a seed.
  coef_tx = (algorithm_lib.coefficient_chain({"objective": objective}, seed=0)
             if objective == "clip_cov" else
             algorithm_lib.coefficient_chain({"objective": objective}))
  step = jax.jit(train.make_rl_step(MC_1L, cfg, optax.sgd(1.0), coef_tx))
  state = train.TrainState(params_1l, optax.sgd(1.0).init(params_1l), None,
                           coef_tx.init(jnp.zeros((1, 1))),
                           jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  new_state, metrics = step(state, off_batch, ref_params)
  grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params_1l,
                       new_state.params)
  return grads, jax.device_get(metrics)


def _compare_full_length(params_1l, off_batch, cfg, objective, monkeypatch, ref_params=None):
  fast, fast_metrics = _sgd_update(params_1l, off_batch, cfg, objective, ref_params)
  with monkeypatch.context() as m:
    m.setattr(steps_lib, "_scored_logprobs", _full_length_logprobs)
    old, old_metrics = _sgd_update(
        params_1l, off_batch, dataclasses.replace(cfg, score_completion_only=False),
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


FULL_LENGTH_CASES = [(o, obj_lib.AGGREGATIONS[i % len(obj_lib.AGGREGATIONS)])
         for i, o in enumerate(algorithm_lib.OBJECTIVES)]


def test_cases_cover_every_objective_and_aggregation():
  assert {o for o, _ in FULL_LENGTH_CASES} == set(algorithm_lib.OBJECTIVES)
  assert {a for _, a in FULL_LENGTH_CASES} == set(obj_lib.AGGREGATIONS)


@pytest.mark.parametrize("objective, aggregation", FULL_LENGTH_CASES)
@pytest.mark.slow
def test_completion_only_gradients_equal_the_full_length_computation(
    params_1l, off_batch, objective, aggregation, monkeypatch):
  cfg = train.RLStepConfig(aggregation=aggregation,
                           old_logprobs="sampler", completion_length=T_OFF,
                           entropy_metric=False)
  metrics = _compare_full_length(params_1l, off_batch, cfg, objective, monkeypatch)
  assert "entropy" not in metrics
  if objective in ("ppo_clip", "dual_clip"):
    assert metrics["clip_frac"] > 0.05


@pytest.mark.slow
def test_kl_entropy_minibatches_and_recomputed_old_logprobs(
    params_1l, off_batch, monkeypatch):
  ref_params = jax.tree.map(lambda x: x * 1.1, params_1l)
  cfg = train.RLStepConfig(num_minibatches=2, num_microbatches=2,
                           kl_coef=0.3, entropy_coef=0.05,
                           completion_length=T_OFF, logprob_remat=True,
                           logprob_chunk_size=4)
  metrics = _compare_full_length(params_1l, off_batch._replace(old_logprobs_NxL=None), cfg,
                     "ppo_clip", monkeypatch, ref_params)
  assert metrics["entropy"] > 0 and metrics["kl"] > 0


def test_completion_length_must_be_below_the_row_length(params_1l, off_batch):
  cfg = train.RLStepConfig(completion_length=L_OFF, old_logprobs="sampler")
  with pytest.raises(ValueError, match=f"completion_length={L_OFF}"):
    _sgd_update(params_1l, off_batch, cfg, "ppo_clip")
  with pytest.raises(ValueError, match="completion_length=0"):
    train.RLStepConfig(completion_length=0)


@pytest.mark.slow
def test_sequence_logprobs_num_scored_is_the_tail_of_the_full_result(params_1l,
                                                                    off_batch):
  full_lp, full_ent = _full_length_logprobs(params_1l, MC_1L, off_batch.tokens_NxL,
                                    off_batch.input_mask_NxL, train.RLStepConfig())
  lp, ent = models.sequence_logprobs(params_1l, MC_1L, off_batch.tokens_NxL,
                                     off_batch.input_mask_NxL, num_scored=T_OFF)
  np.testing.assert_allclose(lp, full_lp[:, -T_OFF:], atol=1e-5)
  np.testing.assert_allclose(ent, full_ent[:, -T_OFF:], atol=1e-5)
  lp, ent = models.sequence_logprobs(params_1l, MC_1L, off_batch.tokens_NxL,
                                     off_batch.input_mask_NxL, num_scored=L_OFF - 1,
                                     with_entropy=False)
  assert ent is None
  np.testing.assert_allclose(lp, full_lp[:, 1:], atol=1e-5)
  with pytest.raises(ValueError, match=f"num_scored={L_OFF}"):
    models.sequence_logprobs(params_1l, MC_1L, off_batch.tokens_NxL,
                             off_batch.input_mask_NxL, num_scored=L_OFF)


@pytest.mark.slow
def test_a_coefficient_chain_that_returns_nan_never_reaches_the_update():
  """Issue 25: a user coefficient link giving NaN/inf on some tokens. Those
  tokens weigh 0 and are counted (``coef/nonfinite_tokens``): the update
  equals the one where their rows' advantages are 0 (the normaliser keeps
  every token), and every parameter stays finite."""
  params = models.init_params(MC, jax.random.key(2))
  optimizer = optax.sgd(0.1)
  base = train.coefficient_chain({"objective": "ppo_clip"})

  def update(ratio, state, params=None, *, advantages_BxT, **kw):
    c, state = base.update(ratio, state, params,
                           advantages_BxT=advantages_BxT, **kw)
    bad = advantages_BxT < 0
    return jnp.where(bad, jnp.where(jnp.arange(c.shape[1]) % 2, jnp.nan,
                                    jnp.inf), c), state

  broken = optax.GradientTransformationExtraArgs(base.init, update)
  batch = _random_batch(seed=3)
  negative = np.asarray(batch.advantages_NxL) < 0
  assert 0 < negative.sum() < len(negative)
  step = jax.jit(train.make_rl_step(MC, train.RLStepConfig(), optimizer,
                                    broken))
  state, metrics = step(_fresh_state(optimizer, broken, params), batch)
  zeroed = batch._replace(advantages_NxL=np.where(
      negative, 0.0, batch.advantages_NxL).astype(np.float32))
  ref_step = jax.jit(train.make_rl_step(MC, train.RLStepConfig(), optimizer,
                                        base))
  ref, ref_metrics = ref_step(_fresh_state(optimizer, base, params), zeroed)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert float(metrics["coef/nonfinite_tokens"]) == float(
      np.asarray(batch.loss_mask_NxL)[negative].sum())
  assert float(ref_metrics["coef/nonfinite_tokens"]) == 0.0
