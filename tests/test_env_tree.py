"""Tree episodes (rljax/rollout/episode_tree.py): a group's episodes fork
between turns.

References are independent of the forks: each row's observations are
replayed from ``Environment.reset`` through its own decoded actions (a
child that stepped its parent's state, or a sibling's, would show it); the
shared history is read from the tokens; the decoded-token count is
recounted from the spans of the distinct ancestors; the paged cache must
give the dense cache's episodes.
"""

import jax
import numpy as np
import pytest

from rljax import envs, models, sampling
from rljax.rollout import episode_tree
from rljax.rollout import multi_turn as mt
from rljax.sampling.tree import TreeConfig
from tests import env_fixtures
from tests.test_envs import (EXAMPLES, MC, SC, TOK, assert_same_episodes,
                             play)

G = 4
CONFIG = SC.replace(num_samples=G, max_new_tokens=40)
# Turns of at most 4 tokens: 3 turns and their observations fit the budget.
TURNS = mt.TurnConfig(max_turns=4, max_observation_tokens=6,
                      max_turn_tokens=4)
TREES = {"uniform": TreeConfig(roots=1, branch=2, branch_by="uniform"),
         "uncertainty": TreeConfig(roots=1, branch=2),
         "two-roots": TreeConfig(roots=2, branch=2)}


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _run(params, tree, *, env=None, paged=None):
  return play(params, env or env_fixtures.Recorder(), CONFIG, TURNS,
              tree=tree, paged=paged)


@pytest.fixture(scope="module")
def forests(params):
  return {name: _run(params, tree) for name, tree in TREES.items()}


def _model_spans(spans):
  return [(s, e) for s, e, kind in spans if kind == "model"]


@pytest.mark.parametrize("name", list(TREES))
def test_each_child_steps_its_own_copy_of_its_parents_environment(
    forests, name):
  """Every row's observations are what the environment answers its own
  actions from the reset on: the shared turns' actions are the parent's,
  the later ones the row's own (with the state shared or stepped twice,
  the count or the letters would be off)."""
  sampler, out = forests[name]
  env_fixtures.assert_replays(out, sampler, env_fixtures.Recorder())


@pytest.mark.parametrize("name", list(TREES))
def test_leaves_that_share_an_ancestor_share_its_turns_to_the_token(
    forests, name):
  tree = TREES[name]
  _, out = forests[name]
  nodes = np.asarray(out.rollout.tree_nodes)
  forks = len(tree.widths(G)) - 1
  assert nodes.shape == (len(out.failed), forks)
  tokens = np.asarray(out.rollout.completion_tokens)
  diverged = 0
  for base in range(0, len(nodes), G):
    for i in range(base, base + G):
      for j in range(i + 1, base + G):
        # The deepest fork whose node they share: the history to the end
        # of the turn after it (and its observation) is the same.
        shared = [d for d in range(forks) if nodes[i, d] == nodes[j, d]]
        if not shared:  # different roots: nothing in common
          continue
        d = max(shared)
        mi, mj = out.turn_tokens[i], out.turn_tokens[j]
        assert all(nodes[i, e] == nodes[j, e] for e in range(d + 1))
        # d + 1 model turns and their observations, where both got so far.
        upto = [s for s in (mi, mj)]
        k = min(len(_model_spans(mi)), len(_model_spans(mj)), d + 1)
        end_i = _history_end(mi, k)
        assert _history_end(mj, k) == end_i
        np.testing.assert_array_equal(tokens[i, :end_i], tokens[j, :end_i])
        assert mi[:2 * k - 1] == mj[:2 * k - 1], upto
        diverged += int(len(_model_spans(mi)) > k and len(_model_spans(mj))
                        > k and not np.array_equal(tokens[i], tokens[j]))
  assert diverged > 0  # children draw with keys of their own


def _history_end(spans, k):
  """The column after the k-th model turn and its observation (if any)."""
  model = 0
  for s, e, kind in spans:
    if kind == "model":
      model += 1
      end = e
    elif model == k:
      return e
    if model > k:
      break
  return end


