"""grain pipelines that feed prompts to the host loop.

``make_prompt_iterator`` turns any random-access source of example dicts (a
list, a ``JsonlSource``, a task's examples) into a deterministic, checkpointable
iterator of batches. A batch is a dict of lists, one list per field, aligned
(``{"prompt": [...], "answer": [...]}``), ready for tokenization and for the
reward functions' ``**example_fields``.

The pipeline is ``source -> shard -> map -> shuffle -> repeat -> batch``, all
on ``grain.MapDataset``, so element ``i`` of the stream is a pure function of
``(source, seed, i)``: the iterator state is just the next index
(``iterator.get_state()`` is a small dict), and ``set_state`` on a fresh
iterator resumes exactly. Each epoch is shuffled differently.

Transforms (``FormatPrompt`` and ``collate_to_lists``) are module-level so that
grain can pickle them to worker processes.

Example:
  >>> examples = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
  >>> it = make_prompt_iterator(examples, batch_size=2, seed=0, shuffle=False)
  >>> next(it)
  {'prompt': ['0+1=', '1+1='], 'answer': ['1', '2']}
  >>> state = it.get_state()
  >>> b = next(it)
  >>> it.set_state(state)
  >>> next(it) == b
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np


def collate_to_lists(examples: Sequence[Mapping[str, Any]]
                     ) -> dict[str, list[Any]]:
  """Batches example dicts into a dict of aligned lists.

  Raises:
    ValueError: if the examples do not all have the same fields.
  """
  keys = list(examples[0])
  for i, example in enumerate(examples):
    if set(example) != set(keys):
      raise ValueError(
          f"example {i} of the batch has fields {sorted(example)} but example "
          f"0 has {sorted(keys)}: every example must have the same fields.")
  return {k: [example[k] for example in examples] for k in keys}


@dataclasses.dataclass(frozen=True)
class FormatPrompt:
  """Sets ``prompt`` from a template over the example's fields.

  Example:
    >>> FormatPrompt("Q: {question}\\nA:")({"prompt": "x", "question": "2+2?"})
    {'prompt': 'Q: 2+2?\\nA:', 'question': '2+2?'}

  Attributes:
    template: a ``str.format`` template; ``{prompt}`` is the current prompt.
  """
  template: str

  def __call__(self, example: Mapping[str, Any]) -> dict[str, Any]:
    try:
      prompt = self.template.format(**example)
    except KeyError as exc:
      raise ValueError(
          f"template={self.template!r} names field {exc} that the example "
          f"lacks; fields: {sorted(example)}.") from exc
    return dict(example, prompt=prompt)


def shuffle_seed(seed: int) -> int:
  """A 32-bit shuffle seed derived from ``seed``.

  grain reshuffles epoch ``e`` with ``seed + e``; hashing the user's seed keeps
  runs with seeds ``s`` and ``s + 1`` from sharing epoch orders.
  """
  return int(np.random.SeedSequence(int(seed)).generate_state(1)[0])


def make_prompt_dataset(
    source: Sequence[Mapping[str, Any]] | grain.MapDataset,
    batch_size: int,
    seed: int,
    *,
    num_epochs: int | None = None,
    shuffle: bool = True,
    drop_remainder: bool = True,
    transform: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    block: tuple[int, int] = (0, 1),
) -> grain.MapDataset:
  """The batched ``grain.MapDataset`` behind ``make_prompt_iterator``.

  Args: see ``make_prompt_iterator``.

  Returns:
    A dataset of batches (dicts of lists); its length is the number of
    batches (``sys.maxsize`` if it repeats forever).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: must be >= 1.")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs}: accepted None (forever) or "
                     "an int >= 1.")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index}, shard_count={shard_count}: "
                     "need 0 <= shard_index < shard_count.")
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed={seed!r}: accepted a non-negative int.")
  ds = (source if isinstance(source, grain.MapDataset)
        else grain.MapDataset.source(source))
  if shard_count > 1:
    ds = ds[shard_index::shard_count]
  n = len(ds)
  if n == 0:
    raise ValueError("the source (after sharding) has no examples.")
  if drop_remainder and num_epochs is not None and n * num_epochs < batch_size:
    raise ValueError(
        f"batch_size={batch_size} exceeds the {n * num_epochs} examples of "
        f"{num_epochs} epoch(s) with drop_remainder=True: no batch would be "
        "produced.")
  if transform is not None:
    ds = ds.map(transform)
  if shuffle:
    ds = ds.shuffle(seed=shuffle_seed(seed))
  ds = ds.repeat(num_epochs)
  k, blocks = block
  if not (isinstance(blocks, int) and blocks >= 1 and 0 <= k < blocks):
    raise ValueError(f"block={block!r}: need (k, K) with 0 <= k < K.")
  if batch_size % blocks:
    raise ValueError(f"batch_size={batch_size} does not split into {blocks} "
                     "process blocks: use a multiple of the process count.")
  ds = ds.batch(batch_size // blocks, drop_remainder=drop_remainder,
                batch_fn=collate_to_lists)
  # Block k of global batch i is local batch i * K + k of the stream.
  return ds[k::blocks] if blocks > 1 else ds


