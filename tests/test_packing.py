"""Padding-free training (``models/packing.py``, ``train/packing.py``).

The packed forward against a float64 NumPy decoder run one row at a time
(``tests/reference_model.py``, no code shared), and the packed RL step
against the padded step on the same rows: loss, gradients and metrics, for
every aggregation mode, with KL, entropy, the critic and distillation, and
with 2 minibatches x 2 microbatches and 2 epochs (the host's shuffle must be
the step's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models
from rljax import objectives as obj_lib
from rljax import train
from rljax.models import packing as packing_lib
from rljax.models import scoring
from rljax.train import algorithm as algorithm_lib
from rljax.train import critic as critic_lib
from rljax.train import packing as train_packing
from tests import compile_count
from tests import reference_model

MC = models.get_preset("tiny", num_layers=1)
P, T = 4, 8
L = P + T
# Long-tailed completions: several short rows, one truncated at T (it shares
# a buffer with short ones), one empty.
PROMPTS = (2, 1, 1, 4, 1, 4, 2, 3)
COMPLETIONS = (8, 1, 0, 2, 3, 1, 8, 5)
N = len(PROMPTS)


def _rows(seed=0, vocab=MC.vocab_size):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, vocab, (N, L)).astype(np.int32)
  input_mask = np.zeros((N, L), bool)
  loss_mask = np.zeros((N, L), bool)
  for i, (p, t) in enumerate(zip(PROMPTS, COMPLETIONS)):
    input_mask[i, P - p:P + t] = True
    loss_mask[i, P:P + t] = True
  return np.where(input_mask, tokens, 0).astype(np.int32), input_mask, \
      loss_mask


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(1))


# --- the packing itself ------------------------------------------------------


def test_first_fit_packs_every_row_once_without_overlap():
  _, mask, _ = _rows()
  packing = packing_lib.pack_rows(mask, N)
  seg = packing.segment_BpxLp
  for i in range(N):
    slots = np.flatnonzero(seg.reshape(-1) == i + 1)
    assert len(slots) == mask[i].sum()
    # One buffer, contiguous, in the row's order, positions from 0.
    assert len(set(slots // L)) <= 1
    np.testing.assert_array_equal(np.diff(slots), 1)
    np.testing.assert_array_equal(packing.position_BpxLp.reshape(-1)[slots],
                                  np.arange(len(slots)))
    np.testing.assert_array_equal(packing.source_BpxLp.reshape(-1)[slots],
                                  i * L + np.flatnonzero(mask[i]))
    np.testing.assert_array_equal(packing.slot_BxL[i][mask[i]], slots)
  needed = packing_lib.buffers_needed(mask.sum(-1), L)
  assert needed < N  # the long tail packs
  assert needed >= -(-mask.sum() // L)
  with pytest.raises(ValueError, match=r"need \d+ buffers of 12 tokens; "
                     r"num_buffers=1"):
    packing_lib.pack_rows(mask, 1)
  with pytest.raises(ValueError, match="does not fit a buffer of 3"):
    packing_lib.pack_rows(mask, N, buffer_length=3)


def test_buckets_are_few_and_cover_the_need():
  for rows in (1, 6, 8, 32, 64):
    sizes = {train_packing.bucket(k, rows) for k in range(1, rows + 1)}
    assert len(sizes) <= train_packing.NUM_BUCKETS
    for k in range(1, rows + 1):
      assert k <= train_packing.bucket(k, rows) <= rows
  assert train_packing.bucket(3, 32, multiple=8) % 8 == 0


def test_more_buckets_leave_fewer_buffers_empty():
  """64 rows needing 23 buffers: 8 buckets round up to 24 (steps of 8);
  64 give 23, exactly; 1 bucket gives all 64. A step of 3 (22 buckets)
  rounds 23 and 24 up to 24, and 25 to 27."""
  assert train_packing.bucket(23, 64) == 24
  assert train_packing.bucket(23, 64, buckets=64) == 23
  assert train_packing.bucket(24, 64, buckets=64) == 24
  assert train_packing.bucket(23, 64, buckets=1) == 64
  assert [train_packing.bucket(k, 64, buckets=22) for k in (23, 24, 25)] == [
      24, 24, 27]
  for n in (1, 8, 22, 64, 100):
    sizes = {train_packing.bucket(k, 64, buckets=n) for k in range(1, 65)}
    assert len(sizes) <= n


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_packing_buckets_must_be_a_positive_integer(value):
  with pytest.raises(ValueError, match=rf"rl.packing_buckets={value!r}: a "
                     "positive integer"):
    train.RLStepConfig(packing_buckets=value)


def _reference_logprobs(params, config, tokens, mask):
  """Per-row float64 NumPy logprobs of every real token after the first."""
  np_params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  out = np.zeros(tokens.shape)
  for i in range(tokens.shape[0]):
    cols = np.flatnonzero(mask[i])
    if len(cols) < 2:
      continue
    logits = reference_model.forward(np_params, config, tokens[i, cols])
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    out[i, cols[1:]] = logp[np.arange(len(cols) - 1), tokens[i, cols[1:]]]
  return out


GEMMA_LIKE = dict(post_norms=True, embed_scale=True, norm_offset=1.0,
                  qk_norm=True, attn_logit_softcap=50.0,
                  final_logit_softcap=30.0, rope_local_theta=100.0)


@pytest.mark.parametrize("overrides", [{}, GEMMA_LIKE],
                         ids=["llama_like", "gemma_like"])
@pytest.mark.parametrize("projected_on", ["buffers", "rows"])
def test_packed_logprobs_equal_a_float64_numpy_reference_per_row(
    overrides, projected_on):
  """Rows packed several to a buffer (one truncated at T beside short ones)
  score as each row alone: block-diagonal attention, positions restarting
  per segment (RoPE), sliding windows counted within the segment. The
  output projection runs on the buffers (fewer slots than the rows' scored
  columns: each slot predicts the next of its segment) or, with as many
  buffers as rows, on the rows' columns."""
  config = models.get_preset("tiny", num_layers=2, sliding_window=3,
                             global_every=2, **overrides)
  params = models.init_params(config, jax.random.key(2))
  tokens, mask, _ = _rows(1, config.vocab_size)
  needed = packing_lib.buffers_needed(mask.sum(-1), L)
  assert needed < N
  packing = packing_lib.pack_rows(
      mask, needed if projected_on == "buffers" else N)
  assert scoring.on_buffers(packing, N, L - 1) == (projected_on == "buffers")
  # The truncated row 0 shares its buffer with another row.
  buf = packing.slot_BxL[0, mask[0]][0] // L
  assert len(set(packing.segment_BpxLp[buf]) - {0}) >= 2
  got, _ = models.sequence_logprobs(params, config, tokens, mask,
                                    packing=jax.tree.map(jnp.asarray, packing))
  want = _reference_logprobs(params, config, tokens, mask)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_the_projection_moves_to_the_buffers_only_when_they_are_smaller():
  """``Bp * Lp`` against the rows' ``B * S`` scored columns, on both sides
  of equality (4 rows x 6 columns = 24 positions)."""
  def packing(bp, lp):
    return packing_lib.Packing(*[np.zeros((bp, lp), np.int32)] * 3,
                               np.zeros((4, 7), np.int32))
  assert not scoring.on_buffers(packing(2, 12), 4, 6)  # 24 = 24
  assert not scoring.on_buffers(packing(5, 5), 4, 6)  # 25
  assert scoring.on_buffers(packing(1, 23), 4, 6)  # 23


