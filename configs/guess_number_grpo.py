r"""A multi-turn game: a small model learns to halve the range it guesses in.

The environment (``rljax/envs/guess.py``): the prompt names a range
(``"1-20?"``), each model turn is a guess and the observation is ``+`` or
``-`` (higher, lower); solving within 5 guesses earns 1. The SFT
demonstrations guess the middle of the allowed range a quarter of the
time and a random allowed number otherwise (about 79% solved); binary search
solves every range up to 31. RL on the game's reward moves the policy
toward halving.

  python -m launch.train --config=configs/guess_number_grpo.py --workdir=/tmp/guess

`--config=configs/guess_number_grpo.py:tiny` shrinks it for smoke tests.
"""

import ml_collections

from configs import common


def _environment(c: ml_collections.ConfigDict) -> None:
  c.task.name = "guess_number"
  c.task.kwargs = ml_collections.ConfigDict(
      {"max_guesses": 5, "midpoint_fraction": 0.25})
  c.env.name = "guess_number"
  c.env.kwargs = ml_collections.ConfigDict({"max_guesses": 5})
  c.env.max_turns = 5
  c.env.max_observation_tokens = 2
  c.env.num_workers = 0  # a cheap, trusted game: stepped in-process
  c.rewards.names = ("env",)
  c.rewards.weights = (1.0,)
  c.sampler.max_new_tokens = 20  # 5 guesses, EOS and hint each
  c.sampler.prompt_buckets = (8,)
  c.sft.max_length = 28


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.base()
  _environment(c)
  c.task.num_train = 300
  c.tokenizer.vocab_size = 32

  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict(
      {"d_model": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
       "head_dim": 32, "mlp_dim": 384})

  c.rewards.num_workers = 0
  c.sampler.temperature = 1.0
  c.sampler.cache_dtype = "float32"

  c.sft.num_steps = 400
  c.sft.num_examples = 4000

  c.rl.num_steps = 300
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.num_minibatches = 2
  c.rl.old_logprobs = "sampler"

  c.optimizer.learning_rate = 2e-4
  c.optimizer.warmup_steps = 5

  c.eval.num_examples = 64
  c.eval.num_samples = 4
  c.eval.every = 100
  c.checkpoint.every = 100
  if arg == "tiny":
    c = common.tiny(c)
    _environment(c)
    c.eval.num_samples = 1
    return c
  return common.apply_arg(c, arg)
