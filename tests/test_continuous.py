"""Continuous batching and partial rollouts, at the sampler and the host.

References are independent: the static sampler (``sampling.sample``) for
rows, a full forward pass without a cache for logprobs, numpy for the
importance weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, objectives, sampling
from rljax.sampling import continuous as cb
from rljax.rollout import partial as partial_lib
from tests import compile_count

MC = models.get_preset("tiny")
T = 24
# One token in twenty ends a row: lengths from 1 to T, very unequal.
EOS = tuple(range(5, 5 + MC.vocab_size // 20))
B, G = 4, 4
SC = sampling.SamplerConfig(num_samples=G, max_new_tokens=T, eos_ids=EOS,
                            pad_id=0, cache_dtype="float32",
                            prompt_buckets=(16,), segment_slots=None)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(4, MC.vocab_size, rng.randint(2, 12)))
           for _ in range(B)]
  return lists, sampling.pad_prompts(lists, SC.prompt_buckets)


@pytest.fixture(scope="module")
def static(params, prompts):
  _, (tokens, mask) = prompts
  return jax.device_get(sampling.sample(params, tokens, mask,
                                        jax.random.key(3), model_config=MC,
                                        config=SC))


@pytest.fixture(scope="module")
def slots4():
  return cb.make_continuous_sampler(MC, SC, cb.SlotConfig(4, 2))


def _queue(prompts, key=jax.random.key(3), config=SC):
  _, (tokens, mask) = prompts
  return cb.fresh_queue(tokens, mask, key, config)


def test_every_row_equals_the_static_samplers_row(params, prompts, static,
                                                  slots4):
  out = jax.device_get(slots4(params, _queue(prompts), B))
  assert static.lengths.min() < 4 and static.lengths.max() == T  # unequal
  np.testing.assert_array_equal(out.completion_tokens, static.completion_tokens)
  np.testing.assert_array_equal(out.completion_mask, static.completion_mask)
  np.testing.assert_array_equal(out.finished, static.finished)
  assert out.done.all()
  # A slot's cache is laid out unlike the static prefix cache: last bits.
  np.testing.assert_allclose(out.sampler_logprobs, static.sampler_logprobs,
                             atol=2e-5, rtol=0)
  # Slot utilisation: kept tokens over slot-steps, against the static batch
  # (every row decodes until the longest has ended).
  used = static.lengths.sum()
  assert int(out.kept_tokens) == used
  static_util = used / (B * G * static.lengths.max())
  slot_util = used / (int(out.decode_steps) * 4)
  assert slot_util > 1.3 * static_util, (slot_util, static_util)


@pytest.fixture(scope="module")
def own_prefill4():
  return cb.make_continuous_sampler(MC, SC, cb.SlotConfig(
      4, 2, share_prompts=False))


def test_shared_prompts_prefill_fewer_rows_and_change_no_row(
    params, prompts, slots4, own_prefill4):
  """A row that copies its prompt's KV from a live slot (or from its
  fill's leader) decodes as the row that prefilled its own: the same tokens
  and logprobs (to the last bits); without sharing every row prefilled its
  own prompt."""
  q = _queue(prompts)
  shared = jax.device_get(slots4(params, q, B))
  own = jax.device_get(own_prefill4(params, q, B))
  np.testing.assert_array_equal(shared.completion_tokens,
                                own.completion_tokens)
  # A forward of fewer rows may round its matmuls differently: last bits.
  np.testing.assert_allclose(shared.sampler_logprobs, own.sampler_logprobs,
                             atol=2e-6, rtol=0)
  assert int(own.prefilled_rows) == B * G
  # One forward per group at least; the first fill (4 slots, one group)
  # alone saves 3.
  assert B <= int(shared.prefilled_rows) <= B * G - 3, shared.prefilled_rows


def _shared_and_own(rows, params, slots4, own_prefill4):
  """The slots' rollouts of ``B * G`` rows of these prompts, queued as
  groups of ``G`` (a queue that only looks grouped), with prompts shared
  and with a prefill per row."""
  tokens, mask = sampling.pad_prompts(rows, SC.prompt_buckets)
  q = cb.fresh_queue(tokens, mask, jax.random.key(3),
                     SC.replace(num_samples=1))
  q = q._replace(group=np.repeat(np.arange(B, dtype=np.int32), G),
                 sample=np.tile(np.arange(G, dtype=np.int32), B))
  return (jax.device_get(slots4(params, q, B)),
          jax.device_get(own_prefill4(params, q, B)))


def test_rows_of_a_group_with_other_prompts_are_prefilled_each(
    params, prompts, slots4, own_prefill4):
  """Sharing follows the prompts, not the group ids: groups whose rows
  hold different prompts (a queue that only looks grouped) prefill every
  row, in chunks of leaders when a fill has more prompts than one per G
  rows."""
  lists, _ = prompts
  shared, own = _shared_and_own(
      [lists[i % B][: 2 + i % 5] + [4 + i] for i in range(B * G)],
      params, slots4, own_prefill4)
  np.testing.assert_array_equal(shared.completion_tokens,
                                own.completion_tokens)
  assert int(shared.prefilled_rows) == int(own.prefilled_rows) == B * G


def test_a_fill_with_more_prompts_than_leaders_prefills_each_prompt_once(
    params, prompts, slots4, own_prefill4):
  """Pairs of rows share a prompt (8 prompts of 2 rows, in groups of 4):
  the first fill (4 rows, room for 1 leader) holds 2 prompts, so its
  leaders run in 2 chunks of 1 row, and each refill of 2 rows holds 1.
  Each prompt is prefilled once (8 rows, not the 10 of a fill that
  prefills every row when its prompts outnumber its leaders), and every
  row is the row that prefilled its own."""
  lists, _ = prompts
  shared, own = _shared_and_own(
      [lists[(i // 2) % B][: 2 + (i // 2) % 5] + [4 + i // 2]
       for i in range(B * G)], params, slots4, own_prefill4)
  np.testing.assert_array_equal(shared.completion_tokens,
                                own.completion_tokens)
  np.testing.assert_allclose(shared.sampler_logprobs, own.sampler_logprobs,
                             atol=2e-6)
  assert int(shared.prefilled_rows) == B * G // 2
  assert int(own.prefilled_rows) == B * G


def test_refills_do_not_recompile(params, prompts, slots4):
  """Five and more refills, another key and other prompts: one program."""
  lists, _ = prompts
  out = slots4(params, _queue(prompts, jax.random.key(9)), B)
  other = sampling.pad_prompts([p[::-1] for p in lists], SC.prompt_buckets)
  queue2 = cb.fresh_queue(*other, jax.random.key(5), SC)
  with compile_count.lowerings() as lowered:
    out2 = slots4(params, queue2, B)
  assert int(out.prefills) >= 6 and int(out2.prefills) >= 6
  assert not lowered, dict(lowered)


def test_a_rows_draws_do_not_depend_on_its_batch(params, prompts):
  """Per-row keys: row r of a batch is row r of any batch that starts with
  the same prompts (the property continuous batching relies on)."""
  _, (tokens, mask) = prompts
  config = SC.replace(num_samples=2)
  both = jax.device_get(sampling.sample(params, tokens[:2], mask[:2],
                                        jax.random.key(1), model_config=MC,
                                        config=config))
  first = jax.device_get(sampling.sample(params, tokens[:1], mask[:1],
                                         jax.random.key(1), model_config=MC,
                                         config=config))
  np.testing.assert_array_equal(both.completion_tokens[:2],
                                first.completion_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["stop_sequence", "remax_greedy_row",
                                    "policy_logprobs"])
def test_static_equality_holds_for_every_sampler_setting(params, prompts,
                                                         method):
  config = {
      "stop_sequence": SC.replace(eos_ids=(), stop_sequences=((7, 8), (9,))),
      "remax_greedy_row": SC.replace(method=sampling.SamplingMethod(
          greedy_every=G)),
      "policy_logprobs": SC.replace(
          method=sampling.SamplingMethod(temperature=0.7, top_k=50),
          record_policy_logprobs=True),
  }[method]
  _, (tokens, mask) = prompts
  ref = jax.device_get(sampling.sample(params, tokens, mask, jax.random.key(4),
                                       model_config=MC, config=config))
  fn = cb.make_continuous_sampler(MC, config, cb.SlotConfig(5, 1))
  out = jax.device_get(fn(params, _queue(prompts, jax.random.key(4), config),
                          B))
  np.testing.assert_array_equal(out.completion_tokens, ref.completion_tokens)
  np.testing.assert_array_equal(out.finished, ref.finished)
  if config.record_policy_logprobs:
    np.testing.assert_allclose(out.policy_logprobs, ref.policy_logprobs,
                               atol=2e-5, rtol=0)


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_partial_stop_then_resume_gives_the_static_rows(params, prompts,
                                                        static, slots4):
  """Stopped once one group has ended, the unfinished rows go on (their
  tokens prefilled, not re-sampled) and end as the static sampler's."""
  q = _queue(prompts)
  first = jax.device_get(slots4(params, q, 1))
  done = np.asarray(first.done)
  assert 0 < done.sum() < B * G
  assert cb.complete_groups(first.done, q.group) >= 1
  partial_rows = ~done & (first.lengths > 0)
  assert partial_rows.any()
  order = np.argsort(done, stable=True)
  carried = cb.Queue(
      prompt_tokens=q.prompt_tokens[order], prompt_mask=q.prompt_mask[order],
      tokens=first.completion_tokens[order], length=first.lengths[order],
      sampler_logprobs=first.sampler_logprobs[order], policy_logprobs=None,
      keys=q.keys[order], sample=q.sample[order], group=q.group[order],
      done=done[order], finished=first.finished[order],
      num_pending=np.int32((~done).sum()))
  fn = cb.make_continuous_sampler(MC, SC, cb.SlotConfig(B * G, 2,
                                                        carried=True))
  second = jax.device_get(fn(params, carried, B))
  back = np.argsort(order)
  np.testing.assert_array_equal(second.completion_tokens[back],
                                static.completion_tokens)
  np.testing.assert_allclose(second.sampler_logprobs[back],
                             static.sampler_logprobs, atol=2e-5, rtol=0)


