"""Padding-free RL steps: the host plans how each microbatch's rows pack.

``rl.padding_free=True`` (the default) wraps the jitted step in
``PaddingFree``: before each call it reads the batch's input mask (and, when
the step shuffles, the state's key) and builds a ``StepPlan``: the rows of
every update's microbatches, in the order the step itself would draw
(``steps.update_order``), and each microbatch's ``models.Packing`` into
``Bp`` buffers of ``k L`` slots, ``k`` = 1 or ``BUFFER_ROWS`` = 2 rows'
length. Every forward pass of the step (the
trained policy's, ``pi_old``'s recompute, the reference's, the teacher's and
the critic's) then runs on the buffers (``models/packing.py``); the loss terms
read the same per-token values as the padded step, in the rows' layout, so
every aggregation mode, normaliser, the microbatch accumulation and the
minibatch split are the padded step's, exactly.

Shapes. A row never exceeds ``L``, so ``k`` rows always fit a buffer of
``k L`` and first-fit needs at most ``ceil(M / k)`` buffers for a microbatch
of ``M`` rows. ``Bp`` is the most buffers any microbatch needs, rounded up to
a bucket, a multiple of ``ceil(M / k / n)`` for ``n = rl.packing_buckets``
(8 by default; and of the mesh's batch shards): a run compiles at most
``n`` step programs per ``k``, whatever its lengths. The rounding leaves
up to ``ceil(M / k / n) - 1`` buffers empty: more buckets fill the buffers
closer to the real tokens (``n >= M / k``: exactly the buffers first-fit
needs) at the cost of more programs.

Cost. The decoder's token-wise work (projections, MLP, norms) runs on
``Bp * k L`` slots instead of ``M L``; attention on buffers of ``k L`` slots
costs (and, without rematerialisation, keeps) ``k`` times a padded row's per
slot (block-diagonal, computed dense). So ``k = 2`` is chosen only when it
saves slots: rows longer than ``L / 2`` (full-length rows) pack one to a
buffer of ``L``, which is the padded step's shape and memory. The output
projection and the losses run on the scored columns in the rows' layout, as
padded.

The microbatch split. By default it is the padded step's: consecutive rows
of the (shuffled) minibatch, so a microbatch holding the batch's longest rows
sets ``Bp`` for all. ``rl.microbatch_tokens`` > 0 splits each minibatch by
tokens instead (verl's dynamic batch size, ``use_dynamic_bsz``): into the
fewest microbatches, at least ``rl.num_microbatches``, whose real tokens stay
within the budget, the rows spread so every microbatch holds about the same
number of tokens (``balanced_split``; verl's sequence-length balanced
partitions). The minibatches and their normalisers do not change, so neither
does the loss (up to float summation order); only what is computed per
microbatch does: the coefficient chain's calls and ``rl.ess_pooling=
microbatch``'s ESS see the regrouped rows. Short rows then train in fewer,
fuller microbatches; long ones in more, so a microbatch's memory stays
bounded by the budget (a microbatch may exceed it only when it cannot be
split further: one row, or one per batch shard of the mesh). The count of
microbatches is part of the program's shape: a run compiles one program per
count it meets (a divisor of the minibatch's rows) and ``Bp`` bucket.
"""

from __future__ import annotations

import functools
import heapq
from typing import Any, Callable

import jax
import numpy as np

from rljax.models import packing as packing_lib
from rljax.train.step_inputs import RLStepConfig, StepPlan

NUM_BUCKETS = 8
BUFFER_ROWS = 2  # a buffer holds this many rows' length (k L slots)


