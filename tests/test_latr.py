"""LATR's lookahead tree rollouts (rljax/sampling/latr.py).

The reference is a plain re-implementation of the algorithm as the paper
and the authors' code state it (arXiv:2510.24302, github.com/starreeze/latr
``model/generation.py``, ``model/sample_filter.py``): a host loop that
recomputes every row's next-token logits with one full forward pass without
a cache, keeps each row as a Python list, branches, forces and prunes by
the rules, and takes the sampled rows' draws with the same per-row keys. The
cached, jitted sampler must give its tokens exactly; the edit distance is
checked against a NumPy dynamic programme.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling import latr as latr_lib
from rljax.sampling.sampler import row_keys

MC = models.get_preset("tiny")
T, G = 12, 4
SC = sampling.SamplerConfig(num_samples=G, max_new_tokens=T, eos_ids=(2, 3),
                            pad_id=0, cache_dtype="float32",
                            prompt_buckets=(8,), segment_slots=None,
                            record_policy_logprobs=True)
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
# Thresholds this model crosses at some steps and not at others; with these
# prompts and key 1 a branch is pruned and its slot taken again.
BRANCHY = latr_lib.LatrConfig(abs_threshold=0.05, rel_threshold=0.1,
                              lookahead=(2, 5), edit_distance=1.0)


@pytest.fixture(scope="module")
def params():
  # Sharper next-token distributions than the default init: a few tokens
  # take most of the mass, so candidates cross the thresholds unevenly.
  p = models.init_params(MC, jax.random.key(0))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


@pytest.fixture(scope="module")
def prompts():
  return sampling.pad_prompts(PROMPTS, (8,))


def _numpy_edit_distance(a, b):
  d = np.zeros((len(a) + 1, len(b) + 1), int)
  d[:, 0] = np.arange(len(a) + 1)
  d[0, :] = np.arange(len(b) + 1)
  for i in range(1, len(a) + 1):
    for j in range(1, len(b) + 1):
      d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1,
                    d[i - 1, j - 1] + (a[i - 1] != b[j - 1]))
  return d[-1, -1]


def test_edit_distance_is_levenshteins():
  rng = np.random.RandomState(0)
  a = rng.randint(0, 3, size=(64, 7))
  b = rng.randint(0, 3, size=(64, 7))
  b[0] = a[0]
  b[1] = np.roll(a[1], 1)  # one deletion and one insertion apart
  b[2] = 5  # nothing in common
  got = np.asarray(latr_lib.edit_distance(jnp.asarray(a), jnp.asarray(b)))
  want = [_numpy_edit_distance(x, y) for x, y in zip(a, b)]
  np.testing.assert_array_equal(got, want)
  assert got[0] == 0 and got[1] <= 2 and got[2] == 7


def _next_logits(params, prompt_tokens, prompt_mask, rows):
  """Each row's next-token logits from one forward pass without a cache."""
  seq = np.zeros((len(rows), prompt_tokens.shape[1] + T), np.int32)
  mask = np.zeros(seq.shape, bool)
  last = []
  for i, (prompt, tokens) in enumerate(rows):
    p = prompt_tokens.shape[1]
    seq[i, :p], mask[i, :p] = prompt_tokens[prompt], prompt_mask[prompt]
    seq[i, p:p + len(tokens)] = tokens
    mask[i, p:p + len(tokens)] = True
    last.append(p + len(tokens) - 1)
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits, _ = models.Decoder(MC).apply({"params": params}, seq, positions,
                                       input_mask_BxT=mask, return_logits=True)
  return np.asarray(logits, np.float32)[np.arange(len(rows)), last]


