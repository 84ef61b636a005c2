"""SPEC-RL on multi-turn episodes: each turn drafts from the prompt's last
episode where the row's history is the stored one's (rljax/rollout/
multi_turn.py, docs/environments.md).

References are runs without drafts: a draft from the same policy is kept
whole, so the episodes are the draft's; a draft forced to be rejected at a
column (a NaN logprob) is kept up to it, and the row decodes on from there
with its own draws, so with the draft's key the episodes are again the
draft's, token for token (which fails if the rejected tokens stayed
visible in the cache or the next token's logits were not the kept
prefix's).
"""

import dataclasses

import jax
import numpy as np
import pytest

from rljax import envs, models, sampling, tokenizers
from rljax.envs import Step
from rljax.rollout import multi_turn as mt
from tests import env_fixtures
from tests.test_envs import EXAMPLES, MC, O, SC, TOK

TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=O,
                      max_turn_tokens=6)
G = SC.num_samples


@dataclasses.dataclass(frozen=True)
class Louder(env_fixtures.Scripted):
  """``Scripted`` with another observation after each turn."""

  def step(self, state, action):
    k = state["k"] + 1
    return Step(observation=f"<{k}>!", reward=0.5, done=k >= self.turns,
                state={"k": k})


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _run(params, env, store, *, slots=None, key=3):
  runner = envs.EnvRunner(env, num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8, 16),
                                  slots=slots, drafts=store)
    return jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(key)))
  finally:
    runner.close()


@pytest.fixture(scope="module")
def plain(params):
  """The episodes without drafts (key 3), and the store they fill."""
  store = sampling.DraftStore(max_prompts=8)
  return _run(params, env_fixtures.Scripted(), store), store


def _same_episodes(got, want):
  a, b = want.rollout, got.rollout
  for field in ("completion_tokens", "completion_mask", "observation_mask",
                "lengths", "finished", "turn_rewards"):
    np.testing.assert_array_equal(getattr(b, field), getattr(a, field),
                                  err_msg=field)
  np.testing.assert_allclose(b.sampler_logprobs, a.sampler_logprobs,
                             atol=1e-4)
  np.testing.assert_allclose(b.policy_logprobs, a.policy_logprobs,
                             atol=1e-4)


def _copy(store):
  out = sampling.DraftStore(max_prompts=store.max_prompts)
  out.load_arrays(store.arrays())
  return out


def _turns(episodes):
  return sum(len([s for s in spans if s[2] == "model"])
             for spans in episodes.turn_tokens)


def test_the_plain_run_stores_each_episode_with_its_observations(plain):
  episodes, store = plain
  assert len(store) == len(EXAMPLES["prompt"])
  assert "spec/drafted_rows" in episodes.metrics
  assert episodes.metrics["spec/drafted_rows"] == 0
  arrays = store.arrays()
  # The stored rows are the episodes', observation mask included.
  r = episodes.rollout
  np.testing.assert_array_equal(
      arrays["observed"].reshape(-1, SC.max_new_tokens),
      np.asarray(r.observation_mask))
  np.testing.assert_array_equal(
      arrays["tokens"].reshape(-1, SC.max_new_tokens),
      np.asarray(r.completion_tokens))
  assert np.asarray(r.observation_mask).any()


@pytest.mark.parametrize("slots", [None, 2])
def test_the_same_policy_keeps_every_turn_whole(params, plain, slots):
  """Another key: every turn is drafted and kept, so the episodes are the
  stored ones (not the other key's draws)."""
  want, store = plain
  got = _run(params, env_fixtures.Scripted(), _copy(store), slots=slots,
             key=4)
  _same_episodes(got, want)
  m = got.metrics
  n = len(EXAMPLES["prompt"]) * G
  assert m["spec/drafted_rows"] == n
  assert m["spec/drafted_turns"] == _turns(want) > n
  assert m["spec/full_accept_fraction"] == 1.0
  assert m["spec/accept_rate"] == 1.0


def test_a_rejected_token_is_redrawn_and_the_row_decodes_on(params, plain):
  """The stored logprob of each first turn's third token is NaN (a corrupt
  draft): the rule rejects it, two tokens are kept, and the row draws on
  with the draft's key, so the episodes are the draft's again; the later
  turns draft (the history matches) and are kept whole."""
  want, store = plain
  arrays = store.arrays()
  column = 2
  mask = arrays["mask"][..., column] & ~arrays["observed"][..., column]
  assert mask.all()  # every first turn has a third token
  arrays["logprobs"][..., column] = np.nan
  broken = sampling.DraftStore(max_prompts=8)
  broken.load_arrays(arrays)
  got = _run(params, env_fixtures.Scripted(), broken, key=3)
  _same_episodes(got, want)
  m = got.metrics
  n = len(EXAMPLES["prompt"]) * G
  turns = _turns(want)
  assert m["spec/drafted_turns"] == turns
  assert m["spec/full_accept_fraction"] == (turns - n) / turns
  model_tokens = int(np.sum(want.rollout.completion_mask
                            & ~want.rollout.observation_mask))
  # Each row's first turn drafted its tokens and kept 2.
  first = [spans[0] for spans in want.turn_tokens]
  dropped = sum(end - start - column for start, end, _ in first)
  assert m["spec/accept_rate"] == pytest.approx(
      (model_tokens - dropped) / model_tokens)


def test_a_turn_drafts_only_where_the_history_is_the_stored_one(params,
                                                                plain):
  """Another environment answers otherwise: the first turns draft (their
  history is the prompt) and are kept; no later turn drafts."""
  want, store = plain
  got = _run(params, Louder(), _copy(store), key=4)
  m = got.metrics
  n = len(EXAMPLES["prompt"]) * G
  assert m["spec/drafted_rows"] == n
  assert m["spec/drafted_turns"] == n
  assert m["spec/full_accept_fraction"] == 1.0
  # The first turns are the stored ones.
  for r, spans in enumerate(want.turn_tokens):
    start, end, _ = spans[0]
    np.testing.assert_array_equal(
        got.rollout.completion_tokens[r, start:end],
        want.rollout.completion_tokens[r, start:end])
  # Louder's observations are not Scripted's: the rows differ after them.
  assert not np.array_equal(got.rollout.completion_tokens,
                            want.rollout.completion_tokens)


def test_a_store_written_before_episodes_drafted_loads_without_observations(
    plain):
  _, store = plain
  arrays = store.arrays()
  del arrays["observed"]
  old = sampling.DraftStore(max_prompts=8)
  old.load_arrays(arrays)
  prompts = tokenizers.encode_prompts(TOK, EXAMPLES["prompt"])
  tokens, mask, _, observed = old.lookup_turns(prompts, G,
                                               SC.max_new_tokens)
  assert mask.any() and not observed.any()
  np.testing.assert_array_equal(
      tokens, store.arrays()["tokens"].reshape(-1, SC.max_new_tokens))


def test_a_negative_lenience_is_refused_naming_the_field():
  runner = envs.EnvRunner(env_fixtures.Scripted(), num_workers=0)
  with pytest.raises(ValueError, match="sampler.spec_log_lenience=-1"):
    mt.MultiTurnSampler(MC, SC, TURNS, runner, TOK, (8,),
                        drafts=sampling.DraftStore(4), log_lenience=-1.0)
