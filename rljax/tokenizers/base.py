"""The tokenizer protocol: what rljax needs of a tokenizer.

Everything in rljax that turns text into ids uses ``Tokenizer``, so a
sentencepiece model (``rljax.tokenizers.sentencepiece``), a Hugging Face
``tokenizers`` model (``rljax.tokenizers.hf``, ``hf`` extra) or a test double
are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
  """What rljax needs of a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...
