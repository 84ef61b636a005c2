"""Hugging Face tokenizers and chat templates behind the rljax ``Tokenizer``.

A checkpoint directory holds ``tokenizer.json`` (the Hugging Face
``tokenizers`` format), ``tokenizer.model`` (sentencepiece) or both, plus a
``tokenizer_config.json`` naming the special tokens and, often, a Jinja chat
template (inline, or in ``chat_template.jinja`` next to it). ``load_tokenizer``
reads whichever is there; ``tokenizer.json`` wins because it is exactly what
``transformers`` runs.

``tokenizers`` and ``jinja2`` come with the ``hf`` extra and are imported only
when used, so the core install imports this module without them.

Conventions (the same as ``SentencePieceTokenizer``):
  * ``encode(text)`` adds no special tokens unless the tokenizer was built with
    ``add_special_tokens=True``: a chat template already writes the BOS text,
    and adding it again would double it.
  * ``decode(ids)`` drops special tokens (EOS, chat markers).

Example:
  >>> tok = load_tokenizer("/path/to/checkpoint")  # doctest: +SKIP
  >>> text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])  # doctest: +SKIP
  >>> ids = tok.encode(text)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rljax.tokenizers.sentencepiece import SentencePieceTokenizer

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token",
                        "sep_token", "cls_token", "mask_token")


def _import_tokenizers():
  try:
    import tokenizers
  except ImportError as e:
    raise ImportError(
        "reading tokenizer.json needs the Hugging Face `tokenizers` package: "
        "pip install 'rljax[hf]' (or pip install tokenizers).") from e
  return tokenizers


def _import_jinja2():
  try:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
  except ImportError as e:
    raise ImportError(
        "chat templates need jinja2: pip install 'rljax[hf]' (or pip install "
        "jinja2).") from e
  return jinja2


def _token_content(token: Any) -> str | None:
  """A special token from tokenizer_config.json: a string or an AddedToken dict."""
  if token is None or isinstance(token, str):
    return token
  if isinstance(token, Mapping) and isinstance(token.get("content"), str):
    return token["content"]
  raise ValueError(f"special token {token!r}: accepted a string or a dict with "
                   "a 'content' string.")


class ChatTemplate:
  """A checkpoint's Jinja chat template, rendered as ``transformers`` does.

  The environment mirrors ``transformers.utils.chat_template_utils``: a
  sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a
  ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
  ``strftime_now``; the special tokens (``bos_token`` ...) are template
  variables.

  Args:
    source: the template text.
    special_tokens: e.g. ``{"bos_token": "<s>", "eos_token": "</s>"}``.
  """

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
    if not isinstance(source, str) or not source:
      raise ValueError(f"chat template {source!r}: a non-empty string is required.")
    jinja2 = _import_jinja2()
    self.source = source
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items()
                           if v is not None}

    class _Generation(jinja2.ext.Extension):
      """``{% generation %}`` marks assistant text for training masks; rendered as is."""

      tags = {"generation"}

      def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [],
                                      body).set_lineno(lineno)

      def _render(self, caller):
        return caller()

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None,
               sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                        separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
      return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    self._template = env.from_string(source)

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders one conversation.

    Args:
      messages: dicts with ``role`` and ``content``.
      add_generation_prompt: end with the header of an assistant turn.
      **kwargs: extra template variables (e.g. ``enable_thinking=False``,
        ``tools=[...]``); they override the special tokens.

    Returns:
      The prompt text.
    """
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping):
        raise TypeError(f"messages[{i}]={m!r}: a dict with 'role' and "
                        "'content' is required.")
    variables = {"tools": None, "documents": None, **self.special_tokens,
                 **kwargs}
    return self._template.render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt, **variables)


class _ChatMixin:
  """``apply_chat_template`` over an optional ``ChatTemplate``."""

  chat_template: ChatTemplate | None = None

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
    """Renders ``messages`` with the checkpoint's chat template (text, not ids).

    Tokenize the result with ``encode`` (which adds no BOS: the template
    writes it where the model expects one).

    Raises:
      ValueError: if the checkpoint has no chat template.
    """
    if self.chat_template is None:
      raise ValueError(
          "this tokenizer has no chat template (tokenizer_config.json has no "
          "'chat_template' and there is no chat_template.jinja): format "
          "prompts yourself, or pass chat_template= when loading.")
    return self.chat_template.render(
        messages, add_generation_prompt=add_generation_prompt, **kwargs)


