r"""GRPO on GSM8K from a Hugging Face checkpoint (e.g. Qwen2.5-0.5B-Instruct).

The model is a local Hugging Face directory (``model.path``: config.json,
*.safetensors, tokenizer files), e.g. from
``huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR``. It
is required: with ``tokenizer.chat_template=True`` an empty ``model.path``
is refused before anything is built. The training loop reads it with
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
checks. ``launch.prepare_data`` writes it from GSM8K's files on the Hugging
Face hub (``main/train-00000-of-00001.parquet``, ``main/test-...``),
downloaded beforehand. Sized for one accelerator (see README.md, "Training a
Hugging Face checkpoint", for the memory it needs).

  python -m launch.prepare_data --format=gsm8k \
      --input=gsm8k/main/train-00000-of-00001.parquet \
      --output=data/gsm8k/train.jsonl
  python -m launch.prepare_data --format=gsm8k \
      --input=gsm8k/main/test-00000-of-00001.parquet \
      --output=data/gsm8k/test.jsonl
  python -m launch.train --config=configs/gsm8k_grpo.py --workdir=/tmp/gsm8k \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct \
      --config.task.path=data/gsm8k/train.jsonl \
      --config.task.heldout_path=data/gsm8k/test.jsonl

`--config=configs/gsm8k_grpo.py:tiny` swaps in the tiny preset and the
built-in arithmetic task, so it validates and runs on a CPU with no files.
Any field can be overridden, e.g. `--config.rl.group_size=16`.
"""

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.base()
  c.task.name = "gsm8k"
  c.task.num_train = 7473
  c.task.path = "data/gsm8k/train.jsonl"        # fields: prompt, answer
  c.task.heldout_path = "data/gsm8k/test.jsonl"  # empty: the head of path

  c.tokenizer.chat_template = True  # wrap prompts in the checkpoint's template

  # Used only without model.path, which chat_template=True requires.
  c.model.preset = "qwen2.5-0.5b"
  # float32 master weights, bfloat16 compute (with model.path: only
  # param_dtype, dtype and remat may be overridden).
  c.model.overrides = ml_collections.ConfigDict(
      {"param_dtype": "float32", "dtype": "bfloat16", "remat": "none"})

  c.sampler.max_new_tokens = 512
  c.sampler.prompt_buckets = (128, 256)

  c.rl.num_steps = 200
  c.rl.num_minibatches = 4
  c.rl.num_microbatches = 4

  c.optimizer.warmup_steps = 10

  c.rewards.names = ("math_answer",)
  c.rewards.num_workers = 4

  c.eval.every = 20
  c.checkpoint.every = 20
  if arg == "tiny":
    common.tiny(c)
    c.rl.num_minibatches = 2
    c.rl.num_microbatches = 1
    c.optimizer.learning_rate = 1e-4
    return c
  return common.apply_arg(c, arg)
