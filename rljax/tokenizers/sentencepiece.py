"""Sentencepiece tokenizers: a ``Tokenizer`` over a model, and an in-process trainer.

Example:
  >>> texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
  >>> tok = train_sentencepiece(texts, vocab_size=64)
  >>> tok.decode(tok.encode("12+7=19"))
  '12+7=19'
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import sentencepiece as spm


class SentencePieceTokenizer:
  """``Tokenizer`` over a sentencepiece model (file path or serialized bytes).

  Args:
    model: a path to a ``.model`` file, or the model's serialized bytes.
  """

  def __init__(self, model: str | os.PathLike | bytes):
    self._sp = spm.SentencePieceProcessor()
    if isinstance(model, bytes):
      self._proto = model
    else:
      with open(model, "rb") as f:
        self._proto = f.read()
    self._sp.LoadFromSerializedProto(self._proto)
    if self._sp.eos_id() < 0:
      raise ValueError(
          "the sentencepiece model has no EOS piece (eos_id=-1); rljax needs "
          "one to end completions: retrain with eos_id >= 0.")

  @property
  def serialized(self) -> bytes:
    """The model as bytes (to save next to a checkpoint)."""
    return self._proto

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "wb") as f:
      f.write(self._proto)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def bos_id(self) -> int | None:
    i = self._sp.bos_id()
    return None if i < 0 else i

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    i = self._sp.pad_id()
    return self.eos_id if i < 0 else i

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    *,
    model_type: str = "bpe",
    user_defined_symbols: Sequence[str] = (),
    character_coverage: float = 1.0,
    byte_fallback: bool = False,
    split_digits: bool = True,
) -> SentencePieceTokenizer:
  """Trains a small sentencepiece model in-process (no files written).

  Ids 0..3 are ``<pad>``, ``<unk>``, ``<s>``, ``</s>``.

  Args:
    texts: training sentences.
    vocab_size: target vocabulary size.
    model_type: ``"bpe"``, ``"unigram"``, ``"char"`` or ``"word"``.
    user_defined_symbols: pieces that are always kept whole.
    character_coverage: fraction of characters covered.
    byte_fallback: encode unknown characters as bytes.
    split_digits: one piece per digit (helps arithmetic tasks).

  Returns:
    The trained tokenizer.
  """
  accepted = ("bpe", "unigram", "char", "word")
  if model_type not in accepted:
    raise ValueError(f"model_type={model_type!r}: accepted {accepted}.")
  if vocab_size < 8:
    raise ValueError(f"vocab_size={vocab_size}: at least 8 is required.")
  buffer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts),
      model_writer=buffer,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=0, unk_id=1, bos_id=2, eos_id=3,
      user_defined_symbols=list(user_defined_symbols),
      character_coverage=character_coverage,
      byte_fallback=byte_fallback,
      split_digits=split_digits,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      hard_vocab_limit=False,
      minloglevel=2,
      num_threads=1,
  )
  return SentencePieceTokenizer(buffer.getvalue())
