"""Hugging Face tokenizer files for a sentencepiece model, encoding as rljax does.

``save_hf_tokenizer`` writes ``tokenizer.model``, ``tokenizer_config.json``,
``special_tokens_map.json`` and, with the ``tokenizers`` package (``hf``
extra, imported only here), ``tokenizer.json``: a fast tokenizer that
``transformers.AutoTokenizer`` loads as it is (``tokenizer_class``
``PreTrainedTokenizerFast``) and that gives the ids ``SentencePieceTokenizer``
gives. ``sentencepiece_to_hf`` builds it from the model's own settings, as
sentencepiece encodes:

* the model: BPE over the vocabulary, with the merges of every split of each
  normal piece into two normal pieces, ranked by the merged piece's score
  (sentencepiece merges the adjacent pair whose merged piece scores
  highest); Unigram over the pieces and their scores; a char model as BPE
  without merges.
* the normalizer, in sentencepiece's order: the precompiled character map,
  extra-whitespace removal, the dummy prefix ``▁`` at the start of the text
  (also when the text starts with a space), spaces as ``▁``.
* user-defined pieces (``<calc>``) split off whole after the dummy prefix,
  and looked up whole; control pieces and ``<unk>`` are special tokens.
* the decoder drops the dummy prefix; the post-processor writes BOS first
  when ``add_bos_token`` (rljax's plain prompts start with BOS:
  ``tokenizers.encode_prompts``).

``transformers``' own conversion is not used: ``LlamaTokenizer`` in
``transformers`` 5 rebuilds the pipeline and drops the dummy prefix of a
text that starts with a space.

Before ``tokenizer.json`` is written, the text of every piece, and of every
two pieces adjacent in id order, is encoded and decoded by both; on a
difference it is left out with a note naming the text. Text that spells a
special token (``</s>``) is the one known difference: ``transformers`` reads
it as that token, sentencepiece as characters.

Example:
  >>> from rljax.tokenizers import train_sentencepiece
  >>> tok = train_sentencepiece([f"{a}+{b}={a + b}" for a in range(30)
  ...                            for b in range(30)], vocab_size=32)
  >>> fast = sentencepiece_to_hf(tok.serialized, add_bos_token=True)  # doctest: +SKIP
  >>> fast.encode("12+7=").ids == [tok.bos_id] + tok.encode("12+7=")  # doctest: +SKIP
  True
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from rljax.tokenizers.sentencepiece import SentencePieceTokenizer

# sentencepiece_model.proto: ModelProto.SentencePiece.Type, TrainerSpec.ModelType
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_UNIGRAM, _BPE, _CHAR = 1, 2, 4  # 3: word models, not mirrored


class SavedTokenizer(NamedTuple):
  """What ``save_hf_tokenizer`` wrote."""

  files: list[str]   # relative to the directory, in writing order
  notes: list[str]   # why a file is missing (e.g. no ``tokenizers`` package)


def _model_proto(model: bytes) -> Any:
  # protobuf classes: imported on use, so importing rljax.tokenizers stays light.
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model)
  return proto


def _bpe_merges(pieces: Sequence[Any]) -> list[tuple[str, str]]:
  normal = {p.piece: (p.score, i) for i, p in enumerate(pieces)
            if p.type == _NORMAL}
  ranked = []
  for piece, (score, i) in normal.items():
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in normal and right in normal:
        ranked.append((-score, i, left, right))
  return [(left, right) for _, _, left, right in sorted(ranked)]


def sentencepiece_to_hf(model: bytes, *, add_bos_token: bool) -> Any:
  """A ``tokenizers.Tokenizer`` that encodes as the sentencepiece ``model``.

  Args:
    model: the serialized sentencepiece model
      (``SentencePieceTokenizer.serialized``).
    add_bos_token: the post-processor writes BOS before the text (when
      ``encode`` is called with ``add_special_tokens=True``).

  Returns:
    The tokenizer (``tokenizers`` package, ``hf`` extra).

  Raises:
    ImportError: without the ``tokenizers`` package.
    ValueError: for a word model (whitespace-split words, not mirrored), or
      ``add_bos_token`` without a BOS piece.
  """
  try:
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models,
                            normalizers, pre_tokenizers, processors)
  except ImportError as e:
    raise ImportError("tokenizer.json needs the hf extra (the Hugging Face "
                      "`tokenizers` package): pip install 'rljax[hf]'.") from e
  proto = _model_proto(model)
  spec, norm = proto.trainer_spec, proto.normalizer_spec
  pieces = proto.pieces
  user = [p.piece for p in pieces if p.type == _USER_DEFINED]
  if spec.model_type == _UNIGRAM:
    backend = models.Unigram([(p.piece, p.score) for p in pieces],
                             spec.unk_id, spec.byte_fallback)
  elif spec.model_type in (_BPE, _CHAR):
    backend = models.BPE(
        vocab={p.piece: i for i, p in enumerate(pieces)},
        merges=_bpe_merges(pieces) if spec.model_type == _BPE else [],
        unk_token=pieces[spec.unk_id].piece, fuse_unk=True,
        byte_fallback=spec.byte_fallback,
        # A user-defined piece is never merged from characters: split off
        # alone, it is looked up whole (as is any other split that is a
        # piece; the check before writing covers that).
        ignore_merges=bool(user))
  else:
    raise ValueError(f"sentencepiece model_type={spec.model_type} (word "
                     "model): accepted BPE, Unigram or char models.")
  tok = Tokenizer(backend)
  steps = []
  if norm.precompiled_charsmap:
    steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
  if norm.remove_extra_whitespaces:
    steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""),
              normalizers.Replace(Regex(" {2,}"), " ")]
  if norm.add_dummy_prefix:
    steps.append(normalizers.Prepend("▁"))
  if norm.escape_whitespaces:
    steps.append(normalizers.Replace(" ", "▁"))
  tok.normalizer = normalizers.Sequence(steps)
  if user:
    longest_first = sorted(user, key=len, reverse=True)
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("|".join(re.escape(u) for u in longest_first)), "isolated")
  tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                          for p in pieces if p.type in (_UNKNOWN, _CONTROL)])
  steps = [decoders.Replace("▁", " ")]
  if spec.byte_fallback:
    steps.append(decoders.ByteFallback())
  steps.append(decoders.Fuse())
  if norm.add_dummy_prefix:
    steps.append(decoders.Strip(content=" ", left=1))
  tok.decoder = decoders.Sequence(steps)
  if add_bos_token:
    if spec.bos_id < 0:
      raise ValueError("add_bos_token=True, but the sentencepiece model has "
                       "no BOS piece (bos_id=-1).")
    bos = pieces[spec.bos_id].piece
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, spec.bos_id)])
  return tok


def _check_texts(pieces: Sequence[Any]) -> list[str]:
  """The text of every normal and user-defined piece, and of each two
  adjacent in id order."""
  texts = [p.piece.replace("▁", " ") for p in pieces
           if p.type in (_NORMAL, _USER_DEFINED)]
  return texts + [a + b for a, b in zip(texts, texts[1:])]


def _first_difference(sp: SentencePieceTokenizer, fast: Any,
                      texts: Sequence[str], unk: int) -> str | None:
  """A note on the first text the two encode or decode differently."""
  encoded = fast.encode_batch(list(texts), add_special_tokens=False)
  for text, got in zip(texts, encoded):
    want = sp.encode(text)
    if got.ids != want:
      return f"{text!r} encodes as {got.ids}, sentencepiece gives {want}"
    # sentencepiece writes <unk> as " \u2047 ", transformers as "<unk>".
    if unk not in want and fast.decode(want) != sp.decode(want):
      return (f"{want} decodes as {fast.decode(want)!r}, sentencepiece "
              f"gives {sp.decode(want)!r}")
  return None


def save_hf_tokenizer(tokenizer: SentencePieceTokenizer,
                      directory: str | os.PathLike, *,
                      add_bos_token: bool) -> SavedTokenizer:
  """Writes a sentencepiece tokenizer as files ``transformers`` loads.

  ``AutoTokenizer.from_pretrained(directory)`` then gives the ids
  ``tokenizer.encode`` gives (after BOS, with ``add_bos_token``) and decodes
  them back to the same text. Without the ``tokenizers`` package no
  ``tokenizer.json`` is written (one left there by an earlier export is
  removed) and ``notes`` says so; ``transformers`` cannot load the tokenizer
  from the others alone.

  Args:
    tokenizer: the run's tokenizer.
    directory: created if missing; files of the same names are replaced.
    add_bos_token: BOS starts every encoded text, as it starts the prompts
      rljax encodes (``tokenizers.encode_prompts``).

  Returns:
    The files written and the notes.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  proto = _model_proto(tokenizer.serialized)
  ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
         "unk_token": proto.trainer_spec.unk_id, "pad_token": tokenizer.pad_id}
  special = {name: tokenizer.id_to_piece(i) for name, i in ids.items()
             if i is not None and i >= 0}
  files, notes = [], []
  tokenizer.save(os.path.join(directory, "tokenizer.model"))
  files.append("tokenizer.model")
  json_path = os.path.join(directory, "tokenizer.json")
  try:
    fast = sentencepiece_to_hf(tokenizer.serialized,
                               add_bos_token=add_bos_token)
    problem = _first_difference(tokenizer, fast, _check_texts(proto.pieces),
                                proto.trainer_spec.unk_id)
  except (ImportError, ValueError) as e:
    fast, problem = None, str(e).rstrip(".")
  if problem is None:
    fast.save(json_path)
    files.append("tokenizer.json")
  else:
    if os.path.exists(json_path):  # an earlier export's, maybe of another model
      os.remove(json_path)
    notes.append(f"tokenizer.json not written ({problem}): transformers "
                 "cannot load the tokenizer without it.")
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
            "add_bos_token": add_bos_token, "add_eos_token": False,
            "clean_up_tokenization_spaces": False}
  for name, content in (("tokenizer_config.json", config),
                        ("special_tokens_map.json", special)):
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
      json.dump(content, f, indent=2, ensure_ascii=False)
    files.append(name)
  return SavedTokenizer(files, notes)
