"""Several processes, one run: the loop on ``jax.distributed`` (multi-controller SPMD).

One process per host, one global mesh (docs/multihost.md). Every process
runs the same program; what differs is the data each holds:

* **Rows.** The mesh's batch axes split a batch's rows into equal,
  contiguous blocks, one per process (``ProcessGroup.block``; a mesh whose
  batch axes do not give each process its own block is refused). Process
  ``p`` reads the prompts of its block, builds the global arrays from them
  (``global_array``), and decodes and scores only its rows (``local_rows``).
  What the metrics need of the other blocks (rewards, lengths, small per-row
  arrays) is gathered in row order (``gather_rows``), so every figure is
  computed from the same global arrays as in one process.
* **Decisions.** Anything that chooses a code path (a draft exists, a
  checkpoint reads back) is agreed on collectively (``any``, ``all``), so no
  process waits in a collective another one skipped.
* **Files.** Process 0 (``primary``) writes the run directory's files; every
  process joins orbax's checkpoint saves and restores.

With one process every method is the identity (or a local computation) and
nothing is communicated, so the single-host path is unchanged.

``initialize`` starts ``jax.distributed`` with a heartbeat timeout: when a
process dies, the others stop within that time with an error naming it
(``The following tasks are unhealthy (stopped sending heartbeats): <id>``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rljax import sharding as sharding_lib

log = logging.getLogger("rljax")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               *, heartbeat_timeout_s: int = 60,
               initialization_timeout_s: int = 300) -> None:
  """Starts ``jax.distributed`` (before any other JAX call of the process).

  With no address, count and id, ``jax.distributed`` detects the cluster
  (TPU pod slices, SLURM, Open MPI); on one machine or an unknown cluster,
  give all three. CPU processes communicate through gloo.

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: processes in the run.
    process_id: this process's id, ``0 <= process_id < num_processes``.
    heartbeat_timeout_s: a process silent this long is declared dead and the
      others stop with an error naming it.
    initialization_timeout_s: how long to wait for every process to join.

  Raises:
    ValueError: when only some of address, count and id are given, or they
      are out of range.
  """
  given = {"coordinator_address": coordinator_address,
           "num_processes": num_processes, "process_id": process_id}
  if any(v is not None for v in given.values()) and any(
      v is None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    raise ValueError(
        f"--coordinator_address, --num_processes and --process_id go "
        f"together: {given} lacks {missing}. Give all three, or none to let "
        "jax.distributed detect the cluster (TPU pod, SLURM, Open MPI).")
  if num_processes is not None and not (
      num_processes >= 1 and 0 <= process_id < num_processes):
    raise ValueError(f"--process_id={process_id} with --num_processes="
                     f"{num_processes}: need 0 <= process_id < num_processes.")
  if heartbeat_timeout_s < 1:
    raise ValueError(f"--heartbeat_timeout_s={heartbeat_timeout_s}: a "
                     "positive number of seconds is required.")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address, num_processes, process_id,
      initialization_timeout=initialization_timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
      shutdown_timeout_seconds=heartbeat_timeout_s)
  log.info("process %d of %d: %d local of %d devices", jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


class ProcessGroup:
  """This process's place in the run, and the collectives the loop needs.

  Args:
    index: ``jax.process_index()`` (default).
    count: ``jax.process_count()`` (default).
  """

  def __init__(self, index: int | None = None, count: int | None = None):
    self.index = jax.process_index() if index is None else index
    self.count = jax.process_count() if count is None else count
    self._blocks: dict[Any, tuple[int, int]] = {}
    self._owners: dict[Any, list[int]] = {}  # block k -> process index
    # Host-side collectives of this process: how many, and their wall clock.
    self.collectives = {"count": 0, "seconds": 0.0}

  @property
  def primary(self) -> bool:
    """Whether this process writes the run directory's files."""
    return self.index == 0

  @property
  def single(self) -> bool:
    return self.count == 1

  # --- rows -----------------------------------------------------------------

  def block(self, mesh: jax.sharding.Mesh,
            rules: sharding_lib.Rules = sharding_lib.DEFAULT_RULES
            ) -> tuple[int, int]:
    """``(k, K)``: this process holds block ``k`` of ``K`` equal, contiguous
    blocks of every batch's rows (``(0, 1)`` with one process).

    Raises:
      ValueError: when the mesh's batch axes do not split the rows into one
        block per process (e.g. the batch is replicated across hosts).
    """
    if self.single:
      return 0, 1
    key = (mesh, rules)
    if key not in self._blocks:
      ways = sharding_lib.batch_ways(mesh, rules)
      spec = sharding_lib.batch_sharding(mesh, 1, rules)
      rows = sorted({idx[0].start or 0 for d, idx in
                     spec.devices_indices_map((ways,)).items()
                     if d.process_index == self.index})
      per = ways // self.count if ways % self.count == 0 else 0
      if (not per or len(rows) != per
          or rows != list(range(rows[0], rows[0] + per)) or rows[0] % per):
        raise ValueError(
            f"mesh {dict(mesh.shape)} with batch axes over {ways} shards: "
            f"process {self.index} holds batch shards {rows}, not one "
            f"contiguous block of {ways}/{self.count}. With several "
            "processes the batch axes (mesh.data x mesh.fsdp) must be a "
            "multiple of the process count and split across hosts; put the "
            "tensor axis within a host.")
      blocks = self.gather_json(rows[0] // per)
      if sorted(blocks) != list(range(self.count)):
        raise ValueError(f"processes hold batch blocks {blocks}: each block "
                         "must belong to exactly one process.")
      self._blocks[key] = (rows[0] // per, self.count)
      self._owners[key] = [blocks.index(k) for k in range(self.count)]
    return self._blocks[key]

  def rows(self, mesh: jax.sharding.Mesh, num_rows: int) -> slice:
    """This process's rows of a batch of ``num_rows``."""
    k, n = self.block(mesh)
    if num_rows % n:
      raise ValueError(f"{num_rows} rows do not split into {n} process "
                       "blocks: use a multiple of the process count.")
    per = num_rows // n
    return slice(k * per, (k + 1) * per)

  def global_array(self, local: np.ndarray, mesh: jax.sharding.Mesh) -> Any:
    """The global batch whose block of rows this process holds as ``local``
    (leading axis split over the mesh's batch axes). One process: ``local``
    itself (the jitted function places it)."""
    if self.single:
      return local
    _, n = self.block(mesh)
    shape = (local.shape[0] * n,) + local.shape[1:]
    return jax.make_array_from_process_local_data(
        sharding_lib.batch_sharding(mesh, local.ndim), local, shape)

  def local_rows(self, x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded array, on the host."""
    if self.single or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    pieces = {}
    for shard in x.addressable_shards:
      start = shard.index[0].start or 0
      if start not in pieces:
        pieces[start] = np.asarray(shard.data)
    return np.concatenate([pieces[s] for s in sorted(pieces)])

  # --- collectives (host values) --------------------------------------------

  def _allgather(self, x: np.ndarray) -> np.ndarray:
    start = time.perf_counter()
    out = np.asarray(multihost_utils.process_allgather(np.asarray(x)))
    self.collectives["count"] += 1
    self.collectives["seconds"] += time.perf_counter() - start
    return out

  def gather_rows(self, local: np.ndarray, mesh: jax.sharding.Mesh
                  ) -> np.ndarray:
    """Every process's ``local`` rows, concatenated in row order."""
    if self.single:
      return np.asarray(local)
    local = np.asarray(local)
    if local.dtype == bool:
      return self.gather_rows(local.astype(np.uint8), mesh).astype(bool)
    self.block(mesh)
    stacked = self._allgather(local)
    owners = self._owners[(mesh, sharding_lib.DEFAULT_RULES)]
    return np.concatenate([stacked[p] for p in owners])

  def gather_json(self, value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, by process index."""
    if self.single:
      return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = self._allgather(np.asarray([data.size], np.int64))[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    stacked = self._allgather(padded)
    return [json.loads(bytes(stacked[i, :sizes[i]]).decode())
            for i in range(self.count)]

  def gather_blocks(self, value: Any, mesh: jax.sharding.Mesh) -> list[Any]:
    """Every process's JSON-able ``value``, in the order of their blocks of
    rows (``block``): a batch's per-row lists concatenate to the global
    batch's."""
    if self.single:
      return [value]
    self.block(mesh)
    gathered = self.gather_json(value)
    return [gathered[p] for p in self._owners[(mesh,
                                               sharding_lib.DEFAULT_RULES)]]

  def max_int(self, value: int) -> int:
    """The largest of the processes' ``value`` (one collective)."""
    if self.single:
      return int(value)
    return int(self._allgather(np.asarray([value], np.int64)).max())

  def any(self, flag: bool) -> bool:
    """Whether ``flag`` holds on some process (one collective)."""
    if self.single:
      return bool(flag)
    return bool(self._allgather(np.asarray([flag], np.uint8)).any())

  def all(self, flag: bool) -> bool:
    """Whether ``flag`` holds on every process (one collective)."""
    if self.single:
      return bool(flag)
    return bool(self._allgather(np.asarray([flag], np.uint8)).all())

  def from_primary(self, value: Any) -> Any:
    """Process 0's JSON-able ``value``, on every process."""
    return value if self.single else self.gather_json(value)[0]

  def barrier(self, name: str) -> None:
    """Waits until every process reaches the barrier ``name``."""
    if not self.single:
      multihost_utils.sync_global_devices(name)

  def raise_any(self, error: str | None) -> None:
    """Raises on every process when some process has an ``error`` (its
    message), so that a failure at start stops all of them alike."""
    errors = self.gather_json(error)
    for i, message in enumerate(errors):
      if message:
        prefix = "" if self.single else f"process {i}: "
        raise RuntimeError(prefix + message)

  def check_same_config(self, config: Mapping[str, Any]) -> None:
    """Fails on every process when the processes' configs differ, naming
    the first differing field and both values.

    Raises:
      ValueError: naming the field, process 0's value and the other's.
    """
    if self.single:
      return
    flat = _flatten(config)
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True,
                                       default=str).encode()).hexdigest()
    digests = self.gather_json(digest)
    if len(set(digests)) == 1:
      return
    configs = self.gather_json({k: repr(v) for k, v in flat.items()})
    reference = configs[0]
    for i, other in enumerate(configs[1:], start=1):
      for field in sorted(set(reference) | set(other)):
        if reference.get(field) != other.get(field):
          raise ValueError(
              f"the processes were started with different configs: field "
              f"{field} is {reference.get(field, '<absent>')} on process 0 "
              f"and {other.get(field, '<absent>')} on process {i}. Start "
              "every process with the same --config and overrides.")


def gather_rows_many(group: ProcessGroup, mesh: jax.sharding.Mesh,
                     *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
  """``group.gather_rows`` of several arrays of the same row count, in one
  collective (packed as float64 columns: exact for bool, int32 and float32
  values, NaN included)."""
  if group.single:
    return tuple(np.asarray(a) for a in arrays)
  arrays = [np.asarray(a) for a in arrays]
  n = arrays[0].shape[0]
  if any(a.shape[0] != n for a in arrays):
    raise ValueError(f"gather_rows_many: row counts {[a.shape[0] for a in arrays]}"
                     " differ; gather arrays of different row counts apart.")
  columns = [a.reshape(n, -1).astype(np.float64) for a in arrays]
  packed = group.gather_rows(np.concatenate(columns, axis=1), mesh)
  out, start = [], 0
  for a, c in zip(arrays, columns):
    width = c.shape[1]
    part = packed[:, start:start + width].reshape((-1,) + a.shape[1:])
    out.append(part.astype(a.dtype))
    start += width
  return tuple(out)


def local_rows_many(group: ProcessGroup, *arrays: jax.Array
                    ) -> tuple[np.ndarray, ...]:
  """``group.local_rows`` of several arrays (one transfer with one process)."""
  if group.single:
    return tuple(np.asarray(a) for a in jax.device_get(arrays))
  return tuple(group.local_rows(a) for a in arrays)


__all__ = ["ProcessGroup", "initialize", "gather_rows_many",
           "local_rows_many"]
