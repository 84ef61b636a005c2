"""The warm-up cache (rljax/train/sft_cache.py): a warm-up trained once is
loaded bit for bit by the next identical one, with its metric rows; any
change to what it depends on trains again; a damaged entry is trained over.
"""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import data as data_lib
from rljax import models, sharding
from rljax import tokenizers as tok_lib
from rljax.train import sft, sft_cache
from tests.test_sft import MC

STEPS = 4


class Rows:
  """A metric writer that keeps what it is given."""

  def __init__(self):
    self.rows = []

  def write(self, step, values):
    self.rows.append((step, dict(values)))


@pytest.fixture(scope="module")
def setting():
  task = data_lib.get_task("arithmetic", min_digits=1, max_digits=1)
  tokenizer = tok_lib.train_sentencepiece(task.tokenizer_corpus(40, 0), 32)
  mc = MC.replace(vocab_size=tokenizer.vocab_size)
  mesh = sharding.mesh_from_config({"data": 1, "fsdp": -1, "tensor": 1})
  return task, tokenizer, mc, mesh


def warm_up(setting, cache_dir, seed=0, init_seed=0, **cfg):
  task, tokenizer, mc, mesh = setting
  params = models.init_params(mc, jax.random.key(init_seed), mesh)
  cfg = sft.SFTConfig(**{"num_steps": STEPS, "batch_size": 8,
                         "num_examples": 40, "max_length": 16, "seed": seed,
                         "cache_dir": str(cache_dir), **cfg})
  writer = Rows()
  out = sft.run_sft(params, cfg, task=task, tokenizer=tokenizer,
                    model_config=mc, mesh=mesh,
                    param_shardings=models.param_shardings(mc, mesh),
                    writer=writer)
  return jax.tree.map(np.asarray, out), writer.rows, out


def entries(directory):
  return sorted(f for f in os.listdir(directory) if f.endswith(".npz"))


