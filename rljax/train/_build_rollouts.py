"""The rollout part of ``build``: meshes (one, or the trainer's and the
sampler's with ``rl.sampler_devices``), ``rl.rollout*`` checks and the
partial-rollout settings (``docs/rollouts.md``). Re-exported by ``build``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from rljax import advantages as advantages_lib
from rljax import sharding
from rljax.data import allocation as allocation_lib
from rljax.data import selection as selection_lib
from rljax.train import algorithm as alg_lib
from rljax.rollout import episode_tree
from rljax.rollout import partial as partial_lib
from rljax.sampling import latr as latr_lib
from rljax.sampling import tree as tree_lib


def _check_sampler_devices(n: int) -> None:
  count = jax.device_count()
  if n >= count:
    raise ValueError(
        f"rl.sampler_devices={n} with {count} devices: the trainer needs at "
        f"least one; accepted: 0 (one mesh) up to {count - 1}.")


def meshes(config: Any) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
  """``(trainer mesh, sampler mesh)``: one mesh twice, or with
  ``rl.sampler_devices = n`` the first devices laid out as ``config.mesh``
  says for the trainer and the last ``n`` as one data-parallel (``fsdp``)
  axis for the sampler. With several processes each gives the sampler its
  last ``n / processes`` devices (so that each process samples, on its
  own devices, the block of rows it trains)."""
  n = config.rl.sampler_devices
  if not n:
    mesh = sharding.mesh_from_config(config.mesh)
    return mesh, mesh
  devices = jax.devices()
  _check_sampler_devices(n)
  processes = jax.process_count()
  if processes == 1:
    return (sharding.mesh_from_config(config.mesh, devices=devices[:-n]),
            sharding.make_mesh(1, -1, 1, devices=devices[-n:]))
  if n % processes:
    raise ValueError(
        f"rl.sampler_devices={n} with {processes} processes: each process "
        "gives the sampler the same number of its devices; accepted: a "
        f"multiple of {processes}.")
  own = [[d for d in devices if d.process_index == p]
         for p in range(processes)]
  k = n // processes
  if any(k >= len(local) for local in own):
    raise ValueError(
        f"rl.sampler_devices={n} with {processes} processes of "
        f"{min(len(local) for local in own)} devices: each process's trainer "
        f"needs one of its devices; accepted: up to "
        f"{processes * (min(len(local) for local in own) - 1)}.")
  trainer = [d for local in own for d in local[:-k]]
  sampler = [d for local in own for d in local[-k:]]
  return (sharding.mesh_from_config(config.mesh, devices=trainer),
          sharding.make_mesh(1, -1, 1, devices=sampler))




def partial_config(config: Any):
  """The ``partial.PartialConfig`` of ``rl.rollout*`` / ``rl.partial_*``;
  None for the plans without slots, ``rl.rollout="static"`` and
  ``"tree"`` and ``"latr"``."""
  rl = config.rl
  if rl.rollout in ("static", "tree", "latr"):
    return None
  rows = rl.prompts_per_step * (rl.group_size + alg_lib.sampling_needs(
      rl.advantage)["extra_samples"])
  slots = rl.rollout_slots or max(1, rows // 2)
  return partial_lib.PartialConfig(
      mode=rl.rollout, slots=slots,
      refill_rows=rl.rollout_refill_rows or max(1, slots // 4),
      max_age=rl.partial_max_age,
      max_carried=(math.ceil(rl.partial_max_carried * rl.prompts_per_step)
                   if rl.rollout == "partial" else 0))


def _validate_rollout(config: Any) -> None:
  """The rollout settings' own checks (replay, allocation, sampler devices,
  slots); which of them combine is ``combinations.RULES``', checked first
  by ``validate``."""
  rl = config.rl
  if rl.replay.fraction and round(rl.replay.fraction * rl.prompts_per_step) \
      >= rl.prompts_per_step:
    raise ValueError(
        f"rl.replay.fraction={rl.replay.fraction!r} replays all "
        f"{rl.prompts_per_step} groups of rl.prompts_per_step: at least one "
        "must be sampled fresh.")
  if rl.allocation.name != "none":
    allocation(config)  # the schedule's own checks
    fresh_allocation(config)  # with replay, the fresh prompts' rounds
  if rl.sampler_devices:
    _check_sampler_devices(rl.sampler_devices)
  if rl.rollout in ("static", "tree", "latr"):
    for name in ("rollout_slots", "rollout_refill_rows"):
      if rl[name] is not None:
        raise ValueError(f"rl.{name}={rl[name]!r} with rl.rollout="
                         f"{rl.rollout!r}: the {rl.rollout} sampler has no "
                         "slots; accepted: rl.rollout='continuous' or "
                         f"'partial', or rl.{name}=None.")
    if rl.rollout == "tree":  # its widths fit the rows and the budget
      tree = tree_config(config)
      # Tree episodes fork between turns, not after segments of tokens.
      budget = None if config.env.name else config.sampler.max_new_tokens
      if rl.allocation.name == "none":
        rows = rl.group_size + alg_lib.sampling_needs(rl.advantage)[
            "extra_samples"]
        tree.widths(rows, budget)
      else:  # each prompt entry of the rounds is a tree
        rows = allocation(config).sampler_samples
        try:
          tree.widths(rows, budget)
        except ValueError as e:
          raise ValueError(
              f"rl.allocation.name={rl.allocation.name!r} samples "
              f"{rows} rows per prompt entry (each round gives a prompt a "
              f"multiple), each entry a tree: {e}") from None
      if config.env.name:
        episode_tree.check(tree, rows, config.env.max_turns)
    if rl.rollout == "latr":
      _validate_latr(config)
    return
  partial_config(config)  # checks slots against refill rows


def _validate_latr(config: Any) -> None:
  """LATR's tree has at least 2 rows of each group (of each prompt entry
  with rollout allocation), and leaves out ReMax's greedy row (the last of
  each group), which its branches would copy."""
  rl = config.rl
  needs = alg_lib.sampling_needs(rl.advantage)
  rows = rl.group_size + needs["extra_samples"]
  latr = latr_config(config)
  if rl.allocation.name != "none":
    rows = allocation(config).sampler_samples
    try:
      latr.tree_rows(rows)
    except ValueError as e:
      raise ValueError(
          f"rl.allocation.name={rl.allocation.name!r} samples {rows} rows "
          f"per prompt entry, each entry with its own LATR tree: {e}"
      ) from None
    return
  m = latr.tree_rows(rows)
  if needs["greedy_baseline"] and m >= rows:
    raise ValueError(
        f"rl.latr.mix_ratio={rl.latr.mix_ratio!r} puts all {rows} rows of a "
        f"group in LATR's tree, and rl.advantage={rl.advantage!r} decodes "
        "the last row greedily from the prompt as its baseline; accepted: "
        f"rl.latr.mix_ratio <= {(rows - 1.5) / rows:.3g} (the greedy row "
        "outside the tree).")


def latr_config(config: Any) -> latr_lib.LatrConfig | None:
  """The ``LatrConfig`` of ``rl.latr.*`` with ``rl.rollout="latr"``, else
  None."""
  if config.rl.rollout != "latr":
    return None
  c = config.rl.latr
  return latr_lib.LatrConfig(
      mix_ratio=float(c.mix_ratio), abs_threshold=float(c.abs_threshold),
      rel_threshold=float(c.rel_threshold), lookahead=tuple(c.lookahead),
      edit_distance=float(c.edit_distance))


def tree_config(config: Any) -> tree_lib.TreeConfig | None:
  """The ``TreeConfig`` of ``rl.tree.*`` with ``rl.rollout="tree"``, else
  None."""
  if config.rl.rollout != "tree":
    return None
  t = config.rl.tree
  return tree_lib.TreeConfig(segment_tokens=t.segment_tokens,
                             branch=t.branch, roots=t.roots,
                             branch_by=t.branch_by)


def allocation(config: Any, batch_size: int | None = None) -> Any:
  """The rounds of ``rl.allocation`` (``rljax/data/allocation.py``) for
  ``batch_size`` prompts (default ``rl.prompts_per_step``): a
  ``Schedule``, for sGPO a fresh ``Sgpo``; None for ``"none"``."""
  a, rl = config.rl.allocation, config.rl
  return allocation_lib.make_schedule(
      a.name, batch_size=batch_size or rl.prompts_per_step,
      group_size=rl.group_size,
      rounds=a.rounds, growth=a.growth, pilot_fraction=a.pilot_fraction,
      commit_fraction=a.commit_fraction, profile_samples=a.profile_samples,
      max_group=a.max_group, unsolved_keep=a.unsolved_keep, seed=config.seed)


def fresh_allocation(config: Any) -> allocation_lib.Schedule | None:
  """With replay (``rl.replay.fraction``), the rounds of the ``B - R``
  fresh prompts of a step that replays ``R`` groups; None without both
  (sGPO sizes the fresh prompts itself: ``allocation.Sgpo.next_prompts``).

  Raises:
    ValueError: when ``B - R`` prompts have no rounds, naming the fields.
  """
  rl = config.rl
  if rl.allocation.name in ("none", "sgpo") or not rl.replay.fraction:
    return None
  b = rl.prompts_per_step
  count = int(round(rl.replay.fraction * b))
  try:
    fresh = allocation(config, b - count)
    full = allocation(config)
    if fresh.sampler_samples != full.sampler_samples:
      raise ValueError(
          f"its rounds of {b - count} prompts draw multiples of "
          f"{fresh.sampler_samples} samples per prompt and those of {b} "
          f"multiples of {full.sampler_samples}: one sampler draws both")
    return fresh
  except ValueError as e:
    raise ValueError(
        f"rl.replay.fraction={rl.replay.fraction!r} replays {count} of "
        f"rl.prompts_per_step={b} groups and leaves {b - count} fresh prompts "
        f"to rollout allocation's rounds, which refuse them (read "
        f"rl.prompts_per_step as {b - count}): {e}") from None


def max_group(config: Any) -> int:
  """The largest group rollout allocation can give a prompt (with replay,
  of either schedule: ``fresh_allocation``)."""
  schedules = [s for s in (allocation(config), fresh_allocation(config))
               if s is not None]
  return max(s.max_group for s in schedules)


def with_allocation(config: Any, alg: alg_lib.Algorithm) -> alg_lib.Algorithm:
  """``alg`` with its advantage chain on groups of unequal size
  (``advantages.by_group_ids``) when ``rl.allocation`` is on."""
  schedule = allocation(config)
  if schedule is None:
    return alg
  return dataclasses.replace(alg, advantage=advantages_lib.by_group_ids(
      alg.advantage, schedule.prompts[0], max_group(config)))


def selection(config: Any, pool_size: int | None = None
              ) -> selection_lib.Selection | None:
  """Prompt selection and dynamic sampling (``rl.selection``); None when
  ``rl.selection.name='none'``. GRESO's and DOTS's draws follow ``seed``;
  DOTS needs ``pool_size``, the number of training prompts."""
  sel = config.rl.selection
  return selection_lib.make_selection(
      sel.name, seed=config.seed, max_rounds=sel.max_rounds,
      greso_target=sel.greso_target, greso_step_size=sel.greso_step_size,
      greso_min_explore=sel.greso_min_explore,
      greso_max_draws=sel.greso_max_draws,
      batch_size=config.rl.prompts_per_step, pool_size=pool_size,
      dots_every=sel.dots_every, dots_reference=sel.dots_reference,
      dots_target=sel.dots_target, dots_temperature=sel.dots_temperature,
      dots_attention_temperature=sel.dots_attention_temperature)


def replay_buffer(config: Any) -> selection_lib.ReplayBuffer | None:
  """The replay buffer of recent informative groups (``rl.replay``); None
  when ``rl.replay.fraction=0``."""
  r = config.rl.replay
  if not r.fraction:
    return None
  return selection_lib.ReplayBuffer(
      fraction=r.fraction, max_age=r.max_age, capacity=r.capacity,
      batch_size=config.rl.prompts_per_step)
