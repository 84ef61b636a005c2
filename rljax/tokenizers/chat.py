"""Chat templates on the host: prompt rendering and encoding, completion decoding.

Prompts reach the sampler as token ids and completions come back as ids;
these functions do the conversions for any ``Tokenizer``. A
``ChatPromptTokenizer`` sends each prompt through the tokenizer's chat
template (``apply_chat_template``, as the Hugging Face tokenizers of
``rljax.tokenizers.hf`` have) as one user turn; a plain tokenizer encodes it
as text after a BOS.

Example:
  >>> from rljax.tokenizers import train_sentencepiece
  >>> tok = train_sentencepiece([f"{a}+{b}={a + b}" for a in range(30)
  ...                            for b in range(30)], vocab_size=64)
  >>> ids = encode_prompts(tok, ["1+2="])[0]
  >>> ids[0] == tok.bos_id, tok.decode(ids[1:])
  (True, '1+2=')
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax.tokenizers.base import Tokenizer


class ChatPromptTokenizer:
  """A tokenizer whose prompts go through its chat template.

  ``encode_prompts`` (and so ``check_prompt_lengths`` and everything that
  encodes prompts through it) renders each prompt as one user turn followed by the assistant
  header, ``apply_chat_template([{"role": "user", "content": prompt}],
  add_generation_prompt=True)``, and encodes the text without adding a BOS:
  the template writes the BOS where the model expects one, as
  ``transformers``' ``apply_chat_template(..., tokenize=True)`` does.
  Completions are encoded and decoded as plain text. Every other attribute
  (``encode``, ``decode``, ``eos_ids``, ``save``, ...) is the wrapped
  tokenizer's.

  Args:
    tokenizer: a tokenizer with ``apply_chat_template`` and a
      ``chat_template`` (``rljax.tokenizers.load_hf_tokenizer``).
  """

  def __init__(self, tokenizer: Tokenizer):
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError(
          "tokenizer.chat_template=True, but this tokenizer has no chat "
          "template: set tokenizer.chat_template=False to encode prompts as "
          "plain text.")
    self.tokenizer = tokenizer

  def __getattr__(self, name: str):
    if name == "tokenizer":  # not set yet (e.g. while unpickling)
      raise AttributeError(name)
    return getattr(self.tokenizer, name)

  def render_prompt(self, prompt: str) -> str:
    """The text the model sees for ``prompt``."""
    return self.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True)


def prompt_tokenizer(tokenizer: Tokenizer, chat_template: bool) -> Tokenizer:
  """``ChatPromptTokenizer(tokenizer)`` if asked for and possible, else ``tokenizer``.

  A tokenizer without a chat template (sentencepiece, or a checkpoint with
  none) encodes prompts as plain text even when ``chat_template`` is true.
  """
  if isinstance(tokenizer, ChatPromptTokenizer):
    return tokenizer if chat_template else tokenizer.tokenizer
  if chat_template and getattr(tokenizer, "chat_template", None) is not None:
    return ChatPromptTokenizer(tokenizer)
  return tokenizer


def render_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[str]:
  """The text of each prompt as encoded: through the chat template if any."""
  if isinstance(tokenizer, ChatPromptTokenizer):
    return [tokenizer.render_prompt(p) for p in prompts]
  return list(prompts)


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[list[int]]:
  """Token ids of each prompt.

  Plain prompts get BOS first when the tokenizer has one; a
  ``ChatPromptTokenizer`` renders the chat template, which writes any BOS
  itself, so none is added.
  """
  if isinstance(tokenizer, ChatPromptTokenizer):
    return [tokenizer.encode(t) for t in render_prompts(tokenizer, prompts)]
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  return [bos + tokenizer.encode(p) for p in prompts]


def check_prompt_lengths(tokenizer: Tokenizer, prompts: Sequence[str],
                         buckets: Sequence[int]) -> int:
  """Longest prompt in tokens; a clear error if no bucket holds it.

  Prompts are counted as ``encode_prompts`` encodes them, so with a
  ``ChatPromptTokenizer`` the chat template's tokens are included.
  """
  longest = max(len(ids) for ids in encode_prompts(tokenizer, prompts))
  if longest > max(buckets):
    where = (" (rendered through the chat template)"
             if isinstance(tokenizer, ChatPromptTokenizer) else "")
    raise ValueError(
        f"sampler.prompt_buckets={tuple(buckets)}: the longest prompt{where} "
        f"has {longest} tokens, more than the largest bucket; accepted: buckets "
        f"whose largest is >= {longest}.")
  return longest


def decode_completions(tokenizer: Tokenizer, tokens_NxT: np.ndarray,
                       mask_NxT: np.ndarray, eos_ids: Sequence[int]) -> list[str]:
  """Completion texts (without the EOS token)."""
  out = []
  for row, m in zip(np.asarray(tokens_NxT), np.asarray(mask_NxT)):
    ids = [int(i) for i in row[m] if int(i) not in eos_ids]
    out.append(tokenizer.decode(ids))
  return out


def continuation_ids(tokenizer: Tokenizer, text: str) -> list[int]:
  """Ids of ``text`` as it would continue a sequence, not start one.

  Sentencepiece marks the start of a text with a dummy-prefix piece (``▁``),
  which ``encode`` writes at the start of every call; an observation or a
  stop string appended mid-sequence has none. This encodes ``"0" + text``
  and drops the ids of ``"0"``; a tokenizer without a prefix (or one whose
  ids merge across the boundary) gets ``encode(text)``.
  """
  if not text:
    return []
  head = tokenizer.encode("0")
  both = tokenizer.encode("0" + text)
  if both[:len(head)] == head and tokenizer.decode(both[len(head):]) == text:
    return both[len(head):]
  return tokenizer.encode(text)
