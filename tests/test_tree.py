"""Tree rollouts (``rl.rollout="tree"``, ``rljax/sampling/tree.py``) and
TreePO's subtree advantage (``rljax/advantages/tree.py``).

References: the model's own forward pass over each finished row (every
sampled token's logprob, which a wrong cache row at a fork would change),
hand-derived forks and counts, and a NumPy float64 port of TreePO's
``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``.
"""

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import advantages as adv
from rljax import models, sampling
from rljax.rollout import rounds as rounds_lib
from rljax.sampling import jitting
from rljax.sampling import paged as paged_lib
from rljax.sampling import tree as tree_lib
from rljax.train import build, combinations
from tests.test_loop import loop_config
from tests.test_sampler_shrink import assert_same_rows, decode_loops

TINY = models.get_preset("tiny")
T = 14
BASE = sampling.SamplerConfig(
    num_samples=8, max_new_tokens=T, cache_dtype="float32",
    method=sampling.SamplingMethod(temperature=1.0),
    eos_ids=tuple(range(20, 30)), prompt_buckets=(8, 16), segment_slots=8,
    record_policy_logprobs=True)
TREE = tree_lib.TreeConfig(segment_tokens=3, branch=2, roots=1)


@pytest.fixture(scope="module")
def params():
  return models.init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  lists = [list(rng.randint(40, TINY.vocab_size, size=n)) for n in (3, 11, 6)]
  return sampling.pad_prompts(lists, (8, 16))


@pytest.fixture(scope="module")
def rollout(params, prompts):
  fn = tree_lib.make_tree_sampler(TINY, BASE, TREE)
  return jax.device_get(fn(params, *prompts, jax.random.key(3)))


# --- the tree's shape --------------------------------------------------------


def test_widths_grow_by_the_branch_up_to_the_rows():
  assert TREE.widths(8, T) == (1, 2, 4, 8)
  assert tree_lib.TreeConfig(roots=2, branch=3).widths(18, 20) == (2, 6, 18)


@pytest.mark.parametrize("rows", [6, 1])
def test_rows_that_are_not_roots_times_a_power_are_refused(rows):
  with pytest.raises(ValueError, match=r"rl\.tree\.roots=1 x rl\.tree\."
                     r"branch=2.*accepted row counts: \[2, 4, 8"):
    TREE.widths(rows, T)


def test_every_fork_comes_before_the_last_token():
  # 3 forks after 4, 8 and 12 tokens: 13 tokens allow them, 12 do not.
  tree = tree_lib.TreeConfig(segment_tokens=4, roots=1)
  assert tree.widths(8, 13) == (1, 2, 4, 8)
  with pytest.raises(ValueError, match=r"rl\.tree\.segment_tokens=4.*"
                     r"sampler\.max_new_tokens=12.*<= 3"):
    tree.widths(8, 12)


@pytest.mark.parametrize("field,value", [("segment_tokens", 0), ("branch", 1),
                                         ("roots", 0), ("branch", True),
                                         ("branch_by", "entropy")])
def test_a_bad_setting_is_refused_naming_it(field, value):
  with pytest.raises(ValueError, match=rf"rl\.tree\.{field}={value!r}"):
    tree_lib.TreeConfig(**{field: value})


# --- forks -------------------------------------------------------------------


def test_forks_give_live_rows_the_new_rows_by_surprisal_or_equally():
  done = jnp.array([[False, False], [True, False], [True, True],
                    [False, False]])
  surprisal = jnp.array([[1.0, 3.0], [5.0, 1.0], [1.0, 1.0], [0.5, 9.5]])
  # Hand-derived: 2 new rows per prompt. [1, 3]: quotas 0.5 / 1.5, the tie
  # of remainders to the first; an ended row keeps its one child; no live
  # row: copies, one each; [0.5, 9.5]: quotas 0.1 / 1.9.
  got = tree_lib.fork_parents(done, surprisal, 4, "uncertainty")
  np.testing.assert_array_equal(got, [[0, 0, 1, 1], [0, 1, 1, 1],
                                      [0, 0, 1, 1], [0, 1, 1, 1]])
  uniform = tree_lib.fork_parents(done, surprisal, 4, "uniform")
  np.testing.assert_array_equal(uniform, [[0, 0, 1, 1], [0, 1, 1, 1],
                                          [0, 0, 1, 1], [0, 0, 1, 1]])


