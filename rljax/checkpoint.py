"""Checkpoints on orbax: any pytree plus JSON metadata, per step.

Generic by design (DESIGN.md): this module saves and restores a pytree of
arrays and a JSON-able dict, and knows nothing of the train state. Saves are
asynchronous (training goes on while the arrays are written) and atomic:
orbax writes into a temporary directory and renames it when complete, so a
kill mid-save leaves the previous checkpoint intact. Restoring takes an
abstract target (``jax.ShapeDtypeStruct`` with shardings), so a checkpoint
saved on one mesh restores onto another.

PRNG keys must be stored as raw ``uint32`` key data
(``jax.random.key_data``); no pickle is involved anywhere.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointManager:
  """Keeps the last ``max_to_keep`` checkpoints of ``(tree, metadata)``.

  Args:
    directory: where step directories are written.
    max_to_keep: how many recent checkpoints to keep (None keeps all).
    async_save: write arrays in a background thread.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               async_save: bool = True):
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, tree: Any, metadata: dict | None = None,
           *, force: bool = True) -> bool:
    """Starts saving ``tree`` and ``metadata`` for ``step`` (returns at once)."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(tree),
        metadata=ocp.args.JsonSave(metadata or {}))
    return self._manager.save(int(step), args=args, force=force)

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
    if target is None:
      restored = self._manager.restore(int(step), args=ocp.args.Composite(
          state=ocp.args.StandardRestore(),
          metadata=ocp.args.JsonRestore()))
      return restored["state"], dict(restored["metadata"] or {})
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        target)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        metadata=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["metadata"] or {})

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
