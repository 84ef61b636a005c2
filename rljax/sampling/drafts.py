"""A small per-prompt store of the last rollout of each prompt: SPEC-RL's drafts.

Host-side and bounded: at most ``max_prompts`` prompts, least recently used
dropped first; each entry is the ``[G, T]`` completion tokens, mask and
sampler logprobs of the prompt's latest rollout (numpy, so a store of
``M`` prompts holds ``M * G * T * 9`` bytes).

Checkpointed: the training loop saves ``arrays()`` with each checkpoint
(an ``ocp`` item beside the train state) and a resume ``load_arrays()`` it,
so a resumed run with speculation on drafts, accepts and draws the same
tokens as the uninterrupted run. A checkpoint written without it (or by
rljax before the store was saved) resumes with an empty store, which
refills as prompts are sampled: the first visit of a prompt then samples
plainly.

References:
  Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning via
  Speculative Rollouts", https://arxiv.org/abs/2509.23232 (drafts are the
  previous epoch's rollouts of the same prompt).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from rljax.sampling.speculative import Draft


class DraftStore:
  """The last rollout of each prompt, keyed by its token ids (LRU-bounded).

  Args:
    max_prompts: how many prompts are kept at most.

  Example:
    >>> import numpy as np
    >>> store = DraftStore(max_prompts=2)
    >>> store.lookup([[1, 2]], num_samples=1, max_new_tokens=3) is None
    True
    >>> store.update([[1, 2]], np.array([[5, 6, 0]]),
    ...              np.array([[True, True, False]]), np.zeros((1, 3)))
    >>> store.lookup([[1, 2]], 1, 3).tokens
    array([[5, 6, 0]], dtype=int32)
  """

  def __init__(self, max_prompts: int):
    if not isinstance(max_prompts, int) or max_prompts < 1:
      raise ValueError(f"sampler.spec_store_prompts={max_prompts!r}: a "
                       "positive integer is required.")
    self.max_prompts = max_prompts
    self._entries: collections.OrderedDict[bytes, tuple[np.ndarray, ...]] = (
        collections.OrderedDict())

  def __len__(self) -> int:
    return len(self._entries)

  @staticmethod
  def _key(prompt: Sequence[int]) -> bytes:
    return np.asarray(prompt, np.int32).tobytes()

  def lookup(self, prompts: Sequence[Sequence[int]], num_samples: int,
             max_new_tokens: int) -> Draft | None:
    """The drafts of ``B`` prompts as one ``Draft`` of ``N = B * G`` rows.

    A prompt without an entry of the same ``[G, T]`` shape gets an empty
    draft (mask all False). Returns None when no prompt has one.
    """
    g, t = num_samples, max_new_tokens
    tokens = np.zeros((len(prompts) * g, t), np.int32)
    mask = np.zeros((len(prompts) * g, t), bool)
    logprobs = np.zeros((len(prompts) * g, t), np.float32)
    found = False
    for i, prompt in enumerate(prompts):
      entry = self._entries.get(self._key(prompt))
      if entry is None or entry[0].shape != (g, t):
        continue
      self._entries.move_to_end(self._key(prompt))
      rows = slice(i * g, (i + 1) * g)
      tokens[rows], mask[rows], logprobs[rows] = entry
      found = True
    return Draft(tokens, mask, logprobs) if found else None

  def update(self, prompts: Sequence[Sequence[int]], tokens_NxT: np.ndarray,
             mask_NxT: np.ndarray, logprobs_NxT: np.ndarray) -> None:
    """Stores each prompt's ``G`` rows (``N = B * G``, group-contiguous)."""
    g = len(tokens_NxT) // len(prompts)
    for i, prompt in enumerate(prompts):
      rows = slice(i * g, (i + 1) * g)
      key = self._key(prompt)
      self._entries[key] = (np.asarray(tokens_NxT[rows], np.int32),
                            np.asarray(mask_NxT[rows], bool),
                            np.asarray(logprobs_NxT[rows], np.float32))
      self._entries.move_to_end(key)
    while len(self._entries) > self.max_prompts:
      self._entries.popitem(last=False)


  def arrays(self) -> dict[str, np.ndarray] | None:
    """The store as arrays, least recently used first (None when empty).

    ``prompts`` ``[M, P]`` int32 is each prompt padded with -1 to the
    longest; ``tokens``/``mask``/``logprobs`` are ``[M, G, T]``. Entries of
    another ``[G, T]`` shape than the newest one are left out (a loop uses
    one shape; ``lookup`` would not return them for it).
    """
    if not self._entries:
      return None
    shape = next(reversed(self._entries.values()))[0].shape
    items = [(np.frombuffer(k, np.int32), v) for k, v in self._entries.items()
             if v[0].shape == shape]
    width = max(len(p) for p, _ in items)
    prompts = np.full((len(items), width), -1, np.int32)
    for i, (p, _) in enumerate(items):
      prompts[i, :len(p)] = p
    return {"prompts": prompts,
            **{name: np.stack([v[j] for _, v in items])
               for j, name in enumerate(("tokens", "mask", "logprobs"))}}

  def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
    """Replaces the entries with ``arrays()``'s (the newest kept if over
    ``max_prompts``)."""
    self._entries.clear()
    prompts = np.asarray(arrays["prompts"], np.int32)
    for i, row in enumerate(prompts):
      self._entries[row[row >= 0].tobytes()] = (
          np.asarray(arrays["tokens"][i], np.int32),
          np.asarray(arrays["mask"][i], bool),
          np.asarray(arrays["logprobs"][i], np.float32))
    while len(self._entries) > self.max_prompts:
      self._entries.popitem(last=False)


class Speculation(NamedTuple):
  """What a rollout collector needs for SPEC-RL drafts.

  Attributes:
    sampler: ``make_speculative_sampler``'s ``fn(params, tokens_BxP,
      mask_BxP, draft, key) -> (Rollout, accepted_N)``, with the same
      settings as the plain sampler it stands in for.
    store: the prompts' latest rollouts.
    max_new_tokens: ``T`` of the rollouts (the drafts' width).
  """

  sampler: Callable
  store: DraftStore
  max_new_tokens: int