def reference(params, prompt_tokens, prompt_mask, key, latr, g=G, sc=SC):
  """LATR step by step on the host (the module docstring)."""
  b = prompt_tokens.shape[0]
  n = b * g
  m = latr.tree_rows(g)
  keys = row_keys(key, n)
  tree = [r % g < m for r in range(n)]
  row = [dict(tokens=[], done=r % g >= 1 and tree[r], active=not tree[r] or
              r % g == 0, parent=-1, birth=0, finished=False)
         for r in range(n)]
  for step in range(T):
    logits = _next_logits(params, prompt_tokens, prompt_mask,
                          [(r // g, row[r]["tokens"]) for r in range(n)])
    probs = np.asarray(jax.nn.softmax(logits, -1))
    order = np.argsort(-probs, -1, kind="stable")
    live = [row[r]["active"] and not row[r]["done"] for r in range(n)]
    ok = [tree[r] and live[r]
          and probs[r, order[r, 1]] > latr.abs_threshold
          and probs[r, order[r, 0]] - probs[r, order[r, 1]]
          > latr.rel_threshold for r in range(n)]
    token = {}
    for q in range(b):
      rows = range(q * g, q * g + g)
      empty = [r for r in rows if tree[r] and not row[r]["active"]]
      branching = [r for r in rows if ok[r]][:len(empty)]
      for slot, src in zip(empty, branching):
        row[slot] = dict(row[src], tokens=list(row[src]["tokens"]),
                         parent=src, birth=step)
        logits[slot] = logits[src]
        token[slot] = int(order[src, 1])
      full = len(empty) == len(branching)
      for r in rows:
        if r in token or not row[r]["active"] or row[r]["done"]:
          continue
        if tree[r] and (r in branching or not full):
          token[r] = int(order[r, 0])
        else:
          draw, _ = sc.method.get_next_tokens(
              jnp.asarray(logits[r:r + 1]), jax.random.fold_in(
                  keys[r], len(row[r]["tokens"]))[None])
          token[r] = int(draw[0])
    for r, tok in token.items():
      row[r]["tokens"].append(tok)
      if tok in sc.eos_ids:
        row[r]["done"] = row[r]["finished"] = True
      elif len(row[r]["tokens"]) == T:
        row[r]["done"] = True
    pruned = set()
    for k in sorted(set(latr.lookahead)):
      for r in range(n):
        par = row[r]["parent"]
        if not (tree[r] and row[r]["active"] and par >= 0
                and step + 1 - row[r]["birth"] == k and not row[r]["done"]
                and not row[par]["done"] and row[par]["active"]):
          continue
        mine, theirs = row[r]["tokens"][-k:], row[par]["tokens"][-k:]
        if _numpy_edit_distance(mine, theirs) < latr.edit_distance * k:
          pruned.add(r)
    for r in pruned:
      row[r].update(active=False, done=True)
    for r in range(n):
      if row[r]["parent"] in pruned or r in pruned:
        row[r]["parent"] = -1
  out = []
  for r in range(n):
    src = r // g * g if tree[r] and not row[r]["active"] else r
    out.append(row[src])
  tokens = np.zeros((n, T), np.int32)
  finished = np.zeros(n, bool)
  for r, x in enumerate(out):
    tokens[r, :len(x["tokens"])] = x["tokens"]
    finished[r] = x["finished"]
  lengths = np.array([len(x["tokens"]) for x in out])
  return tokens, lengths, finished


def _check(params, prompts, latr, paged=None, key=1, sc=SC):
  fn = latr_lib.make_latr_sampler(MC, sc, latr, paged=paged)
  got, stats = fn.with_metrics(params, *prompts, jax.random.key(key))
  got = jax.device_get(got)
  tokens, lengths, finished = reference(params, *prompts,
                                        jax.random.key(key), latr,
                                        g=sc.num_samples, sc=sc)
  np.testing.assert_array_equal(got.lengths, lengths)
  np.testing.assert_array_equal(
      np.where(got.completion_mask, got.completion_tokens, 0), tokens)
  np.testing.assert_array_equal(got.finished, finished)
  return got, stats


@pytest.mark.parametrize("name,latr", [
    ("branch_and_prune", BRANCHY),
    # Fewer branch points: a pruned slot stays empty and ends as a copy.
    ("prune_and_copy", BRANCHY.replace(abs_threshold=0.1,
                                       rel_threshold=0.15)),
    ("half_tree", BRANCHY.replace(mix_ratio=0.5)),
    ("never_prune", BRANCHY.replace(edit_distance=0.0)),
    ("never_branch", BRANCHY.replace(abs_threshold=1.0)),
])
def test_latr_gives_the_reference_rows(params, prompts, name, latr):
  got, stats = _check(params, prompts, latr)
  if name == "never_branch":  # roots decode greedily; the slots copy them
    assert stats["latr/branches"] == 0
    assert stats["latr/copies"] == 3 * (G - 1)
  if name == "never_prune":
    assert stats["latr/pruned"] == 0
  if name == "branch_and_prune":  # a pruned slot branches again
    assert stats["latr/pruned"] > 0
    assert stats["latr/branches"] > 3 * (G - 1)
  if name == "prune_and_copy":
    assert stats["latr/pruned"] > 0 and stats["latr/copies"] > 0
  # The forward without a cache gives the recorded logprobs: each branch's
  # cache rows were its parent's.
  from tests.test_continuous import _logprobs  # pylint: disable=import-outside-toplevel
  want = _logprobs(params, np.repeat(prompts[0], G, 0),
                   np.repeat(prompts[1], G, 0), got.completion_tokens,
                   got.completion_mask)
  np.testing.assert_allclose(got.policy_logprobs, want, atol=1e-5)


def test_rows_outside_the_tree_are_the_static_samplers(params, prompts):
  """With half the rows in the tree, rows 2 and 3 of each prompt are
  sampled as the static sampler's (same keys, never forced)."""
  fn = latr_lib.make_latr_sampler(MC, SC, BRANCHY.replace(mix_ratio=0.5))
  got = jax.device_get(fn(params, *prompts, jax.random.key(1)))
  want = jax.device_get(sampling.sample(params, *prompts, jax.random.key(1),
                                        model_config=MC, config=SC))
  outside = np.arange(len(PROMPTS) * G) % G >= 2
  np.testing.assert_array_equal(got.completion_tokens[outside],
                                want.completion_tokens[outside])


def test_on_a_paged_cache_latr_gives_the_same_rows_and_frees_every_block(
    params, prompts):
  got, stats = _check(params, prompts, BRANCHY,
                      paged=sampling.PagedConfig(block_size=4))
  assert stats["rollout/kv_blocks_left"] == 0
  assert stats["rollout/kv_cut_rows"] == 0
  assert stats["latr/branches"] > 0


@pytest.mark.parametrize("mix,g", [(0.25, 8), (0.5, 4)])
def test_a_tree_of_fewer_than_two_rows_is_refused(mix, g):
  """round(G x mix_ratio) = 2 grows a tree; 1 is refused, naming it."""
  assert latr_lib.LatrConfig(mix_ratio=mix).tree_rows(g) == 2
  with pytest.raises(ValueError, match=r"rl\.latr\.mix_ratio"):
    latr_lib.LatrConfig(mix_ratio=mix / 2).tree_rows(g)


@pytest.mark.parametrize("field,value", [
    ("mix_ratio", 1.5), ("abs_threshold", -0.1), ("rel_threshold", True),
    ("edit_distance", "0.4"), ("lookahead", ()), ("lookahead", (0,)),
    ("lookahead", [30])])
def test_a_bad_setting_is_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=rf"rl\.latr\.{field}="):
    latr_lib.LatrConfig(**{field: value})


def test_latrs_peak_is_blocks_held_at_once(params, prompts):
  """``rollout/kv_blocks_peak`` counts the blocks right after each step's
  reservations, so a pool of exactly the peak cuts no row (a block that
  every branch writes is kept by one of them: ``paged_cache.reserve``),
  one block below it cuts a row (the run goes on, every block back), and
  the peak never exceeds the pool."""
  _, stats = _check(params, prompts, BRANCHY,
                    paged=sampling.PagedConfig(block_size=4))
  peak = int(stats["rollout/kv_blocks_peak"])
  assert 0 < peak <= stats["rollout/kv_blocks_pool"]
  fn = latr_lib.make_latr_sampler(MC, SC, BRANCHY,
                                  paged=sampling.PagedConfig(4, peak))
  _, at = fn.with_metrics(params, *prompts, jax.random.key(1))
  assert at["rollout/kv_cut_rows"] == 0
  assert at["rollout/kv_blocks_peak"] == peak
  fn = latr_lib.make_latr_sampler(MC, SC, BRANCHY,
                                  paged=sampling.PagedConfig(4, peak - 1))
  _, below = fn.with_metrics(params, *prompts, jax.random.key(1))
  assert below["rollout/kv_cut_rows"] >= 1
  assert below["rollout/kv_blocks_left"] == 0
  assert below["rollout/kv_blocks_peak"] <= peak - 1


# --- SPEC-RL's drafts for the rows sampled as usual -------------------------

HALF = BRANCHY.replace(mix_ratio=0.5)


@pytest.fixture(scope="module")
def drafted(params, prompts):
  """``{paged: (plain sampler, drafted sampler)}`` of half-tree LATR."""
  from rljax.sampling import paged as paged_lib  # pylint: disable=import-outside-toplevel
  out = {}
  for paged in (False, True):
    pool = paged_lib.PagedConfig(block_size=4) if paged else None
    out[paged] = (latr_lib.make_latr_sampler(MC, SC, HALF, paged=pool),
                  latr_lib.make_latr_sampler(MC, SC, HALF, paged=pool,
                                             speculative=True))
  return out


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_an_empty_draft_gives_latrs_rollout(params, prompts, drafted, paged):
  plain, spec = drafted[paged]
  want, stats = plain.with_metrics(params, *prompts, jax.random.key(1))
  n = want.completion_tokens.shape[0]
  empty = sampling.Draft(jnp.zeros((n, T), jnp.int32),
                         jnp.zeros((n, T), bool), jnp.zeros((n, T)))
  got, accepted, got_stats = spec(params, *prompts, empty, jax.random.key(1))
  np.testing.assert_array_equal(got.completion_tokens, want.completion_tokens)
  np.testing.assert_allclose(got.sampler_logprobs, want.sampler_logprobs,
                             atol=1e-5)
  assert not np.asarray(accepted).any()
  assert stats["latr/branches"] > 0
  for k in ("latr/branches", "latr/pruned", "latr/copies"):
    assert float(got_stats[k]) == stats[k], k


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_rows_sampled_as_usual_draft_and_the_trees_rows_do_not(
    params, prompts, drafted, paged):
  """A draft of the same policy: the rows outside the tree keep theirs
  whole (p == q), so with another key they are the draft's; the tree's
  rows draft nothing (their forced tokens and branches are LATR's)."""
  plain, spec = drafted[paged]
  earlier = plain(params, *prompts, jax.random.key(1))
  draft = sampling.Draft(earlier.completion_tokens, earlier.completion_mask,
                         earlier.sampler_logprobs)
  got, accepted, _ = spec(params, *prompts, draft, jax.random.key(7))
  n = got.completion_tokens.shape[0]
  outside = np.arange(n) % G >= HALF.tree_rows(G)
  np.testing.assert_array_equal(
      np.asarray(got.completion_tokens)[outside],
      np.asarray(earlier.completion_tokens)[outside])
  np.testing.assert_array_equal(np.asarray(accepted)[outside],
                                np.asarray(earlier.lengths)[outside])
  assert not np.asarray(accepted)[~outside].any()
  # Drawn with key 7 instead, they would differ.
  other = plain(params, *prompts, jax.random.key(7))
  assert (np.asarray(other.completion_tokens)[outside]
          != np.asarray(earlier.completion_tokens)[outside]).any()
