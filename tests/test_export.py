"""launch/export.py: the exporter over a fake run (``load_policy`` replaced).

Each test runs the launcher's ``main`` in-process and reads the result back
with the ``safetensors`` package or ``models.load_hf_checkpoint``.
"""

import json
import os
import stat
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


def _export(monkeypatch, params, config, out, fmt, step=3,
            workdir="/nonexistent", tokenizer=None):
  policy = types.SimpleNamespace(params=params, model_config=config,
                                 tokenizer=tokenizer, step=step)
  monkeypatch.setattr(export, "load_policy", lambda workdir, step: policy)
  flags.FLAGS(["export", f"--workdir={workdir}", f"--format={fmt}"]
              + ([] if out is None else [f"--out={out}"]))
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


def test_safetensors_export_defaults_to_the_run_export_directory(
    tiny, tmp_path, monkeypatch):
  config, params, _ = tiny
  _export(monkeypatch, params, config, None, "safetensors",
          workdir=str(tmp_path))
  path = tmp_path / "export" / "policy.safetensors"
  assert stat.S_IMODE(os.stat(path).st_mode) & 0o044
  loaded = st_numpy.load_file(str(path))
  np.testing.assert_array_equal(loaded["embedding"], params["embedding"])


def test_hf_export_of_a_checkpoint_run_keeps_its_ids_and_files(
    tiny, tmp_path, monkeypatch):
  """A run started from a Hugging Face checkpoint: config.json keeps the
  checkpoint's ids (a list of EOS ids too) and takes only the missing pad id
  from the tokenizer; its generation_config.json and tokenizer files are
  copied as they are."""
  config, params, _ = tiny
  source = tmp_path / "tokenizer"
  source.mkdir()
  files = {"config.json": {"bos_token_id": 5, "eos_token_id": [6, 7]},
           "generation_config.json": {"eos_token_id": [6, 7, 8]},
           "tokenizer_config.json": {"eos_token": "<end>"}}
  for name, content in files.items():
    (source / name).write_text(json.dumps(content))
  tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2, pad_id=0)
  _export(monkeypatch, params, config, None, "hf", workdir=str(tmp_path),
          tokenizer=tokenizer)
  out = tmp_path / "export" / "hf"
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors",
                                     "tokenizer_config.json"]
  written = json.loads((out / "config.json").read_text())
  assert (written["bos_token_id"], written["eos_token_id"],
          written["pad_token_id"]) == (5, [6, 7], 0)
  for name in ("generation_config.json", "tokenizer_config.json"):
    assert json.loads((out / name).read_text()) == files[name]
