"""Device meshes, logical-axis rules and the helpers that apply them.

Every parameter of an rljax model carries *logical* axis names (``embed``,
``mlp``, ``heads``, ``kv_heads``, ``head_dim``, ``vocab``); activations use
``batch``, ``length`` and the same names. One table of rules maps logical names
onto the physical mesh axes ``data``, ``fsdp`` and ``tensor``:

* ``data``: pure data parallelism (batch split, parameters replicated);
* ``fsdp``: batch split *and* parameters sharded along ``embed`` (ZeRO-3);
* ``tensor``: Megatron-style tensor parallelism over heads, MLP and vocab.

Any axis may have size 1, so the same program runs on one CPU device, on eight
simulated CPU devices or on a pod slice.

Example:
  >>> import jax
  >>> from rljax import sharding
  >>> mesh = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  >>> mesh.shape
  {'data': 1, 'fsdp': 1, 'tensor': 1}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# A rule maps one logical axis name to a mesh axis, a tuple of mesh axes, or
# None (replicated). Rules are tuples so that they are hashable and can sit in
# frozen configs.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("cache_length", None),
    ("lora_rank", None),  # LoRA adapters' inner axis (models/lora.py)
    # Activations: the hidden width stays whole on each device; heads/mlp
    # activations follow the tensor axis of their weights.
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; ``-1`` for at most one axis means "the rest".

  Attributes:
    data: data-parallel replicas.
    fsdp: fully-sharded data-parallel shards.
    tensor: tensor-parallel shards.
  """

  data: int = 1
  fsdp: int = -1
  tensor: int = 1


