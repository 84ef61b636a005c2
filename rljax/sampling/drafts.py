"""A small per-prompt store of the last rollout of each prompt: SPEC-RL's drafts.

Host-side and bounded: at most ``max_prompts`` prompts, least recently used
dropped first; each entry is the ``[G, T]`` completion tokens, mask and
sampler logprobs of the prompt's latest rollout (numpy, so a store of
``M`` prompts holds ``M * G * T * 10`` bytes), and for a multi-turn
episode its observation mask (``lookup_turns``: each turn drafts from the
earlier episode's turn, ``rljax/rollout/multi_turn.py``).

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
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from rljax.sampling.speculative import Draft


_FIELDS = ("tokens", "mask", "logprobs", "observed")


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
    # Inside ``frozen``: the updates that wait, and each prompt's lookups.
    self._pending: list[tuple[Any, ...]] | None = None
    self._cursor: dict[bytes, int] | None = None

  def __len__(self) -> int:
    return len(self._entries)

  @staticmethod
  def _key(prompt: Sequence[int]) -> bytes:
    return np.asarray(prompt, np.int32).tobytes()

  def lookup(self, prompts: Sequence[Sequence[int]], num_samples: int,
             max_new_tokens: int) -> Draft | None:
    """The drafts of ``B`` prompts as one ``Draft`` of ``N = B * G`` rows.

    A prompt without an entry of the same ``[G, T]`` shape gets an empty
    draft (mask all False). Inside ``frozen`` an entry may hold any number
    of rows of width ``T``: a prompt's ``c``-th lookup of the step (its
    ``c``-th prompt entry, counted over the calls) gets rows
    ``[c G, (c + 1) G)``, or an empty draft past the entry's rows, so no
    stored row drafts two new ones. Returns None when no prompt has one.
    """
    out = self._gather(prompts, num_samples, max_new_tokens)
    return None if out is None else Draft(*out[:3])

  def lookup_turns(self, prompts: Sequence[Sequence[int]], num_samples: int,
                   max_new_tokens: int) -> tuple[np.ndarray, ...] | None:
    """``lookup`` for multi-turn episodes: ``(tokens, mask, logprobs,
    observed)``, each ``[B * G, T]``, where ``observed`` marks the earlier
    episode's observation tokens (all False for a single-turn entry).
    None when no prompt has an entry."""
    return self._gather(prompts, num_samples, max_new_tokens)

  def _gather(self, prompts, num_samples, max_new_tokens):
    g, t = num_samples, max_new_tokens
    tokens = np.zeros((len(prompts) * g, t), np.int32)
    mask = np.zeros((len(prompts) * g, t), bool)
    logprobs = np.zeros((len(prompts) * g, t), np.float32)
    observed = np.zeros((len(prompts) * g, t), bool)
    found = False
    for i, prompt in enumerate(prompts):
      key = self._key(prompt)
      entry = self._entries.get(key)
      if self._cursor is None:  # one group per prompt: its own rows
        if entry is None or entry[0].shape != (g, t):
          continue
        block = entry
      else:
        c = self._cursor.get(key, 0)
        self._cursor[key] = c + 1
        if (entry is None or entry[0].shape[1] != t
            or (c + 1) * g > len(entry[0])):
          continue
        block = tuple(x[c * g:(c + 1) * g] for x in entry)
      self._entries.move_to_end(key)
      rows = slice(i * g, (i + 1) * g)
      tokens[rows], mask[rows], logprobs[rows], observed[rows] = block
      found = True
    return (tokens, mask, logprobs, observed) if found else None

  @contextlib.contextmanager
  def frozen(self) -> Iterator[None]:
    """A step sampled in rounds (rollout allocation), each prompt in any
    number of entries. Within, lookups see the entries of before (drafts
    from earlier steps only: a draft from an earlier round of the same
    policy would be accepted whole, a copy), each prompt's entries taking
    successive rows of its entry (``lookup``); updates wait, and at exit
    each prompt's entry becomes all the rows it got within, in order."""
    if self._pending is not None:
      raise RuntimeError("DraftStore.frozen is not reentrant.")
    self._pending, self._cursor = [], {}
    try:
      yield
    finally:
      pending, self._pending, self._cursor = self._pending, None, None
      merged: dict[bytes, list[tuple[np.ndarray, ...]]] = {}
      for prompts, *arrays in pending:
        g = len(arrays[0]) // len(prompts)
        for i, prompt in enumerate(prompts):
          merged.setdefault(self._key(prompt), []).append(
              tuple(x[i * g:(i + 1) * g] for x in arrays))
      for key, blocks in merged.items():
        self._store(key, tuple(np.concatenate(parts)
                               for parts in zip(*blocks)))
      self._trim()

  def update(self, prompts: Sequence[Sequence[int]], tokens_NxT: np.ndarray,
             mask_NxT: np.ndarray, logprobs_NxT: np.ndarray,
             observed_NxT: np.ndarray | None = None) -> None:
    """Stores each prompt's ``G`` rows (``N = B * G``, group-contiguous);
    inside ``frozen``, at its exit. ``observed_NxT``: a multi-turn
    episode's observation tokens (None: none)."""
    if observed_NxT is None:
      observed_NxT = np.zeros(np.shape(mask_NxT), bool)
    if self._pending is not None:
      self._pending.append((list(prompts), np.array(tokens_NxT),
                            np.array(mask_NxT), np.array(logprobs_NxT),
                            np.array(observed_NxT)))
      return
    g = len(tokens_NxT) // len(prompts)
    for i, prompt in enumerate(prompts):
      rows = slice(i * g, (i + 1) * g)
      self._store(self._key(prompt), (tokens_NxT[rows], mask_NxT[rows],
                                      logprobs_NxT[rows], observed_NxT[rows]))
    self._trim()

  def _store(self, key: bytes, entry: tuple[np.ndarray, ...]) -> None:
    tokens, mask, logprobs, observed = entry
    self._entries[key] = (np.asarray(tokens, np.int32),
                          np.asarray(mask, bool),
                          np.asarray(logprobs, np.float32),
                          np.asarray(observed, bool))
    self._entries.move_to_end(key)

  def _trim(self) -> None:
    while len(self._entries) > self.max_prompts:
      self._entries.popitem(last=False)

  def arrays(self) -> dict[str, np.ndarray] | None:
    """The store as arrays, least recently used first (None when empty).

    ``prompts`` ``[M, P]`` int32 is each prompt padded with -1 to the
    longest; ``tokens``/``mask``/``logprobs``/``observed`` are
    ``[M, G, T]``, each entry's rows padded (zeros, masks False) to the
    most any has, and
    ``rows`` ``[M]`` its own count. Entries of another width ``T`` than the
    newest one are left out (a loop uses one; ``lookup`` would not return
    them for it).
    """
    if not self._entries:
      return None
    width_t = next(reversed(self._entries.values()))[0].shape[1]
    items = [(np.frombuffer(k, np.int32), v) for k, v in self._entries.items()
             if v[0].shape[1] == width_t]
    width = max(len(p) for p, _ in items)
    most = max(len(v[0]) for _, v in items)
    prompts = np.full((len(items), width), -1, np.int32)
    for i, (p, _) in enumerate(items):
      prompts[i, :len(p)] = p
    out = {"prompts": prompts,
           "rows": np.array([len(v[0]) for _, v in items], np.int32)}
    for j, name in enumerate(_FIELDS):
      out[name] = np.stack([np.pad(v[j], ((0, most - len(v[j])), (0, 0)))
                            for _, v in items])
    return out

  def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
    """Replaces the entries with ``arrays()``'s (the newest kept if over
    ``max_prompts``; without ``rows``, every entry has all the rows;
    without ``observed``, a store written before episodes drafted, no
    token is an observation)."""
    self._entries.clear()
    prompts = np.asarray(arrays["prompts"], np.int32)
    rows = np.asarray(arrays.get("rows", [arrays["tokens"].shape[1]]
                                 * len(prompts)))
    arrays = dict(arrays)
    if "observed" not in arrays:
      arrays["observed"] = np.zeros(np.shape(arrays["mask"]), bool)
    for i, row in enumerate(prompts):
      n = int(rows[i])
      self._store(row[row >= 0].tobytes(),
                  tuple(arrays[name][i][:n] for name in _FIELDS))
    self._trim()


class Speculation(NamedTuple):
  """What a rollout collector needs for SPEC-RL drafts.

  Attributes:
    sampler: ``make_speculative_sampler``'s ``fn(params, tokens_BxP,
      mask_BxP, draft, key) -> (Rollout, accepted_N)``, with the same
      settings as the plain sampler it stands in for.
    store: the prompts' latest rollouts.
    max_new_tokens: ``T`` of the rollouts (the drafts' width).
    draft_slots: ``[G]`` bool, the rows of a group that take a draft (LATR:
      its rows sampled as usual); None: every row.
  """

  sampler: Callable
  store: DraftStore
  max_new_tokens: int
  draft_slots: np.ndarray | None = None
