"""``Entry`` (one name of the algorithm table), its factory's ``Context`` and
``check_choice``; ``table.py`` and ``advantage_entries.py`` hold the entries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optax

from rljax.train._field import Field

_Tx = optax.GradientTransformationExtraArgs


class Context(NamedTuple):
  """What a factory needs besides the ``rl`` section.

  Attributes:
    group_size: ``G``, the trained rows per prompt (``rl.group_size``).
    max_new_tokens: the generation budget (``sampler.max_new_tokens``).
    seed: the run's seed (Clip-Cov's token draw).
    extra_samples: rows sampled per prompt beyond ``G`` (a pivot or a greedy
      row, dropped after the advantages).
  """

  group_size: int
  max_new_tokens: int | None = None
  seed: int | None = None
  extra_samples: int = 0

  @property
  def samples_per_prompt(self) -> int:
    """``G + extra_samples``: the rows of a group the advantage chain sees."""
    return self.group_size + self.extra_samples


@dataclasses.dataclass(frozen=True)
class Entry:
  """One name of one axis.

  Attributes:
    doc: one line for the README's table.
    build: ``(rl, ctx) -> [transform, ...]``: an advantage preset's whole
      chain, an advantage link's one transform, an objective's or an IS
      correction's coefficient links. None for names the step reads
      directly (aggregations, KL estimators, rejection statistics).
    fields: ``rl.*`` fields this entry adds (name without ``rl.`` ->
      ``Field``).
    reads: ``rl.*`` fields it reads besides its own (documentation and the
      README; e.g. ``clip_eps_low``).
    link: an advantage transform that ``"+"`` may join into a chain.
    needs_groups: divides by a per-group statistic (needs G >= 2, unless
      ``singleton_ok`` and ``rl.singleton_groups="raw"``).
    singleton_ok: honours ``rl.singleton_groups``.
    needs_critic: advantages come from a value model (``critic.*``).
    extra_samples: samples per prompt beyond ``rl.group_size``.
    drop_pivot: MC-GRPO's median pivot row is dropped after the advantages.
    greedy_baseline: the extra sample is greedy (ReMax) and dropped.
    ess_kl_coef: the default of ``rl.ess_kl_coef`` with this objective.
    step_settings: ``rl -> {RLStepConfig field: value}``: the step's own
      loss term of this objective (KL-Cov's and DRO's penalties).
    needs_seed: draws tokens at random (``Context.seed``).
    check: ``(rl, ctx, eval_num_samples) -> None``, raising ``ValueError``
      for settings a range cannot express.
    loop_fixups: settings it needs to mean anything in the 2-step loop test.
  """

  doc: str
  build: Callable[[Mapping[str, Any], Context], list[_Tx]] | None = None
  fields: Mapping[str, Field] = dataclasses.field(default_factory=dict)
  reads: tuple[str, ...] = ()
  link: bool = False
  needs_groups: bool = False
  singleton_ok: bool = False
  needs_critic: bool = False
  extra_samples: int = 0
  drop_pivot: bool = False
  greedy_baseline: bool = False
  ess_kl_coef: float = 0.0
  step_settings: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
  needs_seed: bool = False
  check: Callable[..., None] | None = None
  loop_fixups: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def check_choice(field: str, value: Any, accepted) -> None:
  """Raises ``ValueError`` naming the field, the value and what is accepted."""
  accepted = tuple(accepted)
  if value not in accepted:
    raise ValueError(f"{field}={value!r} is unknown; accepted: {accepted}.")