def test_targets_on_the_buffers_are_each_segment_s_next_token():
  """Hand-made: two rows in one buffer of 6 and an empty slot; a slot's
  target is the next slot's token while the segment goes on, else 0."""
  tokens = np.array([[0, 5, 6, 7], [0, 0, 8, 9]], np.int32)
  mask = tokens > 0
  packing = packing_lib.pack_rows(mask, 1, buffer_length=6)
  got = np.asarray(packing_lib.next_targets(jnp.asarray(tokens), jax.tree.map(
      jnp.asarray, packing)))
  # First-fit by decreasing length: row 0 (5 6 7) at 0..2, row 1 (8 9) at 3..4.
  np.testing.assert_array_equal(got, [[6, 7, 0, 9, 0, 0]])


# --- the packed step equals the padded step ----------------------------------


def _batch(params, off_policy=True, seed=3):
  tokens, mask, loss_mask = _rows(seed)
  rng = np.random.RandomState(seed)
  lp = np.asarray(models.sequence_logprobs(params, MC, tokens, mask)[0])
  old = np.where(loss_mask, lp + rng.normal(0, 0.3, (N, L)), 0.0)
  sampler = np.where(loss_mask, old + rng.normal(0, 0.3, (N, L)), 0.0)
  return train.RLBatch(tokens, mask, loss_mask,
                       rng.normal(0, 1, N).astype(np.float32),
                       sampler.astype(np.float32),
                       old.astype(np.float32) if off_policy else None,
                       rng.uniform(0, 1, N).astype(np.float32))