def _resolve_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  for name, size in sizes.items():
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(
          f"mesh.{name}={size!r} is invalid: accepted values are positive "
          "integers, or -1 for 'all remaining devices'.")
  wildcard = [name for name, size in sizes.items() if size == -1]
  if len(wildcard) > 1:
    raise ValueError(
        f"mesh axes {wildcard} are all -1: at most one axis may be -1.")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  resolved = dict(sizes)
  if wildcard:
    if num_devices % fixed:
      raise ValueError(
          f"mesh axes {dict(sizes)} cannot fill {num_devices} devices: the "
          f"fixed axes multiply to {fixed}, which does not divide {num_devices}.")
    resolved[wildcard[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(
        f"mesh axes {dict(sizes)} multiply to {fixed} but {num_devices} "
        "devices are in use: make the product equal the device count, or set "
        "one axis to -1.")
  return resolved


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """Builds a ``(data, fsdp, tensor)`` mesh with automatic (GSPMD) axes.

  Args:
    data: size of the ``data`` axis.
    fsdp: size of the ``fsdp`` axis; ``-1`` takes the remaining devices.
    tensor: size of the ``tensor`` axis.
    devices: devices to use; all of ``jax.devices()`` by default.

  Returns:
    A ``jax.sharding.Mesh`` with axis names ``('data', 'fsdp', 'tensor')``.

  Raises:
    ValueError: if the sizes do not multiply to the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = _resolve_sizes(
      {"data": data, "fsdp": fsdp, "tensor": tensor}, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  device_array = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(
      device_array, MESH_AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(config: Any, *, devices=None) -> Mesh:
  """Builds a mesh from any object with ``data``/``fsdp``/``tensor`` fields."""
  get = (config.get if isinstance(config, Mapping) or hasattr(config, "get")
         else lambda k, d: getattr(config, k, d))
  return make_mesh(
      int(get("data", 1)), int(get("fsdp", -1)), int(get("tensor", 1)),
      devices=devices)


def merge_rules(overrides: Mapping[str, Any] | Rules | None = None,
                base: Rules = DEFAULT_RULES) -> Rules:
  """Returns ``base`` with the entries of ``overrides`` replaced or added."""
  if not overrides:
    return base
  overrides = dict(overrides)
  for name, target in overrides.items():
    targets = target if isinstance(target, (tuple, list)) else (target,)
    for t in targets:
      if t is not None and t not in MESH_AXES:
        raise ValueError(
            f"logical rule {name!r} -> {target!r}: mesh axis {t!r} is unknown; "
            f"accepted: {MESH_AXES} or None.")
  merged = [(k, overrides.pop(k) if k in overrides else v) for k, v in base]
  merged += [(k, tuple(v) if isinstance(v, list) else v)
             for k, v in overrides.items()]
  return tuple(merged)


def logical_to_spec(
    logical_axes: Sequence[str | None] | None,
    rules: Rules = DEFAULT_RULES,
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
  """Maps logical axis names to a ``PartitionSpec`` over mesh axes.

  A mesh axis is used at most once per array (the first logical axis claiming
  it wins). When ``shape`` and ``mesh`` are given, mesh axes that do not divide
  the dimension are dropped, so e.g. 2 kv heads on ``tensor=4`` replicate
  instead of failing.

  Args:
    logical_axes: one logical name (or None) per array dimension.
    rules: logical-to-mesh table.
    shape: optional array shape, for the divisibility check.
    mesh: optional mesh, for the divisibility check.

  Returns:
    The ``PartitionSpec``.
  """
  if logical_axes is None:
    return PartitionSpec()
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(
          f"logical axis {name!r} has no rule; known logical axes: "
          f"{sorted(table)}. Add it with sharding.merge_rules({{{name!r}: ...}}).")
    target = table[name]
    targets = (() if target is None else
               (target,) if isinstance(target, str) else tuple(target))
    kept = []
    size = None if shape is None else shape[dim]
    for axis in targets:
      if axis in used:
        continue
      if mesh is not None and size is not None:
        axis_size = mesh.shape[axis]
        prod = math.prod(mesh.shape[a] for a in kept) * axis_size
        if size % prod:
          continue
      kept.append(axis)
      used.add(axis)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def _is_axes_leaf(x) -> bool:
  return isinstance(x, PartitionSpec) or (
      isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def logical_to_sharding(axes_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                        shapes: Any = None) -> Any:
  """Maps a tree of logical axis tuples to a tree of ``NamedSharding``.

  Args:
    axes_tree: pytree whose leaves are tuples (or ``PartitionSpec``s) of
      logical axis names, e.g. from ``rljax.models.param_logical_axes``.
    mesh: the device mesh.
    rules: logical-to-mesh table.
    shapes: optional matching pytree of arrays or ``ShapeDtypeStruct``s; when
      given, mesh axes that do not divide a dimension are dropped.

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``axes_tree``.
  """
  if shapes is None:
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_spec(tuple(axes), rules)),
        axes_tree, is_leaf=_is_axes_leaf)
  return jax.tree.map(
      lambda axes, x: NamedSharding(
          mesh, logical_to_spec(tuple(axes), rules, shape=x.shape, mesh=mesh)),
      axes_tree, shapes, is_leaf=_is_axes_leaf)


def shard_params(params: Any, axes_tree: Any, mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> Any:
  """Places ``params`` on ``mesh`` as their logical axes and ``rules`` say."""
  shardings = logical_to_sharding(axes_tree, mesh, rules, shapes=params)
  return jax.device_put(params, shardings)


def put_global(tree: Any, shardings: Any) -> Any:
  """``tree``, a value every process holds whole (host arrays, or arrays on
  one of its own devices), placed as ``shardings`` say, also where they
  span devices of other processes: each process builds its own shards
  from its copy (``jax.make_array_from_callback``). ``jax.device_put``
  refuses such shardings; on one process this is ``jax.device_put``."""

  def put(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])

  return jax.tree.map(put, tree, shardings)


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = DEFAULT_RULES,
                   ) -> NamedSharding:
  """Sharding of an array whose leading axis is the batch (rest replicated)."""
  return NamedSharding(
      mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def check_batch_divisible(batch_size: int, mesh: Mesh, field: str = "batch",
                          rules: Rules = DEFAULT_RULES) -> None:
  """Raises a clear error if ``batch_size`` does not split over the batch axes."""
  target = dict(rules).get("batch")
  axes = () if target is None else (target,) if isinstance(target, str) else target
  ways = math.prod(mesh.shape[a] for a in axes)
  if batch_size % ways:
    raise ValueError(
        f"{field}={batch_size} does not divide over the mesh batch axes "
        f"{tuple(axes)} of total size {ways}: use a multiple of {ways}.")


def shard_batch(batch: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """Places every array of ``batch`` with its leading axis split over the batch axes."""
  def put(x):
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    check_batch_divisible(x.shape[0], mesh, rules=rules)
    return jax.device_put(x, batch_sharding(mesh, x.ndim, rules))
  return jax.tree.map(put, batch)


def constrain(x: jax.Array, logical_axes: Sequence[str | None],
              rules: Rules = DEFAULT_RULES) -> jax.Array:
  """Constrains an activation's sharding by logical axis names.

  A no-op when no mesh is active (``jax.set_mesh``) or the mesh has a single
  device, so model code can call it unconditionally.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  spec = logical_to_spec(tuple(logical_axes), rules, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, spec)


def whole_on_each_device(fn: Any) -> Any:
  """``fn`` computed whole on every device of the active mesh: its
  arguments gathered once, its results replicated, no collective inside.

  For bookkeeping on small arrays that every row's step reads (a paged KV
  cache's block tables and free list, ``rljax/models/paged_cache.py``):
  laid out across devices by the compiler, each of its scatters and scans
  would gather its operands, a collective per op, which between processes
  costs more than the work. A no-op without a mesh, on one device, or
  inside a ``shard_map`` already (every axis manual).
  """
  def call(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
      return fn(*args)
    return jax.shard_map(fn, in_specs=PartitionSpec(),
                         out_specs=PartitionSpec(), check_vma=False)(*args)
  return call


def batch_ways(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
  """How many ways the mesh's batch axes split a batch's rows."""
  target = dict(rules).get("batch")
  axes = () if target is None else (target,) if isinstance(target, str) else target
  return math.prod(mesh.shape[a] for a in axes)


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A key path as names (dict keys, attribute names, sequence indices)."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(
      k, "idx", k)))) for k in path)


