"""``rljax.train.steps``: one SGD update of ``rl_step`` against an independently
written loss, for every aggregation, with and without gradient accumulation.

The reference loss takes the per-token logprobs from the model's forward
(``models.sequence_logprobs``) and writes the aggregation out from its
definition over the whole minibatch; its gradient comes from ``jax.grad``.
On-policy (one update, pi_old = sg(pi_theta)) every coefficient is 1, so the
per-token loss is ``-A_b * log pi(y_t)``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models
from rljax import objectives as obj_lib
from rljax import train

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
  loss_tok = -BATCH.advantages_N[:, None] * lp * m   # masked per-token loss
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
def test_one_sgd_update_equals_reference_gradient(params, reference_grads,
                                                  aggregation,
                                                  num_microbatches):
  cfg = train.RLStepConfig(num_minibatches=1,
                           num_microbatches=num_microbatches,
                           aggregation=aggregation, max_length=MAX_LENGTH)
  new_state, metrics = _run_step(params, cfg)
  assert_sgd_update(params, new_state.params, reference_grads[aggregation])
  assert int(new_state.step) == 1
  np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, atol=1e-5)
  np.testing.assert_allclose(float(metrics["coef_mean"]), 1.0, atol=1e-5)


def test_reinforce_coefficient_gives_the_same_update(params, reference_grads):
  cfg = train.RLStepConfig(num_microbatches=2,
                           aggregation="sequence_mean_token_mean",
                           max_length=MAX_LENGTH)
  new_state, _ = _run_step(params, cfg, objective="reinforce")
  assert_sgd_update(params, new_state.params,
                    reference_grads["sequence_mean_token_mean"])


def test_sampler_old_logprobs_at_current_params_equal_recompute(params):
  logprobs = jax.jit(lambda p: models.sequence_logprobs(
      p, MC, BATCH.tokens_NxL, BATCH.input_mask_NxL)[0])
  old = jnp.where(BATCH.loss_mask_NxL, logprobs(params), 0.0)
  recompute = train.RLStepConfig(max_length=MAX_LENGTH)
  sampler = train.RLStepConfig(max_length=MAX_LENGTH, old_logprobs="sampler")
  want, _ = _run_step(params, recompute)
  got, _ = _run_step(params, sampler, batch=BATCH._replace(old_logprobs_NxL=old))
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  # The update is not trivially zero.
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(want.params), jax.tree.leaves(params))) > 1e-4


def test_sampler_old_logprobs_are_required_in_sampler_mode(params):
  cfg = train.RLStepConfig(max_length=MAX_LENGTH, old_logprobs="sampler")
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
    tok = -BATCH.advantages_N[:, None] * lp * keep
    if num_sequences is None:
      return tok.sum() / keep.sum()
    n = keep.sum(-1)
    return jnp.where(n > 0, tok.sum(-1) / jnp.maximum(n, 1), 0).sum() \
        / num_sequences

  return jax.device_get(jax.jit(jax.grad(loss))(params))


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
      max_length=MAX_LENGTH, old_logprobs="sampler",
      rejection=obj_lib.parse_rejection("token_k1:0.8:1.25"))
  new_state, metrics = _run_step(params, cfg, batch=BATCH._replace(
      old_logprobs_NxL=old, sampler_logprobs_NxL=sampler))
  assert_sgd_update(params, new_state.params,
                    _masked_reference_grads(params, keep))
  np.testing.assert_allclose(float(metrics["rejection/frac_tokens"]),
                             1 - keep.sum() / m.sum(), rtol=1e-6)


def test_count_empty_sequences_divides_by_every_row(params):
  """TRL's grpo loss: the mean over all N rows (row 2 has no token)."""
  cfg = train.RLStepConfig(max_length=MAX_LENGTH,
                           aggregation="sequence_mean_token_mean",
                           count_empty_sequences=True)
  new_state, _ = _run_step(params, cfg)
  assert_sgd_update(params, new_state.params, _masked_reference_grads(
      params, np.asarray(BATCH.loss_mask_NxL), num_sequences=float(N)))
