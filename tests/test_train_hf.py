"""Training from a Hugging Face checkpoint: ``train.run`` with ``model.path``.

A tiny random Llama checkpoint (written by ``models.save_hf_checkpoint``,
fp32) with a character-level ``tokenizer.json`` and a chat template in
``tokenizer_config.json`` is trained for two GRPO steps on a JSONL addition
task; the run directory is then reloaded with ``load_policy``. No torch is
needed: the tests that read the tokenizer need the ``tokenizers`` and
``jinja2`` packages of the hf extra (``requires_hf``) and skip without them.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from rljax import metrics, models, sampling, sharding, tokenizers
from tests.hf_extra import requires_hf
from tests.test_build import checkpoint_dir, jsonl_file

requires_tokenizer = requires_hf("tokenizers", "jinja2")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
VOCAB = SPECIALS + ["\n"] + list("0123456789+=")
PAD, BOS, EOS, USER, ASSISTANT, NEWLINE = range(6)
MODEL_VOCAB = 32  # padded embeddings: more rows than the tokenizer's 18 ids
LEARNING_RATE = 1e-4


LLAMA_JSON = dict(
    architectures=["LlamaForCausalLM"], vocab_size=MODEL_VOCAB, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    hidden_act="silu", torch_dtype="float32")


def starts_with_digit(prompts, completions, **unused_fields):
  """1.0 for a completion that starts with a digit.

  A random policy earns it for some samples of a group and not others, so
  the advantages are not all zero and RL must move the weights (the sums of
  ``numeric_match`` are out of a random policy's reach).
  """
  del prompts, unused_fields
  return [float(c[:1].isdigit()) for c in completions]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny Llama checkpoint directory with tokenizer files and a template."""
  hf_tokenizers = pytest.importorskip("tokenizers")
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
  config = models.model_config_from_hf(LLAMA_JSON)
  leaves, treedef = jax.tree.flatten(models.init_params(config,
                                                        jax.random.key(0)))
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten([  # matrices ~N(0, 0.2), far from rljax's init
      0.2 * jax.random.normal(k, p.shape, p.dtype) if p.ndim > 1 else p
      for p, k in zip(leaves, keys)])
  models.save_hf_checkpoint(path, config, params, extra_config={
      "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})
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
  config.sft.num_steps = 0  # a JSONL task has no reference completions
  config.tokenizer.chat_template = True
  config.rewards.names = ("numeric_match",
                           "tests.test_train_hf:starts_with_digit")
  config.rewards.weights = (1.0, 1.0)
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
  return tokenizers.prompt_tokenizer(tokenizers.load_hf_tokenizer(checkpoint),
                                     chat_template)


@requires_tokenizer
@pytest.mark.slow
def test_prompts_are_rendered_through_the_chat_template(checkpoint):
  tok = _tokenizer(checkpoint)
  assert isinstance(tok, tokenizers.ChatPromptTokenizer)
  assert tokenizers.render_prompts(tok, ["1+2="]) == [
      "<s><|user|>\n1+2=</s>\n<|assistant|>\n"]
  ids = tokenizers.encode_prompts(tok, ["1+2="])[0]
  digits = [VOCAB.index(c) for c in "1+2="]
  # One BOS, written by the template; encode_prompts adds no second one.
  assert ids == [BOS, USER, NEWLINE, *digits, EOS, NEWLINE, ASSISTANT, NEWLINE]
  plain = _tokenizer(checkpoint, chat_template=False)
  assert not isinstance(plain, tokenizers.ChatPromptTokenizer)
  assert tokenizers.encode_prompts(plain, ["1+2="])[0] == [BOS, *digits]
  # Prompt-length validation counts the template's tokens.
  assert tokenizers.check_prompt_lengths(plain, ["1+2="], (5,)) == 5
  with pytest.raises(ValueError, match="rendered through the chat template"):
    tokenizers.check_prompt_lengths(tok, ["1+2="], (5,))


def test_gsm8k_config_validates(tmp_path):
  """The tiny variant needs no files; the full job names each one it lacks
  (its data, then the checkpoint) and validates once they exist."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location(
      "gsm8k_grpo", os.path.join(os.path.dirname(__file__), "..", "configs",
                                 "gsm8k_grpo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  mesh = sharding.make_mesh(1, -1, 1)
  train.validate(module.get_config("tiny"), mesh)
  config = module.get_config()
  assert config.model.path == "" and config.rewards.names == ("math_answer",)
  assert config.task.path.endswith(".jsonl") and config.sft.num_steps == 0
  config.task.path = str(tmp_path / "train.jsonl")
  with pytest.raises(ValueError, match=r"^task.path='.*/train.jsonl': the "
                     r"file does not exist.*launch.prepare_data"):
    train.validate(config, mesh)
  config.task.path = jsonl_file(tmp_path / "train.jsonl")
  config.task.heldout_path = jsonl_file(tmp_path / "test.jsonl")
  with pytest.raises(ValueError, match=r"^model.path='' with "
                     r"tokenizer.chat_template=True.*Set model.path"):
    train.validate(config, mesh)
  config.model.path = checkpoint_dir(tmp_path / "ckpt")
  train.validate(config, mesh)
  config.task.path = ""
  with pytest.raises(ValueError, match="set task.path to a JSONL file"):
    train.validate(config, mesh)


@requires_tokenizer
def test_checkpoint_fields_cannot_be_overridden(checkpoint, task_files):
  from rljax import train  # pylint: disable=import-outside-toplevel
  config = _config(checkpoint, task_files)
  config.model.overrides.num_layers = 4
  with pytest.raises(ValueError, match="model.overrides.num_layers"):
    train.validate(config)
  config = _config(checkpoint, task_files)
  config.tokenizer.path = "/some/tokenizer.model"
  with pytest.raises(ValueError, match="tokenizer.path"):
    train.validate(config)


@requires_tokenizer
@pytest.mark.slow
def test_run_trains_the_checkpoint_and_load_policy_reloads_it(
    checkpoint, task_files, tmp_path, monkeypatch):
  from rljax import train  # pylint: disable=import-outside-toplevel
  from rljax.train import build  # pylint: disable=import-outside-toplevel
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
  saved = set(os.listdir(os.path.join(workdir, build.HF_DIR)))
  assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= saved
  assert not os.path.exists(os.path.join(workdir, "tokenizer.model"))
  loaded = train.load_policy(workdir)
  assert loaded.step == 2
  assert loaded.model_config == models.load_hf_config(checkpoint)
  assert loaded.model_config.vocab_size == MODEL_VOCAB
  assert isinstance(loaded.tokenizer, tokenizers.ChatPromptTokenizer)
  assert loaded.tokenizer.vocab_size == len(VOCAB)
  assert loaded.tokenizer.eos_ids == (EOS,)

  # RL started from the checkpoint's weights: two steps of Adam (2 updates
  # each) move every weight by at most a few learning rates, while the
  # weights themselves are ~0.2 apart from any other initialisation ...
  _, hf_params = models.load_hf_checkpoint(checkpoint)
  assert jax.tree.structure(loaded.params) == jax.tree.structure(hf_params)
  moved = 0.0
  for got, want in zip(jax.tree.leaves(loaded.params),
                       jax.tree.leaves(hf_params)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=4 * 3 * LEARNING_RATE, rtol=0)
    moved = max(moved, float(np.abs(np.asarray(got) - np.asarray(want)).max()))
  # ... and it trained them: an Adam update moves a weight with a non-zero
  # gradient by about one learning rate (starts_with_digit makes the
  # advantages, and so the gradients, non-zero).
  assert moved > LEARNING_RATE / 2, moved
