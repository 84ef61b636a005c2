"""rljax.safetensors: round trips, files of other writers, and bad files.

References come from outside the module: NumPy arrays, the ``safetensors``
package's own writer and reader, and a file assembled byte by byte from the
format's specification (8-byte little-endian header size, JSON header, raw
little-endian data).
"""

import json
import os
import stat
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_numpy

from rljax import safetensors


def _arrays():
  rng = np.random.RandomState(0)
  return {
      "f32": rng.randn(3, 4).astype(np.float32),
      "bf16": rng.randn(2, 5).astype(ml_dtypes.bfloat16),
      "f16": rng.randn(7).astype(np.float16),
      "f64": rng.randn(2, 2),
      "i32": rng.randint(-9, 9, (2, 3)).astype(np.int32),
      "u8": rng.randint(0, 255, 5).astype(np.uint8),
      "bool": rng.rand(4) > 0.5,
      "scalar": np.array(1.5, np.float32),
      "empty": np.zeros((0, 3), np.float32),
      "transposed": rng.randn(4, 3).astype(np.float32).T,  # not C-contiguous
      "big_endian": rng.randn(3).astype(">f4"),
  }


def _write_raw(path, header, data: bytes):
  """A safetensors file built from the format's definition, not a library."""
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob + data)
  return path


def test_round_trip_against_numpy(tmp_path):
  arrays = _arrays()
  path = tmp_path / "a.safetensors"
  safetensors.save_file(arrays, path, metadata={"step": 7})
  assert not os.path.exists(str(path) + ".tmp")
  loaded = safetensors.load_file(path)
  assert sorted(loaded) == sorted(arrays)
  for name, want in arrays.items():
    got = loaded[name]
    assert got.dtype == want.dtype.newbyteorder("="), name
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(got, want, err_msg=name)
  with safetensors.SafetensorsFile(path) as f:
    assert f.metadata == {"step": "7"}
    assert f.names == tuple(sorted(arrays))
    assert f.dtype("bf16") == "BF16" and f.shape("bf16") == (2, 5)
    assert f.dtype("bool") == "BOOL" and f.shape("scalar") == ()



def test_views_map_the_file_and_equal_the_written_arrays(tmp_path):
  """``view`` reads nothing up front (a memory map of the file: indexing it
  reads only what the index touches) and gives the arrays written, every
  dtype, a scalar, an empty tensor and a big-endian source included."""
  arrays = _arrays()
  path = tmp_path / "a.safetensors"
  safetensors.save_file(arrays, path)
  with safetensors.SafetensorsFile(path) as f:
    for name, want in arrays.items():
      got = f.view(name)
      assert got.shape == want.shape and got.dtype.name == want.dtype.name, name
      np.testing.assert_array_equal(got, want, err_msg=name)
      if want.size:
        base = got
        while base.base is not None and not isinstance(base, np.memmap):
          base = base.base
        assert isinstance(base, np.memmap), name
        assert not got.flags.writeable, name
    np.testing.assert_array_equal(f.view("f32")[1:, ::2], arrays["f32"][1:, ::2])
    with pytest.raises(ValueError, match="shape"):
      f.view("f32", shape=(4, 3))
    with pytest.raises(ValueError, match="no tensor 'nope'"):
      f.view("nope")