def test_leaves_share_the_segments_of_their_common_ancestors(rollout):
  nodes = rollout.tree_nodes
  assert nodes.shape == (24, 3)
  tokens, lengths = rollout.completion_tokens, rollout.lengths
  seg = TREE.segment_tokens
  for i in range(24):
    for j in range(24):
      if i // 8 != j // 8:
        continue
      shared = 0  # the depth of the last common ancestor, plus one
      while shared < 3 and nodes[i, shared] == nodes[j, shared]:
        shared += 1
      n = shared * seg
      np.testing.assert_array_equal(tokens[i, :n], tokens[j, :n])
  # Siblings diverge: each prompt's 8 leaves are not all one completion.
  for b in range(3):
    rows = {tuple(tokens[i, :lengths[i]]) for i in range(8 * b, 8 * b + 8)}
    assert len(rows) > 1


def test_every_leaf_has_its_own_tokens_logprobs_under_the_model(params,
                                                                rollout):
  """A fork that gathered the wrong cache row, logits or position would
  give a leaf logprobs that the model's forward pass over the leaf's own
  tokens does not."""
  tokens, mask = rollout.sequences()
  lp, _ = models.sequence_logprobs(params, TINY, tokens, mask, with_entropy=False)
  p = rollout.prompt_tokens.shape[1]
  want = np.where(rollout.completion_mask, np.asarray(lp)[:, p:], 0.0)
  np.testing.assert_allclose(rollout.policy_logprobs, want, atol=2e-5)
  np.testing.assert_allclose(rollout.sampler_logprobs, want, atol=2e-5)
  assert rollout.completion_mask.sum() > 24 * 2 * TREE.segment_tokens


