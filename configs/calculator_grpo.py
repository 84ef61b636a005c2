r"""Tool use: a small model learns to call a calculator on word problems.

The environment (``rljax/envs/calculator.py``): the model writes
``<calc>12*13+5</calc>``, the turn ends there, the tool's value ``=161;`` is
appended as tokens and the model answers. Half of the SFT demonstrations
answer without the tool, which this model cannot compute: RL on the
environment's reward teaches it to call the tool (``env/tool_calls`` rises
with held-out success).

  python -m launch.train --config=configs/calculator_grpo.py --workdir=/tmp/calc

`--config=configs/calculator_grpo.py:tiny` shrinks it for smoke tests.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.base()
  c.task.name = "word_problems"
  c.task.kwargs = ml_collections.ConfigDict({"tool_fraction": 0.5})
  c.task.num_train = 4000
  c.tokenizer.vocab_size = 96

  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict(
      {"d_model": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
       "head_dim": 32, "mlp_dim": 384})

  c.env.name = "calculator"
  c.env.max_turns = 3
  c.env.max_observation_tokens = 8
  c.env.num_workers = 0  # a cheap, trusted tool: stepped in-process
  c.rewards.names = ("env",)
  c.rewards.weights = (1.0,)
  c.rewards.num_workers = 0

  c.sampler.max_new_tokens = 28  # model turns and observations together
  c.sampler.temperature = 1.0
  c.sampler.prompt_buckets = (24, 32)
  c.sampler.cache_dtype = "float32"

  c.sft.num_steps = 400
  c.sft.max_length = 56

  c.rl.num_steps = 120
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.rl.num_minibatches = 2
  c.rl.old_logprobs = "sampler"

  c.optimizer.learning_rate = 2e-4
  c.optimizer.warmup_steps = 5

  c.eval.num_examples = 128
  c.eval.num_samples = 2
  c.eval.every = 40
  c.checkpoint.every = 40
  if arg == "tiny":
    c = common.tiny(c)
    c.task.name = "word_problems"
    c.task.kwargs = ml_collections.ConfigDict({"tool_fraction": 0.5})
    c.tokenizer.vocab_size = 96
    c.sampler.max_new_tokens = 28
    c.sampler.prompt_buckets = (24, 32)
    c.sft.max_length = 56
    c.eval.num_samples = 1
    return c
  return common.apply_arg(c, arg)
