"""The one safetensors reader and writer of rljax.

Hugging Face checkpoints (``rljax.models.hf_weights``) and ``launch/export``
read and write ``.safetensors`` files through this module, which is built on
the maintained ``safetensors`` package's NumPy API instead of a hand-written
parser:

* Reading opens a file with ``safetensors.safe_open(path, framework="numpy")``,
  which memory-maps it and validates the whole header up front (known dtype
  codes, byte ranges inside the file that neither overlap nor leave gaps, byte
  sizes that match the shapes). ``SafetensorsFile`` then reads one tensor at a
  time, so a caller holds at most one tensor on the host; the shape and dtype
  of every tensor are known before any is read. ``SafetensorsFile.view``
  maps a tensor without reading it: indexing the view reads only the pages
  the index touches (how a process of a multi-host run loads only the
  slices its devices hold). ``load_file`` reads a whole file.
* Writing hands NumPy arrays to ``safetensors.numpy.save_file``, through a
  temporary file and a rename, so a crash never leaves half a file. The file
  gets the mode any new file gets (``0o666`` less the umask), not the
  ``0o600`` the package gives it.

BF16: NumPy has no bfloat16. The package's NumPy backend makes BF16 arrays of
``np.dtype("bfloat16")``, and writes arrays whose dtype is named
``bfloat16`` as BF16; NumPy resolves that name once ``ml_dtypes`` (a JAX
dependency) has registered its ``bfloat16``. This module imports
``ml_dtypes``, so BF16 tensors go through the same tensor-by-tensor API as the
others, as ``ml_dtypes.bfloat16`` arrays (the dtype ``jnp.bfloat16`` is).
Neither raw byte handling nor a torch / flax backend is needed
(``safetensors>=0.4.1``: 0.4.0 looked up ``numpy.bfloat16``, which does not
exist, and refused BF16). The 8-bit float codes (``F8_*``) have no such
registration and are refused, as are the sub-byte ones.

Errors are ``ValueError`` naming the file and, where one is at fault, the
tensor: a file the package refuses (with the package's own message, and the
tensor whose header entry is wrong where the header shows one), a dtype rljax
does not read, a tensor the file lacks, or a shape other than the expected
one.

Example:
  >>> import os, tempfile
  >>> import ml_dtypes, numpy as np
  >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
  >>> save_file({"w": np.ones((2, 3), ml_dtypes.bfloat16)}, path,
  ...           metadata={"step": "7"})
  >>> with SafetensorsFile(path) as f:
  ...   print(f.names, f.dtype("w"), f.shape("w"), f.metadata)
  ...   print(f.read("w", shape=(2, 3)).dtype)
  ('w',) BF16 (2, 3) {'step': '7'}
  bfloat16
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes  # registers bfloat16 with NumPy: see the module docstring
import numpy as np
import safetensors
import safetensors.numpy

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
"""The safetensors dtype codes rljax reads and writes, with their NumPy dtypes."""

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

_CODES = {dtype.name: code for code, dtype in DTYPES.items()}


class SafetensorsFile:
  """One ``.safetensors`` file: its header, and its tensors read one at a time.

  Opening validates the header (through ``safetensors.safe_open``) and reads
  no tensor data. Use as a context manager, or call ``close``.

  Args:
    path: the file.

  Attributes:
    path: the file, as a string.
    names: the tensor names, sorted.
    metadata: the header's ``__metadata__`` (string to string; may be empty).

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: if the file is not a valid safetensors file.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    try:
      self._file = safetensors.safe_open(self.path, framework="numpy")
    except safetensors.SafetensorError as e:
      raise ValueError(_invalid_file_message(self.path, e)) from e
    self.metadata: dict[str, str] = dict(self._file.metadata() or {})
    self.names: tuple[str, ...] = tuple(sorted(self._file.keys()))
    self._header: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in self.names:
      info = self._file.get_slice(name)
      self._header[name] = (info.get_dtype(), tuple(info.get_shape()))
    self._data_start, self._spans = _data_spans(self.path)

  def __enter__(self) -> "SafetensorsFile":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def close(self) -> None:
    """Releases the file's memory map."""
    self._file.__exit__(None, None, None)

  def __contains__(self, name: str) -> bool:
    return name in self._header

  def _entry(self, name: str) -> tuple[str, tuple[int, ...]]:
    if name not in self._header:
      raise ValueError(f"{self.path}: there is no tensor {name!r}; the file "
                       f"holds {len(self.names)}, e.g. {list(self.names[:5])}.")
    return self._header[name]

  def dtype(self, name: str) -> str:
    """The safetensors dtype code of a tensor (``"F32"``, ``"BF16"``, ...)."""
    return self._entry(name)[0]

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entry(name)[1]

  def check(self, name: str, *, shape: Sequence[int] | None = None,
            dtypes: Collection[str] | None = None) -> None:
    """Raises unless tensor ``name`` exists, with ``shape`` and a dtype in ``dtypes``.

    Args:
      name: the tensor.
      shape: the expected shape; None accepts any.
      dtypes: the accepted dtype codes; None accepts those of ``DTYPES``.

    Raises:
      ValueError: naming the file, the tensor, what it has and what is
        accepted.
    """
    code, got = self._entry(name)
    accepted = tuple(DTYPES) if dtypes is None else tuple(dtypes)
    if code not in accepted or code not in DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has dtype {code!r}; "
                       f"accepted: {accepted}.")
    if shape is not None and tuple(shape) != got:
      raise ValueError(f"{self.path}: tensor {name!r} has shape {list(got)}; "
                       f"expected {list(shape)}.")

  def read(self, name: str, *, shape: Sequence[int] | None = None,
           dtypes: Collection[str] | None = None) -> np.ndarray:
    """One tensor as a host NumPy array of the file's dtype (after ``check``)."""
    self.check(name, shape=shape, dtypes=dtypes)
    try:
      return self._file.get_tensor(name)
    except safetensors.SafetensorError as e:
      raise ValueError(f"{self.path}: tensor {name!r} cannot be read: {e}") from e

  def view(self, name: str, *, shape: Sequence[int] | None = None,
           dtypes: Collection[str] | None = None) -> np.ndarray:
    """One tensor as a read-only memory map of the file (after ``check``).

    Nothing is read until the view is indexed or copied, and then only the
    pages the index touches: ``np.array(view[rows])`` of a row block reads
    that block. Reshapes and transposes of the view are views too.
    """
    self.check(name, shape=shape, dtypes=dtypes)
    code, dims = self._header[name]
    dtype = DTYPES[code].newbyteorder("<")  # the format is little-endian
    begin, end = self._spans[name]
    if begin == end:  # mmap refuses zero bytes
      return np.zeros(dims, dtype)
    flat = np.memmap(self.path, dtype=dtype, mode="r",
                     offset=self._data_start + begin,
                     shape=((end - begin) // dtype.itemsize,))
    return flat.reshape(dims)


def _data_spans(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
  """Where the data starts, and each tensor's byte range after it.

  Called once ``safe_open`` has validated the header, so the JSON parses and
  the ranges lie inside the file.
  """
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
  return 8 + n, {name: tuple(info["data_offsets"])
                 for name, info in header.items() if name != "__metadata__"}


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of a file, as ``{name: NumPy array}`` (BF16 as ``ml_dtypes.bfloat16``)."""
  with SafetensorsFile(path) as f:
    return {name: f.read(name) for name in f.names}


def save_file(tensors: Mapping[str, Any], path: str | os.PathLike,
              metadata: Mapping[str, Any] | None = None) -> None:
  """Writes ``{name: array}`` as one ``.safetensors`` file.

  The file is written under a temporary name (``path + ".tmp"``, removed if
  anything fails) and renamed, so ``path`` never holds half a file. Its mode
  is that of any new file (``0o644`` under the usual umask). Every
  array is brought to the host (a ``jax.Array`` must be fully addressable)
  and keeps its dtype.

  Args:
    tensors: names to arrays (NumPy, JAX or anything ``np.asarray`` takes)
      of a dtype in ``DTYPES``.
    path: the output file.
    metadata: the header's ``__metadata__``; values are written with ``str``.

  Raises:
    IsADirectoryError: if ``path`` is a directory (nothing is written).
    TypeError: naming the tensor whose dtype safetensors cannot store.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    raise IsADirectoryError(f"{path} is a directory; save_file writes one "
                            ".safetensors file: name a file path.")
  arrays = {}
  for name, value in tensors.items():
    array = np.asarray(value)
    if array.dtype.name not in _CODES:
      raise TypeError(f"{path}: tensor {name!r} has dtype {array.dtype}; "
                      f"accepted: {sorted(_CODES)}.")
    arrays[name] = np.require(array, requirements="C")
  header = None if metadata is None else {
      str(k): str(v) for k, v in metadata.items()}
  tmp = path + ".tmp"
  try:
    mode = _new_file_mode(tmp)
    safetensors.numpy.save_file(arrays, tmp, metadata=header)
    os.chmod(tmp, mode)  # the package writes 0o600 whatever the umask
    os.replace(tmp, path)
  finally:  # after a failure, no half-written file is left behind
    if os.path.exists(tmp):
      os.remove(tmp)


def _new_file_mode(file: str) -> int:
  """Creates ``file`` empty and returns the mode it got: that of any new file
  there (``0o666`` less the umask, which cannot be read without setting it)."""
  if os.path.lexists(file):
    os.remove(file)
  os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
  return stat.S_IMODE(os.stat(file).st_mode)


def flatten_names(tree: Any, sep: str = ".") -> dict[str, Any]:
  """``{"layers_0.attn.q_kernel": leaf, ...}`` from a nested-dict pytree."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = sep.join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    flat[name] = leaf
  return flat


def _invalid_file_message(path: str, error: Exception) -> str:
  problem = _header_problem(path)
  return (f"{path} is not a valid safetensors file"
          + (f" ({problem})" if problem else "") + f": {error}")


def _header_problem(path: str) -> str:
  """What is wrong with a file's header, naming the tensor at fault.

  Returns '' when nothing is found.

  The package's messages do not always name the tensor; this reads the JSON
  header again only to say which entry is wrong.
  """
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        return (f"the file has {size} bytes, fewer than the 8 that hold the "
                "header size")
      n = int.from_bytes(prefix, "little")
      if n > size - 8:
        return (f"the header size {n} exceeds the {size - 8} bytes that "
                "follow it")
      header = json.loads(f.read(n))
  except OSError:
    return ""
  except ValueError as e:  # JSON and UTF-8 decoding errors
    return f"the header is not valid JSON: {e}"
  if not isinstance(header, dict):
    return (f"the header is a JSON {type(header).__name__}; a JSON object "
            "mapping tensor names to entries is required")
  data_bytes = size - 8 - n
  spans, unknown = [], ""
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if not isinstance(info, dict):
      return (f"tensor {name!r}: header entry {info!r} is not an object with "
              "dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
      return f"tensor {name!r}: header entry {info!r} lacks {missing}"
    try:
      code, shape = info["dtype"], [int(d) for d in info["shape"]]
      begin, end = (int(x) for x in info["data_offsets"])
    except (TypeError, ValueError):
      return f"tensor {name!r}: malformed header entry {info!r}"
    if not 0 <= begin <= end <= data_bytes:
      return (f"tensor {name!r}: data_offsets [{begin}, {end}] lie outside "
              f"the file's {data_bytes} data bytes")
    if code not in DTYPES:
      # Reported only if nothing else is wrong: the package knows dtypes
      # (F8_*, sub-byte) that rljax does not read.
      unknown = unknown or (f"tensor {name!r}: dtype {code!r}; rljax "
                            f"accepts {tuple(DTYPES)}")
    elif end - begin != math.prod(shape) * DTYPES[code].itemsize:
      return (f"tensor {name!r}: shape {shape} of {code} needs "
              f"{math.prod(shape) * DTYPES[code].itemsize} bytes, "
              f"data_offsets [{begin}, {end}] hold {end - begin}")
    spans.append((begin, end, name))
  spans.sort()
  for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
    if begin < end:
      return f"tensor {second!r}: its bytes overlap those of {first!r}"
  return unknown
