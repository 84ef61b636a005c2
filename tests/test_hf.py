"""Hugging Face config and weights: rljax.models.hf_config and hf_weights.

Two kinds of test:
  * pure JAX (always run): ``config.json`` dicts written out by hand as
    ``transformers`` writes them, checkpoints written by rljax and read back
    by the ``safetensors`` package itself, layouts checked against the torch
    ``Linear`` convention (``y = W x``), broken checkpoints;
  * parity with ``transformers`` (``requires_hf``: torch and transformers):
    each family is a tiny random ``transformers`` model (fp32, GQA, weights
    and norms moved away from their init), saved with ``save_pretrained`` and
    read back by ``rljax.models.load_hf_checkpoint``; logits, greedy decoding
    and the reload of an export are compared.
"""

import functools
import json
import os
import re
import struct
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors as st_package

from rljax import models, sampling, sharding
from rljax import safetensors as rljax_safetensors
from rljax.tokenizers.hf import HFTokenizer, check_tokenizer_vocab
from tests.hf_extra import requires_hf

requires_torch = requires_hf("torch", "transformers")


def _hf():
  """``(torch, transformers)``, imported only by the tests that need them."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  transformers.utils.logging.disable_progress_bar()
  return torch, transformers


# --------------------------------------------------------------------------
# config.json <-> ModelConfig (pure)

_SHAPES = dict(vocab_size=160, hidden_size=64, intermediate_size=96,
               num_attention_heads=4, num_key_value_heads=2)

# As transformers writes them: Qwen2 in the pre-v5 field names, Llama in the
# v5 ``rope_parameters``, Gemma 3 with per-layer attention types.
QWEN2_JSON = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_hidden_layers=2,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, hidden_act="silu",
    tie_word_embeddings=False, torch_dtype="float32", use_sliding_window=False,
    sliding_window=None, max_window_layers=28, **_SHAPES)
LLAMA_JSON = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2,
    head_dim=16, rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False,
    mlp_bias=False, tie_word_embeddings=True, dtype="bfloat16",
    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                     "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16}, **_SHAPES)
GEMMA3_JSON = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
    num_hidden_layers=4, head_dim=16, hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=24, sliding_window=4, rope_theta=1_000_000.0,
    rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear",
                                              "factor": 2.0},
    layer_types=["sliding_attention", "full_attention"] * 2, **_SHAPES)


@pytest.mark.parametrize("hf, expected", [
    (QWEN2_JSON, dict(qkv_bias=True, qk_norm=False, head_dim=16,
                      num_kv_heads=2, rope_theta=1e6, rope_scaling=None,
                      sliding_window=None, tie_embeddings=False,
                      param_dtype="float32", norm_eps=1e-6)),
    (LLAMA_JSON, dict(qkv_bias=False, qk_norm=False, rope_theta=5e5,
                      rope_scaling=models.RopeScaling(
                          factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position=16),
                      tie_embeddings=True, param_dtype="bfloat16",
                      dtype="bfloat16")),
    (GEMMA3_JSON, dict(qk_norm=True, post_norms=True, norm_offset=1.0,
                       activation="gelu_tanh", embed_scale=True,
                       sliding_window=4, global_every=2,
                       rope_local_theta=100.0, query_scale=24 ** -0.5,
                       rope_scaling=models.RopeScaling(factor=2.0,
                                                       rope_type="linear"),
                       tie_embeddings=True, attn_logit_softcap=None)),
], ids=["qwen2", "llama3", "gemma3"])
def test_config_json_translation_and_round_trip(hf, expected):
  config = models.model_config_from_hf(hf)
  for field, value in expected.items():
    got = getattr(config, field)
    if isinstance(value, float):
      assert got == pytest.approx(value), field
    else:
      assert got == value, field
  arch = hf["architectures"][0]
  assert models.infer_architecture(config) == arch
  written = models.hf_config_from_model_config(config)
  assert written["architectures"] == [arch]
  assert models.model_config_from_hf(written) == config


def test_read_hf_config_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint"):
    models.read_hf_config(tmp_path)
  (tmp_path / "config.json").write_text("{oops")
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    models.load_hf_config(tmp_path)


def test_export_refuses_configs_the_architecture_cannot_express(tmp_path):
  config = models.get_preset("tiny").replace(final_logit_softcap=3.0)
  with pytest.raises(ValueError, match="final_logit_softcap=3.0 cannot be "
                     "exported as LlamaForCausalLM"):
    models.save_hf_checkpoint(tmp_path, config, None)
  with pytest.raises(ValueError, match="qkv_bias=False cannot be exported as "
                     "Qwen2ForCausalLM"):
    models.hf_config_from_model_config(models.get_preset("tiny"),
                                       "Qwen2ForCausalLM")
  with pytest.raises(TypeError, match=r"save_hf_checkpoint\(path, config, "
                     r"params\): config is a dict"):
    models.save_hf_checkpoint(tmp_path, {}, models.get_preset("tiny"))


# --------------------------------------------------------------------------
# Weights written by rljax (pure)


def _perturbed_params(config, seed=0):
  """Random params with biases and norms moved away from their init too."""
  leaves, treedef = jax.tree.flatten(models.init_params(config,
                                                        jax.random.key(seed)))
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return treedef.unflatten([
      p + 0.1 * jax.random.normal(k, p.shape, p.dtype)
      for p, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def rljax_checkpoint(tmp_path_factory):
  """``(path, config, params, files)``: a Qwen2 checkpoint in several shards."""
  config = models.model_config_from_hf(QWEN2_JSON)
  params = _perturbed_params(config)
  path = tmp_path_factory.mktemp("rljax_qwen2")
  files = models.save_hf_checkpoint(path, config, params,
                                    max_shard_size=40_000)
  return path, config, params, files


def _package_tensor(path, name):
  """A tensor read by the safetensors package itself, through the index."""
  with open(path / "model.safetensors.index.json") as f:
    file = json.load(f)["weight_map"][name]
  with st_package.safe_open(str(path / file), framework="numpy") as f:
    return f.get_tensor(name)


@pytest.mark.slow
def test_rljax_checkpoint_round_trip(rljax_checkpoint):
  path, config, params, files = rljax_checkpoint
  assert "model.safetensors.index.json" in files and "config.json" in files
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 1 and sorted(shards) == sorted(
      f for f in os.listdir(path) if f.endswith(".safetensors"))
  config2, params2 = models.load_hf_checkpoint(path)
  assert config2 == config
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_written_layouts_follow_torch_linear(rljax_checkpoint):
  """Each file tensor acts as torch's ``Linear`` (``y = W x``) on rljax's maths."""
  path, config, params, _ = rljax_checkpoint
  n, k, h, d = (config.num_heads, config.num_kv_heads, config.head_dim,
                config.d_model)
  rng = np.random.RandomState(0)
  x = rng.randn(d).astype(np.float32)
  attn, mlp = params["layers_1"]["attn"], params["layers_1"]["mlp"]
  tensor = functools.partial(_package_tensor, path)
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  for proj, heads in (("q", n), ("k", k), ("v", k)):
    w = tensor(f"model.layers.1.self_attn.{proj}_proj.weight")
    assert w.shape == (heads * h, d)
    close((w @ x).reshape(heads, h),
          np.einsum("d,dnh->nh", x, np.asarray(attn[f"{proj}_kernel"])))
    b = tensor(f"model.layers.1.self_attn.{proj}_proj.bias")
    close(b.reshape(heads, h), np.asarray(attn[f"{proj}_bias"]))
  a = rng.randn(n, h).astype(np.float32)
  close(tensor("model.layers.1.self_attn.o_proj.weight") @ a.reshape(-1),
        np.einsum("nh,nhd->d", a, np.asarray(attn["o_kernel"])))
  y = rng.randn(config.mlp_dim).astype(np.float32)
  close(tensor("model.layers.1.mlp.gate_proj.weight") @ x,
        x @ np.asarray(mlp["gate_kernel"]))
  close(tensor("model.layers.1.mlp.up_proj.weight") @ x,
        x @ np.asarray(mlp["up_kernel"]))
  close(tensor("model.layers.1.mlp.down_proj.weight") @ y,
        y @ np.asarray(mlp["down_kernel"]))
  close(tensor("lm_head.weight") @ x, x @ np.asarray(params["lm_head"]))
  close(tensor("model.embed_tokens.weight"), np.asarray(params["embedding"]))
  close(tensor("model.layers.1.post_attention_layernorm.weight"),
        np.asarray(params["layers_1"]["pre_mlp_norm"]["scale"]))


def test_import_onto_mesh_follows_the_logical_rules(rljax_checkpoint):
  path, config, params, _ = rljax_checkpoint
  mesh = sharding.make_mesh(2, 2, 2)
  config8, params8 = models.load_hf_checkpoint(path, mesh)
  assert config8 == config
  expected = models.param_shardings(config, mesh)
  flat, _ = jax.tree_util.tree_flatten_with_path(params8)
  for (keypath, array), want, single in zip(
      flat, jax.tree.leaves(expected), jax.tree.leaves(params)):
    assert array.sharding == want, jax.tree_util.keystr(keypath)
    np.testing.assert_array_equal(np.asarray(array), np.asarray(single))
  q = params8["layers_0"]["attn"]["q_kernel"]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert {s.data.shape for s in q.addressable_shards} == {(32, 2, 16)}


def test_bf16_export_and_import(rljax_checkpoint, tmp_path):
  _, config, params, _ = rljax_checkpoint
  files = models.save_hf_checkpoint(tmp_path, config, params, dtype="bfloat16")
  assert files == ["model.safetensors", "config.json"]
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  with st_package.safe_open(str(tmp_path / "model.safetensors"),
                            framework="numpy") as f:
    assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
  config16, params16 = models.load_hf_checkpoint(tmp_path)
  assert config16 == config.replace(param_dtype="bfloat16", dtype="bfloat16")
  for got, want in zip(jax.tree.leaves(params16), jax.tree.leaves(params)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(want.astype(jnp.bfloat16)))
  _, params32 = models.load_hf_checkpoint(tmp_path, param_dtype="float32")
  assert params32["embedding"].dtype == jnp.float32
  np.testing.assert_array_equal(
      np.asarray(params32["embedding"]),
      np.asarray(params16["embedding"]).astype(np.float32))


def test_load_hf_pretrained_returns_config_and_params_only(rljax_checkpoint,
                                                           tmp_path):
  path, config, params, _ = rljax_checkpoint
  source = tmp_path / "tokenizer_source"
  source.mkdir()
  (source / "tokenizer.json").write_text('{"any": "bytes"}')
  (source / "chat_template.jinja").write_text("{{ messages }}")
  out = tmp_path / "out"
  files = models.save_hf_checkpoint(out, config, params, tokenizer_from=source)
  # Tokenizer files are copied as bytes; the model package never parses them.
  assert files[-2:] == ["tokenizer.json", "chat_template.jinja"]
  assert (out / "tokenizer.json").read_text() == '{"any": "bytes"}'
  loaded = models.load_hf_pretrained(out)
  assert isinstance(loaded, models.HFModel) and len(loaded) == 2
  config2, params2 = loaded
  assert config2 == loaded.config == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)


# --------------------------------------------------------------------------
# Broken checkpoints and unsupported configs (pure)


def _copy(src, dst):
  os.makedirs(dst, exist_ok=True)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(dst / name, "wb") as g:
      g.write(f.read())
  return dst


def _edit_config(path, **changes):
  file = os.path.join(path, "config.json")
  with open(file) as f:
    config = json.load(f)
  config.update(changes)
  with open(file, "w") as f:
    json.dump(config, f)


def _shard_of(path, tensor):
  with open(path / "model.safetensors.index.json") as f:
    return json.load(f)["weight_map"][tensor]


def _rewrite_shard(path, shard, **replace):
  """Rewrites one shard with the package, replacing or adding tensors."""
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  tensors = st_numpy.load_file(str(path / shard))
  tensors.update(replace)
  st_numpy.save_file(tensors, str(path / shard), metadata={"format": "pt"})


def test_missing_shard_is_a_clear_error(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  shard = sorted(n for n in os.listdir(path) if n.startswith("model-"))[-1]
  os.remove(path / shard)
  with pytest.raises(FileNotFoundError, match=f"{shard}.*missing"):
    models.load_hf_checkpoint(path)


def test_wrong_shape_is_a_clear_error(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  _edit_config(path, intermediate_size=100)
  with pytest.raises(ValueError, match=r"gate_proj.weight' has shape \[96, 64\]"
                     r", but config.json implies \[100, 64\]"):
    models.load_hf_checkpoint(path)


def test_integer_tensor_is_a_clear_error(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  name = "model.layers.0.mlp.up_proj.weight"
  shard = _shard_of(path, name)
  _rewrite_shard(path, shard, **{name: np.zeros((96, 64), np.int32)})
  with pytest.raises(ValueError, match=rf"{shard}: tensor '{name}' has dtype "
                     r"'I32'; accepted: \('F64', 'F32', 'F16', 'BF16'\)"):
    models.load_hf_checkpoint(path)


def test_unexpected_tensor_is_a_clear_error(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  _rewrite_shard(path, _shard_of(path, "model.norm.weight"),
                 **{"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match=r"1 tensor\(s\) that rljax's "
                     r"Qwen2ForCausalLM does not use, e.g. \['model.layers.0."
                     r"mlp.extra.weight'\]"):
    models.load_hf_checkpoint(path)


def test_corrupt_shard_names_the_file(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  shard = _shard_of(path, "model.norm.weight")
  data = (path / shard).read_bytes()
  (path / shard).write_bytes(data[:-4])  # the last tensor loses its tail
  with pytest.raises(ValueError, match=rf"{shard} is not a valid safetensors "
                     r"file \(tensor '.*': data_offsets .* lie outside"):
    models.load_hf_checkpoint(path)


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["MistralForCausalLM"]},
     r"architectures=\['MistralForCausalLM'\].*accepted: one of \("),
    ({"hidden_act": "gelu"}, r"Qwen2ForCausalLM: .*hidden_act='gelu'.*'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                          "rope_theta": 1e4}},
     r"rope_parameters.rope_type='yarn'.*accepted: \('default', 'linear'"),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
      "layer_types": None},
     r"layer_types=None.*every k-th layer full_attention"),
])
def test_unsupported_config_is_a_clear_error(rljax_checkpoint, tmp_path,
                                             changes, match):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=match):
    models.load_hf_checkpoint(path)


def _write_config(directory, hf):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f)
  return directory


_LLAMA_ROPE = LLAMA_JSON["rope_parameters"]


@pytest.mark.parametrize("base, changes, match", [
    (QWEN2_JSON, {"num_attention_heads": 0},
     r"num_attention_heads=0 is invalid; accepted: a positive integer"),
    (QWEN2_JSON, {"num_key_value_heads": 0},
     r"num_key_value_heads=0 is invalid; accepted: a positive integer"),
    (QWEN2_JSON, {"num_key_value_heads": 3},
     r"num_key_value_heads=3 is invalid; accepted: a divisor of "
     r"num_attention_heads=4"),
    (QWEN2_JSON, {"hidden_size": 66},
     r"hidden_size=66 is invalid; accepted: a multiple of "
     r"num_attention_heads=4, since there is no head_dim"),
    (LLAMA_JSON, {"head_dim": -16}, r"head_dim=-16 is invalid"),
    (QWEN2_JSON, {"intermediate_size": 0}, r"intermediate_size=0 is invalid"),
    (QWEN2_JSON, {"vocab_size": "160"}, r"vocab_size='160' is invalid"),
    (QWEN2_JSON, {"num_hidden_layers": True},
     r"num_hidden_layers=True is invalid"),
    (QWEN2_JSON, {"num_hidden_layers": None},
     r"config.json has no 'num_hidden_layers'"),
    (QWEN2_JSON, {"max_position_embeddings": 0},
     r"max_position_embeddings=0 is invalid"),
    (QWEN2_JSON, {"rms_norm_eps": -1e-6},
     r"rms_norm_eps=-1e-06 is invalid; accepted: a finite number >= 0"),
    (QWEN2_JSON, {"rope_theta": 0},
     r"rope_theta=0 is invalid; accepted: a finite number > 0"),
    (QWEN2_JSON, {"tie_word_embeddings": "yes"},
     r"tie_word_embeddings='yes' is invalid; accepted: true or false"),
    (QWEN2_JSON, {"hidden_act": "relu"},
     r"hidden_act='relu' is not supported by rljax; accepted: \('silu',\)"),
    (QWEN2_JSON, {"rope_scaling": [8.0]}, r"rope_scaling=\[8.0\] is invalid"),
    (LLAMA_JSON, {"rope_parameters": {**_LLAMA_ROPE, "high_freq_factor": 1.0}},
     r"rope_parameters.high_freq_factor=1.0 is invalid; accepted: a finite "
     r"number > 1"),
    (LLAMA_JSON, {"rope_parameters": {"rope_type": "linear", "factor": 0}},
     r"rope_parameters.factor=0 is invalid"),
    (GEMMA3_JSON, {"query_pre_attn_scalar": 0},
     r"query_pre_attn_scalar=0 is invalid"),
    (GEMMA3_JSON, {"sliding_window": 0}, r"sliding_window=0 is invalid"),
    (GEMMA3_JSON, {"final_logit_softcapping": -3.0},
     r"final_logit_softcapping=-3.0 is invalid"),
    (GEMMA3_JSON, {"rope_local_base_freq": -1.0},
     r"rope_local_base_freq=-1.0 is invalid"),
])
def test_invalid_config_values_name_the_file_and_field(tmp_path, base,
                                                       changes, match):
  path = _write_config(tmp_path / "ckpt", {**base, **changes})
  file = re.escape(os.path.join(path, "config.json"))
  with pytest.raises(ValueError,
                     match=rf"^{file}: \w+ForCausalLM: .*{match}"):
    models.load_hf_config(path)


def test_config_json_that_is_not_an_object_names_the_file(tmp_path):
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match=r"config.json holds a JSON list; a "
                     "JSON object of config fields is required"):
    models.load_hf_config(tmp_path)
  (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
  with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
    models.load_hf_config(tmp_path)


def test_zero_heads_in_a_checkpoint_is_a_clear_error(rljax_checkpoint,
                                                     tmp_path):
  # Used to be a bare ZeroDivisionError (hidden_size // num_attention_heads).
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  _edit_config(path, num_attention_heads=0, head_dim=None)
  file = re.escape(os.path.join(path, "config.json"))
  with pytest.raises(ValueError, match=rf"^{file}: Qwen2ForCausalLM: "
                     r"config.json field num_attention_heads=0 is invalid"):
    models.load_hf_checkpoint(path)


def _alias(file, name, other):
  """Points ``name``'s data_offsets at ``other``'s bytes, byte by byte."""
  raw = file.read_bytes()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + n])
  header[name]["data_offsets"] = header[other]["data_offsets"]
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def test_aliased_weights_are_refused(rljax_checkpoint, tmp_path):
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  name = "model.norm.weight"
  shard = _shard_of(path, name)
  with st_package.safe_open(str(path / shard), framework="numpy") as f:
    other = next(t for t in f.keys() if t != name
                 and f.get_slice(t).get_shape() == [64])
  _alias(path / shard, name, other)
  with pytest.raises(ValueError, match=rf"{shard} is not a valid safetensors "
                     r"file \(tensor '.*': its bytes overlap those of") as e:
    models.load_hf_checkpoint(path)
  assert name in str(e.value) and other in str(e.value)


def test_all_tensors_are_checked_before_any_is_read(rljax_checkpoint,
                                                    tmp_path, monkeypatch):
  reads = []
  view = rljax_safetensors.SafetensorsFile.view  # the import maps each tensor

  def counting_view(self, name, **kwargs):
    reads.append(name)
    return view(self, name, **kwargs)

  monkeypatch.setattr(rljax_safetensors.SafetensorsFile, "view", counting_view)
  monkeypatch.setattr(rljax_safetensors.SafetensorsFile, "read", None)
  path = _copy(rljax_checkpoint[0], tmp_path / "ckpt")
  models.load_hf_checkpoint(path)
  assert reads and reads[-1] == "lm_head.weight"  # the last tensor read
  name = "lm_head.weight"
  shard = _shard_of(path, name)
  for bad, match in ((np.zeros((160, 64), np.int32), r"has dtype 'I32'"),
                     (np.zeros((160, 63), np.float32),
                      r"has shape \[160, 63\], but config.json implies")):
    reads.clear()
    _rewrite_shard(path, shard, **{name: bad})
    with pytest.raises(ValueError, match=rf"{shard}: tensor '{name}' {match}"):
      models.load_hf_checkpoint(path)
    assert not reads


def test_export_over_an_older_export_removes_its_files(rljax_checkpoint,
                                                       tmp_path):
  _, config, params, _ = rljax_checkpoint
  out = _copy(rljax_checkpoint[0], tmp_path / "out")  # an older sharded export
  (out / "README.md").write_text("kept")
  new = _perturbed_params(config, seed=5)
  files = models.save_hf_checkpoint(out, config, new)
  assert files == ["model.safetensors", "config.json"]
  assert sorted(os.listdir(out)) == ["README.md", "config.json",
                                     "model.safetensors"]
  _, loaded = models.load_hf_checkpoint(out)
  jax.tree.map(np.testing.assert_array_equal, loaded, new)
  # And back to shards: no model.safetensors is left beside the index.
  files = models.save_hf_checkpoint(out, config, params, max_shard_size=40_000)
  assert sorted(os.listdir(out)) == sorted(files + ["README.md"])
  _, loaded = models.load_hf_checkpoint(out)
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


# --------------------------------------------------------------------------
# Tokenizer ids against the model's vocabulary (pure, and tokenizers)


def test_tokenizer_ids_past_the_model_vocab_are_a_clear_error():
  tok = types.SimpleNamespace(vocab_size=100, bos_id=1, eos_id=2, pad_id=0,
                              eos_ids=(2, 130))
  assert check_tokenizer_vocab(tok, 131, "ckpt") == 130
  with pytest.raises(ValueError, match=r"^ckpt: the tokenizer's largest id is "
                     r"130 \(eos_ids\[1\]\), but the model has vocab_size=120 "
                     r"\(ids 0..119\)"):
    check_tokenizer_vocab(tok, 120, "ckpt")
  tok = types.SimpleNamespace(vocab_size=100, bos_id=None, eos_id=2, pad_id=0)
  assert check_tokenizer_vocab(tok, 100, "ckpt") == 99
  with pytest.raises(ValueError, match=r"largest id is 99 "
                     r"\(tokenizer.vocab_size - 1\).*vocab_size=64"):
    check_tokenizer_vocab(tok, 64, "ckpt")
  tok.pad_id = 100
  with pytest.raises(ValueError, match=r"largest id is 100 \(pad_id\)"):
    check_tokenizer_vocab(tok, 100, "ckpt")


@requires_hf("tokenizers")
def test_tokenizer_json_ids_are_checked_beyond_its_vocab_size():
  import tokenizers  # pylint: disable=import-outside-toplevel
  # Ids with a hole: get_vocab_size() is 3, but 'z' has id 9.
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"a": 0, "</s>": 1, "z": 9}, unk_token="a"))
  tok = HFTokenizer(backend, eos_token="</s>")
  assert tok.vocab_size == 3
  assert check_tokenizer_vocab(tok, 10, "ckpt") == 9
  with pytest.raises(ValueError, match=r"largest id is 9 \(the id of token "
                     r"'z'\), but the model has vocab_size=5"):
    check_tokenizer_vocab(tok, 5, "ckpt")


# --------------------------------------------------------------------------
# Parity with transformers (torch, transformers)

VOCAB = 160
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _family_configs():
  _, t = _hf()
  return {
      "llama3": (t.LlamaForCausalLM, t.LlamaConfig(
          num_hidden_layers=2, rope_theta=500_000.0, rope_scaling={
              "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
          **_COMMON)),
      "qwen2.5": (t.Qwen2ForCausalLM, t.Qwen2Config(
          num_hidden_layers=2, rope_theta=1_000_000.0, **_COMMON)),
      "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(
          num_hidden_layers=2, tie_word_embeddings=True, **_COMMON)),
      # Windows of 4 tokens: shorter than the prompts, so local layers matter.
      "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(
          num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=24,
          attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **_COMMON)),
      "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
          num_hidden_layers=4, sliding_window=4, sliding_window_pattern=2,
          rope_local_base_freq=100.0, query_pre_attn_scalar=24,
          rope_scaling={"rope_type": "linear", "factor": 2.0}, **_COMMON)),
  }


FAMILIES = ("llama3", "qwen2.5", "qwen3", "gemma2", "gemma3")
PROMPT_LENGTHS = (3, 9, 12)
MAX_DIFFS = {}  # filled by the logit test, printed with -s


def _hf_model(name):
  torch, _ = _hf()
  cls, config = _family_configs()[name]
  config._attn_implementation = "eager"  # Gemma 2's soft-cap needs eager
  torch.manual_seed(sorted(FAMILIES).index(name))
  model = cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:  # norms (Gemma's are zero-centred) and biases
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.15)
  return model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
  """``(name, hf_model, checkpoint_dir, config, params)`` of one family."""
  name = request.param
  model = _hf_model(name)
  path = str(tmp_path_factory.mktemp(name.replace(".", "_")))
  model.save_pretrained(path)
  config, params = models.load_hf_checkpoint(path)
  return name, model, path, config, params


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(0, VOCAB, size=n) for n in PROMPT_LENGTHS]


def _hf_logits(model, tokens):
  torch, _ = _hf()
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens)[None])).logits[0].numpy()


@functools.lru_cache(maxsize=None)
def _apply(config):
  return jax.jit(functools.partial(models.Decoder(config).apply,
                                   return_logits=True))


def _rljax_logits(config, params, tokens, mask):
  out, _ = _apply(config)({"params": params}, tokens,
                          models.positions_from_mask(mask), input_mask_BxT=mask)
  return np.asarray(out)


def _left_padded(prompts, width=16):
  return sampling.pad_prompts([list(p) for p in prompts], (width,))


@requires_torch
@pytest.mark.slow
def test_config_translation(family):
  name, model, _, config, params = family
  hf_config = model.config
  assert config.num_layers == hf_config.num_hidden_layers
  assert config.tie_embeddings == hf_config.tie_word_embeddings
  assert ("lm_head" in params) == (not config.tie_embeddings)
  if name.startswith("gemma"):
    assert config.sliding_window == 4 and config.global_every == 2
    assert config.query_scale == pytest.approx(24 ** -0.5)
    assert [config.is_local_layer(i) for i in range(config.num_layers)] == [
        t == "sliding_attention" for t in hf_config.layer_types]
  if name == "gemma3":
    assert config.rope_local_theta == 100.0
    assert config.rope_scaling == models.RopeScaling(factor=2.0,
                                                     rope_type="linear")
  if name == "llama3":
    assert config.rope_scaling == models.RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position=16)


@requires_torch
@pytest.mark.slow
def test_logits_match_transformers_on_ragged_left_padded_batch(family, prompts):
  name, model, _, config, params = family
  tokens, mask = _left_padded(prompts)
  ours = _rljax_logits(config, params, tokens, mask)
  diff = 0.0
  for i, p in enumerate(prompts):
    ref = _hf_logits(model, p)
    diff = max(diff, float(np.abs(ours[i][mask[i]] - ref).max()))
  MAX_DIFFS[name] = diff
  print(f"\n{name}: max |logit diff| = {diff:.2e}")
  assert diff <= 1e-4


@requires_torch
@pytest.mark.slow
def test_greedy_generation_matches_transformers(family, prompts):
  torch, _ = _hf()
  _, model, _, config, params = family
  tokens, mask = _left_padded(prompts)
  sampler = sampling.SamplerConfig(
      max_new_tokens=32, method=sampling.SamplingMethod(greedy=True),
      cache_dtype="float32", prompt_buckets=(tokens.shape[1],))
  rollout = jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(0), model_config=config,
      config=sampler))
  assert rollout.completion_mask.all()
  for i, p in enumerate(prompts):
    with torch.no_grad():
      out = model.generate(
          torch.tensor(p[None]), attention_mask=torch.ones((1, len(p)), dtype=torch.long),
          do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
    np.testing.assert_array_equal(rollout.completion_tokens[i],
                                  out[0, len(p):].numpy())


@requires_torch
def test_export_then_transformers_reload_gives_the_same_logits(
    family, prompts, tmp_path):
  _, transformers = _hf()
  _, model, _, config, params = family
  files = models.save_hf_checkpoint(tmp_path, config, params,
                                    max_shard_size=40_000)
  assert "model.safetensors.index.json" in files  # several shards were written
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded) is type(model)
  for p in prompts:
    np.testing.assert_allclose(_hf_logits(reloaded, p), _hf_logits(model, p),
                               atol=1e-5, rtol=0)
  config2, params2 = models.load_hf_checkpoint(tmp_path)
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, params2, params)


@requires_torch
def test_bf16_checkpoint_of_transformers_loads_without_torch_conversion(
    tmp_path):
  torch, transformers = _hf()
  model = _hf_model("qwen3").to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  config, params = models.load_hf_checkpoint(tmp_path)
  assert config.param_dtype == "bfloat16"
  q = params["layers_1"]["attn"]["q_kernel"]
  assert q.dtype == jnp.bfloat16
  want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(
      np.asarray(q, np.float32),
      want.reshape(config.num_heads, config.head_dim, -1).transpose(2, 0, 1))
  config32, params32 = models.load_hf_checkpoint(tmp_path, param_dtype="float32")
  assert config32.param_dtype == "float32"
  assert params32["embedding"].dtype == jnp.float32
  files = models.save_hf_checkpoint(tmp_path / "out", config, params)
  assert files == ["model.safetensors", "config.json"]
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert again.dtype == torch.bfloat16
  torch.testing.assert_close(again.model.embed_tokens.weight,
                             model.model.embed_tokens.weight, atol=0, rtol=0)


@requires_torch
def test_sharded_checkpoint_of_transformers_loads(tmp_path):
  path = tmp_path / "sharded"
  _hf_model("qwen2.5").save_pretrained(path, max_shard_size="40KB")
  with open(path / "model.safetensors.index.json") as f:
    assert len(set(json.load(f)["weight_map"].values())) > 1
  config, params = models.load_hf_checkpoint(path)
  assert config.qkv_bias and params["layers_1"]["attn"]["k_bias"].shape == (2, 16)