def test_on_a_mesh_the_tree_is_the_same(params, prompts, rollout):
  """3 prompts over 8 devices: padded to 8 prompts, their rows dropped."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1),
                           ("data", "fsdp", "tensor"))
  fn = tree_lib.make_tree_sampler(TINY, BASE, TREE, mesh)
  got = jax.device_get(fn(params, *prompts, jax.random.key(3)))
  np.testing.assert_array_equal(got.completion_tokens,
                                rollout.completion_tokens)
  np.testing.assert_array_equal(got.tree_nodes, rollout.tree_nodes)
  np.testing.assert_allclose(got.sampler_logprobs, rollout.sampler_logprobs,
                             atol=1e-5)


def test_counts_follow_the_shared_segments():
  # Two prompts of 4 leaves, widths 1, 2, 4, segments of 2 tokens.
  # A: node 1 of depth 1 ended after 3 tokens and kept one child; node 0
  # got three. Decoded: the root's 2, node 0's 2, node 1's 1, then the
  # leaves past 4 tokens 1 + 2 + 1 = 9 of the leaves' 19.
  # B: the root ended after 2 tokens: every fork copied it, 3 copies;
  # decoded 2 of 8.
  nodes = np.array([[0, 0], [0, 0], [0, 0], [0, 1],
                    [0, 0], [0, 0], [0, 1], [0, 1]])
  lengths = np.array([5, 6, 5, 3, 2, 2, 2, 2])
  got = tree_lib.tree_counts(nodes, lengths, 4, 2)
  assert got == {"rollout/generated_tokens": 11.0,
                 "rollout/tree_leaf_tokens": 27.0,
                 "rollout/tree_copies": 3.0}
  merged = tree_lib.tree_metrics([got, got])
  assert merged["rollout/tree_token_saving"] == pytest.approx(1 - 22 / 54)


# --- TreePO's advantage ------------------------------------------------------


def _treepo_reference(scores, uids, lengths, weighting="group_size"):
  """TreePO's compute_tree_reinforce_plus_plus_baseline_outcome_advantage,
  ported to NumPy float64: uids "prompt#node0#node1...", subgroup means by
  depth (a subgroup of one skipped below the root), then masked_whiten over
  every completion token (Bessel, eps 1e-8)."""
  scores = np.asarray(scores, np.float64)
  depth = max(len(u.split("#")) - 1 for u in uids)
  terms = [[] for _ in uids]
  for d in range(depth):
    ids = ["#".join(u.split("#")[:d + 1]) for u in uids]
    groups = collections.defaultdict(list)
    for i, k in enumerate(ids):
      groups[k].append(scores[i])
    for i, k in enumerate(ids):
      size = len(groups[k])
      mean = 0.0 if size == 1 else np.mean(groups[k])
      if d == 0 or size > 1:
        terms[i].append((scores[i] - mean, size))
  out = []
  for t in terms:
    if weighting == "group_size":
      total = sum(s for _, s in t)
      out.append(sum(v * s / total for v, s in t))
    else:
      out.append(np.mean([v for v, _ in t]))
  tok = np.repeat(np.asarray(out), lengths)
  mean, var = tok.mean(), tok.var(ddof=1)
  return (np.asarray(out) - mean) / np.sqrt(var + 1e-8)


@pytest.mark.parametrize("weighting", ["group_size", "average"])
def test_treepo_matches_its_reference_implementation(weighting):
  rng = np.random.RandomState(1)
  # Two prompts of 8 leaves: a tree of widths 1, 2, 4, 8 and one whose
  # forks went unevenly (a row that ended kept one child).
  nodes = np.array([[0, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 1],
                    [0, 1, 2], [0, 1, 2], [0, 1, 3], [0, 1, 3],
                    [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 1],
                    [0, 1, 2], [0, 1, 3], [0, 1, 3], [0, 1, 3]])
  rewards = rng.randint(0, 3, size=16).astype(np.float32)
  lengths = rng.randint(1, 9, size=16)
  uids = [f"p{i // 8}#" + "#".join(str(x) for x in nodes[i]) + f"#{i}"
          for i in range(16)]
  # The reference's depth-0 group is the prompt, depth d + 1 the leaf's
  # node of depth d (here one root: its subtree is the prompt's group
  # again, as in TreePO's code), the leaf itself last (never a group).
  want = _treepo_reference(rewards, uids, lengths, weighting)
  tx = adv.treepo(weighting)
  t = 9
  mask = np.arange(t)[None] < lengths[:, None]
  got, _ = tx.update(jnp.asarray(rewards), tx.init(rewards), group_size=8,
                     tree_nodes_NxD=jnp.asarray(nodes),
                     lengths_N=jnp.asarray(lengths),
                     completion_mask_NxT=jnp.asarray(mask))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_without_a_tree_the_baseline_is_the_group_mean():
  rewards = jnp.array([1.0, 0.0, 0.0, 3.0, 2.0, 2.0])
  tx = adv.center_by_subtrees()
  got, _ = tx.update(rewards, tx.init(rewards), group_size=3)
  np.testing.assert_allclose(got, [2 / 3, -1 / 3, -1 / 3, 2 / 3, -1 / 3,
                                   -1 / 3], rtol=1e-6)


def test_invalid_rows_are_in_no_subtree():
  rewards = jnp.array([1.0, 0.0, 5.0, 0.0])
  nodes = jnp.array([[0], [0], [1], [1]])
  tx = adv.center_by_subtrees()
  got, _ = tx.update(rewards, tx.init(rewards), group_size=4,
                     mask_N=jnp.array([True, True, False, True]),
                     tree_nodes_NxD=nodes)
  # Root mean of the valid 1, 0, 0: 1/3 (weight 3); node 0's (1, 0): 1/2
  # (weight 2); node 1 holds one valid row: skipped.
  np.testing.assert_allclose(got, [(3 * 2 / 3 + 2 * 0.5) / 5,
                                   (3 * -1 / 3 + 2 * -0.5) / 5, 0.0, -1 / 3],
                             rtol=1e-6)


def test_a_nan_reward_of_an_invalid_row_reaches_no_other_row():
  """A reward function's NaN on a failed row (``mask_N`` False, as the
  evaluator marks it) is in no subtree's mean."""
  rewards = jnp.array([1.0, jnp.nan, 0.0, 0.0])
  nodes = jnp.array([[0], [0], [1], [1]])
  tx = adv.treepo()
  got, _ = tx.update(rewards, tx.init(rewards), group_size=4,
                     mask_N=jnp.array([True, False, True, True]),
                     tree_nodes_NxD=nodes, lengths_N=jnp.array([2, 2, 2, 2]),
                     completion_mask_NxT=jnp.ones((4, 2), bool))
  assert np.all(np.isfinite(got)) and got[1] == 0
  assert got[0] > 0 > got[2] and got[2] == got[3]