class HFTokenizer(_ChatMixin):
  """``Tokenizer`` over a Hugging Face ``tokenizers.Tokenizer`` (tokenizer.json).

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    eos_token: the EOS token text (required: rljax ends completions with it).
    bos_token: the BOS token text, or None.
    pad_token: the padding token text; None pads with EOS.
    extra_eos_ids: more ids that end a completion (e.g. the list in
      ``generation_config.json``); ``eos_ids`` is ``(eos_id, *extra)``.
    chat_template: optional ``ChatTemplate``.
    add_special_tokens: let ``encode`` run the tokenizer's post-processor
      (which adds BOS for Llama-style tokenizers).
  """

  def __init__(self, tokenizer: Any, *, eos_token: str,
               bos_token: str | None = None, pad_token: str | None = None,
               extra_eos_ids: Sequence[int] = (),
               chat_template: ChatTemplate | None = None,
               add_special_tokens: bool = False):
    self._tok = tokenizer
    self._add_special_tokens = bool(add_special_tokens)
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self._eos_id = self._require_id("eos_token", eos_token)
    self._bos_id = None if bos_token is None else self._require_id("bos_token",
                                                                   bos_token)
    self._pad_id = (self._eos_id if pad_token is None
                    else self._require_id("pad_token", pad_token))
    extra = [int(i) for i in extra_eos_ids]
    self._eos_ids = tuple(dict.fromkeys([self._eos_id] + extra))
    self.chat_template = chat_template

  def _require_id(self, name: str, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{name}={token!r} is not in the tokenizer's vocabulary.")
    return i

  @classmethod
  def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> "HFTokenizer":
    """Reads a ``tokenizer.json``; ``kwargs`` as in the constructor."""
    tokenizers = _import_tokenizers()
    return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), **kwargs)

  @property
  def backend(self) -> Any:
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a completion, ``eos_id`` first."""
    return self._eos_ids

  @property
  def pad_id(self) -> int:
    return self._pad_id

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(
        text, add_special_tokens=self._add_special_tokens).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_piece(self, i: int) -> str:
    return self._tok.id_to_token(int(i))

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``tokenizer.json`` (special tokens and template are not in it)."""
    self._tok.save(os.fspath(path))


