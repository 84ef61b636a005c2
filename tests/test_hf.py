"""Hugging Face import/export: logit and greedy-decoding parity with transformers.

Each family is a tiny random ``transformers`` model (fp32, GQA, weights and
norms moved away from their init), saved with ``save_pretrained`` and read
back by ``rljax.models.load_hf_checkpoint``.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the Hugging Face parity tests need the hf extra (torch)")
transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face parity tests need the hf extra "
    "(transformers)")
hf_tokenizers = pytest.importorskip(
    "tokenizers", reason="the tokenizer adapter tests need the hf extra")

from rljax import hf_tokenizer, models, sampling, sharding  # noqa: E402
from rljax import tokenizers as rljax_tokenizers  # noqa: E402

transformers.utils.logging.disable_progress_bar()

VOCAB = 160
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _family_configs():
  t = transformers
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


def test_greedy_generation_matches_transformers(family, prompts):
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


def test_export_then_transformers_reload_gives_the_same_logits(
    family, prompts, tmp_path):
  name, model, path, config, params = family
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


def test_import_onto_mesh_follows_the_logical_rules(family):
  _, _, path, config, params = family
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


def test_bf16_checkpoint_loads_without_torch_conversion(tmp_path):
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
  assert params32["embedding"].dtype == jnp.float32
  files = models.save_hf_checkpoint(tmp_path / "out", config, params)
  assert files == ["model.safetensors", "config.json"]
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
  assert again.dtype == torch.bfloat16
  torch.testing.assert_close(again.model.embed_tokens.weight,
                             model.model.embed_tokens.weight, atol=0, rtol=0)


# --------------------------------------------------------------------------
# Broken checkpoints and unsupported configs


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("sharded")
  _hf_model("qwen2.5").save_pretrained(path, max_shard_size="40KB")
  return path


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


def test_sharded_checkpoint_loads(sharded_checkpoint):
  with open(sharded_checkpoint / "model.safetensors.index.json") as f:
    assert len(set(json.load(f)["weight_map"].values())) > 1
  config, params = models.load_hf_checkpoint(sharded_checkpoint)
  assert config.qkv_bias and params["layers_1"]["attn"]["k_bias"].shape == (2, 16)


def test_missing_shard_is_a_clear_error(sharded_checkpoint, tmp_path):
  path = _copy(sharded_checkpoint, tmp_path / "ckpt")
  shard = sorted(n for n in os.listdir(path) if n.startswith("model-"))[-1]
  os.remove(path / shard)
  with pytest.raises(FileNotFoundError, match=f"{shard}.*missing"):
    models.load_hf_checkpoint(path)


def test_wrong_shape_is_a_clear_error(sharded_checkpoint, tmp_path):
  path = _copy(sharded_checkpoint, tmp_path / "ckpt")
  _edit_config(path, intermediate_size=100)
  with pytest.raises(ValueError, match=r"gate_proj.weight' has shape \[96, 64\]"
                     r", but config.json implies \[100, 64\]"):
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
def test_unsupported_config_is_a_clear_error(sharded_checkpoint, tmp_path,
                                             changes, match):
  path = _copy(sharded_checkpoint, tmp_path / "ckpt")
  _edit_config(path, **changes)
  with pytest.raises(ValueError, match=match):
    models.load_hf_checkpoint(path)


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
# Tokenizers


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief. "},
            {"role": "user", "content": "What is 7 * 6?"}]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  """A byte-level BPE tokenizer trained in-process, saved as tokenizer.json."""
  path = tmp_path_factory.mktemp("bpe")
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
      initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  corpus = [f"What is {a} * {b}? The answer is {a * b}." for a in range(20)
            for b in range(20)]
  tok.train_from_iterator(corpus, trainer)
  tok.save(str(path / "tokenizer.json"))
  with open(path / "tokenizer_config.json", "w") as f:
    # The EOS in the older AddedToken form, which some checkpoints still use.
    json.dump({"bos_token": "<s>", "pad_token": "<pad>",
               "eos_token": {"__type": "AddedToken", "content": "</s>",
                             "special": True},
               "chat_template": TEMPLATE,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  with open(path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [2, 0]}, f)
  return path


@pytest.mark.parametrize("text", [
    "What is 12 * 3? The answer is 36.",
    "  leading spaces,\ttabs and\nnewlines ",
    "unseen: ünïcödé €100 — 😀",
])
def test_hf_tokenizer_round_trips_and_matches_transformers(bpe_dir, text):
  tok = hf_tokenizer.load_tokenizer(bpe_dir)
  assert isinstance(tok, hf_tokenizer.HFTokenizer)
  assert isinstance(tok, rljax_tokenizers.Tokenizer)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert all(0 <= i < tok.vocab_size for i in ids)
  reference = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(bpe_dir / "tokenizer.json"))
  assert ids == reference.encode(text, add_special_tokens=False)


def test_hf_tokenizer_special_tokens(bpe_dir):
  tok = hf_tokenizer.load_tokenizer(bpe_dir)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.eos_ids == (2, 0)
  assert tok.vocab_size == 300
  assert tok.decode([1] + tok.encode("7") + [2]) == "7"


def test_chat_template_matches_transformers(bpe_dir):
  tok = hf_tokenizer.load_tokenizer(bpe_dir)
  text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
  assert text == ("<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is 7 * 6?</s>\n"
                  "<|assistant|>\n")
  reference = transformers.AutoTokenizer.from_pretrained(bpe_dir)
  for gen in (True, False):
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == (
        reference.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                      tokenize=False))
  assert tok.encode(text)[0] == tok.bos_id  # the template wrote the BOS


def test_sentencepiece_checkpoint_tokenizer_with_template_file(tmp_path):
  sp = rljax_tokenizers.train_sentencepiece(
      [f"What is {a} * {b}?" for a in range(30) for b in range(30)], 64)
  sp.save(tmp_path / "tokenizer.model")
  with open(tmp_path / "chat_template.jinja", "w") as f:
    f.write(TEMPLATE)
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  tok = hf_tokenizer.load_tokenizer(tmp_path)
  assert isinstance(tok, hf_tokenizer.SentencePieceChatTokenizer)
  assert tok.decode(tok.encode("What is 3 * 4?")) == "What is 3 * 4?"
  assert tok.apply_chat_template(MESSAGES[1:]).startswith("<s><|user|>\nWhat")


def test_missing_tokenizer_and_template_are_clear_errors(tmp_path, bpe_dir):
  with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor"):
    hf_tokenizer.load_tokenizer(tmp_path)
  tok = hf_tokenizer.HFTokenizer.from_file(bpe_dir / "tokenizer.json",
                                           eos_token="</s>")
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(MESSAGES)
  with pytest.raises(ValueError, match="eos_token='<eos>' is not in"):
    hf_tokenizer.HFTokenizer.from_file(bpe_dir / "tokenizer.json",
                                       eos_token="<eos>")


def test_load_hf_pretrained_returns_config_params_and_tokenizer(
    sharded_checkpoint, bpe_dir, tmp_path):
  config, params = models.load_hf_checkpoint(sharded_checkpoint)
  models.save_hf_checkpoint(tmp_path, config, params, tokenizer_from=bpe_dir)
  config2, params2, tok = models.load_hf_pretrained(tmp_path)
  assert config2 == config and isinstance(tok, hf_tokenizer.HFTokenizer)
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  assert tok.apply_chat_template(MESSAGES).endswith("<|assistant|>\n")


def test_gsm8k_config_validates():
  import importlib.util  # pylint: disable=import-outside-toplevel
  from rljax.train import loop  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "gsm8k_grpo", os.path.join(os.path.dirname(__file__), "..", "configs",
                                 "gsm8k_grpo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  mesh = sharding.make_mesh(1, -1, 1)
  for arg in (None, "tiny"):
    loop.validate(module.get_config(arg), mesh)
  config = module.get_config()
  assert config.model.path == "" and config.rewards.names == ("math_answer",)
  assert config.task.path.endswith(".jsonl") and config.sft.num_steps == 0
  config.task.path = ""
  with pytest.raises(ValueError, match="set task.path to a JSONL file"):
    loop.validate(config, mesh)
