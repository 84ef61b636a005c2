"""Which features do not combine, and why: the one table of rules.

The features of a run (rollout plans, schedules, prompt feeders,
environments, reward sources, several processes) combine with each other
except where a rule below says otherwise. Each refusal is written once,
here, with its reason: ``build.validate`` (one process) and ``build.build``
(the run's processes) raise the first rule that applies, before anything is
compiled, and ``docs/rollouts.md`` lists every rule by name
(``tests/test_combinations.py`` checks both).

A rule refuses only a combination that has no meaning, and its reason says
why: no combination is refused because a code path is not built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Rule(NamedTuple):
  """One refused combination.

  Attributes:
    name: its short name (``docs/rollouts.md`` lists it).
    fields: the config fields the error names, the setting that is refused
      first (``"processes"`` is the run's process count).
    applies: ``(config, processes) -> bool``.
    reason: why, after the fields in the error.
    accepted: what the user may set instead.
  """

  name: str
  fields: tuple[str, ...]
  applies: Callable[[Any, int], bool]
  reason: str
  accepted: str


def _get(config: Any, field: str) -> Any:
  value = config
  for part in field.split("."):
    value = value[part]
  return value


def _slots(c: Any) -> bool:
  return c.rl.rollout in ("continuous", "partial")


def _extra_samples(c: Any) -> int:
  from rljax.train import algorithm  # pylint: disable=g-import-not-at-top
  return algorithm.sampling_needs(c.rl.advantage)["extra_samples"]


def _tree(c: Any) -> bool:
  return c.rl.rollout == "tree"


def _rows(c: Any) -> int:
  """The training rows per prompt: ``rl.group_size`` and the advantage's
  extra rows."""
  return c.rl.group_size + _extra_samples(c)


def _latr(c: Any) -> bool:
  return c.rl.rollout == "latr"


_ALLOCATION = "rl.allocation.name"
RULES: tuple[Rule, ...] = (
    # --- one process -------------------------------------------------------
    Rule("shrink-on-slots", ("sampler.shrink_batch_to", "rl.rollout"),
         lambda c, p: c.sampler.shrink_batch_to is not None and _slots(c),
         "slots refill as rows end, so there is no batch to shrink",
         "sampler.shrink_batch_to=None, or rl.rollout='static'"),
    Rule("allocation-with-partial", (_ALLOCATION, "rl.rollout"),
         lambda c, p: (c.rl.allocation.name != "none"
                       and c.rl.rollout == "partial"),
         "allocation chooses each round's prompts from the rewards of every "
         "row of the rounds before, within the step; a row carried "
         "unfinished to the next step has no reward to choose by",
         "rl.rollout='continuous' or 'static'"),
    Rule("sgpo-with-selection", (_ALLOCATION, "rl.selection.name"),
         lambda c, p: (c.rl.allocation.name == "sgpo"
                       and c.rl.selection.name != "none"),
         "sGPO's curriculum chooses each step's prompts and their group "
         "sizes from its profile of the pool; DOTS and GRESO would choose "
         "the prompts instead, and DAPO's refills would draw prompts from "
         "outside the curriculum", "rl.selection.name='none', or "
         "rl.allocation.name='vigor' or 'pilot_commit'"),
    Rule("treepo-without-tree", ("rl.advantage", "rl.rollout"),
         lambda c, p: "treepo" in c.rl.advantage.split("+") and not _tree(c),
         "TreePO's advantage centres each row on the subtrees of a tree "
         "rollout; rows sampled independently have no subtrees",
         "rl.rollout='tree'"),
    Rule("tree-with-greedy-row", ("rl.rollout", "rl.advantage"),
         lambda c, p: _tree(c) and c.rl.advantage == "remax",
         "ReMax's baseline row is decoded greedily from the prompt on; every "
         "row of a tree shares its first segment with sampled siblings",
         "an advantage without a greedy row, or rl.rollout='static'"),
    Rule("tree-sgpo", ("rl.rollout", _ALLOCATION),
         lambda c, p: _tree(c) and c.rl.allocation.name == "sgpo",
         "sGPO samples a prompt's group as single completions, one per "
         "entry (any size from 2 to rl.allocation.max_group), and a tree "
         "of one leaf has no fork; VIGOR's and Pilot-Commit's entries are "
         "trees", "rl.allocation.name='vigor' or 'pilot_commit', or "
         "rl.rollout='static'"),
    Rule("latr-speculative-all-tree", ("sampler.speculative",
                                       "rl.latr.mix_ratio"),
         lambda c, p: _latr(c) and bool(c.sampler.speculative) and (
             round(_rows(c) * c.rl.latr.mix_ratio) >= _rows(c)),
         "SPEC-RL drafts the rows LATR samples as usual; with every row of "
         "a group in LATR's tree (rl.latr.mix_ratio x the rows per prompt "
         "rounds to all of them) no row draws its tokens, so none has a "
         "draft to verify",
         "rl.latr.mix_ratio that leaves rows outside the tree (0.5), or "
         "sampler.speculative=False"),
    Rule("latr-sgpo", ("rl.rollout", _ALLOCATION),
         lambda c, p: _latr(c) and c.rl.allocation.name == "sgpo",
         "sGPO samples a prompt's group as single completions, one per "
         "entry, and a LATR tree of one row never branches; VIGOR's and "
         "Pilot-Commit's entries are LATR trees",
         "rl.allocation.name='vigor' or 'pilot_commit', or "
         "rl.rollout='static'"),
    Rule("allocation-with-extra-rows", (_ALLOCATION, "rl.advantage"),
         lambda c, p: (c.rl.allocation.name != "none"
                       and bool(_extra_samples(c))),
         "the advantage samples a pivot or greedy row per group of G; "
         "groups of unequal size have no such row",
         "an advantage without extra samples"),
)


def applying(config: Any, processes: int = 1) -> list[Rule]:
  """The rules that refuse ``config`` on ``processes`` processes."""
  return [rule for rule in RULES if rule.applies(config, processes)]


def message(rule: Rule, config: Any, processes: int = 1) -> str:
  """The error of ``rule`` for ``config``: the fields and their values, the
  reason and what is accepted."""
  settings = " with ".join(
      f"{processes} processes" if field == "processes"
      else f"{field}={_get(config, field)!r}" for field in rule.fields)
  return f"{settings}: {rule.reason}; accepted: {rule.accepted}."


def check(config: Any, processes: int = 1) -> None:
  """Raises the first rule that refuses ``config`` on ``processes``
  processes.

  Raises:
    ValueError: naming the rule's fields and values, its reason and what
      is accepted.
  """
  for rule in applying(config, processes):
    raise ValueError(message(rule, config, processes))


__all__ = ["RULES", "Rule", "applying", "check", "message"]
