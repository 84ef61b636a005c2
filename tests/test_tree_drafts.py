"""SPEC-RL's drafts on tree rollouts (``rl.rollout="tree"`` with
``sampler.speculative``: ``rljax/sampling/tree_drafts.py``, and tree
episodes' turns in ``rljax/rollout/episode_drafts.py``).

References: the tree sampler itself (an empty draft must give its rollout
token for token; greedy decoding is exact, so any draft must), the model's
own forward pass over each finished leaf (a wrong cache slot after a
partly accepted segment would change a logprob), and hand-built draft
trees whose nodes are read off by eye.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling import paged as paged_lib
from rljax.sampling import tree as tree_lib
from rljax.sampling import tree_drafts
from tests import test_tree
from tests.test_tree import BASE, T, TINY, TREE

PAGED = paged_lib.PagedConfig(block_size=4)


# The tree tests' model and prompts (module-scoped fixtures, one copy here).
params = test_tree.params
prompts = test_tree.prompts


@pytest.fixture(scope="module")
def samplers():
  """``{(paged, speculative): sampler}``, each compiled once per module."""
  out = {}
  for paged in (None, PAGED):
    out[paged is not None, False] = tree_lib.make_tree_sampler(
        TINY, BASE, TREE, paged=paged)
    out[paged is not None, True] = tree_lib.make_tree_sampler(
        TINY, BASE, TREE, paged=paged, speculative=True)
  return out


def _plain(samplers, paged, params, prompts, key):
  return jax.device_get(samplers[paged, False](params, *prompts, key))


def _drafted(samplers, paged, params, prompts, draft, key):
  out = jax.device_get(samplers[paged, True](params, *prompts, draft, key))
  return out[0], out[1], (out[2] if paged else None)


def _as_draft(rollout):
  return sampling.Draft(rollout.completion_tokens, rollout.completion_mask,
                        rollout.sampler_logprobs)


def _same_tree(a, b):
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
  np.testing.assert_array_equal(a.tree_nodes, b.tree_nodes)
  np.testing.assert_allclose(a.sampler_logprobs, b.sampler_logprobs,
                             atol=1e-5)


# --- which draft node each row follows -------------------------------------


def _levels(leaves, widths, seg):
  tokens = np.array(leaves, np.int32)[None]
  draft = sampling.Draft(jnp.asarray(tokens[0]),
                         jnp.ones(tokens[0].shape, bool),
                         jnp.zeros(tokens[0].shape))
  return tree_drafts.draft_levels(draft, 1, len(leaves), widths, seg), draft


def test_children_follow_the_distinct_branches_below_their_parents_node():
  # A draft tree of one root: first tokens (5), then (5, 6) and (5, 9),
  # then four leaves.
  leaves = [[5, 6, 7], [5, 6, 8], [5, 9, 1], [5, 9, 2]]
  levels, draft = _levels(leaves, (1, 2, 4), 1)
  root = tree_drafts.root_sources(levels, draft, 1, 4, 1)
  np.testing.assert_array_equal(root, [0])
  depth1 = tree_drafts.child_sources(levels, 0, root.reshape(1, 1),
                                     jnp.array([[0, 0]]))
  np.testing.assert_array_equal(depth1, [[0, 2]])  # (5, 6) and (5, 9)
  leaf = tree_drafts.child_sources(levels, 1, depth1, jnp.array([[0, 0, 1, 1]]))
  np.testing.assert_array_equal(leaf, [[0, 1, 2, 3]])
  # Three children of the first row: its node has two branches, so the
  # third follows none; the second row's one child takes its first.
  uneven = tree_drafts.child_sources(levels, 1, depth1,
                                     jnp.array([[0, 0, 0, 1]]))
  np.testing.assert_array_equal(uneven, [[0, 1, -1, 2]])
  # A row that follows no node has children that follow none.
  lost = tree_drafts.child_sources(levels, 1, jnp.array([[0, -1]]),
                                   jnp.array([[0, 0, 1, 1]]))
  np.testing.assert_array_equal(lost, [[0, 1, -1, -1]])


def test_equal_branches_are_one_node_and_two_roots_take_two_first_segments():
  leaves = [[5, 6, 7], [5, 6, 7], [3, 4, 4], [3, 1, 4]]
  levels, draft = _levels(leaves, (2, 4), 1)
  roots = tree_drafts.root_sources(levels, draft, 1, 4, 2)
  np.testing.assert_array_equal(roots, [0, 2])
  # Leaves 0 and 1 are one completion: the second child of root 0 has no
  # branch of its own to follow.
  leaf = tree_drafts.child_sources(levels, 0, roots.reshape(1, 2),
                                   jnp.array([[0, 0, 1, 1]]))
  np.testing.assert_array_equal(leaf, [[0, -1, 2, 3]])


def test_a_prompt_without_a_draft_has_roots_that_follow_nothing():
  draft = sampling.Draft(jnp.ones((4, 3), jnp.int32),
                         jnp.zeros((4, 3), bool), jnp.zeros((4, 3)))
  levels = tree_drafts.draft_levels(draft, 1, 4, (1, 2, 4), 1)
  np.testing.assert_array_equal(
      tree_drafts.root_sources(levels, draft, 1, 4, 1), [-1])


# --- the drafted tree -------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_an_empty_draft_gives_the_tree_samplers_rollout(samplers, params,
                                                        prompts, paged):
  key = jax.random.key(3)
  plain = _plain(samplers, paged, params, prompts, key)
  n = plain.completion_tokens.shape[0]
  empty = sampling.Draft(jnp.zeros((n, T), jnp.int32),
                         jnp.zeros((n, T), bool), jnp.zeros((n, T)))
  got, accepted, _ = _drafted(samplers, paged, params, prompts, empty, key)
  _same_tree(plain, got)
  assert not accepted.any()


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_draft_of_the_same_policy_is_kept_whole_branch_by_branch(
    samplers, params, prompts, paged):
  """p == q accepts every token, and each row follows its own branch: the
  tree comes back as drawn, not as copies of one branch."""
  earlier = _plain(samplers, paged, params, prompts, jax.random.key(3))
  got, accepted, stats = _drafted(samplers, paged, params, prompts,
                                  _as_draft(earlier), jax.random.key(11))
  _same_tree(earlier, got)
  np.testing.assert_array_equal(accepted, earlier.lengths)
  if paged:
    assert stats["rollout/kv_blocks_left"] == 0


def _edited(rollout):
  """``rollout``'s tokens as a draft, one token of each leaf changed (a
  different column per leaf)."""
  tokens = np.array(rollout.completion_tokens)
  rows = np.arange(len(tokens))
  cols = rows % 7 + 2
  tokens[rows, cols] = (tokens[rows, cols] + 1) % TINY.vocab_size
  return sampling.Draft(jnp.asarray(tokens), rollout.completion_mask,
                        rollout.sampler_logprobs)


@pytest.fixture(scope="module")
def nearby(samplers, params, prompts):
  """An earlier tree of the same policy with a token of each leaf changed:
  its segments before the change are accepted whole (p == q), so rows wait
  at a segment's end while others decode on from a rejected token."""
  return _edited(_plain(samplers, False, params, prompts, jax.random.key(5)))