def test_tree_nodes_of_another_batch_are_refused():
  tx = adv.center_by_subtrees()
  with pytest.raises(ValueError, match=r"tree_nodes_NxD must be \[N, D\] "
                     r"with N=4 rows; got shape \(8, 2\)"):
    tx.update(jnp.zeros(4), tx.init(jnp.zeros(4)), group_size=2,
              tree_nodes_NxD=jnp.zeros((8, 2), jnp.int32))


# --- the config --------------------------------------------------------------


def test_a_tree_that_does_not_fit_is_refused_before_any_compile():
  # The tiny config: 4 rows per prompt, 6 new tokens; the default tree
  # (2 roots, branch 2) forks once: after 5 tokens it fits, after 6 not.
  build.validate(loop_config(**{"rl.rollout": "tree",
                                "rl.tree.segment_tokens": 5}))
  with pytest.raises(ValueError, match=r"rl\.tree\.segment_tokens=6"):
    build.validate(loop_config(**{"rl.rollout": "tree",
                                  "rl.tree.segment_tokens": 6}))
  with pytest.raises(ValueError, match=r"accepted row counts"):
    build.validate(loop_config(**{"rl.rollout": "tree",
                                  "rl.group_size": 6}))


@pytest.mark.parametrize("overrides,rule", [
    ({"rl.advantage": "treepo"}, "treepo-without-tree"),
    ({"rl.rollout": "tree", "rl.advantage": "remax"}, "tree-with-greedy-row"),
    ({"rl.rollout": "tree", "rl.allocation.name": "sgpo"}, "tree-sgpo"),
])
def test_what_a_tree_does_not_combine_with_is_refused(overrides, rule):
  config = loop_config(**overrides)
  assert [r.name for r in combinations.applying(config)][:1] == [rule]
  with pytest.raises(ValueError, match=rule.split("-")[0]):
    build.validate(config)


def test_on_a_paged_cache_forks_share_blocks_and_draw_the_same_tree(
    params, prompts, rollout):
  """Forks point to their parents' blocks (copy on write) instead of
  copying cache rows: the same leaves, every block back at the end."""
  fn = tree_lib.make_tree_sampler(TINY, BASE, TREE,
                                  paged=paged_lib.PagedConfig(block_size=2))
  got, stats = fn.with_metrics(params, *prompts, jax.random.key(3))
  got = jax.device_get(got)
  np.testing.assert_array_equal(got.completion_tokens,
                                rollout.completion_tokens)
  np.testing.assert_array_equal(got.tree_nodes, rollout.tree_nodes)
  np.testing.assert_allclose(got.sampler_logprobs, rollout.sampler_logprobs,
                             atol=1e-5)
  assert stats["rollout/kv_blocks_left"] == 0
  assert stats["rollout/kv_cut_rows"] == 0
  assert 0 < stats["rollout/kv_blocks_peak"] < stats["rollout/kv_blocks_pool"]


# --- trees in rollout allocation's rounds -----------------------------------