def test_bad_slot_settings_are_refused():
  with pytest.raises(ValueError, match="rl.rollout_slots=0"):
    cb.SlotConfig(0)
  with pytest.raises(ValueError, match="rl.rollout_refill_rows=5 is more"):
    cb.SlotConfig(4, 5)
  with pytest.raises(ValueError, match="rl.rollout_slots=True"):
    cb.SlotConfig(True)
  with pytest.raises(ValueError, match="rl.rollout='sliding'"):
    partial_lib.PartialConfig("sliding", 4, 1)
  with pytest.raises(ValueError, match="rl.partial_max_age=-1"):
    partial_lib.PartialConfig("partial", 4, 1, max_age=-1)


# --- partial rollouts on the host -------------------------------------------


def _logprobs(params, prompt_tokens, prompt_mask, tokens, mask):
  """log softmax(logits)[token] of every completion token, from one full
  forward pass without a cache (independent of the sampler)."""
  seq = np.concatenate([prompt_tokens, tokens], 1)
  seq_mask = np.concatenate([prompt_mask, mask], 1)
  positions = np.maximum(np.cumsum(seq_mask, 1) - 1, 0)
  logits, _ = models.Decoder(MC).apply({"params": params}, seq, positions,
                                       input_mask_BxT=seq_mask,
                                       return_logits=True)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  p = prompt_tokens.shape[1]
  picked = jnp.take_along_axis(logp[:, p - 1:-1], tokens[..., None], -1)[..., 0]
  return np.asarray(jnp.where(mask, picked, 0.0))


