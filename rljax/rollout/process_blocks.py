"""The collector's view of several processes (``docs/multihost.md``).

A run's processes each hold one block of every batch's rows
(``distributed.ProcessGroup.block``). Prompt feeders decide on the global
batch (``gathered``), each process samples its ``block``, and host arrays
of every row go back to the devices as the global arrays whose blocks the
processes hold. With one process every method is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rljax import sharding as sharding_lib


class ProcessBlocks:
  """Mixed into ``Collector``: needs ``group`` (``ProcessGroup``), ``mesh``
  and ``sample_mesh``."""

  def gathered(self, examples: Mapping[str, Sequence[Any]]
                ) -> dict[str, list[Any]]:
    """The global batch whose block this process holds as ``examples``
    (every process's blocks, in order); one process: ``examples``."""
    if self.group.single:
      return dict(examples)
    blocks = self.group.gather_blocks(
        {f: list(v) for f, v in examples.items()}, self.mesh)
    return {f: [x for block in blocks for x in block[f]] for f in examples}

  def block(self, examples: Mapping[str, Sequence[Any]]
             ) -> dict[str, list[Any]]:
    """This process's block of a global batch of examples."""
    if self.group.single:
      return dict(examples)
    rows = self.group.rows(self.mesh, len(examples["prompt"]))
    return {f: list(v)[rows] for f, v in examples.items()}

  def _gathered_prompts(self, prompts: Sequence[Sequence[int]]
                        ) -> list[list[int]]:
    """Every process's encoded prompts, in block order."""
    return [p for part in self.group.gather_blocks(
        [[int(t) for t in p] for p in prompts], self.mesh) for p in part]

  def _to_trainer(self, rollout: Any) -> Any:
    """A rollout sampled on the sampler's own devices
    (``rl.sampler_devices``) moved to the trainer's, split as its batch;
    else as it is. Several processes: each process's rows are on its own
    devices in both meshes, so each moves its block (``jax.device_put``
    cannot move arrays between device sets that span processes)."""
    if self.sample_mesh is None:
      return rollout
    where = lambda x: sharding_lib.batch_sharding(self.mesh, x.ndim)  # noqa: E731
    if self.group.single:
      return jax.device_put(rollout, jax.tree.map(where, rollout))
    return jax.tree.map(lambda x: self.group.global_array(
        self.group.local_rows(x), self.mesh), rollout)

  def _host_rows(self, x: Any) -> np.ndarray:
    """Every row of a batch array on the host (gathered from the processes'
    blocks of a global array)."""
    if (self.group.single or isinstance(x, np.ndarray)
        or x.is_fully_addressable):
      return np.asarray(x)
    # Whatever its sharding (a padded round's cut rows are not split by
    # process blocks): the global value.
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def _device_rows(self, x: Any) -> Any:
    """A host array of every row (a merged batch's rewards, its trained
    rows) as the global array whose blocks the processes hold; a device
    array, or anything on one process, as it is."""
    if self.group.single or x is None or not isinstance(x, np.ndarray):
      return x
    return self.group.global_array(
        x[self.group.rows(self.mesh, len(x))], self.mesh)


__all__ = ["ProcessBlocks"]