def assert_same(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def trained(setting, tmp_path_factory):
  """The warm-up without a cache, and once more through an empty cache."""
  plain = warm_up(setting, "")
  directory = tmp_path_factory.mktemp("sft_cache")
  first = warm_up(setting, directory)
  return plain, directory, first


def test_the_first_warm_up_trains_and_writes_one_entry(trained):
  plain, directory, first = trained
  assert_same(first[0], plain[0])
  assert first[1] == plain[1] and len(plain[1]) == STEPS
  assert len(entries(directory)) == 1
  assert not [f for f in os.listdir(directory) if ".tmp-" in f]


def test_the_same_warm_up_loads_the_entry_bit_for_bit(trained, setting,
                                                      caplog):
  plain, directory, _ = trained
  with caplog.at_level(logging.INFO, logger="rljax"):
    params, rows, arrays = warm_up(setting, directory)
  assert "warm-up loaded from the cache" in caplog.text
  assert "compiling the step" not in caplog.text
  assert_same(params, plain[0])
  assert rows == plain[1]  # the same sft/* rows, at the same steps
  # On the params' own shardings, as training returns them.
  shardings = models.param_shardings(setting[2], setting[3])
  for x, s in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  assert len(entries(directory)) == 1


@pytest.mark.parametrize("change", [{"seed": 1}, {"init_seed": 1},
                                    {"learning_rate": 1e-3},
                                    {"num_steps": STEPS + 1}])
def test_any_change_the_result_depends_on_trains_again(trained, setting,
                                                       change, tmp_path,
                                                       caplog):
  _, directory, _ = trained
  local = tmp_path / "cache"
  local.mkdir()
  for name in entries(directory):
    (local / name).write_bytes((directory / name).read_bytes())
  with caplog.at_level(logging.INFO, logger="rljax"):
    warm_up(setting, local, **change)
  assert "loaded from the cache" not in caplog.text
  assert len(entries(local)) == 2


def test_the_environment_variable_names_the_directory(trained, setting,
                                                      monkeypatch, caplog):
  plain, directory, _ = trained
  monkeypatch.setenv(sft_cache.ENV, str(directory))
  with caplog.at_level(logging.INFO, logger="rljax"):
    params, _, _ = warm_up(setting, "")
  assert "loaded from the cache" in caplog.text
  assert_same(params, plain[0])
  assert sft_cache.cache_dir("elsewhere") == "elsewhere"  # the config first


def _damaged(entry_bytes, how):
  if how == "truncated":
    return entry_bytes[:len(entry_bytes) // 2]
  if how == "not_an_archive":
    return b"not a zip file at all"
  return entry_bytes


@pytest.mark.parametrize("how", ["truncated", "not_an_archive", "shapes",
                                 "other_key"])
def test_a_damaged_entry_is_reported_and_trained_over(trained, setting, how,
                                                      tmp_path, caplog):
  plain, directory, _ = trained
  [name] = entries(directory)
  local = tmp_path / "cache"
  local.mkdir()
  raw = (directory / name).read_bytes()
  if how in ("shapes", "other_key"):
    with np.load(directory / name, allow_pickle=False) as z:
      arrays = dict(z)
    manifest = json.loads(bytes(arrays["manifest"]).decode())
    if how == "shapes":  # an entry of another model under this name
      manifest["shapes"][0] = [s + 1 for s in manifest["shapes"][0]]
    else:
      manifest["key"] = "0" * 64
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    np.savez(local / name, **arrays)
  else:
    (local / name).write_bytes(_damaged(raw, how))
  with caplog.at_level(logging.INFO, logger="rljax"):
    params, rows, _ = warm_up(setting, local)
  assert "does not read back" in caplog.text
  assert_same(params, plain[0])
  assert rows == plain[1]
  # Trained over: the entry reads back whole now.
  assert (local / name).read_bytes() == raw


def test_bfloat16_parameters_round_trip(tmp_path):
  params = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 3,
            "b": jnp.ones(3, jnp.float32)}
  group = sft_cache.distributed.ProcessGroup()
  rows = [{"step": -1, "metrics": {"sft/sft_loss": 0.5}}]
  sft_cache.save(str(tmp_path), "k" * 64, params, rows, group)
  got, got_rows = sft_cache.load(str(tmp_path), "k" * 64, params, group)
  assert got["w"].dtype == jnp.bfloat16 and got_rows == rows
  assert_same(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, params))


@pytest.mark.slow
def test_a_run_from_the_config_loads_the_warm_up_another_run_trained(
    tmp_path, caplog):
  """``sft.cache_dir`` from the launcher's config: the second run loads the
  first one's warm-up and logs the same rows (clocks aside)."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import _without_clock, loop_config  # pylint: disable=import-outside-toplevel
  from rljax import metrics  # pylint: disable=import-outside-toplevel
  config = loop_config(**{"sft.num_steps": 3,
                          "sft.cache_dir": str(tmp_path / "cache")})
  config.rl.num_steps = 1
  rows = []
  for name in ("first", "second"):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rljax"):
      train.run(config, str(tmp_path / name))
    rows.append([_without_clock(r) for r in metrics.read_jsonl(
        str(tmp_path / name / "metrics.jsonl"))])
  assert "warm-up loaded from the cache" in caplog.text
  assert len(entries(tmp_path / "cache")) == 1
  assert rows[0] == rows[1]
  assert [r["step"] for r in rows[1] if "sft/sft_loss" in r] == [-2, -1, 0]


def test_a_cache_that_cannot_be_written_warns_and_the_warm_up_stands(
    trained, setting, tmp_path, caplog):
  plain, _, _ = trained
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with caplog.at_level(logging.INFO, logger="rljax"):
    params, rows, _ = warm_up(setting, blocker / "cache")
  assert "was not cached" in caplog.text
  assert_same(params, plain[0])
  assert rows == plain[1]