def _step(params, cfg, batch, packed, *, ref=None, teacher=None, lr=1.0):
  coef_tx = algorithm_lib.coefficient_chain({"objective": "ppo_clip"})
  # SGD: Adam would turn float-rounding-sized gradients into whole steps.
  critic_opt = optax.sgd(lr) if cfg.critic else None
  critic = None
  if cfg.critic is not None:
    cp = critic_lib.init_params(params, MC)
    cp["head"]["kernel"] = jax.random.normal(jax.random.key(5),
                                             (MC.d_model,)) * 0.3
    critic = critic_lib.CriticState(cp, critic_opt.init(cp))
  optimizer = optax.sgd(lr)
  state = train.TrainState(params, optimizer.init(params), None,
                           coef_tx.init(jnp.zeros((1, 1))),
                           jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(7)), critic)
  step = jax.jit(train.make_rl_step(MC, cfg, optimizer, coef_tx,
                                    critic_optimizer=critic_opt,
                                    teacher_config=MC))
  if packed:
    step = train_packing.PaddingFree(step, cfg)
  args = (ref,) + (() if teacher is None else (teacher,))
  new, metrics = step(state, batch if cfg.critic else batch._replace(
      rewards_N=None), *args)
  return new, jax.device_get(metrics), step


def _assert_same(padded, packed):
  (s0, m0), (s1, m1) = padded, packed
  for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
      np.testing.assert_allclose(b, a, rtol=1e-5,
                                 atol=1e-5 * max(np.abs(a).max(), 1e-3))
    else:
      np.testing.assert_array_equal(a, b)
  assert set(m0) == set(m1)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("aggregation", [
    a if a == "sequence_mean_token_mean" else pytest.param(
        a, marks=pytest.mark.slow) for a in obj_lib.AGGREGATIONS])
def test_the_packed_step_equals_the_padded_step(params, aggregation):
  """One update on off-policy rows: every aggregation's normaliser comes
  from the rows' layout, so packing changes no number."""
  cfg = train.RLStepConfig(aggregation=aggregation, completion_length=T,
                           old_logprobs="sampler")
  batch = _batch(params)
  padded = _step(params, cfg, batch, False)[:2]
  new, metrics, step = _step(params, cfg, batch, True)
  assert step.last_fill > 0.5  # the rows did pack
  _assert_same(padded, (new, metrics))
  assert metrics["grad_norm"] > 1e-3


@pytest.mark.slow
def test_with_kl_entropy_critic_distillation_and_2x2_minibatches(params):
  """Every forward of the step packed: pi_old's recompute, the reference,
  the teacher, the critic's old values and its trained values; 2 epochs x 2
  minibatches x 2 microbatches (the host draws the step's shuffle)."""
  ref = jax.tree.map(lambda x: x * 1.1, params)
  teacher = jax.tree.map(lambda x: x * 0.9, params)
  cfg = train.RLStepConfig(
      num_epochs=2, num_minibatches=2, num_microbatches=2,
      aggregation="sequence_mean_token_mean", completion_length=T,
      kl_coef=0.3, entropy_coef=0.05, distill_coef=0.5,
      critic=critic_lib.CriticConfig(), ess_pooling="minibatch",
      ess_kl_coef=0.1)
  batch = _batch(params, off_policy=False)
  padded = _step(params, cfg, batch, False, ref=ref, teacher=teacher,
                 lr=0.01)[:2]
  packed = _step(params, cfg, batch, True, ref=ref, teacher=teacher,
                 lr=0.01)[:2]
  for leaf in jax.tree.leaves(padded[0].params):
    assert np.all(np.isfinite(leaf))
  _assert_same(padded, packed)
  m = packed[1]
  assert m["kl"] > 0 and m["entropy"] > 0 and "critic/value_loss" in m


def test_a_plan_of_the_wrong_shape_is_refused(params):
  cfg = train.RLStepConfig(completion_length=T, old_logprobs="sampler")
  batch = _batch(params)
  plan = train_packing.plan_step(cfg, batch.input_mask_NxL, None)
  bad = plan._replace(packing=plan.packing._replace(
      slot_BxL=plan.packing.slot_BxL[..., :-1]))
  step = train.make_rl_step(MC, cfg, optax.sgd(1.0),
                            algorithm_lib.coefficient_chain({}))
  with pytest.raises(ValueError, match=r"RLBatch.plan.packing.slot_BxL has "
                     r"shape"):
    jax.eval_shape(step, _state_shapes(params, cfg), batch._replace(
        plan=bad, rewards_N=None))


