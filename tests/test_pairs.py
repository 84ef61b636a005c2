"""Every pair of the single-process rollout and training features trains.

Fifteen features, each a few settings of a tiny calculator config: the
rollout plans (continuous slots, partial rollouts, tree rollouts, the
static batch on a paged KV cache), the schedules
(asynchronous sampling, sampler devices), a multi-turn environment, SPEC-RL,
LoRA, padded training, DAPO's prompt selection, PPO with a critic, a reward
model and on-policy distillation. A pair is refused only where the table of
``rljax/train/combinations.py`` has a rule for it (``REFUSED`` lists them,
and the test checks that the table refuses exactly these), or where both
features set the same field (``SAME_FIELD``).

The other pairs are covered by a few runs of several features each (a
greedy cover, planned at collection): every run must train 2 steps with
finite metrics, and each of its features must be seen to act through its
own figure (slot utilisation, carried groups, sampler lag, the sampler's
devices, environment turns, drafted rows, LoRA adapters, no packing,
selection rounds, the critic's loss, the reward model's scores, the
distillation KL).

The sixteenth feature, several processes, pairs with each of these in
``tests/test_multihost.py`` (``COLUMN`` names the two-process run of each,
which matches one process to 1e-6).
"""

import itertools
import math
import os
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import pytest

from rljax import models, train
from rljax.models import reward_model as rm
from rljax.train import build, combinations
from tests.test_loop import rl_rows
from tests.test_train import load_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


class Feature(NamedTuple):
  settings: dict[str, Any]
  acted: Callable[[list[dict], str], bool]  # (metrics rows, workdir)


def _has(key):
  return lambda rows, workdir: all(key in r for r in rows)


def _lora_adapters(rows, workdir):
  del rows
  params = train.load_policy(workdir).params
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]]
  return any("_lora_a" in n for n in names)


# LATR with thresholds every token crosses (an untrained model's next-token
# distributions are flat), half the rows a tree: the others sampled as
# usual, which SPEC-RL drafts (the tree's rows draft nothing).
LATR_SETTINGS = {"rl.rollout": "latr", "rl.latr.abs_threshold": 0.0,
                 "rl.latr.rel_threshold": 0.0, "rl.latr.mix_ratio": 0.5}

FEATURES = {
    "continuous": Feature({"rl.rollout": "continuous"},
                          _has("rollout/slot_utilization")),
    "partial": Feature({"rl.rollout": "partial"},
                       _has("rollout/carried_groups")),
    "async": Feature({"rl.max_staleness": 1},
                     lambda rows, w: rows[-1]["rollout/sampler_lag"] == 1),
    "sampler_devices": Feature(
        {"rl.sampler_devices": 4},
        lambda rows, w: all(r["rollout/sampler_devices"] == 4 for r in rows)),
    "env": Feature({"env.name": "calculator"},
                   lambda rows, w: all(r["env/turns/mean"] >= 1
                                       for r in rows)),
    # Every step samples the same prompts: step 2 drafts from step 1.
    "spec_rl": Feature({"sampler.speculative": True},
                       lambda rows, w: rows[-1]["spec/drafted_rows"] > 0),
    "lora": Feature({"model.lora.rank": 4}, _lora_adapters),
    "padded": Feature({"rl.padding_free": False},
                      lambda rows, w: not any("packing/fill" in r
                                              for r in rows)),
    "dapo": Feature({"rl.selection.name": "dapo"}, _has("select/rounds")),
    "critic": Feature({"rl.advantage": "gae"},
                      lambda rows, w: all(math.isfinite(
                          r["critic/value_loss"]) for r in rows)),
    "reward_model": Feature({}, lambda rows, w: all(
        math.isfinite(r["reward/pair_rm/mean"]) for r in rows)),
    # Shared segments decoded once: fewer tokens decoded than the leaves hold.
    "tree": Feature({"rl.rollout": "tree"}, lambda rows, w: all(
        r["rollout/tree_token_saving"] > 0 for r in rows)),
    # LATR branching at every token until each prompt's tree is full.
    "latr": Feature(LATR_SETTINGS, lambda rows, w: all(
        r["latr/branches"] > 0 for r in rows)),
    # The static batch on blocks: ended rows gave theirs back.
    "paged": Feature({"sampler.kv_cache": "paged"}, lambda rows, w: all(
        r["rollout/kv_blocks_peak"] > 0 and r["rollout/kv_blocks_left"] == 0
        for r in rows)),
    "distillation": Feature({"rl.distill_coef": 0.1},
                            lambda rows, w: all(math.isfinite(
                                r["distill/reverse_kl"]) for r in rows)),
}

# Pairs that set the same field: one run cannot hold both.
SAME_FIELD = {frozenset(p) for p in itertools.combinations(
    ("continuous", "partial", "tree", "latr"), 2)}

# The pairs the table refuses, by its rule (docs/rollouts.md gives the
# reasons).
REFUSED = {
}