@pytest.fixture(scope="module")
def partly(samplers, params, prompts, nearby):
  return {paged: _drafted(samplers, paged, params, prompts, nearby,
                          jax.random.key(11)) for paged in (False, True)}


def test_a_partly_accepted_tree_has_each_leafs_logprobs_under_the_model(
    params, partly):
  """Rows that wait at a segment's end, rows that decode on from a rejected
  token and forks of both: a cache slot written wrong would change some
  leaf's logprob under the model's own forward pass."""
  rollout, accepted, _ = partly[False]
  total = rollout.completion_mask.sum()
  assert 0 < accepted.sum() < total
  tokens, mask = rollout.sequences()
  lp, _ = models.sequence_logprobs(params, TINY, tokens, mask,
                                   with_entropy=False)
  p = rollout.prompt_tokens.shape[1]
  want = np.where(rollout.completion_mask, np.asarray(lp)[:, p:], 0.0)
  np.testing.assert_allclose(rollout.sampler_logprobs, want, atol=2e-5)
  np.testing.assert_allclose(rollout.policy_logprobs, want, atol=2e-5)


def test_each_leafs_accepted_tokens_are_a_draft_leafs_and_the_tree_holds(
    partly, nearby):
  rollout, accepted, _ = partly[False]
  tokens, nodes = rollout.completion_tokens, rollout.tree_nodes
  draft = np.asarray(nearby.tokens)
  g = BASE.num_samples
  for i, a in enumerate(accepted):
    group = draft[(i // g) * g:(i // g + 1) * g, :a]
    assert (group == tokens[i, :a]).all(1).any(), i
  # Leaves with a common ancestor share its segments.
  seg = TREE.segment_tokens
  for i in range(len(tokens)):
    for j in range(i - i % g, i - i % g + g):
      shared = 0
      while shared < nodes.shape[1] and nodes[i, shared] == nodes[j, shared]:
        shared += 1
      np.testing.assert_array_equal(tokens[i, :shared * seg],
                                    tokens[j, :shared * seg])


def test_on_a_paged_cache_the_drafted_tree_is_the_dense_ones(partly):
  (dense, acc_dense, _), (paged, acc_paged, stats) = partly[False], partly[True]
  _same_tree(dense, paged)
  np.testing.assert_array_equal(acc_dense, acc_paged)
  assert stats["rollout/kv_blocks_left"] == 0
  assert stats["rollout/kv_cut_rows"] == 0


def test_greedy_trees_are_exact_whatever_the_draft(params, prompts):
  """Greedy decoding keeps exactly the draft tokens that are the argmax:
  the greedy tree, with one token of each leaf changed, drafts the greedy
  tree again."""
  greedy = BASE.__class__(**{**BASE.__dict__,
                             "method": sampling.SamplingMethod(greedy=True)})
  plain = jax.device_get(tree_lib.make_tree_sampler(TINY, greedy, TREE)(
      params, *prompts, jax.random.key(3)))
  draft = _edited(plain)
  got, accepted = jax.device_get(tree_lib.make_tree_sampler(
      TINY, greedy, TREE, speculative=True)(params, *prompts, draft,
                                            jax.random.key(4)))
  np.testing.assert_array_equal(got.completion_tokens,
                                plain.completion_tokens)
  np.testing.assert_array_equal(got.tree_nodes, plain.tree_nodes)
  assert 0 < accepted.sum() < plain.completion_mask.sum()


def test_a_nan_draft_logprob_rejects_its_token_and_nothing_before_it(
    samplers, params, prompts):
  """A stored logprob that is NaN (a corrupt store) fails the acceptance
  test at its column: every leaf keeps at most the 4 tokens before it,
  each a draft leaf's, and decodes on from there."""
  earlier = _plain(samplers, False, params, prompts, jax.random.key(3))
  logprobs = np.array(earlier.sampler_logprobs)
  logprobs[:, 4] = np.nan
  draft = sampling.Draft(earlier.completion_tokens, earlier.completion_mask,
                         jnp.asarray(logprobs))
  got, accepted, _ = _drafted(samplers, False, params, prompts, draft,
                              jax.random.key(11))
  long_enough = earlier.lengths > 4
  assert accepted.max() == 4 and long_enough.any()
  g = BASE.num_samples
  for i, a in enumerate(accepted):
    group = np.asarray(earlier.completion_tokens)[(i // g) * g:(i // g + 1) * g]
    assert (group[:, :a] == got.completion_tokens[i, :a]).all(1).any(), i
  assert np.isfinite(got.sampler_logprobs).all()


@pytest.mark.parametrize("lenience", [-0.5, float("nan")])
def test_a_bad_lenience_is_refused_before_compiling(lenience):
  from rljax.sampling import latr as latr_lib  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"sampler\.spec_log_lenience="):
    tree_lib.make_tree_sampler(TINY, BASE, TREE, speculative=True,
                               log_lenience=lenience)
  with pytest.raises(ValueError, match=r"sampler\.spec_log_lenience="):
    latr_lib.make_latr_sampler(TINY, BASE, latr_lib.LatrConfig(mix_ratio=0.5),
                               speculative=True, log_lenience=lenience)
  # 0, the strict rule, is accepted (nothing compiles until a call).
  tree_lib.make_tree_sampler(TINY, BASE, TREE, speculative=True,
                             log_lenience=0.0)
