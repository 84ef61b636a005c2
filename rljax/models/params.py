"""Creating policy parameters: logical axes, abstract shapes, sharded init.

Initialisation is sharded from the start: ``jax.eval_shape`` gives the
parameter shapes and logical axes without allocating anything, the rules turn
those into shardings, and ``jax.jit(init, out_shardings=...)`` materialises
each shard directly on its device. A model larger than one device's memory can
therefore be created.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import sharding
from rljax.models.config import ModelConfig
from rljax.models.transformer import Decoder


def _init_boxed(config: ModelConfig, key: jax.Array):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Decoder(config).init(key, tokens, tokens)["params"]


def _abstract_key() -> jax.ShapeDtypeStruct:
  """A key's shape and dtype only: shapes never depend on its value."""
  return jax.eval_shape(jax.random.key, jax.ShapeDtypeStruct((), jnp.uint32))


def param_logical_axes(config: ModelConfig) -> Any:
  """Pytree (like the params) of tuples of logical axis names."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, config),
                         _abstract_key())
  specs = nn.get_partition_spec(boxed)
  return jax.tree.map(tuple, specs,
                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def param_shapes(config: ModelConfig) -> Any:
  """Pytree of ``jax.ShapeDtypeStruct`` of the params (nothing allocated)."""
  boxed = jax.eval_shape(functools.partial(_init_boxed, config),
                         _abstract_key())
  return nn.meta.unbox(boxed)


def param_shardings(config: ModelConfig, mesh: Mesh,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> Any:
  """Pytree of ``NamedSharding`` that the rules give each parameter."""
  return sharding.logical_to_sharding(
      param_logical_axes(config), mesh, rules, shapes=param_shapes(config))


def init_params(config: ModelConfig, key: jax.Array, mesh: Mesh | None = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> Any:
  """Initialises the params, each created directly with its final sharding.

  Args:
    config: the model config.
    key: PRNG key.
    mesh: device mesh; ``None`` places everything on the default device.
    rules: logical-to-mesh rules.

  Returns:
    The params pytree (plain arrays; logical axes from ``param_logical_axes``).
  """
  def init(k):
    return nn.meta.unbox(_init_boxed(config, k))
  if mesh is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=param_shardings(config, mesh, rules))(key)


def count_params(params: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