MAX_FEATURES = 10  # per run


def config(features, rm_dir="/rm", teacher_dir="/teacher"):
  """The tiny calculator config (without its environment) with
  ``features`` on."""
  c = load_config(os.path.join(CONFIGS, "calculator_grpo.py"), "tiny")
  c.env.name = ""
  c.rl.num_steps = 2
  c.eval.every = c.checkpoint.every = 100
  # What the pairs do not need: the warm-up, greedy and long evaluations.
  c.sft.num_steps = 0
  c.eval.greedy = False
  c.eval.num_examples = 8
  c.task.num_train = c.rl.prompts_per_step  # the same prompts every step
  names = ["numeric_match", "tests.reward_fixtures:parity"]
  weights = [1.0, 0.5]
  for name in features:
    for key, value in FEATURES[name].settings.items():
      *path, leaf = key.split(".")
      node = c
      for part in path:
        node = node[part]
      node[leaf] = value
  if "env" in features:
    names[0] = "env"
  if "reward_model" in features:
    names.append(f"model:{rm_dir}")
    weights.append(0.5)
  if "distillation" in features:
    c.teacher.path = teacher_dir
  c.rewards.names, c.rewards.weights = tuple(names), tuple(weights)
  c.eval.reward = names[0]
  return c


def _refused(features):
  return [r.name for r in combinations.applying(config(features))]


def _allowed(pair):
  return frozenset(pair) not in SAME_FIELD and not _refused(pair)


def plan():
  """Runs (tuples of features) that cover every allowed pair: greedy, each
  run grown from an uncovered pair by the features that cover the most
  uncovered pairs while the run stays allowed."""
  names = list(FEATURES)
  uncovered = {frozenset(p) for p in itertools.combinations(names, 2)
               if _allowed(p)}
  runs = []
  while uncovered:
    run = sorted(min(uncovered, key=sorted), key=names.index)
    while len(run) < MAX_FEATURES:
      gains = []
      for f in names:
        if f in run or any(frozenset((f, g)) in SAME_FIELD for g in run):
          continue
        gain = sum(frozenset((f, g)) in uncovered for g in run)
        if gain and not _refused(run + [f]):
          gains.append((gain, -names.index(f), f))
      if not gains:
        break
      run.append(max(gains)[2])
    runs.append(tuple(sorted(run, key=names.index)))
    uncovered -= {frozenset(p) for p in itertools.combinations(run, 2)}
  return runs


PLAN = plan()


def test_the_table_refuses_exactly_the_listed_pairs():
  names = list(FEATURES)
  refused = {}
  for pair in itertools.combinations(names, 2):
    if frozenset(pair) in SAME_FIELD:
      continue
    rules = _refused(pair)
    if rules:
      refused[frozenset(pair)] = rules[0]
  assert refused == REFUSED
  for rule in REFUSED.values():
    assert rule in {r.name for r in combinations.RULES}


def test_the_runs_cover_every_allowed_pair():
  covered = {frozenset(p) for run in PLAN
             for p in itertools.combinations(run, 2)}
  pairs = {frozenset(p) for p in itertools.combinations(FEATURES, 2)}
  # A refused pair may still meet in a run that a third feature makes
  # allowed (DAPO on slots with episodes).
  assert covered >= pairs - SAME_FIELD - set(REFUSED)
  assert all(not _refused(run) for run in PLAN)
  assert len(PLAN) <= 16  # a cheap test: a few runs, not one per pair


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
  """A tiny random reward model on the base config's tokenizer."""
  c = config(())
  task, examples, _ = build.load_task(c)
  tokenizer = build.make_tokenizer(c, task, examples)
  rm_config = rm.RewardModelConfig(models.get_preset("tiny").replace(
      vocab_size=tokenizer.vocab_size))
  params = rm.init_params(rm_config, jax.random.key(0))
  kernel = jax.random.normal(jax.random.key(1),
                             (rm_config.decoder.d_model, 1))
  path = tmp_path_factory.mktemp("rm") / "pair_rm"
  rm.save_hf_reward_model(path, rm_config, {"decoder": params["decoder"],
                                            "score": {"kernel": kernel}})
  (path / "tokenizer.model").write_bytes(tokenizer.serialized)
  return str(path)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A one-step run of the base config: the distillation teacher."""
  c = config(())
  c.rl.num_steps = 1
  c.eval.greedy = False
  workdir = str(tmp_path_factory.mktemp("teacher"))
  train.run(c, workdir)
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("run", PLAN, ids="+".join)
def test_every_allowed_pair_trains_and_each_feature_acts(run, rm_dir,
                                                         teacher_dir,
                                                         tmp_path):
  c = config(run, rm_dir, teacher_dir)
  train.run(c, str(tmp_path))
  rows = rl_rows(tmp_path)
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert np.isfinite(r["pg_loss"]) and r["grad_norm"] > 0, r
  for name in run:
    assert FEATURES[name].acted(rows, str(tmp_path)), name
