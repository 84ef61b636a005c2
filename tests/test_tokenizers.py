import pytest

from rljax import tokenizers


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
