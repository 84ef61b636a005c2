"""launch/export.py: the exporter over a fake run (``load_policy`` replaced).

Each test runs the launcher's ``main`` (or ``export_policy``) in-process and
reads the result back with the ``safetensors`` package or
``models.load_hf_checkpoint``; a LoRA policy's exports are read back with
``transformers`` and ``peft`` (``requires_hf``), whose logits are compared
with the adapted rljax model's.
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
from rljax import models, train
from tests.hf_extra import requires_hf

requires_peft = requires_hf("torch", "transformers", "peft")


@pytest.fixture(scope="module")
def tiny():
  """``(config, params_a, params_b)``: two different tiny models."""
  config = models.get_preset("tiny")
  return (config, models.init_params(config, jax.random.key(0)),
          models.init_params(config, jax.random.key(1)))


def _export(monkeypatch, params, config, out, fmt, step=3,
            workdir="/nonexistent", tokenizer=None, args=()):
  """Runs the launcher; ``fmt`` None leaves ``--format`` out, ``args`` are
  more flags."""
  policy = types.SimpleNamespace(params=params, model_config=config,
                                 tokenizer=tokenizer, step=step)
  monkeypatch.setattr(export, "load_policy", lambda workdir, step: policy)
  flags.FLAGS(["export", f"--workdir={workdir}"]
              + ([] if fmt is None else [f"--format={fmt}"])
              + ([] if out is None else [f"--out={out}"]) + list(args))
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


# ----------------------------------------------------------------------------
# LoRA policies: the merged Hugging Face directory and peft's adapters.

_TOKENS = np.random.RandomState(0).randint(0, 256, size=(1, 12))


def _rljax_logits(config, params):
  positions = np.arange(_TOKENS.shape[1])[None]
  logits, _ = models.Decoder(config).apply({"params": params}, _TOKENS,
                                           positions, return_logits=True)
  return np.asarray(logits[0])


def _torch_logits(model):
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    return model(torch.tensor(_TOKENS)).logits[0].numpy()


@pytest.fixture(scope="module", params=["none", "int8"])
def lora_policy(request):
  """``(policy, adapted_logits, base_logits)`` of a tiny LoRA policy whose
  adapters matter (``B`` random, not zero), with a float or an int8 base."""
  config = models.get_preset("tiny").replace(lora=models.LoraConfig(
      rank=4, alpha=8.0, quantize_base=request.param))
  params = models.init_params(config, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(1), 64))

  def nonzero_b(path, leaf):
    if path[-1].key.endswith("_lora_b"):
      return 0.2 * jax.random.normal(next(keys), leaf.shape, leaf.dtype)
    return leaf

  params = jax.tree_util.tree_map_with_path(nonzero_b, params)
  adapted = _rljax_logits(config, params)
  base = _rljax_logits(config.base_config(), params)
  assert np.abs(adapted - base).max() > 0.1  # the adapters change the logits
  policy = train.Policy(params, config, tokenizer=None, config=None, step=0)
  return policy, adapted, base


@pytest.mark.slow  # a transformers model per base: the fast tier stays near 5 min
@requires_peft
def test_merged_hf_export_of_a_lora_policy_gives_the_adapted_logits(
    lora_policy, tmp_path, monkeypatch, capsys):
  """``--merge``: a plain Hugging Face model (an int8 base dequantized) whose
  logits are the adapted rljax model's."""
  import transformers  # pylint: disable=import-outside-toplevel
  policy, adapted, _ = lora_policy
  out = tmp_path / "merged"
  _export(monkeypatch, policy.params, policy.model_config, out, None,
          args=["--merge"])
  assert "adapters are merged" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  config, params = models.load_hf_checkpoint(out)
  assert config == policy.model_config.without_lora()
  assert not models.lora.has_adapters(params)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(_torch_logits(model), adapted, atol=1e-4, rtol=0)


