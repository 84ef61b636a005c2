import json

import numpy as np

from rljax import metrics


def test_crc32c_known_vectors():
  # RFC 3720 test vectors (iSCSI CRC32C).
  assert metrics.crc32c(b"") == 0
  assert metrics.crc32c(b"123456789") == 0xE3069283
  assert metrics.crc32c(bytes(32)) == 0x8A9136AA


def test_tensorboard_round_trip_including_negative_steps(tmp_path):
  w = metrics.TensorBoardWriter(tmp_path)
  w.write(-5, {"sft/loss": 2.5})
  w.write(3, {"reward": np.float32(0.25), "acc": 1.0, "vector": np.ones(3)})
  w.close()
  records = metrics.read_tensorboard_scalars(w.path)
  assert (-5, "sft/loss", 2.5) in records
  assert (3, "reward", 0.25) in records and (3, "acc", 1.0) in records
  assert not any(tag == "vector" for _, tag, _ in records)


def test_tensorboard_detects_corruption(tmp_path):
  w = metrics.TensorBoardWriter(tmp_path)
  w.write(1, {"a": 1.0})
  w.close()
  data = bytearray(open(w.path, "rb").read())
  data[-6] ^= 0xFF
  open(w.path, "wb").write(bytes(data))
  try:
    metrics.read_tensorboard_scalars(w.path)
  except ValueError as e:
    assert "corrupt" in str(e)
  else:
    raise AssertionError("corruption not detected")


def test_jsonl_writer(tmp_path):
  w = metrics.JsonlWriter(tmp_path / "m.jsonl")
  w.write(1, {"a": np.float32(0.5), "b": float("nan")})
  w.write(2, {"a": 1})
  w.close()
  rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
  assert rows == [{"step": 1, "a": 0.5, "b": "nan"}, {"step": 2, "a": 1.0}]


def test_plot_writes_png(tmp_path):
  rows = [{"step": i, "reward": i / 10} for i in range(5)]
  assert metrics.plot_curves(rows, tmp_path / "p.png", ["reward", "missing"])
  assert open(tmp_path / "p.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
