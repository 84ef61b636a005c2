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

from rljax import rewards as rewards_lib
from rljax import sharding as sharding_lib
from rljax.rollout.rounds import Sampled, distinct_completions


class ProcessBlocks:
  """Mixed into ``Collector``: needs ``group`` (``ProcessGroup``), ``mesh``,
  ``sample_mesh``, and for ``sample_global`` its ``sample_round``,
  ``slots``, ``episodes``, ``samples_per_prompt`` and ``_tree_metrics``."""

  def sample_global(self, params, examples, key, version, on_dispatch=None,
                    more_examples=None, **kwargs
                     ) -> Sampled:
    """``sample_round`` of a global batch of examples: this process samples
    and scores its block, and the result holds every process's examples
    and completions (rounds are planned and merged on the global batch;
    ``_finish`` keeps this process's completions). The reward failure
    counts include a padded row's (a copy of the last example's). Slots
    play the whole batch on every process (``more_examples``: the next
    global batch, for partial rollouts' over-provisioning)."""
    if self.group.single:
      return self.sample_round(params, examples, key, version, on_dispatch,
                               more_examples, **kwargs)
    if self.slots is not None:  # the slots play the whole batch
      sampled = self.sample_round(params, examples, key, version,
                                  on_dispatch, more_examples, whole=True,
                                  **kwargs)
      completions = self.group.gather_blocks(sampled.completions, self.mesh)
      return sampled._replace(examples=dict(examples), completions=[
          c for block in completions for c in block])
    # Prompt arrays split over the batch's shards: a count that does not
    # divide is padded with copies of the last example, whose rows are
    # dropped (as the static sampler pads on one process). Episodes play
    # each process's block (a count of examples that does not split into
    # the process blocks is refused by ProcessGroup.rows).
    n = len(examples["prompt"])
    pad = 0 if self.episodes is not None else -n % sharding_lib.batch_ways(
        self.mesh)
    padded = {f: list(v) + [v[-1]] * pad for f, v in examples.items()}
    sampled = self.sample_round(params, self.block(padded), key, version,
                                on_dispatch, None, real=n if pad else None,
                                **kwargs)
    completions = self.group.gather_blocks(sampled.completions, self.mesh)
    sampled = sampled._replace(examples=dict(examples), completions=[
        c for block in completions for c in block])
    if not pad:
      return sampled
    g = kwargs.get("samples") or self.samples_per_prompt
    rows = n * g
    cut = lambda x: None if x is None else x[:rows]  # noqa: E731
    r = sampled.result
    spec = dict(sampled.spec_metrics, **{  # the padding's groups left out
        "rollout/distinct_completions": distinct_completions(
            sampled.completions[:rows], g)})
    if sampled.rollout.tree_nodes is not None and self.episodes is None:
      nodes = self.group.gather_rows(self.group.local_rows(
          sampled.rollout.tree_nodes), self.mesh)
      spec.update(self._tree_metrics(kwargs.get("sampler"), nodes[:rows],
                                     sampled.lengths[:rows], g))
    return sampled._replace(spec_metrics=spec,
        rollout=jax.tree.map(cut, sampled.rollout),
        completions=sampled.completions[:rows],
        result=rewards_lib.merge_results(
            r.names, r.rewards_NxR[:rows], r.valid_NxR[:rows],
            r.total_N[:rows], [r.metrics]),
        rewards_NxR=cut(sampled.rewards_NxR), valid_N=cut(sampled.valid_N),
        lengths=cut(sampled.lengths), finished=cut(sampled.finished),
        prompt_tokens_N=cut(sampled.prompt_tokens_N),
        completion_tokens_N=cut(sampled.completion_tokens_N),
        token_versions=cut(sampled.token_versions))

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
