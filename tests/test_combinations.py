"""The one table of refused combinations (``rljax/train/combinations.py``):
every rule fires on its settings and on nothing less, is raised by
``build.validate`` before compiling, and is listed in ``docs/rollouts.md``."""

import os

import pytest

from rljax.train import build, combinations
from tests.test_loop import loop_config

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "rollouts.md")

# Settings that make each rule apply: (overrides, processes).
TRIGGERS = {
    "shrink-on-slots": ({"sampler.shrink_batch_to": 2,
                         "rl.rollout": "continuous"}, 1),
    "allocation-with-partial": ({"rl.allocation.name": "vigor",
                                 "rl.rollout": "partial"}, 1),
    "sgpo-with-selection": ({"rl.allocation.name": "sgpo",
                             "rl.selection.name": "dots"}, 1),
    "allocation-with-extra-rows": ({"rl.allocation.name": "vigor",
                                    "rl.advantage": "mc_grpo"}, 1),
    "treepo-without-tree": ({"rl.advantage": "treepo"}, 1),
    "tree-with-greedy-row": ({"rl.rollout": "tree",
                              "rl.advantage": "remax"}, 1),
    "tree-sgpo": ({"rl.rollout": "tree", "rl.allocation.name": "sgpo"}, 1),
    "latr-speculative-all-tree": ({"rl.rollout": "latr",
                                   "sampler.speculative": True}, 1),
    "latr-sgpo": ({"rl.rollout": "latr", "rl.allocation.name": "sgpo"}, 1),
}
RULES = {rule.name: rule for rule in combinations.RULES}


def _config(overrides):
  config = loop_config()
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = config
    for part in path:
      node = node[part]
    node[leaf] = value
  return config


def test_every_rule_has_a_trigger_and_a_unique_name():
  assert set(TRIGGERS) == set(RULES)
  assert len(RULES) == len(combinations.RULES)


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_each_rule_applies_to_its_settings_and_to_nothing_less(name):
  overrides, processes = TRIGGERS[name]
  rule = RULES[name]
  config = _config(overrides)
  assert rule.applies(config, processes)
  # Each setting is needed: without it (or on one process) the rule is off.
  for key in overrides:
    less = {k: v for k, v in overrides.items() if k != key}
    assert not rule.applies(_config(less), processes), (name, key)
  if processes > 1:
    assert not rule.applies(config, 1)
  text = combinations.message(rule, config, processes)
  for field in rule.fields:
    assert (f"{processes} processes" if field == "processes"
            else f"{field}=") in text
  assert rule.reason in text and "for now" not in text


@pytest.mark.parametrize("name", sorted(n for n, (_, p) in TRIGGERS.items()
                                        if p == 1))
def test_validate_raises_the_rule_before_compiling(name):
  overrides, _ = TRIGGERS[name]
  config = _config(overrides)
  if "env.name" in overrides:
    config.rewards.names = ("env",)
    config.rewards.weights = (1.0,)
  with pytest.raises(ValueError) as info:
    build.validate(config)
  # The first applying rule is raised; it is this one or one written before
  # it that the same settings also trigger.
  first = combinations.applying(config)[0]
  assert str(info.value) == combinations.message(first, config)
  assert name in [r.name for r in combinations.applying(config)]


@pytest.mark.parametrize("overrides", [
    {"rl.rollout": "continuous"}, {"rl.rollout": "partial"},
    {"rl.rollout": "tree"}, {"sampler.kv_cache": "paged"},
    {"rl.max_staleness": 1}, {"rl.sampler_devices": 2},
    {"env.name": "calculator", "rl.rollout": "continuous"},
    {"rl.selection.name": "greso"}, {"rl.replay.fraction": 0.25},
    {"rl.allocation.name": "vigor"},
    {"rewards.names": ("model:/nowhere",), "rewards.weights": (1.0,)},
], ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_several_processes_refuse_nothing_one_process_runs(overrides):
  """Every feature runs on several processes (tests/test_multihost.py): the
  rules that apply on two processes are those that apply on one."""
  config = _config(overrides)
  assert ([r.name for r in combinations.applying(config, 2)]
          == [r.name for r in combinations.applying(config, 1)])


def test_the_docs_list_every_rule_with_its_reason():
  with open(DOCS, encoding="utf-8") as f:
    docs = f.read()
  for rule in combinations.RULES:
    row = next((line for line in docs.splitlines()
                if line.startswith(f"| `{rule.name}` |")), None)
    assert row is not None, rule.name
    assert f"| {rule.reason} |" in row, rule.name
