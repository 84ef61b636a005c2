"""What the configs share: every section with its defaults, and the tiny shrink.

A config file starts from ``base()`` and changes what differs:

    from configs import common

    def get_config(arg=None):
      c = common.base()
      c.task.name = "arithmetic"
      ...
      return common.apply_arg(c, arg)

``python -m launch.*`` and the tests run from the repository root, so
``configs`` is importable there. Every field is read by
``rljax/train/build.py``; ``--config.<section>.<field>=...`` overrides it.
"""

import ml_collections

from rljax.train import schema


def base() -> ml_collections.ConfigDict:
  """Every section of a training config, with the library's defaults.

  The fields, their defaults, ranges and meaning are declared once, in
  ``rljax/train/schema.py`` (and, for the fields of one algorithm name, its
  entry in ``rljax/train/table.py``).
  """
  return schema.base_config()


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks a config to CPU-test size: tiny model, arithmetic, 3 RL steps."""
  c.task.name = "arithmetic"
  c.task.path = c.task.heldout_path = ""
  c.task.kwargs = ml_collections.ConfigDict({"min_digits": 1, "max_digits": 2})
  c.task.num_train = 200
  c.tokenizer.chat_template = False
  c.model.path = ""
  c.model.preset = "tiny"
  c.model.overrides = ml_collections.ConfigDict({})
  c.sampler.max_new_tokens = 6
  c.sampler.prompt_buckets = (8, 16)
  c.sampler.cache_dtype = "float32"
  c.sft.num_steps = 4
  c.sft.num_examples = 64
  c.sft.batch_size = 8
  c.rl.num_steps = 3
  c.rl.prompts_per_step = 8
  c.rl.group_size = 4
  c.eval.num_examples = 16
  c.eval.every = 2
  c.checkpoint.every = 2
  c.rewards.num_workers = 0
  return c


def apply_arg(c: ml_collections.ConfigDict, arg: str | None
              ) -> ml_collections.ConfigDict:
  """The config argument: '' (as is) or 'tiny' (``tiny(c)``)."""
  if arg == "tiny":
    return tiny(c)
  if arg:
    raise ValueError(f"config argument {arg!r}: accepted '' or 'tiny'.")
  return c