def _examples(lists):
  return {"prompt": [str(i) for i in range(len(lists))],
          "answer": list(range(len(lists)))}


def _more(lists):
  """``more``: one new prompt per call (batches of B = 1), cycling."""
  state = {"i": 0}

  def more():
    i = 1 + state["i"] % (len(lists) - 1)
    state["i"] += 1
    return [lists[i]], {"prompt": [str(i)], "answer": [i]}
  return more


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_mixed_version_rows_carry_each_tokens_own_sampler_logprob(params,
                                                                  prompts):
  """Rows started under version 0 and ended under version 1: each token's
  sampler logprob is under the params that drew it, and the TIS weight the
  trainer applies is the hand-computed one."""
  lists, _ = prompts
  config = SC
  partial = partial_lib.PartialConfig("partial", slots=8, refill_rows=2,
                                      max_age=3, max_carried=B)
  rollouts = partial_lib.SlotRollouts(MC, config, partial, num_prompts=1)
  params1 = jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(7), x.shape,
                                             x.dtype), params)
  key = jax.random.key(11)
  _, _, v0, m0 = rollouts.sample(params, [lists[0]], _examples([0]), key, 0,
                                 SC.prompt_buckets,
                                 more=_more(lists))
  assert m0["rollout/carried_groups"] >= 1
  assert (v0[v0 >= 0] == 0).all()
  mixed = None
  for version in (1, 2, 3):
    rollout, _, versions, _ = rollouts.sample(
        params1, [lists[0]], _examples([0]), jax.random.fold_in(key, version),
        version, SC.prompt_buckets)
    rows = ((versions == 0).any(1) & (versions >= 1).any(1))
    if rows.any():
      mixed = rollout, versions
      break
  assert mixed is not None, "no row had tokens of two versions"
  rollout, versions = mixed
  lp0, lp1 = (_logprobs(p, rollout.prompt_tokens, rollout.prompt_mask,
                        rollout.completion_tokens, rollout.completion_mask)
              for p in (params, params1))
  expected = np.where(versions == 0, lp0, np.where(versions >= 1, lp1, 0.0))
  np.testing.assert_allclose(rollout.sampler_logprobs, expected, atol=2e-5,
                             rtol=0)
  # TIS against the trainer's logprobs under the newest params (version 1).
  cap = 2.0
  mask = rollout.completion_mask
  weight = np.where(mask, np.minimum(np.exp(lp1 - expected), cap), 0.0)
  tis = objectives.truncated_is(cap=cap)
  coef, _ = tis.update(jnp.ones(mask.shape), tis.init(None),
                       old_logprobs_BxT=jnp.asarray(lp1),
                       sampler_logprobs_BxT=jnp.asarray(
                           rollout.sampler_logprobs),
                       mask_BxT=jnp.asarray(mask))
  np.testing.assert_allclose(np.where(mask, coef, 0.0), weight, rtol=1e-5,
                             atol=1e-6)
  stale = (versions == 0) & mask
  assert np.abs(weight[stale] - 1.0).max() > 1e-3  # the weight is not 1


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_groups_older_than_the_age_cap_are_dropped_and_counted(params,
                                                               prompts):
  lists, _ = prompts
  # Eight slots start two groups of four at once and one is trained per
  # step: started groups pile up, and the ones older than a step are dropped.
  partial = partial_lib.PartialConfig("partial", slots=8, refill_rows=1,
                                      max_age=1, max_carried=B)
  rollouts = partial_lib.SlotRollouts(MC, SC, partial, num_prompts=1)
  more = _more(lists)
  dropped, key = [], jax.random.key(2)
  for version in range(4):
    _, _, versions, metrics = rollouts.sample(
        params, [lists[0]], _examples([0]), jax.random.fold_in(key, version),
        version, SC.prompt_buckets, more=more)
    real = versions >= 0
    assert (version - versions[real]).max() <= 1  # never older than the cap
    dropped.append(metrics["rollout/dropped_groups"])
    for gr in rollouts.carried:
      assert gr.born is None or version + 1 - gr.born <= 1
  assert dropped[-1] > 0 and dropped == sorted(dropped)


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_carried_rows_survive_a_checkpoint_round_trip(params, prompts):
  lists, _ = prompts
  partial = partial_lib.PartialConfig("partial", slots=4, refill_rows=1,
                                      max_age=3, max_carried=B)
  make = lambda: partial_lib.SlotRollouts(MC, SC, partial, num_prompts=1)  # noqa: E731
  a, b = make(), make()
  more = _more(lists)
  a.sample(params, [lists[0]], _examples([0]), jax.random.key(1), 0,
           SC.prompt_buckets, more=more)
  saved = a.arrays()
  assert a.carried and "prompts" in saved
  b.load_arrays({k: np.array(v) for k, v in saved.items()})
  outs = [r.sample(params, [lists[2]], _examples([2]), jax.random.key(2), 1,
                   SC.prompt_buckets) for r in (a, b)]
  for x, y in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):
    np.testing.assert_array_equal(x, y)
  assert outs[0][1] == outs[1][1]
  # A checkpoint written with another group size or generation budget.
  bad = dict(saved, tokens=saved["tokens"][:, :, :5])
  with pytest.raises(ValueError, match="tokens has shape"):
    make().load_arrays(bad)