def test_trees_merged_into_one_group_keep_their_nodes_apart():
  """Two trees of two leaves (one fork: both leaves' depth-0 node is their
  root, 0) become one prompt's group under VIGOR; a third is another
  prompt's. Numbered apart, TreePO's advantage on the unequal groups is the
  NumPy port's with each tree's root a subtree of its own; numbered as
  sampled, the two roots would read as one."""
  local = np.zeros((6, 1), np.int32)  # every tree's leaves: root 0
  apart = rounds_lib.tree_nodes_apart(local, 2)
  np.testing.assert_array_equal(apart[:, 0], [0, 0, 2, 2, 4, 4])
  np.testing.assert_array_equal(rounds_lib.tree_nodes_apart(apart, 2), apart)
  rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], np.float32)
  lengths = np.array([3, 5, 2, 4, 6, 1])
  uids = ["p0#e0#0", "p0#e0#1", "p0#e1#2", "p0#e1#3", "p1#e2#4", "p1#e2#5"]
  want = _treepo_reference(rewards, uids, lengths)
  tx = adv.by_group_ids(adv.treepo(), num_groups=2, max_group_size=4)
  mask = np.arange(6)[None] < lengths[:, None]

  def advantages(nodes):
    got, _ = tx.update(jnp.asarray(rewards), tx.init(rewards),
                       group_ids_N=jnp.array([0, 0, 0, 0, 1, 1]),
                       tree_nodes_NxD=jnp.asarray(nodes),
                       lengths_N=jnp.asarray(lengths),
                       completion_mask_NxT=jnp.asarray(mask))
    return np.asarray(got)
  np.testing.assert_allclose(advantages(apart), want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(advantages(local), want, atol=1e-3)


def test_allocation_entries_that_are_not_trees_are_refused():
  """VIGOR's 2 rounds of the tiny config give a prompt 2 or 2 + 4 rows, in
  entries of 2: a tree of 2 leaves (1 root, a branch of 2) fits, the
  default 2 roots do not."""
  fits = loop_config(**{"rl.rollout": "tree", "rl.allocation.name": "vigor",
                        "rl.allocation.rounds": 2, "rl.tree.roots": 1})
  build.validate(fits)
  fits.rl.tree.roots = 2
  with pytest.raises(ValueError, match=r"rl\.allocation\.name='vigor' "
                     r"samples 2 rows per prompt entry.*rl\.tree\.roots=2"):
    build.validate(fits)


@pytest.mark.slow
def test_vigor_rounds_of_trees_train_from_the_config(tmp_path):
  """VIGOR's rounds sample each prompt entry as a tree, on a paged cache;
  TreePO trains on the unequal groups."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  config = loop_config(**{"rl.rollout": "tree", "rl.advantage": "treepo",
                          "rl.allocation.name": "vigor",
                          "rl.allocation.rounds": 2, "rl.tree.roots": 1,
                          "sampler.kv_cache": "paged",
                          "sampler.kv_block_size": 4})
  train.run(config, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["alloc/rounds"] == 2 and r["alloc/max_group"] == 6
    assert 0 < r["rollout/tree_token_saving"] < 1
    assert r["rollout/kv_blocks_left"] == 0
    assert r["grad_norm"] > 0 and np.isfinite(r["pg_loss"])


# --- a last width that shrinks ----------------------------------------------

# Leaves that end all along the last width: 24 new tokens, forks after 2, 4
# and 6, many end ids.
LONG_TAIL = BASE.replace(max_new_tokens=24, eos_ids=tuple(range(20, 34)))
SHORT_SEGMENTS = tree_lib.TreeConfig(segment_tokens=2, branch=2, roots=1)


@pytest.fixture(scope="module")
def long_tailed_tree(params, prompts):
  fn = tree_lib.make_tree_sampler(TINY, LONG_TAIL, SHORT_SEGMENTS)
  return jax.device_get(fn(params, *prompts, jax.random.key(3)))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_the_last_width_shrinks_as_its_leaves_end(params, prompts,
                                                  long_tailed_tree, paged):
  """``sampler.shrink_batch_to=4``: the 24 leaves decode in a batch of 24,
  then 12 (the live rows gathered, a dense cache copying the prompt prefix
  in, a paged one moving block tables), then 6: the same tree, every block
  back at the end."""
  ref = long_tailed_tree
  lengths = ref.lengths
  # More than half the leaves end in the last width (after the third fork,
  # 6 tokens) and some run to the budget: the batch shrinks to 12 rows.
  assert np.sum((lengths > 6) & (lengths < 24)) >= 12, lengths
  assert np.sum(lengths == 24) >= 1 and np.sum(lengths < 24) > 12, lengths
  fn = tree_lib.make_tree_sampler(
      TINY, LONG_TAIL.replace(shrink_batch_to=4), SHORT_SEGMENTS,
      paged=paged_lib.PagedConfig(block_size=2) if paged else None)
  if not paged:  # a loop per width (3, 6, 12, 24 rows), then the last
    # width's smaller batches one loop each
    loops = decode_loops(fn.jitted, params, *prompts, jax.random.key(3),
                         t=LONG_TAIL.max_new_tokens)
    assert loops == {3: 1, 6: 2, 12: 2, 24: 1}, loops
  got, stats = fn.with_metrics(params, *prompts, jax.random.key(3))
  assert_same_rows(ref, jax.device_get(got))
  if paged:
    assert stats["rollout/kv_blocks_left"] == 0
    assert stats["rollout/kv_cut_rows"] == 0


@pytest.mark.slow
def test_on_a_mesh_the_shrinking_tree_keeps_whole_rows_per_device(
    params, prompts, long_tailed_tree):
  """3 prompts over 8 devices (padded to 8 prompts, 64 leaves): the last
  width halves to 32, 16 and 8 rows (one per device), never below, and the
  tree is the unsharded one's."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1),
                           ("data", "fsdp", "tensor"))
  fn = tree_lib.make_tree_sampler(
      TINY, LONG_TAIL.replace(shrink_batch_to=1), SHORT_SEGMENTS, mesh)
  padded = jitting.pad_rows(5, *prompts)  # as the sampler pads them
  with jax.set_mesh(mesh):
    loops = decode_loops(fn.jitted, params, *padded, jax.random.key(3),
                         t=LONG_TAIL.max_new_tokens)
  # The widths (8, 16, 32, 64 rows), then 32, 16 and 8 once more.
  assert loops == {8: 2, 16: 2, 32: 2, 64: 1}, loops
  got = jax.device_get(fn(params, *prompts, jax.random.key(3)))
  assert_same_rows(long_tailed_tree, got)


