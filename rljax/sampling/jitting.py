"""Samplers jitted for a mesh: the rows split over its batch axes, the
prompts padded to a multiple of them and the padding's rows dropped.

``make_sampler`` is the static sampler's (``sampler.sample``); ``jit_rows``
jits any sampler of the same signature (the tree's, the paged one's), and
``mesh_shardings`` / ``pad_rows`` serve the speculative sampler's own
wrapper.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding
from rljax.models import ModelConfig
from rljax.sampling.sampler import Rollout, SamplerConfig, _sample_impl


class MeshShardings(NamedTuple):
  """The shardings of a sampler call on a mesh (``mesh_shardings``)."""

  batch2: Any
  batch1: Any
  replicated: Any
  rollout: Rollout
  ways: int  # how many ways the batch axes split the rows


def mesh_shardings(mesh: jax.sharding.Mesh, rules: Any,
                   config: SamplerConfig) -> MeshShardings:
  """Rows split over the mesh's batch axes; one ``Rollout`` of shardings."""
  batch2 = sharding.batch_sharding(mesh, 2, rules)
  batch1 = sharding.batch_sharding(mesh, 1, rules)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = Rollout(batch2, batch2, batch2, batch2, batch1, batch1,
                batch2 if config.record_policy_logprobs else None, batch2)
  axes = batch1.spec[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  ways = int(np.prod([mesh.shape[a] for a in axes]))
  return MeshShardings(batch2, batch1, replicated, out, ways)


def pad_rows(extra: int, *xs_BxP: jax.Array, block: int = 1):
  """Each array with its last ``block`` rows repeated ``extra`` times."""
  if not extra:
    return xs_BxP
  return tuple(jnp.concatenate([x, jnp.tile(x[-block:], (extra, 1))])
               for x in xs_BxP)


def make_sampler(model_config: ModelConfig, config: SamplerConfig,
                 mesh: jax.sharding.Mesh | None = None,
                 param_shardings: Any = None,
                 rules: sharding.Rules = sharding.DEFAULT_RULES):
  """A jitted ``fn(params, prompt_tokens_BxP, prompt_mask_BxP, key) -> Rollout``.

  With a mesh, shardings are explicit at the call site: params as
  ``param_shardings`` (e.g. ``models.param_shardings``), prompts and every
  rollout array split over the batch axes, the key replicated. A prompt count
  that does not divide over the batch axes is padded with copies of the last
  prompt, whose rows are dropped from the returned ``Rollout``; draws are
  keyed by row index (JAX's default partitionable threefry), so the real rows
  are those an unpadded call would sample.
  """
  fn = functools.partial(_sample_impl, model_config=model_config, config=config)
  return jit_rows(fn, config, mesh, param_shardings, rules)


def jit_rows(fn, config: SamplerConfig, mesh: jax.sharding.Mesh | None,
             param_shardings: Any = None,
             rules: sharding.Rules = sharding.DEFAULT_RULES, *,
             tree_nodes: bool = False, with_stats: bool = False):
  """``fn(params, prompt_tokens_BxP, prompt_mask_BxP, key[, row_multiple])
  -> Rollout`` jitted as ``make_sampler`` describes: on a mesh, with the
  prompts padded to a multiple of the batch ways and the padding's rows
  dropped. ``tree_nodes``: the ``Rollout`` has ``tree_nodes``;
  ``with_stats``: ``fn`` returns ``(Rollout, {name: scalar})``, the scalars
  replicated."""
  if mesh is None:
    return jax.jit(fn)
  s = mesh_shardings(mesh, rules, config)
  out = s.rollout._replace(tree_nodes=s.batch2) if tree_nodes else s.rollout
  if with_stats:
    out = (out, s.replicated)
  jitted = jax.jit(functools.partial(fn, row_multiple=s.ways),
                   in_shardings=(param_shardings, s.batch2, s.batch2,
                                 s.replicated),
                   out_shardings=out)

  def call(params, prompt_tokens_BxP, prompt_mask_BxP, key):
    b = prompt_tokens_BxP.shape[0]
    extra = -b % s.ways
    prompt_tokens_BxP, prompt_mask_BxP = pad_rows(
        extra, prompt_tokens_BxP, prompt_mask_BxP)
    with jax.set_mesh(mesh):
      rollout = jitted(params, prompt_tokens_BxP, prompt_mask_BxP, key)
    if extra:
      n = b * config.num_samples
      if with_stats:
        rollout = (jax.tree.map(lambda x: x[:n], rollout[0]), rollout[1])
      else:
        rollout = jax.tree.map(lambda x: x[:n], rollout)
    return rollout
  call.jitted = jitted
  return call


class MeteredSampler:
  """A sampler called as the static one, whose ``with_metrics`` also
  returns its figures: a paged pool's (``paged``, ``sampling.paged``), or
  any sampler's that returns them (``stats``: LATR's counts), none
  otherwise. ``tree``: a tree rollout's ``TreeConfig``, which tells the
  collector how to count its tokens."""

  def __init__(self, fn, *, paged: Any = None, tree: Any = None,
               stats: bool = False):
    self._fn, self.paged, self.tree = fn, paged, tree
    self._stats = stats or paged is not None
    self.jitted = getattr(fn, "jitted", fn)

  def __call__(self, params, prompt_tokens_BxP, prompt_mask_BxP, key):
    return self.with_metrics(params, prompt_tokens_BxP, prompt_mask_BxP,
                             key)[0]

  def with_metrics(self, params, prompt_tokens_BxP, prompt_mask_BxP, key
                   ) -> tuple[Rollout, dict[str, float]]:
    out = self._fn(params, prompt_tokens_BxP, prompt_mask_BxP, key)
    if not self._stats:
      return out, {}
    return out[0], {k: float(v) for k, v in jax.device_get(out[1]).items()}


__all__ = ["MeshShardings", "MeteredSampler", "jit_rows", "make_sampler",
           "mesh_shardings", "pad_rows"]
