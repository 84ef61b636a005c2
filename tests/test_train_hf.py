"""Training from a Hugging Face checkpoint: ``train.run`` with ``model.path``.

A tiny random Llama (``transformers``, fp32) with a character-level
``tokenizer.json`` and a chat template in ``tokenizer_config.json`` is trained
for two GRPO steps on a JSONL addition task; the run directory is then
reloaded with ``load_policy``.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="training a Hugging Face checkpoint needs the hf extra")
transformers = pytest.importorskip(
    "transformers", reason="training a Hugging Face checkpoint needs the hf "
    "extra")
hf_tokenizers = pytest.importorskip(
    "tokenizers", reason="training a Hugging Face checkpoint needs the hf extra")
pytest.importorskip("jinja2", reason="chat templates need the hf extra")

from rljax import hf_tokenizer, metrics, models, sampling, train  # noqa: E402
from rljax.train import batching, policy  # noqa: E402

transformers.utils.logging.disable_progress_bar()

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
VOCAB = SPECIALS + ["\n"] + list("0123456789+=")
PAD, BOS, EOS, USER, ASSISTANT, NEWLINE = range(6)
MODEL_VOCAB = 32  # padded embeddings: more rows than the tokenizer's 18 ids
LEARNING_RATE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny Llama checkpoint directory with tokenizer files and a template."""
  path = tmp_path_factory.mktemp("hf_llama")
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(
      {t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.Split(
      hf_tokenizers.Regex(".|\n"), "isolated")  # one token per character
  tok.decoder = hf_tokenizers.decoders.Fuse()
  tok.add_special_tokens(SPECIALS)
  tok.save(str(path / "tokenizer.json"))
  with open(path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
               "chat_template": TEMPLATE,
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, tie_word_embeddings=False, bos_token_id=BOS,
      eos_token_id=EOS, pad_token_id=PAD))
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim > 1:
        p.normal_(0.0, 0.2)
  model.save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
  path = tmp_path_factory.mktemp("task")
  rng = np.random.default_rng(0)
  files = {}
  for split, n in (("train", 32), ("test", 8)):
    files[split] = str(path / f"{split}.jsonl")
    with open(files[split], "w") as f:
      for a, b in rng.integers(0, 50, (n, 2)):
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return files


def _config(checkpoint, task_files):
  spec = importlib.util.spec_from_file_location(
      "gsm8k_grpo", os.path.join(os.path.dirname(__file__), "..", "configs",
                                 "gsm8k_grpo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("tiny")
  config.model.path = checkpoint
  config.task.path = task_files["train"]
  config.task.heldout_path = task_files["test"]
  config.tokenizer.chat_template = True
  config.rewards.names = ("numeric_match",)
  config.rewards.num_workers = 0
  config.sampler.max_new_tokens = 4
  config.sampler.prompt_buckets = (16,)
  config.rl.num_steps = 2
  config.eval.num_examples = 8
  config.eval.every = 2
  config.optimizer.learning_rate = LEARNING_RATE
  config.optimizer.warmup_steps = 0
  config.eval.greedy = False
  return config


def _tokenizer(checkpoint, chat_template=True):
  return batching.prompt_tokenizer(hf_tokenizer.load_tokenizer(checkpoint),
                                   chat_template)


def test_prompts_are_rendered_through_the_chat_template(checkpoint):
  tok = _tokenizer(checkpoint)
  assert isinstance(tok, batching.ChatPromptTokenizer)
  assert batching.render_prompts(tok, ["1+2="]) == [
      "<s><|user|>\n1+2=</s>\n<|assistant|>\n"]
  ids = batching.encode_prompts(tok, ["1+2="])[0]
  digits = [VOCAB.index(c) for c in "1+2="]
  # One BOS, written by the template; encode_prompts adds no second one.
  assert ids == [BOS, USER, NEWLINE, *digits, EOS, NEWLINE, ASSISTANT, NEWLINE]
  plain = _tokenizer(checkpoint, chat_template=False)
  assert not isinstance(plain, batching.ChatPromptTokenizer)
  assert batching.encode_prompts(plain, ["1+2="])[0] == [BOS, *digits]
  # Prompt-length validation counts the template's tokens.
  assert batching.check_prompt_lengths(plain, ["1+2="], (5,)) == 5
  with pytest.raises(ValueError, match="rendered through the chat template"):
    batching.check_prompt_lengths(tok, ["1+2="], (5,))


def test_checkpoint_fields_cannot_be_overridden(checkpoint, task_files):
  config = _config(checkpoint, task_files)
  config.model.overrides.num_layers = 4
  with pytest.raises(ValueError, match="model.overrides.num_layers"):
    train.validate(config)
  config = _config(checkpoint, task_files)
  config.tokenizer.path = "/some/tokenizer.model"
  with pytest.raises(ValueError, match="tokenizer.path"):
    train.validate(config)


def test_run_trains_the_checkpoint_and_load_policy_reloads_it(
    checkpoint, task_files, tmp_path, monkeypatch):
  seen = []
  pad_prompts = sampling.pad_prompts

  def recording_pad_prompts(prompts, *args, **kwargs):
    seen.extend(list(p) for p in prompts)
    return pad_prompts(prompts, *args, **kwargs)

  monkeypatch.setattr(sampling, "pad_prompts", recording_pad_prompts)
  workdir = str(tmp_path / "run")
  summary = train.run(_config(checkpoint, task_files), workdir)

  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  rl_rows = [r for r in rows if r["step"] > 0]
  assert [r["step"] for r in rl_rows] == [1, 2]
  for r in rl_rows:
    for key in ("pg_loss", "grad_norm", "reward/total/mean", "accuracy"):
      assert np.isfinite(r[key]), key
  assert np.isfinite(rows[-1]["eval/accuracy"])
  assert set(summary["before"]) >= {"eval/accuracy", "eval/pass@1"}

  # Every prompt the sampler saw (training and evaluation) went through the
  # template, with exactly one BOS.
  assert len(seen) == 2 * 8 + 2 * 8  # 2 RL steps, 2 evaluations
  for ids in seen:
    assert ids[:3] == [BOS, USER, NEWLINE], ids
    assert ids[-4:] == [EOS, NEWLINE, ASSISTANT, NEWLINE], ids
    assert ids.count(BOS) == 1

  # The run directory holds what load_policy needs; no tokenizer.model.
  saved = set(os.listdir(os.path.join(workdir, policy.HF_DIR)))
  assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= saved
  assert not os.path.exists(os.path.join(workdir, "tokenizer.model"))
  loaded = train.load_policy(workdir)
  assert loaded.step == 2
  assert loaded.model_config == models.load_hf_config(checkpoint)
  assert loaded.model_config.vocab_size == MODEL_VOCAB
  assert isinstance(loaded.tokenizer, batching.ChatPromptTokenizer)
  assert loaded.tokenizer.vocab_size == len(VOCAB)
  assert loaded.tokenizer.eos_ids == (EOS,)

  # RL started from the checkpoint's weights: two steps of Adam (2 updates
  # each) move every weight by at most a few learning rates, while the
  # weights themselves are ~0.2 apart from any other initialisation.
  _, hf_params = models.load_hf_checkpoint(checkpoint)
  assert jax.tree.structure(loaded.params) == jax.tree.structure(hf_params)
  for got, want in zip(jax.tree.leaves(loaded.params),
                       jax.tree.leaves(hf_params)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=4 * 3 * LEARNING_RATE, rtol=0)
