"""Data: built-in generated tasks, JSONL sources and grain prompt pipelines.

Typical use in the host loop:

  >>> task = get_task("arithmetic", max_digits=2)
  >>> train = task.examples("train", 1000, seed=0)
  >>> it = make_prompt_iterator(train, batch_size=8, seed=0)
  >>> batch = next(it)
  >>> sorted(batch)
  ['answer', 'expression', 'prompt']

Batches are dicts of aligned lists; pass ``batch["prompt"]`` to the tokenizer
and the whole batch (repeated per group with ``repeat_each``) to the reward
evaluator as example fields. Save ``it.get_state()`` with each checkpoint.

A dataset file already on disk (parquet, JSON Lines, JSON) becomes a JSONL
task with ``prepare_jsonl`` (``python -m launch.prepare_data``).
"""

from rljax.data.pipeline import collate_to_lists
from rljax.data.pipeline import FormatPrompt
from rljax.data.pipeline import make_prompt_dataset
from rljax.data.pipeline import make_prompt_iterator
from rljax.data.pipeline import repeat_each
from rljax.data.prepare import DATASET_PRESETS
from rljax.data.prepare import DatasetPreset
from rljax.data.prepare import prepare_jsonl
from rljax.data.prepare import read_records
from rljax.data.prepare import task_examples
from rljax.data.sources import check_answers
from rljax.data.sources import JsonlSource
from rljax.data.sources import read_jsonl
from rljax.data.sources import write_jsonl
from rljax.data.agent_tasks import GuessNumberTask
from rljax.data.agent_tasks import WordProblemsTask
from rljax.data.tasks import ArithmeticTask
from rljax.data.tasks import CountdownTask
from rljax.data.tasks import get_task
from rljax.data.tasks import split_of
from rljax.data.tasks import SPLITS
from rljax.data.tasks import TASKS
from rljax.data.tasks import tokenizer_corpus

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "DATASET_PRESETS",
    "DatasetPreset",
    "GuessNumberTask",
    "WordProblemsTask",
    "FormatPrompt",
    "JsonlSource",
    "SPLITS",
    "TASKS",
    "check_answers",
    "collate_to_lists",
    "get_task",
    "make_prompt_dataset",
    "make_prompt_iterator",
    "prepare_jsonl",
    "read_jsonl",
    "read_records",
    "repeat_each",
    "split_of",
    "task_examples",
    "tokenizer_corpus",
    "write_jsonl",
]