def shardings_like_params(tree: Any, params: Any, mesh: Mesh) -> Any:
  """Shardings for ``tree`` (arrays or ``jax.ShapeDtypeStruct``s; an
  optimizer or training state): a leaf whose key path ends with a leaf of
  ``params``'s path, with the same shape, takes that param's sharding (an
  Adam moment is sharded as its param); every other leaf (counts, keys,
  factored statistics) is replicated.

  ``jax.jit`` does not propagate a param's sharding to the zeros that an
  optimizer's ``init`` builds from it (they read no data of the param), so
  without this the moments of a fully sharded model are replicated on
  every device.
  """
  by_path = {_path_names(p): x for p, x in
             jax.tree_util.tree_flatten_with_path(params)[0]}
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    names = _path_names(path)
    for i in range(len(names)):  # the longest matching suffix first
      param = by_path.get(names[i:])
      if param is not None and tuple(param.shape) == tuple(leaf.shape):
        return param.sharding
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)


def init_like_params(init: Any, params: Any, mesh: Mesh, *args: Any) -> Any:
  """``jax.jit(init)(params, *args)`` with its outputs sharded by
  ``shardings_like_params``: an optimizer's (or a ``TrainState``'s) fresh
  state, each moment sharded as its param. A checkpoint restored into this
  state then has the shardings the step's outputs have, so a resumed run
  runs the same compiled step as an uninterrupted one."""
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(init, params, *args)
    return jax.jit(init, out_shardings=shardings_like_params(
        shapes, params, mesh))(params, *args)