def make_prompt_iterator(
    source: Sequence[Mapping[str, Any]] | grain.MapDataset,
    batch_size: int,
    seed: int,
    *,
    num_epochs: int | None = None,
    shuffle: bool = True,
    drop_remainder: bool = True,
    transform: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    block: tuple[int, int] = (0, 1),
    read_threads: int = 0,
) -> grain.DatasetIterator:
  """A deterministic, checkpointable iterator of prompt batches.

  Args:
    source: random-access example dicts (a list, a ``JsonlSource``, a
      ``grain.MapDataset``); each has a ``prompt``.
    batch_size: examples per batch (per process when sharded).
    seed: shuffle seed; the same seed gives the same batches.
    num_epochs: passes over the data; None repeats forever.
    shuffle: shuffle (differently in each epoch).
    drop_remainder: drop a last, smaller batch (with finite epochs); keep
      batches a fixed size for a fixed-shape train step.
    transform: a per-example map, e.g. ``FormatPrompt``; a module-level
      picklable callable.
    shard_index: this reader's shard of the source (split before the
      shuffle: shards see disjoint examples in their own order).
    shard_count: number of source shards.
    block: ``(k, K)``: yield block ``k`` of ``K`` equal, contiguous blocks
      of each batch of ``batch_size`` (``ProcessGroup.block``): the blocks
      of ``K`` processes are together exactly the batches of ``(0, 1)``, and
      each process reads only its own examples. The iterator's state is the
      global batch index whatever ``K``, so a run can resume on another
      process count.
    read_threads: grain read threads; 0 reads in the calling thread, best
      for in-memory data.

  Returns:
    A ``grain.DatasetIterator``: ``next(it)`` is a dict of lists;
    ``it.get_state()`` / ``it.set_state(state)`` save and restore the
    position (store the state with the checkpoint).
  """
  ds = make_prompt_dataset(
      source, batch_size, seed, num_epochs=num_epochs, shuffle=shuffle,
      drop_remainder=drop_remainder, transform=transform,
      shard_index=shard_index, shard_count=shard_count, block=block)
  return iter(ds.to_iter_dataset(
      grain.ReadOptions(num_threads=read_threads,
                        prefetch_buffer_size=max(1, 2 * read_threads))))


def repeat_each(batch: Mapping[str, Sequence[Any]], times: int
                ) -> dict[str, list[Any]]:
  """Repeats every example ``times`` times in a row (one group per prompt).

  Example:
    >>> repeat_each({"prompt": ["a", "b"], "answer": [1, 2]}, 2)
    {'prompt': ['a', 'a', 'b', 'b'], 'answer': [1, 1, 2, 2]}
  """
  if times < 1:
    raise ValueError(f"times={times}: must be >= 1.")
  return {k: [x for x in v for _ in range(times)] for k, v in batch.items()}