@pytest.mark.slow  # a transformers model per base: the fast tier stays near 5 min
@requires_peft
def test_peft_export_loads_in_peft_as_the_adapted_policy(lora_policy, tmp_path):
  """``"peft"``: ``base/`` is the frozen base exactly; the adapters on it
  (every tensor loaded) and their ``merge_and_unload`` give the adapted
  logits."""
  import peft  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  policy, adapted, base_logits = lora_policy
  exported = train.export_policy(policy, str(tmp_path), "peft")
  out = tmp_path / "export" / "adapters"
  assert exported.path == str(out)
  assert sorted(exported.files) == [
      "adapter_config.json", "adapter_model.safetensors",
      os.path.join("base", "config.json"),
      os.path.join("base", "model.safetensors")]
  adapter_config = json.loads((out / "adapter_config.json").read_text())
  assert adapter_config["base_model_name_or_path"] == str(out / "base")
  assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
  assert adapter_config["target_modules"] == [
      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
      "down_proj"]
  tensors = st_numpy.load_file(str(out / "adapter_model.safetensors"))
  d, f = policy.model_config.d_model, policy.model_config.mlp_dim
  assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
                 ].shape == (4, d)
  assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
                 ].shape == (d, 4)
  assert len(tensors) == 2 * 7 * policy.model_config.num_layers
  assert f != d  # so that a transposed gate/up/down would not fit

  base = transformers.AutoModelForCausalLM.from_pretrained(
      adapter_config["base_model_name_or_path"]).eval()
  np.testing.assert_allclose(_torch_logits(base), base_logits, atol=1e-4,
                             rtol=0)
  model = peft.PeftModel.from_pretrained(base, str(out)).eval()
  loaded = peft.get_peft_model_state_dict(model)
  assert sorted(loaded) == sorted(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(loaded[name].numpy(), value)
  np.testing.assert_allclose(_torch_logits(model), adapted, atol=1e-4, rtol=0)
  merged = model.merge_and_unload()
  assert not isinstance(merged, peft.PeftModel)
  np.testing.assert_allclose(_torch_logits(merged), adapted, atol=1e-4, rtol=0)


def test_peft_export_of_a_run_without_adapters_is_refused(
    tiny, tmp_path, monkeypatch):
  config, params, _ = tiny
  policy = train.Policy(params, config, tokenizer=None, config=None, step=0)
  with pytest.raises(ValueError, match=r"fmt='peft'.*no LoRA adapters "
                     r"\(model.lora.rank=0\)"):
    train.export_policy(policy, str(tmp_path), "peft")
  with pytest.raises(SystemExit, match=r"^error: --adapters: .* has no LoRA "
                     r"adapters \(model.lora.rank=0\)"):
    _export(monkeypatch, params, config, None, None, workdir=str(tmp_path),
            args=["--adapters"])
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("args, error", [
    (["--merge", "--adapters"], "--merge and --adapters: accepted one of them"),
    (["--merge", "--format=peft"], "--merge with --format=peft"),
    (["--merge", "--format=safetensors"], "--merge with --format=safetensors"),
    (["--adapters", "--format=hf"], "--adapters with --format=hf"),
])
def test_conflicting_format_flags_are_one_line_before_loading(
    args, error, monkeypatch):
  def load_policy(workdir, step):
    raise AssertionError("the flags are checked before the run is loaded")

  monkeypatch.setattr(export, "load_policy", load_policy)
  flags.FLAGS(["export", "--workdir=/nonexistent"] + args)
  try:
    with pytest.raises(SystemExit) as e:
      export.main([])
  finally:
    flags.FLAGS.unparse_flags()
  assert e.value.code.startswith(f"error: {error}")
  assert "\n" not in e.value.code


@pytest.mark.parametrize("fmt, given, merge, adapters, want", [
    ("safetensors", False, False, False, "safetensors"),
    ("safetensors", False, True, False, "hf"),
    ("safetensors", False, False, True, "peft"),
    ("hf", True, True, False, "hf"),
    ("peft", True, False, True, "peft"),
    ("peft", True, False, False, "peft"),
])
def test_merge_and_adapters_agree_with_format(fmt, given, merge, adapters,
                                              want):
  assert export.output_format(fmt, given, merge, adapters) == want