# --- SPEC-RL drafts verified in the slots' prefills ---------------------------


def _draft_queue(prompts, draft, key=jax.random.key(3)):
  """The fresh queue with each row's draft as its tokens, to be verified."""
  q = _queue(prompts, key)
  return q._replace(
      tokens=np.where(draft.completion_mask, draft.completion_tokens, 0),
      length=draft.lengths.astype(np.int32),
      sampler_logprobs=draft.sampler_logprobs,
      verify=draft.lengths > 0)


@pytest.fixture(scope="module")
def spec_slots():
  return cb.make_continuous_sampler(
      MC, SC, cb.SlotConfig(4, 2, carried=True, log_lenience=0.0))


@pytest.mark.slow  # compiles several steps: CI, not the fast tier
def test_a_draft_from_the_current_policy_is_kept_whole(params, prompts, static,
                                                       spec_slots):
  out = jax.device_get(spec_slots(params, _draft_queue(prompts, static), B))
  np.testing.assert_array_equal(out.accepted, static.lengths)
  np.testing.assert_array_equal(out.completion_tokens, static.completion_tokens)
  np.testing.assert_array_equal(out.finished, static.finished)
  assert int(out.decode_steps) == 0  # nothing left to decode
  np.testing.assert_allclose(out.sampler_logprobs, static.sampler_logprobs,
                             atol=2e-5, rtol=0)