# --- the benchmarks ----------------------------------------------------------


def _launch(module, *flags, cwd):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from tests import subprocess_env  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  result = subprocess.run([sys.executable, "-m", module, *flags], cwd=root,
                          env=subprocess_env.one_device_env(),
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  [record] = [f for f in os.listdir(cwd) if f.endswith(".json")]
  return json.loads((cwd / record).read_text())["figures"]


@pytest.mark.slow
def test_bench_tree_quick_decodes_fewer_tokens_than_independent_rows(
    tmp_path):
  figures = _launch("launch.bench_tree", "--quick", "--methods=grpo,tree",
                    f"--workdir={tmp_path}", cwd=tmp_path)
  s = figures["summary"]
  assert s["tree"]["tokens"]["mean"] < s["grpo"]["tokens"]["mean"]
  assert 0 < s["tree"]["tree_token_saving"]["mean"] < 1
  assert s["grpo"]["tree_token_saving"]["mean"] == 0
  for method in ("grpo", "tree"):
    [run] = figures["runs"][method]
    assert run["tokens_per_distinct"] == pytest.approx(
        run["tokens"] / run["distinct"])


@pytest.mark.slow
def test_bench_tree_on_the_calculator_forks_episodes_between_turns(tmp_path):
  """``--task=calculator``: tree episodes share their first turns."""
  figures = _launch("launch.bench_tree", "--quick", "--task=calculator",
                    "--methods=tree", f"--workdir={tmp_path}", cwd=tmp_path)
  [run] = figures["runs"]["tree"]
  assert 0 < run["tree_token_saving"] < 1
  assert run["tokens_per_distinct"] == pytest.approx(
      run["tokens"] / run["distinct"])
  assert [f for f in os.listdir(tmp_path) if f.endswith(".json")][
      0].startswith("bench_tree_calculator_quick-")


@pytest.mark.slow
def test_bench_paged_small_run_finds_the_same_tokens_in_fewer_slots(tmp_path):
  figures = _launch("launch.bench_paged", "--prompts=2", "--group_size=4",
                    "--prompt_len=16", "--max_new_tokens=32",
                    "--eos_every=8", "--block_size=4", "--steps=3",
                    f"--record_dir={tmp_path}", cwd=tmp_path)
  cache = figures["cache"]
  assert cache["paged_peak_slots"] < cache["dense_slots"]
  assert cache["dense_slots"] == 2 * 16 + 8 * 32
  assert figures["cut_rows"] == 0
