"""launch/export.py: the exporter over a fake run (``load_policy`` replaced).

Each test runs the launcher's ``main`` in-process and reads the result back
with the ``safetensors`` package or ``models.load_hf_checkpoint``.
"""

import os
import types

import jax
import numpy as np
import pytest
import safetensors.numpy as st_numpy
from absl import flags

from launch import export
from rljax import models


@pytest.fixture(scope="module")
def tiny():
  """``(config, params_a, params_b)``: two different tiny models."""
  config = models.get_preset("tiny")
  return (config, models.init_params(config, jax.random.key(0)),
          models.init_params(config, jax.random.key(1)))


def _export(monkeypatch, params, config, out, fmt, step=3):
  policy = types.SimpleNamespace(params=params, model_config=config, step=step)
  monkeypatch.setattr(export, "load_policy", lambda workdir, step: policy)
  flags.FLAGS(["export", "--workdir=/nonexistent", f"--out={out}",
               f"--format={fmt}"])
  try:
    export.main([])
  finally:
    flags.FLAGS.unparse_flags()


def test_hf_export_over_an_older_sharded_export_loads_the_new_weights(
    tiny, tmp_path, monkeypatch):
  config, old, new = tiny
  out = tmp_path / "hf"
  files = models.save_hf_checkpoint(out, config, old, max_shard_size=100_000)
  assert "model.safetensors.index.json" in files  # the older export: shards
  _export(monkeypatch, new, config, out, "hf")
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  config2, loaded = models.load_hf_checkpoint(out)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, loaded, new)


def test_safetensors_export_to_a_directory_is_refused_without_tmp(
    tiny, tmp_path, monkeypatch):
  config, params, _ = tiny
  out = tmp_path / "out"
  out.mkdir()
  with pytest.raises(IsADirectoryError, match=r"out is a directory"):
    _export(monkeypatch, params, config, out, "safetensors")
  assert sorted(os.listdir(tmp_path)) == ["out"] and not os.listdir(out)
  file = tmp_path / "policy.safetensors"
  _export(monkeypatch, params, config, file, "safetensors")
  assert sorted(os.listdir(tmp_path)) == ["out", "policy.safetensors"]
  tensors = st_numpy.load_file(str(file))
  np.testing.assert_array_equal(tensors["embedding"], params["embedding"])
