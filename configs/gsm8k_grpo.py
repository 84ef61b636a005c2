r"""GRPO on GSM8K from a Hugging Face checkpoint (e.g. Qwen2.5-0.5B-Instruct).

The model is a local Hugging Face directory (``model.path``: config.json,
*.safetensors, tokenizer files). The training loop reads it with
``rljax.models.load_hf_pretrained(path, mesh)``: the architecture and shapes
come from its config.json (``model.preset`` is used only when ``model.path``
is empty; ``model.overrides`` may set only ``param_dtype``, ``dtype`` and
``remat``), RL starts from its weights, completions end at any of its EOS ids
(``generation_config.json`` included), and with ``tokenizer.chat_template``
each prompt is sent as one user turn through the checkpoint's chat template.
The tokenizer files and config.json are copied to ``<workdir>/tokenizer/`` so
that ``launch.evaluate`` / ``launch.sample`` / ``launch.export`` can reload
the policy.

Weights are kept in float32 and the matmuls run in bfloat16
(``model.overrides``): bfloat16 weights would round away updates of a 1e-6
learning rate.

The data is a local JSONL file with one ``{"prompt": ..., "answer": ...}``
object per line (``answer``: the final number, e.g. ``"72"``). Prompts should
ask for the answer after ``####`` or in ``\boxed{}``, which ``math_answer``
checks. Sized for one accelerator (see README.md, "Training a Hugging Face
checkpoint", for the memory it needs).

  python -m launch.train --config=configs/gsm8k_grpo.py --workdir=/tmp/gsm8k \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct \
      --config.task.path=data/gsm8k/train.jsonl \
      --config.task.heldout_path=data/gsm8k/test.jsonl

`--config=configs/gsm8k_grpo.py:tiny` swaps in the tiny preset and the
built-in arithmetic task, so it validates and runs on a CPU with no files.
Any field can be overridden, e.g. `--config.rl.group_size=16`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.task = ml_collections.ConfigDict()
  c.task.name = "gsm8k"
  c.task.kwargs = ml_collections.ConfigDict({})
  c.task.num_train = 7473
  c.task.path = "data/gsm8k/train.jsonl"        # fields: prompt, answer
  c.task.heldout_path = "data/gsm8k/test.jsonl"  # empty: the head of path

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.path = ""          # sentencepiece runs only; with model.path: ""
  c.tokenizer.vocab_size = 32    # only used when training a sentencepiece model
  c.tokenizer.corpus_size = 2000
  c.tokenizer.chat_template = True  # wrap prompts in the checkpoint's template

  c.model = ml_collections.ConfigDict()
  c.model.path = ""              # Hugging Face checkpoint directory
  c.model.preset = "qwen2.5-0.5b"  # used only when model.path is empty
  # float32 master weights, bfloat16 compute (with model.path: only
  # param_dtype, dtype and remat may be overridden).
  c.model.overrides = ml_collections.ConfigDict(
      {"param_dtype": "float32", "dtype": "bfloat16", "remat": "none"})

  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_new_tokens = 512
  c.sampler.temperature = 1.0
  c.sampler.top_k = ml_collections.config_dict.placeholder(int)
  c.sampler.top_p = ml_collections.config_dict.placeholder(float)
  c.sampler.min_p = ml_collections.config_dict.placeholder(float)
  c.sampler.prompt_buckets = (128, 256)
  c.sampler.cache_dtype = "bfloat16"
  c.sampler.share_prefix = True

  c.sft = ml_collections.ConfigDict()
  c.sft.num_steps = 0            # a JSONL task has no reference completions
  c.sft.batch_size = 64
  c.sft.learning_rate = 3e-3
  c.sft.num_examples = 4000
  c.sft.max_length = 16

  c.rl = ml_collections.ConfigDict()
  c.rl.num_steps = 200
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 4
  c.rl.num_microbatches = 4
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
  c.rl.training_temperature = 1.0

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-6
  c.optimizer.warmup_steps = 10
  c.optimizer.schedule = "constant"
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  c.optimizer.ess_scaling = ml_collections.config_dict.placeholder(str)
  c.optimizer.max_consecutive_nonfinite = 5

  c.rewards = ml_collections.ConfigDict()
  c.rewards.names = ("math_answer",)
  c.rewards.weights = (1.0,)
  c.rewards.num_workers = 4
  c.rewards.timeout_s = 10.0

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 20
  c.eval.num_examples = 256
  c.eval.num_samples = 1
  c.eval.greedy = True
  c.eval.reward = ""

  c.checkpoint = ml_collections.ConfigDict({"every": 20, "max_to_keep": 2})

  if arg == "tiny":
    c.task.name = "arithmetic"
    c.task.path = c.task.heldout_path = ""
    c.task.kwargs = ml_collections.ConfigDict({"min_digits": 1, "max_digits": 2})
    c.task.num_train = 200
    c.tokenizer.chat_template = False
    c.model.preset = "tiny"
    c.model.overrides = ml_collections.ConfigDict({})
    c.sampler.max_new_tokens = 6
    c.sampler.prompt_buckets = (8, 16)
    c.sampler.cache_dtype = "float32"
    c.rl.num_steps = 3
    c.rl.prompts_per_step = 8
    c.rl.group_size = 4
    c.rl.num_minibatches = 2
    c.rl.num_microbatches = 1
    c.optimizer.learning_rate = 1e-4
    c.eval.num_examples = 16
    c.eval.every = 2
    c.checkpoint.every = 2
    c.rewards.num_workers = 0
  elif arg:
    raise ValueError(f"config argument {arg!r}: accepted '' or 'tiny'.")
  return c
