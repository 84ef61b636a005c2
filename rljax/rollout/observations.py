"""The ids an observation adds to an episode after a model turn
(``rljax.rollout.multi_turn``): plain text, or the chat template's turn as it
renders an observation message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rljax import tokenizers as tok_lib


class ObservationFormat:
  """Turns an observation's text into the ids appended after a model turn.

  Plain (a tokenizer without a chat template, e.g. sentencepiece): the
  observation's text as is (``tokenizers.continuation_ids``: no BOS, no
  sentencepiece start-of-text piece). Chat (a
  ``ChatPromptTokenizer``): the model turn is closed as the template closes an
  assistant message (less the end-of-turn token when the model wrote it),
  the observation is a message of ``role`` as the template renders it, and
  the assistant header follows: the text between two renders of a probe
  conversation, with and without the observation.

  Args:
    tokenizer: the run's tokenizer (``ChatPromptTokenizer`` for chat).
    role: the observation's role in a chat (``"user"`` or ``"tool"``, as
      the template knows it).
    eos_ids: the end-of-turn ids (their text is dropped from the closing
      when the model's turn ended with one).
  """

  _PROBE_USER, _PROBE_TURN, _PROBE_OBS = "\x01U\x01", "\x01A\x01", "\x01O\x01"

  def __init__(self, tokenizer: Any, *, role: str = "user",
               eos_ids: Sequence[int] = ()):
    self.tokenizer = tokenizer
    self.chat = isinstance(tokenizer, tok_lib.ChatPromptTokenizer)
    self.eos_ids = tuple(eos_ids)
    self.role = role
    if self.chat:
      render = tokenizer.tokenizer.apply_chat_template
      head = [{"role": "user", "content": self._PROBE_USER},
              {"role": "assistant", "content": self._PROBE_TURN}]
      before = render(head, add_generation_prompt=False)
      after = render(head + [{"role": role, "content": self._PROBE_OBS}],
                     add_generation_prompt=True)
      if not after.startswith(before) or self._PROBE_OBS not in after:
        raise ValueError(
            f"env.observation_role={role!r}: the chat template does not "
            "render an observation message after an assistant turn as a "
            "suffix of the conversation; try role 'user'.")
      close = before[before.index(self._PROBE_TURN) + len(self._PROBE_TURN):]
      middle = after[len(before):]
      self.close = close
      self.open, self.tail = middle.split(self._PROBE_OBS)
      piece = getattr(tokenizer, "id_to_piece", None) or (
          lambda i: tokenizer.decode([i]))
      eos_texts = [piece(i) for i in self.eos_ids]
      self.close_after_eos = next(
          (close[len(e):] for e in eos_texts if e and close.startswith(e)),
          close)

  def encode(self, observation: str, ended_with_eos: bool) -> list[int]:
    """The ids appended for ``observation`` after a turn (that ended with an
    end-of-turn id, or not: a tool call's stop sequence)."""
    if not self.chat:
      return tok_lib.continuation_ids(self.tokenizer, observation)
    close = self.close_after_eos if ended_with_eos else self.close
    return self.tokenizer.encode(close + self.open + observation + self.tail)


__all__ = ["ObservationFormat"]