class SentencePieceChatTokenizer(_ChatMixin, SentencePieceTokenizer):
  """``SentencePieceTokenizer`` with a checkpoint's chat template.

  Args:
    model: path or serialized bytes of ``tokenizer.model``.
    chat_template: optional ``ChatTemplate``.
    extra_eos_ids: more ids that end a completion.
  """

  def __init__(self, model: str | os.PathLike | bytes, *,
               chat_template: ChatTemplate | None = None,
               extra_eos_ids: Sequence[int] = ()):
    super().__init__(model)
    self.chat_template = chat_template
    self._eos_ids = tuple(dict.fromkeys([self.eos_id] +
                                        [int(i) for i in extra_eos_ids]))

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a completion, ``eos_id`` first."""
    return self._eos_ids


def check_tokenizer_vocab(tokenizer: Any, vocab_size: int, where: str) -> int:
  """Raises unless every id ``tokenizer`` can produce is below ``vocab_size``.

  The model's embedding has ``vocab_size`` rows; an id at or past that reads
  outside it (JAX fills such a gather with NaN), and training later stops on
  NaN far from the cause. The ids checked are the largest of the vocabulary
  (``tokenizer.vocab_size - 1``, and, for a ``tokenizer.json``, the largest id
  it assigns, added tokens included), ``bos_id``, ``eos_id``, every
  ``eos_ids`` entry and ``pad_id``. A model vocabulary larger than the
  tokenizer's (padded embeddings) is fine.

  Args:
    tokenizer: a ``Tokenizer`` (a ``ChatPromptTokenizer`` works too).
    vocab_size: the model's ``vocab_size``.
    where: names the model and tokenizer in the error, e.g. the checkpoint
      directory.

  Returns:
    The largest id the tokenizer can produce.

  Raises:
    ValueError: naming ``where``, the largest id, which id it is (e.g.
      ``eos_ids[1]``) and ``vocab_size``.

  Example:
    >>> from rljax.tokenizers import train_sentencepiece
    >>> texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    >>> tok = train_sentencepiece(texts, vocab_size=64)
    >>> check_tokenizer_vocab(tok, 64, "a 64-token model") == tok.vocab_size - 1
    True
    >>> check_tokenizer_vocab(tok, 8, "an 8-token model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: an 8-token model: the tokenizer's largest id is ...
  """
  ids = {"tokenizer.vocab_size - 1": int(tokenizer.vocab_size) - 1}
  backend = getattr(tokenizer, "backend", None)
  if hasattr(backend, "get_vocab"):
    vocab = backend.get_vocab(with_added_tokens=True)
    if vocab:
      token = max(vocab, key=vocab.get)
      ids[f"the id of token {token!r}"] = int(vocab[token])
  for name in ("bos_id", "eos_id", "pad_id"):
    value = getattr(tokenizer, name, None)
    if value is not None:
      ids[name] = int(value)
  for i, value in enumerate(getattr(tokenizer, "eos_ids", None) or ()):
    ids[f"eos_ids[{i}]"] = int(value)
  name = max(ids, key=ids.get)
  largest = ids[name]
  if largest >= vocab_size:
    raise ValueError(
        f"{where}: the tokenizer's largest id is {largest} ({name}), but the "
        f"model has vocab_size={vocab_size} (ids 0..{vocab_size - 1}): that "
        "id would read past the embedding and training would stop on NaN. "
        "Use the model's own tokenizer, or a model with vocab_size >= "
        f"{largest + 1}.")
  return largest


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from e


def _template_source(directory: str, tokenizer_config: Mapping[str, Any]
                     ) -> str | None:
  """The default chat template: chat_template.jinja, else tokenizer_config.json."""
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  source = tokenizer_config.get("chat_template")
  if isinstance(source, list):  # named templates: [{"name", "template"}, ...]
    named = {t.get("name"): t.get("template") for t in source}
    source = named.get("default")
  return source or None


def _id_list(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in (value if isinstance(value, list) else [value])]


def load_tokenizer(directory: str | os.PathLike, *,
                   chat_template: str | None = None,
                   add_special_tokens: bool = False,
                   ) -> HFTokenizer | SentencePieceChatTokenizer:
  """The tokenizer of a Hugging Face checkpoint directory.

  Args:
    directory: holds ``tokenizer.json`` and/or ``tokenizer.model``, and
      usually ``tokenizer_config.json``; ``generation_config.json`` and
      ``config.json`` add EOS ids.
    chat_template: a template to use instead of the checkpoint's.
    add_special_tokens: for ``tokenizer.json``: ``encode`` runs the
      post-processor (adds BOS where the tokenizer does).

  Returns:
    An ``HFTokenizer`` (from ``tokenizer.json``) or a
    ``SentencePieceChatTokenizer`` (from ``tokenizer.model``); both have
    ``eos_ids`` and ``apply_chat_template``.

  Raises:
    FileNotFoundError: if neither tokenizer file exists.
    ValueError: if no EOS token can be found.
  """
  directory = os.fspath(directory)
  tok_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
  special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
  special = {}
  for name in _SPECIAL_TOKEN_NAMES:
    value = tok_config.get(name, special_map.get(name))
    special[name] = _token_content(value)
  source = chat_template or _template_source(directory, tok_config)
  template = None if source is None else ChatTemplate(source, special)
  model_ids = []
  for name in ("generation_config.json", "config.json"):
    model_ids += _id_list(_read_json(os.path.join(directory, name)).get(
        "eos_token_id"))

  json_path = os.path.join(directory, "tokenizer.json")
  if os.path.exists(json_path):
    tokenizers = _import_tokenizers()
    backend = tokenizers.Tokenizer.from_file(json_path)
    eos = special["eos_token"]
    if eos is None and model_ids:
      eos = backend.id_to_token(model_ids[0])
    if eos is None:
      raise ValueError(
          f"{directory}: no EOS token: tokenizer_config.json has no "
          "'eos_token' and config.json / generation_config.json no "
          "'eos_token_id'; rljax needs one to end completions.")
    return HFTokenizer(backend, eos_token=eos, bos_token=special["bos_token"],
                       pad_token=special["pad_token"], extra_eos_ids=model_ids,
                       chat_template=template,
                       add_special_tokens=add_special_tokens)
  spm_path = os.path.join(directory, "tokenizer.model")
  if os.path.exists(spm_path):
    return SentencePieceChatTokenizer(spm_path, chat_template=template,
                                      extra_eos_ids=model_ids)
  raise FileNotFoundError(
      f"{directory} holds neither tokenizer.json nor tokenizer.model: copy "
      "the checkpoint's tokenizer files next to its config.json.")
