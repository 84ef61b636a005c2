"""Tokenizers: the protocol, sentencepiece, Hugging Face tokenizers, chat templates.

Modules:
  ``base``: the ``Tokenizer`` protocol.
  ``sentencepiece``: ``SentencePieceTokenizer`` and ``train_sentencepiece``.
  ``hf``: a checkpoint's ``tokenizer.json`` / ``tokenizer.model`` and its
    Jinja chat template (``load_hf_tokenizer``); the ``tokenizers`` and
    ``jinja2`` packages (``hf`` extra) are imported only when one is read, so
    importing this package needs neither.
  ``chat``: prompt rendering through a chat template, prompt encoding and
    completion decoding.
  ``hf_export``: a sentencepiece tokenizer as Hugging Face tokenizer files
    (``save_hf_tokenizer``; ``tokenizer.json`` needs the ``hf`` extra).

Example:
  >>> texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
  >>> tok = train_sentencepiece(texts, vocab_size=64)
  >>> tok.decode(tok.encode("12+7=19"))
  '12+7=19'
"""

from rljax.tokenizers.base import Tokenizer
from rljax.tokenizers.chat import (ChatPromptTokenizer, check_prompt_lengths,
                                   decode_completions, encode_prompts,
                                   continuation_ids,
                                   prompt_tokenizer, render_prompts)
from rljax.tokenizers.hf import (ChatTemplate, HFTokenizer,
                                 SentencePieceChatTokenizer,
                                 check_tokenizer_vocab)
from rljax.tokenizers.hf import load_tokenizer as load_hf_tokenizer
from rljax.tokenizers.hf_export import (SavedTokenizer, save_hf_tokenizer,
                                        sentencepiece_to_hf)
from rljax.tokenizers.sentencepiece import (SentencePieceTokenizer,
                                            train_sentencepiece)

__all__ = [
    "Tokenizer", "SentencePieceTokenizer", "train_sentencepiece",
    "load_hf_tokenizer", "HFTokenizer", "ChatTemplate",
    "SentencePieceChatTokenizer", "ChatPromptTokenizer", "prompt_tokenizer",
    "render_prompts", "encode_prompts", "check_prompt_lengths",
    "decode_completions", "check_tokenizer_vocab", "continuation_ids",
    "SavedTokenizer", "save_hf_tokenizer", "sentencepiece_to_hf",
]
