"""LATR episodes (rljax/rollout/episode_latr.py): a group's episodes branch
at uncertain tokens of any turn, and branches that stay like their parent
are pruned.

References are independent of the sampler: a full forward pass without a
cache gives the candidates a branch point must take (thresholds of 0: every
live tree token is a branch point until the tree is full); each row's
observations are replayed from the reset through its own actions; the
copies of the root are counted from the tokens; the paged cache must give
the dense cache's episodes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import envs, models, sampling
from rljax.rollout import multi_turn as mt
from rljax.sampling.latr import LatrConfig
from tests import env_fixtures
from tests.test_envs import (EXAMPLES, MC, SC, TOK, assert_same_episodes,
                             play)

G = 4
CONFIG = SC.replace(num_samples=G, max_new_tokens=40)
# Nearly greedy draws: a branch and its parent often decode alike.
COLD = CONFIG.replace(method=sampling.SamplingMethod(temperature=0.1))
TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=6,
                      max_turn_tokens=6)
EVERY = LatrConfig(abs_threshold=0.0, rel_threshold=0.0)
# Branches compared 3 tokens after their birth, pruned within 2 edits.
PRUNING = EVERY.replace(lookahead=(3,), edit_distance=1.0)
RUNS = {
    "every": (CONFIG, EVERY),
    # With these keys and params: branches pruned, their slots taken again.
    "pruning": (COLD, PRUNING),
    # Fewer branch points: a pruned slot stays empty, filled by a copy.
    "copying": (COLD, PRUNING.replace(abs_threshold=0.05)),
}


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _run(params, name, *, paged=None):
  config, latr = RUNS[name]
  return play(params, env_fixtures.Recorder(), config, TURNS, latr=latr,
              paged=paged)


@pytest.fixture(scope="module")
def runs(params):
  return {name: _run(params, name) for name in RUNS}


def _next_logits(params, prompt_tokens, prompt_mask, tokens):
  """The policy's next-token logits after ``prompt + tokens`` (one row, a
  full forward pass without a cache)."""
  seq = np.concatenate([prompt_tokens, np.asarray(tokens, np.int32)])[None]
  mask = np.concatenate([prompt_mask, np.ones(len(tokens), bool)])[None]
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits, _ = models.Decoder(MC).apply({"params": params}, seq, positions,
                                       input_mask_BxT=mask, return_logits=True)
  return np.asarray(logits[0, -1], np.float32)


def test_branch_points_take_the_two_most_likely_tokens(params, runs):
  """Thresholds of 0, a tree of 4 rows: the root branches at column 0 (it
  takes the most likely token, slot 1 the second), then both branch at
  column 1 (into slots 2 and 3, in row order)."""
  _, out = runs["every"]
  r = out.rollout
  for base in range(0, len(out.failed), G):
    toks = np.asarray(r.completion_tokens[base:base + G])
    pt, pm = r.prompt_tokens[base], np.asarray(r.prompt_mask[base], bool)
    top = np.argsort(-_next_logits(params, pt, pm, []))[:2]
    assert [toks[i, 0] for i in range(G)] == [top[0], top[1], top[0], top[1]]
    for row, sibling in ((0, 2), (1, 3)):
      top = np.argsort(-_next_logits(params, pt, pm, toks[row, :1]))[:2]
      assert (toks[row, 1], toks[sibling, 1]) == (top[0], top[1]), base
  # A forced token's sampler logprob is the policy's at the temperature.
  lp = jax.nn.log_softmax(jnp.asarray(_next_logits(
      params, r.prompt_tokens[0], np.asarray(r.prompt_mask[0], bool), []))
                          / CONFIG.method.temperature)
  assert r.sampler_logprobs[1, 0] == pytest.approx(
      float(lp[r.completion_tokens[1, 0]]), abs=1e-5)
  assert out.metrics["latr/branches"] == 3 * len(out.failed) // G


@pytest.mark.parametrize("name", list(RUNS))
def test_each_branch_steps_its_own_copy_of_the_episode(runs, name):
  sampler, out = runs[name]
  env_fixtures.assert_replays(out, sampler, env_fixtures.Recorder())
  turns = out.metrics["env/turns/mean"]
  assert turns > 1  # branches played on past their birth turn


def test_pruned_slots_are_taken_again_or_copy_the_root(runs):
  """A pruned branch's records go with it (every row still replays,
  above); a pruned slot is taken by a later branch point, or at the end
  holds a copy of its group's root episode, as many as ``latr/copies``."""
  for name in ("pruning", "copying"):
    _, out = runs[name]
    m = out.metrics
    assert m["latr/pruned"] > 0, name
    toks = np.asarray(out.rollout.completion_tokens)
    copies = [i for i in range(len(toks))
              if i % G and np.array_equal(toks[i], toks[i - i % G])]
    assert m["latr/copies"] == len(copies), name
    for i in copies:
      root = i - i % G
      assert out.turn_tokens[i] == out.turn_tokens[root]
      assert out.env_reward[i] == out.env_reward[root]
  assert runs["pruning"][1].metrics["latr/copies"] == 0  # taken again
  assert runs["pruning"][1].metrics["latr/branches"] > 3 * 2
  assert runs["copying"][1].metrics["latr/copies"] > 0


def test_a_paged_cache_gives_the_dense_caches_branches(params, runs):
  _, want = runs["pruning"]
  _, got = _run(params, "pruning", paged=sampling.PagedConfig(block_size=4))
  assert_same_episodes(got, want)
  assert got.metrics["rollout/kv_blocks_left"] == 0
  for k in ("latr/branches", "latr/pruned", "latr/copies"):
    assert got.metrics[k] == want.metrics[k], k


def test_latr_episodes_refuse_slots():
  runner = envs.EnvRunner(env_fixtures.Recorder(), num_workers=0)
  try:
    with pytest.raises(ValueError, match="static batch"):
      mt.MultiTurnSampler(MC, CONFIG, TURNS, runner, TOK, (8,),
                          latr=EVERY, slots=2)
    with pytest.raises(ValueError, match="rl.latr.mix_ratio"):
      mt.MultiTurnSampler(MC, CONFIG, TURNS, runner, TOK, (8,),
                          latr=EVERY.replace(mix_ratio=0.25))
  finally:
    runner.close()


def test_the_rows_sampled_as_usual_draft_their_turns_and_the_tree_none(
    params):
  """SPEC-RL on LATR episodes: a row outside the tree drafts each turn
  from its stored episode; the tree's rows, whose tokens are forced or
  branch, draft nothing. With the same policy a drafted turn is kept whole
  and the environment answers the same, so with another key the rows
  sampled as usual play the first run's episodes again."""
  latr = EVERY.replace(mix_ratio=0.5)
  store = sampling.DraftStore(max_prompts=8)
  runner = envs.EnvRunner(env_fixtures.Recorder(), num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, CONFIG, TURNS, runner, TOK, (8,),
                                  latr=latr, drafts=store)
    first = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(3)))
    second = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(8)))
  finally:
    runner.close()
  m = latr.tree_rows(G)
  outside = np.arange(len(first.failed)) % G >= m
  tokens = lambda out: np.asarray(out.rollout.completion_tokens)
  np.testing.assert_array_equal(tokens(second)[outside],
                                tokens(first)[outside])
  assert second.metrics["spec/drafted_rows"] == outside.sum()
  assert second.metrics["spec/full_accept_fraction"] == 1.0
  # With the other key the sampled rows would differ had they not drafted.
  third = play(params, env_fixtures.Recorder(), CONFIG, TURNS, latr=latr,
               key=8)[1]
  assert (tokens(third)[outside] != tokens(first)[outside]).any()
