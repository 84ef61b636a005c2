"""Creating policy parameters: logical axes, abstract shapes, sharded init.

Initialisation is sharded from the start: ``jax.eval_shape`` gives the
parameter shapes and logical axes without allocating anything, the rules turn
those into shardings, and ``jax.jit(init, out_shardings=...)`` materialises
each shard directly on its device. A model larger than one device's memory can
therefore be created.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import sharding
from rljax.models import lora as lora_lib
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


def _float_lora(config: ModelConfig) -> ModelConfig:
  """``config`` with float kernels (the adapters' shapes are the same)."""
  return config.replace(lora=dataclasses.replace(config.lora,
                                                 quantize_base="none"))


def _init_adapters(config: ModelConfig, key: jax.Array) -> Any:
  return lora_lib.adapters_of(nn.meta.unbox(_init_boxed(_float_lora(config),
                                                        key)))


def _init_all(config: ModelConfig, key: jax.Array) -> Any:
  """The base of ``config.without_lora()`` from ``key`` (the values a model
  without adapters gets), then, with ``config.lora``, its int8 layout and
  fresh adapters from ``fold_in(key, 1)``."""
  base = nn.meta.unbox(_init_boxed(config.without_lora(), key))
  if config.lora is None:
    return base
  if config.lora.quantize_base == "int8":
    base = lora_lib.quantize_params(base)
  return lora_lib.merge(base, _init_adapters(config,
                                             jax.random.fold_in(key, 1)))


def init_params(config: ModelConfig, key: jax.Array, mesh: Mesh | None = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> Any:
  """Initialises the params, each created directly with its final sharding.

  With ``config.lora`` the base is what ``config.without_lora()`` gets from
  ``key`` (int8 with ``quantize_base``) and the adapters are fresh
  (``init_adapters`` with ``fold_in(key, 1)``).

  Args:
    config: the model config.
    key: PRNG key.
    mesh: device mesh; ``None`` places everything on the default device.
    rules: logical-to-mesh rules.

  Returns:
    The params pytree (plain arrays; logical axes from ``param_logical_axes``).
  """
  init = functools.partial(_init_all, config)
  if mesh is None:
    return jax.jit(init)(key)
  return jax.jit(init, out_shardings=param_shardings(config, mesh, rules))(key)


def init_adapters(config: ModelConfig, key: jax.Array, mesh: Mesh | None = None,
                  rules: sharding.Rules = sharding.DEFAULT_RULES) -> Any:
  """Fresh adapters of ``config.lora`` alone (``A`` random, ``B`` zero), each
  created with its sharding; ``lora.merge(base, adapters)`` attaches them.

  Only the adapters are computed: the rest of the init is dead code that the
  compiler drops.
  """
  if config.lora is None:
    raise ValueError("init_adapters: config.lora is None (no adapters).")
  init = functools.partial(_init_adapters, config)
  if mesh is None:
    return jax.jit(init)(key)
  shardings = lora_lib.adapters_of(param_shardings(config, mesh, rules))
  return jax.jit(init, out_shardings=shardings)(key)


def attach_base(base: Any, config: ModelConfig, key: jax.Array,
                mesh: Mesh | None = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> Any:
  """Params of ``config`` from a float base of ``config.without_lora()`` (an
  SFT result, a Hugging Face checkpoint): int8 where ``quantize_base`` says,
  plus fresh adapters from ``key``. ``base`` itself is returned without
  ``config.lora``."""
  if config.lora is None:
    return base
  if config.lora.quantize_base == "int8":
    quantize = lora_lib.quantize_params
    if mesh is not None:
      shardings = lora_lib.split(param_shardings(config, mesh, rules))[1]
      quantize = jax.jit(quantize, out_shardings=shardings)
    else:
      quantize = jax.jit(quantize)
    base = quantize(base)
  return lora_lib.merge(base, init_adapters(config, key, mesh, rules))


def count_params(params: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