def test_drafts_are_kept_up_to_the_first_rejection_by_hand(params, prompts,
                                                           static, spec_slots):
  """Under moved params, row r keeps draft token j while log u_j <= log p_new
  - log p_old (lenience 0), u from the row's acceptance key; p_new from a
  cache-free forward pass; the rows then go on decoding in their slots."""
  params1 = jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(8), x.shape,
                                             x.dtype), params)
  q = _draft_queue(prompts, static)
  out = jax.device_get(spec_slots(params1, q, B))
  mask = static.completion_mask
  lp_new = _logprobs(params1, static.prompt_tokens, static.prompt_mask,
                     static.completion_tokens, mask)
  u = np.stack([np.asarray(jax.random.uniform(jax.random.fold_in(
      jax.random.wrap_key_data(k), cb.ACCEPT_FOLD), (T,))) for k in q.keys])
  margin = lp_new - static.sampler_logprobs - np.log(u)
  accept = (margin >= 0) & mask
  expected = np.cumprod(accept, 1).sum(1)
  clear = np.all((np.abs(margin) > 1e-4) | ~mask, 1)  # no rounding tie
  assert clear.sum() >= B * G - 2
  np.testing.assert_array_equal(out.accepted[clear], expected[clear])
  assert 0 < expected.sum() < mask.sum()  # some kept, some rejected
  cols = np.arange(T)[None]
  kept = cols < out.accepted[:, None]
  np.testing.assert_array_equal(
      np.where(kept, out.completion_tokens, -1),
      np.where(kept, static.completion_tokens, -1))
  np.testing.assert_allclose(np.where(kept, out.sampler_logprobs, 0.0),
                             np.where(kept, lp_new, 0.0), atol=2e-5, rtol=0)
  assert out.done.all() and (out.lengths >= out.accepted).all()
  assert (out.lengths > out.accepted).any()  # rejected rows decoded on
