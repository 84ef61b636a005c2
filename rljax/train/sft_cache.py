"""A directory of finished warm-ups: the same SFT is trained once.

A reward model, its policy, a DPO run and every seed of a benchmark often
start from the same warm-up (``sft.py``): the same initial parameters, the
same demonstrations, the same program. ``sft.cache_dir`` (or the
``RLJAX_SFT_CACHE`` environment variable, as ``JAX_COMPILATION_CACHE_DIR``
names JAX's compilation cache) keeps each finished warm-up's parameters and
its logged ``sft/*`` rows, under a key that covers everything they depend on:

- the initial parameters' values, the demonstrations' token arrays and the
  warm-up's settings (steps, rows, learning rate, seed, packing);
- the jitted step's program (StableHLO without locations: the model, the
  loss, the optimizer, the shapes and shardings) and the host code that
  draws and packs the batches (this module's, ``sft.py`` and
  ``train/packing.py``'s source);
- the platform: JAX's version, the devices, the mesh, the process count and
  ``XLA_FLAGS`` (code generation can move the last bits).

A later warm-up with the same key loads the parameters and writes the same
metric rows instead of training: bit for bit what training would have
given, since a program's result on CPU, GPU or TPU is a function of its
inputs. An entry is one ``.npz`` file written under a temporary name and
renamed when complete (a killed writer leaves no entry); an entry that does
not read back (truncated, not an archive, other shapes) is reported and
trained over. No pickle is involved: arrays are stored as raw bytes with
their dtype names.

With several processes every process computes the key from the gathered
parameters, process 0 writes the entry, and all of them load it only if
every one of them read it whole (``ProcessGroup.all``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import rljax
from rljax import distributed

log = logging.getLogger("rljax")

FORMAT = 1
ENV = "RLJAX_SFT_CACHE"
_SOURCES = ("sft.py", "packing.py", "sft_cache.py")


def cache_dir(configured: str) -> str:
  """``sft.cache_dir``, else ``$RLJAX_SFT_CACHE``, else "" (no cache)."""
  return configured or os.environ.get(ENV, "")


def _host(x: jax.Array) -> np.ndarray:
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _leaves(params: Any) -> tuple[list[str], list[Any]]:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def key(params: Any, cfg: Any, program_text: str,
        arrays: Sequence[np.ndarray], mesh: jax.sharding.Mesh,
        group: distributed.ProcessGroup) -> str:
  """The entry's name: a SHA-256 over what the warm-up's result depends on
  (the module docstring's list)."""
  h = hashlib.sha256()
  settings = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k != "cache_dir"}
  h.update(json.dumps({
      "format": FORMAT, "rljax": rljax.__version__, "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [d.device_kind for d in mesh.devices.flat],
      "mesh": dict(mesh.shape), "processes": group.count,
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "settings": settings},
                      sort_keys=True).encode())
  h.update(program_text.encode())
  here = os.path.dirname(os.path.abspath(__file__))
  for name in _SOURCES:
    with open(os.path.join(here, name), "rb") as f:
      h.update(f.read())
  names, leaves = _leaves(params)
  for name, leaf in zip(names, leaves):
    x = _host(leaf)
    h.update(f"{name}|{x.dtype.name}|{x.shape}".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  for x in arrays:
    x = np.ascontiguousarray(x)
    h.update(f"{x.dtype.name}|{x.shape}".encode())
    h.update(x.tobytes())
  return h.hexdigest()


def path(directory: str, entry: str) -> str:
  return os.path.join(directory, f"sft-{entry}.npz")


def save(directory: str, entry: str, params: Any, rows: list[dict],
         group: distributed.ProcessGroup) -> None:
  """Writes the entry (process 0; every process gathers its leaves)."""
  names, leaves = _leaves(params)
  host = [_host(x) for x in leaves]
  if group.primary:
    manifest = {"key": entry, "names": names,
                "dtypes": [x.dtype.name for x in host],
                "shapes": [list(x.shape) for x in host], "rows": rows}
    arrays = {f"a{i}": np.frombuffer(np.ascontiguousarray(x).tobytes(),
                                     np.uint8) for i, x in enumerate(host)}
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(),
                                       np.uint8)
    final = path(directory, entry)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:  # a cache that cannot be written costs the next run, not this one
      os.makedirs(directory, exist_ok=True)
      with open(tmp, "wb") as f:
        np.savez(f, **arrays)
      os.replace(tmp, final)
      log.info("sft: warm-up saved to the cache %s", final)
    except OSError as e:
      log.warning("sft: the warm-up was not cached in %s (%s: %s)",
                  directory, type(e).__name__, e)
  group.barrier("sft_cache_save")


def _read(file: str, entry: str, params: Any
          ) -> tuple[list[np.ndarray], list[dict]]:
  names, leaves = _leaves(params)
  with np.load(file, allow_pickle=False) as z:
    manifest = json.loads(bytes(z["manifest"]).decode())
    if manifest.get("key") != entry:
      raise ValueError(f"the entry's key is {manifest.get('key')!r}")
    if manifest["names"] != names:
      raise ValueError("its parameters are not this model's")
    out = []
    for i, (leaf, dtype, shape) in enumerate(zip(
        leaves, manifest["dtypes"], manifest["shapes"])):
      if (dtype, tuple(shape)) != (leaf.dtype.name, tuple(leaf.shape)):
        raise ValueError(f"{names[i]} is {dtype}{shape}, the model's "
                         f"{leaf.dtype.name}{list(leaf.shape)}")
      out.append(np.frombuffer(z[f"a{i}"].tobytes(),
                               np.dtype(leaf.dtype)).reshape(shape))
  return out, manifest["rows"]


def load(directory: str, entry: str, params: Any,
         group: distributed.ProcessGroup) -> tuple[Any, list[dict]] | None:
  """``(params, rows)`` of the entry ``entry`` (on ``params``' shardings),
  or None where it is missing or does not read back on some process."""
  file = path(directory, entry)
  found = None
  if os.path.exists(file):
    try:
      found = _read(file, entry, params)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
            json.JSONDecodeError) as e:
      log.warning("sft: the cached warm-up %s does not read back (%s: %s); "
                  "training it again", file, type(e).__name__, e)
  if not group.all(found is not None):
    return None
  arrays, rows = found
  treedef = jax.tree.structure(params)
  leaves = [jax.make_array_from_callback(x.shape, p.sharding,
                                         lambda idx, x=x: x[idx])
            for x, p in zip(arrays, jax.tree.leaves(params))]
  log.info("sft: warm-up loaded from the cache %s", file)
  return jax.tree.unflatten(treedef, leaves), rows
