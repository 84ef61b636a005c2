"""Checkpoints on orbax: any pytree plus JSON metadata, per step.

Generic by design (docs/architecture.md, layers): this module saves and restores a pytree of
arrays and a JSON-able dict, and knows nothing of the train state. With
several processes (docs/multihost.md) all of them save and restore together;
process 0 alone writes ``best_scores.json`` and moves unreadable checkpoints
aside, and the fall-back from one is agreed on by all. Saves are
asynchronous (training goes on while the arrays are written) and atomic:
orbax writes into a temporary directory and renames it when complete, so a
kill mid-save leaves the previous checkpoint intact. Restoring takes an
abstract target (``jax.ShapeDtypeStruct`` with shardings), so a checkpoint
saved on one mesh restores onto another.

A replicated shard is written cooperatively by its replicas (orbax's
replica-parallel saving: each of R replicas writes 1/R of it) only where
several processes share the writing; one process writes each shard whole
(``_handler_registry``: the slices would cost it a program per shape and a
copy, and spread no work).

PRNG keys must be stored as raw ``uint32`` key data
(``jax.random.key_data``); no pickle is involved anywhere. Exported weights
(``.safetensors``) are ``rljax.safetensors``'s business, not this module's.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rljax import distributed


def _handler_registry(replica_parallel: bool
                      ) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """orbax's handlers for the items this module writes: ``state`` (the
  pytree) with ``replica_parallel`` set on its array handler, and the
  standard and JSON handlers for any other item."""
  scalar = ocp.type_handlers.ScalarHandler()
  types = ocp.type_handlers.create_type_handler_registry(
      (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
      (np.ndarray, ocp.type_handlers.NumpyHandler()),
      (jax.Array, ocp.type_handlers.ArrayHandler(
          use_replica_parallel=replica_parallel)),
      (str, ocp.type_handlers.StringHandler()))
  state = ocp.PyTreeCheckpointHandler(type_handler_registry=types)
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("state", ocp.args.PyTreeSave, state)
  registry.add("state", ocp.args.PyTreeRestore, state)
  for save, restore, handler in (
      (ocp.args.StandardSave, ocp.args.StandardRestore,
       ocp.StandardCheckpointHandler),
      (ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler)):
    registry.add(None, save, handler)
    registry.add(None, restore, handler)
  return registry


def _restore_state(abstract: Any) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(
          abstract))


class CheckpointManager:
  """Keeps the last ``max_to_keep`` checkpoints of ``(tree, metadata)``.

  Args:
    directory: where step directories are written.
    max_to_keep: how many recent checkpoints to keep (None keeps all).
    async_save: write arrays in a background thread.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               async_save: bool = True, best_metric: str | None = None,
               best_mode: str = "max"):
    self.directory = os.path.abspath(os.fspath(directory))
    if best_mode not in ("max", "min"):
      raise ValueError(f"checkpoint.best_mode={best_mode!r}: accepted 'max', 'min'.")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"checkpoint.max_to_keep={max_to_keep!r}: a positive "
                       "integer or None is required.")
    self.best_metric, self.best_mode, self.max_to_keep = (
        best_metric, best_mode, max_to_keep)
    # Pruning (last N plus the best) is done here: orbax's own best_fn keeps
    # the N best only, which could drop the latest checkpoint a resume needs.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None, enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        handler_registry=_handler_registry(jax.process_count() > 1))
    self._group = distributed.ProcessGroup()
    self._scores_path = os.path.join(self.directory, "best_scores.json")
    self._scores: dict[str, float] = {}
    if os.path.exists(self._scores_path):
      with open(self._scores_path) as f:
        self._scores = json.load(f)

  def save(self, step: int, tree: Any, metadata: dict | None = None,
           *, metrics: dict | None = None, force: bool = True,
           host_arrays: dict[str, dict[str, np.ndarray]] | None = None
           ) -> bool:
    """Starts saving ``tree`` and ``metadata`` for ``step`` (returns at once).

    ``metrics[best_metric]``, when given, ranks the checkpoint for
    ``best_step``; the best one is kept besides the last ``max_to_keep``.
    ``host_arrays``: named extra items, each a dict of host (numpy) arrays
    whose shapes vary between saves (e.g. the SPEC-RL draft store), read
    back by ``restore_host_arrays`` without a target; None values are
    skipped.
    """
    extra = {name: ocp.args.StandardSave(value)
             for name, value in (host_arrays or {}).items()
             if value is not None}
    if extra.keys() & {"state", "metadata"}:
      raise ValueError(f"host_arrays names {sorted(extra)}: 'state' and "
                       "'metadata' are taken.")
    args = ocp.args.Composite(
        state=ocp.args.PyTreeSave(tree),
        metadata=ocp.args.JsonSave(metadata or {}), **extra)
    saved = self._manager.save(int(step), args=args, force=force)
    if self.best_metric and metrics and self.best_metric in metrics:
      self._scores[str(int(step))] = float(metrics[self.best_metric])
      if self._group.primary:
        tmp = self._scores_path + ".tmp"
        with open(tmp, "w") as f:
          json.dump(self._scores, f)
        os.replace(tmp, self._scores_path)
    self._prune()
    return saved

  def _prune(self) -> None:
    if self.max_to_keep is None:
      return
    steps = self.all_steps()
    keep = set(steps[-self.max_to_keep:])
    best = self.best_step()
    if best is not None:
      keep.add(best)
    for step in steps:
      if step not in keep:
        self._manager.delete(step)

  def best_step(self) -> int | None:
    """The saved step with the best ``best_metric`` (None without scores)."""
    present = set(self.all_steps())
    scores = {int(k): v for k, v in self._scores.items() if int(k) in present}
    if not scores:
      return None
    pick = max if self.best_mode == "max" else min
    return pick(scores, key=scores.get)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
    """Restores ``(tree, metadata)``; ``target`` gives structure, dtypes, shardings.

    Args:
      step: the step to restore; None for the latest.
      target: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with
        ``sharding``) matching the saved tree; None restores the saved
        structure as nested dicts/lists of host-local arrays.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}.")
    if target is None:  # onto this process's first device, whatever the
      # mesh and process count of the run that saved it
      restored = self._manager.restore(int(step), args=ocp.args.Composite(
          state=_restore_state(self._local_target(step)),
          metadata=ocp.args.JsonRestore()))
      return restored["state"], dict(restored["metadata"] or {})
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        target)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=_restore_state(abstract),
        metadata=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["metadata"] or {})

  def _local_target(self, step: int) -> Any:
    """The saved tree's shapes and dtypes on this process's first device."""
    metadata = ocp.CheckpointManager(
        self.directory, item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "metadata": ocp.JsonCheckpointHandler()}).item_metadata(
                int(step))["state"]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
        if hasattr(x, "shape") and hasattr(x, "dtype") else x, metadata)

  def restore_host_arrays(self, step: int, name: str
                          ) -> dict[str, np.ndarray] | None:
    """The ``host_arrays[name]`` saved with ``step``, as numpy arrays; None
    when that checkpoint has no such item."""
    if not os.path.isdir(os.path.join(self.directory, str(int(step)), name)):
      return None
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        **{name: ocp.args.StandardRestore()}))
    return {k: np.asarray(v) for k, v in restored[name].items()}

  def restore_latest_valid(self, target: Any) -> tuple[int, Any, dict]:
    """``restore_latest_valid_with(target)`` without host arrays:
    ``(step, tree, metadata)``."""
    return self.restore_latest_valid_with(target)[:3]

  def restore_latest_valid_with(self, target: Any,
                                host_arrays: tuple[str, ...] = ()
                                ) -> tuple[int, Any, dict, dict[str, Any]]:
    """Restores the newest checkpoint that reads back whole: its state, its
    metadata and each of its ``host_arrays`` items (e.g. the SPEC-RL draft
    store), all of them verified together.

    A checkpoint that fails to restore (truncated or corrupted files) is
    skipped with a warning naming its directory, and the one before it is
    tried. Once an older checkpoint restores with the same ``target`` (so the
    target is right and the newer ones are damaged), the unreadable newer
    ones are moved aside into ``<directory>.corrupt/`` (renamed, with a
    warning), so their steps can be saved again. Nothing is moved when no
    checkpoint restores.

    Returns:
      ``(step, tree, metadata, {name: host arrays or None})``.

    Raises:
      FileNotFoundError: if no checkpoint can be restored.
    """
    errors = []
    for step in reversed(self.all_steps()):
      try:
        tree, metadata = self.restore(step, target)
        extras = {name: self.restore_host_arrays(step, name)
                  for name in host_arrays}
        failure = None
      except Exception as e:  # orbax/tensorstore raise many kinds
        failure = e
        self._check_structure(step, target)  # another run's state: raise
      # With several processes, all of them fall back together.
      if not self._group.all(failure is None):
        bad = os.path.join(self.directory, str(step))
        reason = ("unreadable on another process" if failure is None else
                  f"{type(failure).__name__}: "
                  + (str(failure).splitlines() or [""])[0][:200])
        logging.warning("checkpoint %s is unreadable (%s); falling back to "
                        "the previous one.", bad, reason)
        errors.append((step, bad))
        continue
      if errors:
        self._move_aside([s for s, _ in errors])
      return step, tree, metadata, extras
    raise FileNotFoundError(
        f"no readable checkpoint in {self.directory}"
        + (f" (unreadable: {[b for _, b in errors]})" if errors else "") + ".")

  def _check_structure(self, step: int, target: Any) -> None:
    """Raises when checkpoint ``step`` is readable but holds another state
    than ``target`` (a changed optimizer or model): a different run, not a
    damaged checkpoint, so nothing falls back or is moved aside. A
    checkpoint whose metadata cannot be read is left to the restore."""
    if target is None:
      return
    try:
      saved = self._local_target(step)
    except Exception:  # pylint: disable=broad-exception-caught
      return  # damaged: the restore falls back
    state = target.get("state", target) if isinstance(target, dict) else target
    saved_state = (saved.get("state", saved) if isinstance(saved, dict)
                   else saved)
    # Shapes as multisets: the saved tree's order need not be the target's.
    old = collections.Counter(tuple(x.shape) for x in jax.tree.leaves(
        saved_state) if hasattr(x, "shape"))
    new = collections.Counter(tuple(x.shape) for x in jax.tree.leaves(state)
                              if hasattr(x, "shape"))
    if old == new:
      return
    only_old = sorted((old - new).elements())[:3]
    only_new = sorted((new - old).elements())[:3]
    raise ValueError(
        f"checkpoint {os.path.join(self.directory, str(step))} holds a "
        f"different state than this run builds (old -> new): "
        f"{sum(old.values())} -> {sum(new.values())} arrays; shapes only "
        f"saved {only_old}, only now {only_new}. The optimizer, the "
        "algorithm or the model changed since it was saved: resume with the "
        "same ones, or start in a new --workdir.")

  def _move_aside(self, steps: list[int]) -> None:
    aside = self.directory + ".corrupt"
    stamp = self._group.from_primary(time.strftime("%Y%m%d-%H%M%S"))
    for step in steps:
      source = os.path.join(self.directory, str(step))
      target = os.path.join(aside, f"{step}-{stamp}")
      if self._group.primary:
        os.makedirs(aside, exist_ok=True)
        os.replace(source, target)
      logging.warning("moved the unreadable checkpoint %s aside to %s; step %d "
                      "will be trained and saved again.", source, target, step)
    self._group.barrier("rljax_checkpoint_moved_aside")
    self._scores = {k: v for k, v in self._scores.items()
                    if int(k) not in set(steps)}
    self._manager.reload()

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