def test_bfloat16_bits_match_the_format(tmp_path):
  # bfloat16 is the top half of float32: 1.0 -> 0x3F80, -2.0 -> 0xC000.
  path = _write_raw(tmp_path / "raw.safetensors",
                    {"w": {"dtype": "BF16", "shape": [2],
                           "data_offsets": [0, 4]}},
                    struct.pack("<HH", 0x3F80, 0xC000))
  with safetensors.SafetensorsFile(path) as f:
    w = f.read("w", shape=(2,))
  assert w.dtype == jnp.bfloat16
  np.testing.assert_array_equal(w.astype(np.float32), [1.0, -2.0])
  out = tmp_path / "out.safetensors"
  safetensors.save_file({"w": jnp.asarray([1.0, -2.0], jnp.bfloat16)}, out)
  with open(out, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    assert header["w"] == {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}
    assert struct.unpack("<HH", f.read(4)) == (0x3F80, 0xC000)


def test_files_of_the_safetensors_package_read_back(tmp_path):
  arrays = {k: v for k, v in _arrays().items()
            if k not in ("transposed", "big_endian")}
  path = str(tmp_path / "package.safetensors")
  st_numpy.save_file(arrays, path, metadata={"format": "np"})
  with safetensors.SafetensorsFile(path) as f:
    assert f.metadata == {"format": "np"}
    for name, want in arrays.items():
      got = f.read(name, shape=want.shape)
      assert got.dtype == want.dtype, name
      np.testing.assert_array_equal(got, want, err_msg=name)


def test_the_package_reads_what_rljax_writes(tmp_path):
  arrays = _arrays()
  path = tmp_path / "rljax.safetensors"
  safetensors.save_file(arrays, path)
  other = st_numpy.load_file(str(path))
  for name, want in arrays.items():
    np.testing.assert_array_equal(other[name], want, err_msg=name)


def test_jax_arrays_and_flatten_names(tmp_path):
  tree = {"layers_0": {"attn": {"q": jnp.ones((2, 3), jnp.bfloat16)}},
          "list": [jnp.arange(3), jnp.zeros(())]}
  flat = safetensors.flatten_names(tree)
  assert sorted(flat) == ["layers_0.attn.q", "list.0", "list.1"]
  path = tmp_path / "tree.safetensors"
  safetensors.save_file(flat, path)
  loaded = safetensors.load_file(path)
  for name, want in flat.items():
    assert loaded[name].dtype == want.dtype
    np.testing.assert_array_equal(loaded[name], np.asarray(want))


def test_unsupported_dtype_on_save_names_the_tensor(tmp_path):
  with pytest.raises(TypeError, match=r"tensor 'c' has dtype complex64"):
    safetensors.save_file({"ok": np.zeros(2), "c": np.zeros(2, np.complex64)},
                          tmp_path / "x.safetensors")
  assert not os.listdir(tmp_path)


_F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, data, match", [
    ({"a": _F32x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
     bytes(12), r"tensor 'b'.*overlap.*'a'"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
     bytes(8), r"tensor 'a'.*\[0, 16\] lie outside the file's 8 data bytes"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
     bytes(8), r"tensor 'a'.*shape \[3\] of F32 needs 12 bytes"),
    ({"ok": _F32x2, "q": {"dtype": "Q7", "shape": [2], "data_offsets": [8, 16]}},
     bytes(16), r"tensor 'q'.*dtype 'Q7'"),
    # Two names for the same bytes: an aliased weight if it were accepted.
    ({"a": _F32x2, "b": _F32x2}, bytes(8),
     r"tensor 'b': its bytes overlap those of 'a'"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8),
     r"tensor 'a': header entry .* lacks \['data_offsets'\]"),
    ({"a": [0, 8]}, bytes(8),
     r"tensor 'a': header entry \[0, 8\] is not an object"),
    ([_F32x2], bytes(8), r"the header is a JSON list; a JSON object"),
])
def test_bad_headers_name_the_file_and_tensor(tmp_path, header, data, match):
  path = _write_raw(tmp_path / "bad.safetensors", header, data)
  with pytest.raises(ValueError, match=rf"bad.safetensors is not a valid "
                     rf"safetensors file \({match}"):
    safetensors.SafetensorsFile(path)
  with pytest.raises(ValueError, match=rf"bad.safetensors.*\({match}"):
    safetensors.load_file(path)


def test_save_into_a_directory_is_refused_and_leaves_no_tmp(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  with pytest.raises(IsADirectoryError, match=r"out is a directory"):
    safetensors.save_file({"w": np.zeros(2, np.float32)}, out)
  assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_file_has_the_mode_of_any_new_file(tmp_path, umask):
  """``0o666`` less the umask (``0o644`` usually), as ``open`` gives, not
  the ``0o600`` the package writes; a stale ``.tmp`` does not lend its mode."""
  path = tmp_path / "w.safetensors"
  (tmp_path / "w.safetensors.tmp").write_bytes(b"stale")
  os.chmod(tmp_path / "w.safetensors.tmp", 0o600)
  previous = os.umask(umask)
  try:
    safetensors.save_file({"w": np.zeros(2, np.float32)}, path)
  finally:
    os.umask(previous)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
  assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_failed_write_leaves_no_tmp(tmp_path, monkeypatch):
  def fail_half_way(arrays, file, metadata=None):
    with open(file, "wb") as f:
      f.write(b"half")
    raise OSError("disk full")

  monkeypatch.setattr(st_numpy, "save_file", fail_half_way)
  with pytest.raises(OSError, match="disk full"):
    safetensors.save_file({"w": np.zeros(2, np.float32)},
                          tmp_path / "w.safetensors")
  assert not os.listdir(tmp_path)


def test_truncated_and_garbled_files_name_the_file(tmp_path):
  path = tmp_path / "short.safetensors"
  path.write_bytes(b"\x05")
  with pytest.raises(ValueError, match="short.safetensors is not a valid"):
    safetensors.SafetensorsFile(path)
  path = tmp_path / "json.safetensors"
  path.write_bytes(struct.pack("<Q", 8) + b"{notjson")
  with pytest.raises(ValueError, match="json.safetensors is not a valid"):
    safetensors.load_file(path)
  with pytest.raises(FileNotFoundError):
    safetensors.SafetensorsFile(tmp_path / "missing.safetensors")


def test_reads_check_dtype_shape_and_name(tmp_path):
  # F8_E4M3 is a valid safetensors dtype that rljax does not read.
  path = _write_raw(tmp_path / "f.safetensors", {
      "w": _F32x2,
      "f8": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [8, 16]}},
      bytes(16))
  with safetensors.SafetensorsFile(path) as f:
    assert f.dtype("f8") == "F8_E4M3"
    with pytest.raises(ValueError, match=r"f.safetensors: tensor 'f8' has "
                       r"dtype 'F8_E4M3'; accepted: \('F64'"):
      f.read("f8")
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \[2\]; "
                       r"expected \[2, 1\]"):
      f.read("w", shape=(2, 1))
    with pytest.raises(ValueError, match=r"tensor 'w' has dtype 'F32'; "
                       r"accepted: \('BF16',\)"):
      f.check("w", dtypes=("BF16",))
    with pytest.raises(ValueError, match=r"there is no tensor 'v'"):
      f.shape("v")
    np.testing.assert_array_equal(f.read("w", shape=[2]), [0.0, 0.0])