@pytest.mark.parametrize("name", list(TREES))
def test_token_saving_counts_each_ancestors_turn_once(forests, name):
  """Decoded model tokens recounted from the spans: the turn ``d + 1`` of
  each distinct ancestor at depth ``d`` once, and each leaf's own turns
  after the last fork."""
  _, out = forests[name]
  nodes = np.asarray(out.rollout.tree_nodes)
  forks = nodes.shape[1]
  lengths = np.asarray(out.rollout.lengths)
  decoded = 0
  for i, spans in enumerate(out.turn_tokens):
    model = _model_spans(spans)
    decoded += sum(e - s for s, e in model[forks:])
  for d in range(forks):
    seen = set()
    for i, spans in enumerate(out.turn_tokens):
      # The ancestor at depth d: the group and its node at every fork
      # before (depth 0 is the root, nodes[:, 0]).
      key = (i // G,) + tuple(nodes[i, :d + 1])
      model = _model_spans(spans)
      if key not in seen and len(model) > d:
        seen.add(key)
        decoded += model[d][1] - model[d][0]
  m = out.metrics
  assert m["rollout/tree_leaf_tokens"] == lengths.sum()
  assert m["rollout/generated_tokens"] == decoded
  assert m["rollout/tree_token_saving"] == pytest.approx(
      1 - decoded / lengths.sum())
  assert m["rollout/tree_token_saving"] > 0


def test_a_paged_cache_gives_the_dense_caches_tree(params, forests):
  _, want = forests["uncertainty"]
  _, got = _run(params, TREES["uncertainty"],
                paged=sampling.PagedConfig(block_size=4))
  assert_same_episodes(got, want, ["tree_nodes"])
  assert got.metrics["rollout/kv_blocks_left"] == 0


def test_a_child_whose_step_fails_fails_alone(params):
  """Children of one parent step their own copies: the ones whose action
  makes the environment raise at turn 3 (after both forks) fail, their
  siblings play on."""
  _, out = _run(params, TREES["uniform"],
                env=env_fixtures.Recorder(fail_at=3))
  assert out.failed.any() and not out.failed.all()
  for base in range(0, G * 2, G):  # a failed leaf's parent had live children
    assert not out.failed[base:base + G].all()
  assert np.isnan(out.env_reward[out.failed]).all()
  assert np.isfinite(out.env_reward[~out.failed]).all()


def test_forks_need_a_turn_after_the_last_one():
  """Two forks (1 x 2^2 rows) come after turns 1 and 2: three turns are
  enough, two are refused, naming the fields."""
  tree = TREES["uniform"]
  assert episode_tree.check(tree, G, 3) == 2
  with pytest.raises(ValueError, match=r"rl.tree.branch=2\^2 .*env.max_turns=2 leaves"):
    episode_tree.check(tree, G, 2)
  with pytest.raises(ValueError, match="rl.tree.roots=1 x rl.tree.branch=2"):
    episode_tree.check(tree, 6, 8)


def test_tree_episodes_refuse_slots():
  runner = envs.EnvRunner(env_fixtures.Recorder(), num_workers=0)
  try:
    with pytest.raises(ValueError, match="static batch"):
      mt.MultiTurnSampler(MC, CONFIG, TURNS, runner, TOK, (8,),
                          tree=TREES["uniform"], slots=2)
  finally:
    runner.close()


@pytest.mark.parametrize("name", ["two-roots", "uncertainty"])
def test_a_tree_drafted_from_a_tree_of_the_same_policy_is_that_tree(
    params, name):
  """SPEC-RL on tree episodes: a turn drafts after its fork, and the k-th
  child of a fork takes the k-th distinct turn the stored episodes played
  from its history. With the same policy every drafted turn is kept whole
  (p == q) and the environment answers the same, so the second run, with
  another key, plays the first one's tree again; roots or siblings that
  drafted one branch would make copies of it instead."""
  store = sampling.DraftStore(max_prompts=8)
  runner = envs.EnvRunner(env_fixtures.Recorder(), num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, CONFIG, TURNS, runner, TOK, (8,),
                                  tree=TREES[name], drafts=store)
    first = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(3)))
    second = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(8)))
  finally:
    runner.close()
  assert first.metrics["spec/drafted_rows"] == 0
  np.testing.assert_array_equal(second.rollout.completion_tokens,
                                first.rollout.completion_tokens)
  np.testing.assert_array_equal(second.rollout.tree_nodes,
                                first.rollout.tree_nodes)
  assert second.metrics["spec/full_accept_fraction"] == 1.0
  assert second.metrics["spec/drafted_turns"] >= len(first.failed)
  # The tree has branches to tell apart: a group's leaves differ.
  tokens = np.asarray(first.rollout.completion_tokens)
  assert all(len({t.tobytes() for t in tokens[b:b + G]}) > 1
             for b in range(0, len(tokens), G))
