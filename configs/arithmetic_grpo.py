r"""The main job: a small model learns 2-digit addition, SFT warm-up then GRPO.

Runs on a laptop CPU in minutes; held-out accuracy (sampled at the training
temperature) is printed before and after RL.

  python -m launch.train --config=configs/arithmetic_grpo.py --workdir=/tmp/rljax_demo

`--config=configs/arithmetic_grpo.py:tiny` shrinks everything for smoke tests.
Any field can be overridden, e.g. `--config.rl.group_size=16`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"
  c.task.kwargs = ml_collections.ConfigDict({"min_digits": 1, "max_digits": 2})
  c.task.num_train = 6000
  c.task.path = ""
  c.task.heldout_path = ""

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.path = ""          # empty: train a small sentencepiece model
  c.tokenizer.vocab_size = 32
  c.tokenizer.corpus_size = 2000

  c.model = ml_collections.ConfigDict()
  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict(
      {"d_model": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
       "head_dim": 32, "mlp_dim": 384})

  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_new_tokens = 6
  # Sampling (and evaluation) at T=1.5: the SFT policy is right at the mode
  # but spreads mass over near misses; RL on the verifiable reward sharpens it.
  c.sampler.temperature = 1.5
  c.sampler.top_k = ml_collections.config_dict.placeholder(int)
  c.sampler.top_p = ml_collections.config_dict.placeholder(float)
  c.sampler.min_p = ml_collections.config_dict.placeholder(float)
  c.sampler.prompt_buckets = (8, 16)
  c.sampler.cache_dtype = "float32"
  c.sampler.share_prefix = True

  c.sft = ml_collections.ConfigDict()
  c.sft.num_steps = 700
  c.sft.batch_size = 64
  c.sft.learning_rate = 3e-3
  c.sft.num_examples = 4000
  c.sft.max_length = 16
  # Fraction of demonstrations given a near-miss answer (an imperfect teacher).
  c.sft.label_noise = 0.0

  c.rl = ml_collections.ConfigDict()
  c.rl.num_steps = 400
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 2
  c.rl.num_microbatches = 1
  c.rl.advantage = "grpo"
  c.rl.advantage_clip = ml_collections.config_dict.placeholder(float)
  c.rl.objective = "ppo_clip"
  c.rl.clip_eps_low = 0.2
  c.rl.clip_eps_high = 0.28
  c.rl.is_correction = "none"
  c.rl.is_cap = 2.0
  c.rl.is_level = "token"
  c.rl.aggregation = "token_mean"
  c.rl.kl_coef = 0.0
  c.rl.entropy_coef = 0.0
  c.rl.training_temperature = 1.5

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1.5e-4
  c.optimizer.warmup_steps = 5
  c.optimizer.schedule = "constant"
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  c.optimizer.ess_scaling = ml_collections.config_dict.placeholder(str)
  c.optimizer.max_consecutive_nonfinite = 5

  c.rewards = ml_collections.ConfigDict()
  c.rewards.names = ("numeric_match",)
  c.rewards.weights = (1.0,)
  c.rewards.num_workers = 2
  c.rewards.timeout_s = 10.0

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50
  c.eval.num_examples = 512
  c.eval.num_samples = 1
  c.eval.greedy = True
  c.eval.reward = ""

  c.checkpoint = ml_collections.ConfigDict(
      {"every": 50, "max_to_keep": 2, "best_metric": "", "best_mode": "max"})

  if arg == "tiny":
    c.model.preset = "tiny"
    c.model.overrides = ml_collections.ConfigDict({})
    c.task.num_train = 200
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
  elif arg:
    raise ValueError(f"config argument {arg!r}: accepted '' or 'tiny'.")
  return c
