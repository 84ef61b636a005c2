"""rljax.tokenizers: sentencepiece, chat rendering and prompt encoding, and
Hugging Face tokenizers with their chat templates (``requires_hf``: the
``tokenizers`` and ``jinja2`` packages, and ``transformers`` as the reference).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rljax import tokenizers
from tests.hf_extra import requires_hf


@pytest.fixture(scope="module")
def tok():
  texts = [f"What is {a} plus {b}? Answer: {a + b}." for a in range(40)
           for b in range(0, 40, 3)]
  return tokenizers.train_sentencepiece(texts, vocab_size=96)


@pytest.mark.parametrize("text", [
    "What is 12 plus 30? Answer: 42.",
    "plus plus  plus",       # repeated spaces survive (identity normalisation)
    "Answer: 999 plus 0",
])
def test_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text


def test_byte_fallback_round_trips_unseen_characters():
  texts = [f"{a} plus {b} is {a + b}" for a in range(30) for b in range(30)]
  tok = tokenizers.train_sentencepiece(texts, vocab_size=300, byte_fallback=True)
  text = "3 + 4 = 7 \u00e9\u20ac"
  assert tok.decode(tok.encode(text)) == text


def test_digits_are_split(tok):
  pieces = [tok.id_to_piece(i) for i in tok.encode("1234")]
  assert [p.strip("\u2581") for p in pieces if p.strip("\u2581")] == list("1234")


def test_special_ids_and_protocol(tok):
  assert isinstance(tok, tokenizers.Tokenizer)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert tok.vocab_size <= 96


def test_serialize_and_reload(tok, tmp_path):
  path = tmp_path / "tok.model"
  tok.save(path)
  again = tokenizers.SentencePieceTokenizer(path)
  text = "What is 7 plus 5? Answer: 12."
  assert again.encode(text) == tok.encode(text)
  assert tokenizers.SentencePieceTokenizer(tok.serialized).vocab_size == tok.vocab_size


def test_bad_training_arguments():
  with pytest.raises(ValueError, match="model_type='wordpiece'"):
    tokenizers.train_sentencepiece(["a b c"], 32, model_type="wordpiece")
  with pytest.raises(ValueError, match="vocab_size=2"):
    tokenizers.train_sentencepiece(["a b c"], 2)


def test_importing_the_package_needs_no_hf_extra():
  code = ("import sys, rljax.tokenizers as t; t.load_hf_tokenizer; "
          "print(sorted({'tokenizers', 'jinja2'} & set(sys.modules)))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == "[]"


# --------------------------------------------------------------------------
# Chat rendering, prompt encoding, completion decoding


class _CharTokenizer:
  """Ids are code points + 3; 0 pad, 1 BOS, 2 EOS (a test double)."""

  vocab_size, pad_id, bos_id, eos_id = 300, 0, 1, 2

  def __init__(self, chat_template=None):
    self.chat_template = chat_template
    self.eos_ids = (2, 0)

  def encode(self, text):
    return [ord(c) + 3 for c in text]

  def decode(self, ids):
    return "".join(chr(i - 3) for i in ids if i >= 3)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
    return text + ("[assistant]" if add_generation_prompt else "")


def test_prompt_tokenizer_wraps_only_tokenizers_with_a_template():
  templated, plain = _CharTokenizer("toy"), _CharTokenizer()
  chat = tokenizers.prompt_tokenizer(templated, True)
  assert isinstance(chat, tokenizers.ChatPromptTokenizer)
  assert chat.tokenizer is templated
  assert (chat.vocab_size, chat.eos_ids) == (300, (2, 0))  # passed through
  assert tokenizers.prompt_tokenizer(templated, False) is templated
  assert tokenizers.prompt_tokenizer(chat, True) is chat
  assert tokenizers.prompt_tokenizer(chat, False) is templated
  assert tokenizers.prompt_tokenizer(plain, True) is plain
  with pytest.raises(ValueError, match="has no chat template"):
    tokenizers.ChatPromptTokenizer(plain)


def test_render_and_encode_prompts():
  tok = _CharTokenizer("toy")
  chat = tokenizers.ChatPromptTokenizer(tok)
  assert tokenizers.render_prompts(chat, ["1+2=", "9"]) == [
      "[user]1+2=[assistant]", "[user]9[assistant]"]
  assert tokenizers.render_prompts(tok, ["1+2="]) == ["1+2="]
  # The template writes any BOS itself; plain prompts get one first.
  assert tokenizers.encode_prompts(chat, ["1+2="]) == [
      tok.encode("[user]1+2=[assistant]")]
  assert tokenizers.encode_prompts(tok, ["1+2="]) == [
      [1, ord("1") + 3, ord("+") + 3, ord("2") + 3, ord("=") + 3]]


def test_check_prompt_lengths_counts_template_tokens():
  tok = _CharTokenizer("toy")
  assert tokenizers.check_prompt_lengths(tok, ["1+2=", "1"], (5,)) == 5
  with pytest.raises(ValueError, match=r"sampler.prompt_buckets=\(5,\): the "
                     r"longest prompt \(rendered through the chat template\) "
                     r"has 21 tokens.*>= 21"):
    tokenizers.check_prompt_lengths(tokenizers.ChatPromptTokenizer(tok),
                                    ["1+2="], (5,))


def test_decode_completions_drops_padding_and_eos():
  tok = _CharTokenizer()
  h, i = ord("h") + 3, ord("i") + 3
  tokens = np.array([[h, i, 2, 0], [i, 0, 0, 0], [h, h, h, h]])
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], bool)
  assert tokenizers.decode_completions(tok, tokens, mask, (2, 0)) == [
      "hi", "i", "hh"]


# --------------------------------------------------------------------------
# Hugging Face tokenizers and chat templates

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief. "},
            {"role": "user", "content": "What is 7 * 6?"}]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  """A byte-level BPE tokenizer trained in-process, saved as tokenizer.json."""
  hf_tokenizers = pytest.importorskip("tokenizers")
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


def _transformers():
  import transformers  # pylint: disable=import-outside-toplevel
  transformers.utils.logging.disable_progress_bar()
  return transformers


@requires_hf("tokenizers", "jinja2", "transformers")
@pytest.mark.parametrize("text", [
    "What is 12 * 3? The answer is 36.",
    "  leading spaces,\ttabs and\nnewlines ",
    "unseen: ünïcödé €100 — 😀",
])
def test_hf_tokenizer_round_trips_and_matches_transformers(bpe_dir, text):
  tok = tokenizers.load_hf_tokenizer(bpe_dir)
  assert isinstance(tok, tokenizers.HFTokenizer)
  assert isinstance(tok, tokenizers.Tokenizer)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert all(0 <= i < tok.vocab_size for i in ids)
  reference = _transformers().PreTrainedTokenizerFast(
      tokenizer_file=str(bpe_dir / "tokenizer.json"))
  assert ids == reference.encode(text, add_special_tokens=False)


@requires_hf("tokenizers", "jinja2")
def test_hf_tokenizer_special_tokens(bpe_dir):
  tok = tokenizers.load_hf_tokenizer(bpe_dir)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.eos_ids == (2, 0)
  assert tok.vocab_size == 300
  assert tok.decode([1] + tok.encode("7") + [2]) == "7"


@requires_hf("tokenizers", "jinja2", "transformers")
def test_chat_template_matches_transformers(bpe_dir):
  tok = tokenizers.load_hf_tokenizer(bpe_dir)
  text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
  assert text == ("<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is 7 * 6?</s>\n"
                  "<|assistant|>\n")
  reference = _transformers().AutoTokenizer.from_pretrained(bpe_dir)
  for gen in (True, False):
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == (
        reference.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                      tokenize=False))
  assert tok.encode(text)[0] == tok.bos_id  # the template wrote the BOS


@requires_hf("tokenizers", "jinja2")
def test_chat_prompts_through_a_checkpoint_template(bpe_dir):
  chat = tokenizers.prompt_tokenizer(tokenizers.load_hf_tokenizer(bpe_dir), True)
  assert tokenizers.render_prompts(chat, ["What is 7 * 6?"]) == [
      "<s><|user|>\nWhat is 7 * 6?</s>\n<|assistant|>\n"]
  ids = tokenizers.encode_prompts(chat, ["What is 7 * 6?"])[0]
  assert ids.count(chat.bos_id) == 1 and ids[0] == chat.bos_id


@requires_hf("jinja2")
def test_sentencepiece_checkpoint_tokenizer_with_template_file(tmp_path):
  sp = tokenizers.train_sentencepiece(
      [f"What is {a} * {b}?" for a in range(30) for b in range(30)], 64)
  sp.save(tmp_path / "tokenizer.model")
  with open(tmp_path / "chat_template.jinja", "w") as f:
    f.write(TEMPLATE)
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  tok = tokenizers.load_hf_tokenizer(tmp_path)
  assert isinstance(tok, tokenizers.SentencePieceChatTokenizer)
  assert tok.decode(tok.encode("What is 3 * 4?")) == "What is 3 * 4?"
  assert tok.apply_chat_template(MESSAGES[1:]).startswith("<s><|user|>\nWhat")


@requires_hf("tokenizers", "jinja2")
def test_missing_tokenizer_and_template_are_clear_errors(tmp_path, bpe_dir):
  with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor"):
    tokenizers.load_hf_tokenizer(tmp_path)
  tok = tokenizers.HFTokenizer.from_file(bpe_dir / "tokenizer.json",
                                         eos_token="</s>")
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(MESSAGES)
  with pytest.raises(ValueError, match="eos_token='<eos>' is not in"):
    tokenizers.HFTokenizer.from_file(bpe_dir / "tokenizer.json",
                                     eos_token="<eos>")


# --------------------------------------------------------------------------
# A sentencepiece tokenizer as Hugging Face files (hf_export)

_CALC = [f"<calc>{a}*{b}</calc>={a * b}" for a in range(30) for b in range(30)]


def _random_texts(seed, alphabet, n=400):
  rng = np.random.RandomState(seed)
  texts = [" 12+3", "  <calc>1", "<calc> 2", "7+8=", "a  b\nc", ""]
  return texts + ["".join(rng.choice(alphabet, size=rng.randint(1, 12)))
                  for _ in range(n)]


@requires_hf("tokenizers", "transformers")
@pytest.mark.parametrize("kwargs", [
    {"vocab_size": 64, "user_defined_symbols": ("<calc>", "</calc>")},
    {"vocab_size": 64, "model_type": "unigram",
     "user_defined_symbols": ("<calc>",)},
    {"vocab_size": 300, "byte_fallback": True},
], ids=["bpe_user_symbols", "unigram", "byte_fallback"])
def test_exported_sentencepiece_encodes_in_transformers_as_sentencepiece(
    tmp_path, kwargs):
  """``AutoTokenizer`` on the files gives BOS and sentencepiece's own ids
  (the reference: the ``sentencepiece`` package), text starting with
  spaces, user-defined pieces and unseen characters included."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel

  sp = tokenizers.train_sentencepiece(_CALC + ["é ü"], **kwargs)
  saved = tokenizers.save_hf_tokenizer(sp, tmp_path, add_bos_token=True)
  assert not saved.notes and "tokenizer.json" in saved.files
  reference = spm.SentencePieceProcessor(model_proto=sp.serialized)
  hf = _transformers().AutoTokenizer.from_pretrained(tmp_path)
  alphabet = ["<calc>", "</calc>", "1", "2", "7", "*", "=", " ", "  ", "ü",
              "\n", "x"]
  for text in _random_texts(0, alphabet):
    ids = reference.encode(text)
    assert hf(text)["input_ids"] == [reference.bos_id()] + ids, text
    if reference.unk_id() not in ids:
      assert hf.decode(ids) == reference.decode(ids), text
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (2, 3, 0)


def test_exported_sentencepiece_without_tokenizers_package_says_so(
    tmp_path, monkeypatch):
  """Without the ``tokenizers`` package: tokenizer.model and the configs,
  no tokenizer.json (an earlier one removed), and a note naming the extra."""
  sp = tokenizers.train_sentencepiece(_CALC, 64)
  (tmp_path / "tokenizer.json").write_text("{}")
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
  saved = tokenizers.save_hf_tokenizer(sp, tmp_path, add_bos_token=False)
  assert sorted(saved.files) == sorted(os.listdir(tmp_path)) == [
      "special_tokens_map.json", "tokenizer.model", "tokenizer_config.json"]
  assert len(saved.notes) == 1 and "rljax[hf]" in saved.notes[0]
  with open(tmp_path / "tokenizer_config.json") as f:
    config = json.load(f)
  assert config["add_bos_token"] is False and config["eos_token"] == "</s>"