def bucket(needed: int, rows: int, multiple: int = 1,
           buckets: int = NUM_BUCKETS) -> int:
  """``Bp`` for ``needed`` buffers of a microbatch of ``rows`` rows: rounded
  up to a multiple of ``ceil(rows / buckets)`` (and of ``multiple``), at
  most ``rows`` rounded up to ``multiple``."""
  step = -(-rows // buckets)
  step = -(-step // multiple) * multiple
  top = -(-rows // multiple) * multiple
  return min(max(-(-needed // step) * step, step), top)


@functools.lru_cache(maxsize=None)
def _order_fn(cfg: RLStepConfig, n: int) -> Callable[[Any], Any]:
  from rljax.train import steps  # pylint: disable=g-import-not-at-top
  return jax.jit(lambda key_data: steps.update_order(cfg, key_data, n)[1])


def host_order(cfg: RLStepConfig, key_data: Any, n: int) -> np.ndarray:
  """``steps.update_order``'s ``[U, K, M]`` rows for ``key_data`` (the
  state's key), on the host."""
  m = n // (cfg.num_minibatches * cfg.num_microbatches)
  if cfg.num_updates == 1:
    return np.arange(n, dtype=np.int32).reshape(1, cfg.num_microbatches, m)
  return np.asarray(_order_fn(cfg, n)(np.asarray(key_data)), np.int32)


def _pack(masks: list[np.ndarray], row_multiple: int,
          buckets: int = NUM_BUCKETS) -> list[packing_lib.Packing]:
  """Each microbatch's ``Packing``, one shape for all: buffers of two rows'
  length only where they save slots (their attention costs more per slot),
  as many as the most any microbatch needs, bucketed."""
  m, length = masks[0].shape
  lengths = [x.sum(-1) for x in masks]
  placements = {rows: [packing_lib.first_fit(x, rows * length)
                       for x in lengths] for rows in (1, BUFFER_ROWS)}
  needed = {rows: max(int(b.max()) + 1 if len(b) else 0
                      for b, _ in placements[rows])
            for rows in placements}
  rows = BUFFER_ROWS if needed[BUFFER_ROWS] * BUFFER_ROWS < needed[1] else 1
  bp = bucket(needed[rows], -(-m // rows), row_multiple, buckets)
  return [packing_lib.pack_rows(x, bp, rows * length, placement=p)
          for x, p in zip(masks, placements[rows])]


def pack_microbatch(input_mask: np.ndarray, row_multiple: int = 1
                    ) -> packing_lib.Packing:
  """One batch's ``models.Packing``, planned as a step's microbatch (the SFT
  warm-up's batches)."""
  return _pack([np.asarray(input_mask, bool)], row_multiple)[0]


def balanced_split(lengths: np.ndarray, groups: int) -> np.ndarray:
  """``[groups, n / groups]`` indices of ``lengths``: groups of equal row
  count with about equal token sums (longest row first, each to the lightest
  group that still has room; ties to the lower group). Each group's rows are
  in ascending index order."""
  sizes = np.asarray(lengths, np.int64)
  n = len(sizes)
  if groups < 1 or n % groups:
    raise ValueError(f"balanced_split: {n} rows do not split into {groups} "
                     "groups of equal size.")
  room = n // groups
  heap = [(0, g) for g in range(groups)]
  members: list[list[int]] = [[] for _ in range(groups)]
  as_list = sizes.tolist()
  for i in np.argsort(-sizes, kind="stable").tolist():
    total, g = heapq.heappop(heap)
    members[g].append(i)
    if len(members[g]) < room:  # a full group leaves the heap
      heapq.heappush(heap, (total + as_list[i], g))
  return np.sort(np.asarray(members, np.int64).reshape(groups, room), -1)


def microbatch_counts(rows: int, minimum: int, row_multiple: int = 1
                      ) -> list[int]:
  """The microbatch counts a minibatch of ``rows`` rows may split into: the
  divisors ``>= minimum`` whose microbatches are a multiple of
  ``row_multiple`` rows (the mesh's batch shards), ascending."""
  counts = [d for d in range(max(minimum, 1), rows + 1)
            if rows % d == 0 and (rows // d) % row_multiple == 0]
  return counts or [minimum]


def split_by_tokens(order_UxKxM: np.ndarray, lengths: np.ndarray,
                    budget: int, row_multiple: int = 1) -> np.ndarray:
  """``rl.microbatch_tokens``: each update's minibatch (the rows of
  ``order_UxKxM[u]``) regrouped into the fewest microbatches, at least ``K``,
  whose real tokens (``lengths``) stay within ``budget``, tokens balanced
  across them (``balanced_split``). One count serves every update of the
  step (the most any needs), so the result is ``[U, K', M']``; when no count
  keeps every microbatch within the budget, the largest is used."""
  u, k, m = order_UxKxM.shape
  minibatches = order_UxKxM.reshape(u, k * m)
  counts = microbatch_counts(k * m, k, row_multiple)
  sizes = np.asarray(lengths, np.int64)[minibatches]  # [U, R]
  need = max(-(-int(sizes.sum(-1).max()) // budget), int(sizes.max() > 0))
  chosen = counts[-1]
  for count in counts:
    if count < need:
      continue
    if all(sizes[i][g].sum(-1).max() <= budget
           for i in range(u) for g in [balanced_split(sizes[i], count)]):
      chosen = count
      break
  split = np.stack([minibatches[i][balanced_split(sizes[i], chosen)]
                    for i in range(u)])
  return split.astype(np.int32)


def plan_step(cfg: RLStepConfig, input_mask_NxL: np.ndarray, key_data: Any,
              row_multiple: int = 1) -> StepPlan:
  """The ``StepPlan`` of one step (NumPy).

  Args:
    cfg: the step's settings (epochs, minibatches, microbatches).
    input_mask_NxL: the batch's real tokens.
    key_data: the state's key (``TrainState.key``); read only when the step
      shuffles (more than one update).
    row_multiple: ``Bp`` is a multiple of it (the mesh's batch shards);
      with ``cfg.microbatch_tokens`` so are the microbatches' rows.
  """
  mask = np.asarray(input_mask_NxL, bool)
  n, length = mask.shape
  if n % (cfg.num_minibatches * cfg.num_microbatches):
    raise ValueError(
        f"plan_step: {n} rows do not split into rl.num_minibatches="
        f"{cfg.num_minibatches} x rl.num_microbatches={cfg.num_microbatches}.")
  order = host_order(cfg, key_data, n)
  if cfg.microbatch_tokens:
    order = split_by_tokens(order, mask.sum(-1), cfg.microbatch_tokens,
                            row_multiple)
  u, k, m = order.shape
  packs = _pack([mask[order[i, j]] for i in range(u) for j in range(k)],
                row_multiple, cfg.packing_buckets)
  stacked = packing_lib.Packing(*[
      np.stack([p[f] for p in packs]).reshape(u, k, *packs[0][f].shape)
      for f in range(len(packing_lib.Packing._fields))])
  return StepPlan(order, stacked)


def fill_fraction(plan: StepPlan) -> float:
  """Real tokens over buffer slots of a plan (1 = no padding left)."""
  seg = plan.packing.segment_BpxLp
  return float(np.mean(np.asarray(seg) > 0))


class PaddingFree:
  """The jitted step, fed a ``StepPlan`` built on the host before each call.

  Args:
    step: from ``steps.jit_rl_step(..., packed=True)``.
    cfg: the step's settings.
    mesh: the step's mesh (``Bp`` is a multiple of its batch shards).
  """

  def __init__(self, step: Callable, cfg: RLStepConfig,
               mesh: jax.sharding.Mesh | None = None):
    self.step, self.cfg = step, cfg
    self.row_multiple = 1
    if mesh is not None:
      from rljax import sharding  # pylint: disable=g-import-not-at-top
      self.row_multiple = sharding.batch_ways(mesh)
    self.last_fill = None
    self.last_microbatches = None

  def plan(self, state: Any, batch: Any) -> StepPlan:
    mask = _host(batch.input_mask_NxL)
    key = _host(state.key) if self.cfg.num_updates > 1 else None
    plan = plan_step(self.cfg, mask, key, self.row_multiple)
    self.last_fill = fill_fraction(plan)
    self.last_microbatches = int(plan.order_UxKxM.shape[1])
    return plan

  def __call__(self, state: Any, batch: Any, *args: Any) -> Any:
    return self.step(state, batch._replace(plan=self.plan(state, batch)),
                     *args)


def _host(x: Any) -> np.ndarray:
  """A (possibly multi-process) array's whole value on this host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.is_fully_replicated:  # every process holds the whole value
      return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


__all__ = ["BUFFER_ROWS", "NUM_BUCKETS", "PaddingFree", "balanced_split",
           "bucket", "fill_fraction", "host_order", "microbatch_counts",
           "pack_microbatch", "plan_step", "split_by_tokens"]