def _state_shapes(params, cfg):
  del cfg
  coef_tx = algorithm_lib.coefficient_chain({})
  return train.TrainState(params, optax.sgd(1.0).init(params), None,
                          coef_tx.init(jnp.zeros((1, 1))),
                          jnp.zeros((), jnp.int32),
                          jax.random.key_data(jax.random.key(7)))


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_one_program_per_bucket_whatever_the_lengths(params):
  """Batches of other lengths in the same bucket reuse the step's program;
  a new bucket compiles one more."""
  cfg = train.RLStepConfig(completion_length=T, old_logprobs="sampler")
  batch = _batch(params)
  jitted = jax.jit(train.make_rl_step(MC, cfg, optax.sgd(0.1),
                                      algorithm_lib.coefficient_chain({})))
  step = train_packing.PaddingFree(jitted, cfg)
  shapes, programs = [], []
  for completions in ((8, 1, 0, 2, 3, 1, 8, 5), (1, 2, 0, 1, 3, 2, 1, 1),
                      (8, 8, 8, 8, 8, 8, 8, 8), (2, 1, 1, 3, 1, 1, 2, 2)):
    mask = np.zeros((N, L), bool)
    for i, t in enumerate(completions):
      mask[i, P - 1:P + t] = True
    b = batch._replace(input_mask_NxL=mask, loss_mask_NxL=mask & (
        np.arange(L) >= P), rewards_N=None)
    state = _state_shapes(params, cfg)
    with compile_count.lowerings() as lowered:
      state, _ = step(state, b)
    shapes.append(step.plan(state, b).packing.segment_BpxLp.shape)
    programs.append(lowered["rl_step"])
  assert len(set(shapes)) >= 2, shapes  # the lengths did change the bucket
  # A step lowers one program exactly when its bucket is new.
  new = [int(shape not in shapes[:i]) for i, shape in enumerate(shapes)]
  assert programs == new, (shapes, programs)


def test_the_packed_sft_step_equals_the_padded_one(params):
  """The warm-up's rows (right-padded, ``sft.sft_arrays``) packed: the same
  loss and update."""
  from rljax.train import sft  # pylint: disable=g-import-not-at-top
  tokens, mask, loss_mask = _rows(4)
  optimizer = optax.sgd(0.5)
  step = jax.jit(sft.make_sft_step(MC, optimizer))
  packing = sft.pack_batch(mask)
  assert packing.segment_BpxLp.shape[0] < N
  out = [step(params, optimizer.init(params), tokens, mask, loss_mask, *extra)
         for extra in ((), (packing,))]
  np.testing.assert_allclose(out[1][2]["sft_loss"], out[0][2]["sft_loss"],
                             rtol=1e-6)
  for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_rows_without_completions_pack_and_train_to_zero(params):
  """Every completion empty (all rejected, or EOS at once) and one row of a
  single token: the packed step gives the padded step's zeros, not NaN."""
  cfg = train.RLStepConfig(completion_length=T, old_logprobs="sampler",
                           aggregation="sequence_mean_token_mean")
  batch = _batch(params)
  mask = np.zeros((N, L), bool)
  mask[:, P - 2:P] = True
  mask[0, :P - 1] = False  # a single real token
  batch = batch._replace(input_mask_NxL=mask,
                         loss_mask_NxL=np.zeros((N, L), bool))
  padded = _step(params, cfg, batch, False)[:2]
  packed = _step(params, cfg, batch, True)[:2]
  _assert_same(padded, packed)
  for leaf in jax.tree.leaves(packed[0].params):
    assert np.all(np.isfinite(leaf))
  assert float(packed[1]["grad_norm"]) == 0.0


def test_the_projection_can_be_chosen_and_is_checked(params):
  """``projection="rows"`` and ``"buffers"`` on the same packing give the
  same logprobs; a wrong name, or the buffers without a packing, is refused
  naming the argument and what is accepted."""
  tokens, mask, _ = _rows(2)
  packing = jax.tree.map(jnp.asarray, packing_lib.pack_rows(
      mask, packing_lib.buffers_needed(mask.sum(-1), L)))
  got = {p: np.asarray(models.sequence_logprobs(
      params, MC, tokens, mask, num_scored=T, packing=packing,
      projection=p)[0]) for p in ("rows", "buffers")}
  np.testing.assert_allclose(got["buffers"], got["rows"], atol=1e-6)
  assert np.abs(got["rows"]).sum() > 0
  with pytest.raises(ValueError, match=r"projection='row'.*'rows'"):
    models.sequence_logprobs(params, MC, tokens, mask, packing=packing,
                             projection="row")
  with pytest.raises(ValueError, match="needs a packing"):
    models.sequence_logprobs(params, MC, tokens, mask, projection="buffers")
