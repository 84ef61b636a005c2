"""Metric writers: JSONL, TensorBoard event files, console progress, plots.

The TensorBoard writer encodes ``Event``/``Summary`` protocol buffers by hand
(scalars only) with the TFRecord framing (length, masked CRC32C), so it needs
neither TensorFlow nor the ``tensorboard`` package; TensorBoard reads the
files as usual.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Scalars = Mapping[str, Any]


def to_floats(metrics: Scalars) -> dict[str, float]:
  """Converts scalar arrays to Python floats (drops non-scalars)."""
  out = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.size == 1:
      out[k] = float(a.reshape(()))
  return out


class JsonlWriter:
  """Appends one JSON object per step: ``{"step": s, name: value, ...}``."""

  def __init__(self, path: str | os.PathLike):
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    self.path = os.fspath(path)
    self._f = open(self.path, "a", encoding="utf-8")

  def write(self, step: int, metrics: Scalars) -> None:
    row = {"step": int(step)}
    for k, v in to_floats(metrics).items():
      row[k] = v if math.isfinite(v) else str(v)
    self._f.write(json.dumps(row, sort_keys=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


# --- TensorBoard ------------------------------------------------------------

def _crc32c_table():
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # negative int64 (e.g. warm-up steps) as two's complement
  out = bytearray()
  while True:
    byte = n & 0x7F
    n >>= 7
    if n:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
  return _varint((number << 3) | wire) + payload


def _len_field(number: int, payload: bytes) -> bytes:
  return _field(number, 2, _varint(len(payload)) + payload)


def _event(wall_time: float, step: int, *, summary: bytes | None = None,
           file_version: str | None = None) -> bytes:
  msg = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    msg += _len_field(3, file_version.encode())
  if summary is not None:
    msg += _len_field(5, summary)
  return msg


def _scalar_summary(tag: str, value: float) -> bytes:
  value_msg = _len_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", value))
  return _len_field(1, value_msg)


class TensorBoardWriter:
  """Writes scalar summaries to ``<logdir>/events.out.tfevents.*``."""

  def __init__(self, logdir: str | os.PathLike):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.path = os.path.join(os.fspath(logdir), name)
    self._f = open(self.path, "ab")
    self._record(_event(time.time(), 0, file_version="brain.Event:2"))

  def _record(self, data: bytes) -> None:
    header = struct.pack("<Q", len(data))
    self._f.write(header + struct.pack("<I", _masked_crc(header)) + data
                  + struct.pack("<I", _masked_crc(data)))

  def write(self, step: int, metrics: Scalars) -> None:
    summary = b"".join(_scalar_summary(k, v)
                       for k, v in to_floats(metrics).items())
    self._record(_event(time.time(), int(step), summary=summary))
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_tensorboard_scalars(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """Decodes ``(step, tag, value)`` from an event file written here (checks CRCs)."""
  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (length,) = struct.unpack_from("<Q", data, pos)
    (hcrc,) = struct.unpack_from("<I", data, pos + 8)
    if hcrc != _masked_crc(data[pos:pos + 8]):
      raise ValueError(f"{path}: corrupt record header at byte {pos}.")
    body = data[pos + 12:pos + 12 + length]
    (bcrc,) = struct.unpack_from("<I", data, pos + 12 + length)
    if bcrc != _masked_crc(body):
      raise ValueError(f"{path}: corrupt record body at byte {pos}.")
    pos += 16 + length
    out.extend(_decode_event(body))
  return out


def _read_varint(buf, i):
  shift = result = 0
  while True:
    b = buf[i]
    i += 1
    result |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return result, i


def _fields(buf):
  i = 0
  while i < len(buf):
    key, i = _read_varint(buf, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _read_varint(buf, i)
    elif wire == 1:
      value, i = buf[i:i + 8], i + 8
    elif wire == 5:
      value, i = buf[i:i + 4], i + 4
    else:
      n, i = _read_varint(buf, i)
      value, i = buf[i:i + n], i + n
    yield number, value


def _decode_event(buf):
  step, out = 0, []
  for number, value in _fields(buf):
    if number == 2:
      step = value - (1 << 64) if value >= 1 << 63 else value
    elif number == 5:
      for _, v in _fields(value):
        tag, x = None, None
        for n2, v2 in _fields(v):
          if n2 == 1:
            tag = v2.decode()
          elif n2 == 2:
            (x,) = struct.unpack("<f", v2)
        out.append((step, tag, x))
  return out


# --- console and plots -------------------------------------------------------

class ProgressBar:
  """A one-line console progress bar with a few chosen metrics."""

  def __init__(self, total: int, keys: Sequence[str] = (), stream=None,
               width: int = 24):
    self.total, self.keys, self.width = total, tuple(keys), width
    self.stream = stream or sys.stderr
    self.start = time.time()

  def update(self, step: int, metrics: Scalars) -> None:
    floats = to_floats(metrics)
    done = int(self.width * step / max(self.total, 1))
    elapsed = time.time() - self.start
    eta = elapsed / max(step, 1) * (self.total - step)
    shown = " ".join(f"{k.split('/')[-1]}={floats[k]:.3g}" for k in self.keys
                     if k in floats)
    line = (f"\r[{'#' * done}{'.' * (self.width - done)}] {step}/{self.total} "
            f"{elapsed:.0f}s<{eta:.0f}s {shown}")
    end = "\n" if step >= self.total else ""
    self.stream.write(line + end)
    self.stream.flush()


class MetricWriter:
  """Fans out to JSONL and TensorBoard under ``workdir``."""

  def __init__(self, workdir: str | os.PathLike):
    self.jsonl = JsonlWriter(os.path.join(workdir, "metrics.jsonl"))
    self.tensorboard = TensorBoardWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: Scalars) -> None:
    self.jsonl.write(step, metrics)
    self.tensorboard.write(step, metrics)

  def close(self) -> None:
    self.jsonl.close()
    self.tensorboard.close()


def plot_curves(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                keys: Sequence[str], title: str = "") -> bool:
  """Saves a PNG with one panel per key that appears in ``rows``.

  Returns False (and writes nothing) when matplotlib is unavailable.
  """
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  keys = [k for k in keys if any(k in r for r in rows)]
  if not keys:
    return False
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                           squeeze=False)
  for ax, key in zip(axes[0], keys):
    pts = [(r["step"], float(r[key])) for r in rows
           if key in r and isinstance(r[key], (int, float))]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True
