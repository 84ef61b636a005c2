r"""RL train-step throughput, compile time, recompiles, and an RL step's time split.

Part 1 times the jitted ``rl_step`` (forward + backward through the chunked
logprobs, PPO-clip coefficients, AdamW) on the ``small`` preset and reports
training tokens/s and the achieved fraction of the machine's matmul FLOP/s
measured in the same run. It also checks that steps after the first compile
nothing (the jit cache holds one entry).

Part 2 runs a few steps of a config (the main job by default) twice, with
``rl.old_logprobs="recompute"`` and ``="sampler"``, and prints where an RL
step's time goes (sample / reward / advantage / train) side by side: the
sampler's logprobs save the trainer's no-gradient forward pass.

  python -m launch.bench_train_step --batch=16 --length=256
  python -m launch.bench_train_step --config=configs/arithmetic_grpo.py --split_steps=8
"""

import copy
import os
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ml_collections import config_flags

from launch.benchlib import matmul_flops_per_s, write_record
from rljax import metrics, models, train

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "arithmetic_grpo.py"),
    "config of part 2 (the main job by default)")

_PRESET = flags.DEFINE_string("preset", "small", "model preset")
_BATCH = flags.DEFINE_integer("batch", 16, "rows per step")
_LENGTH = flags.DEFINE_integer("length", 256, "tokens per row")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps")
_SPLIT = flags.DEFINE_bool("time_split", True, "run part 2 (main-job time split)")
_SPLIT_STEPS = flags.DEFINE_integer("split_steps", 8, "RL steps for part 2")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")


def train_flops(config: models.ModelConfig, tokens: int, length: int) -> float:
  """Matmul FLOPs of forward + backward (3x forward) for ``tokens`` tokens."""
  dense = (2 * config.d_model * config.num_heads * config.head_dim
           + 2 * config.d_model * config.num_kv_heads * config.head_dim
           + 3 * config.d_model * config.mlp_dim) * config.num_layers
  dense += config.d_model * config.vocab_size
  attn = 2 * config.num_layers * config.num_heads * config.head_dim * length
  return 3 * tokens * (2 * dense + attn)


def part1():
  mc = models.get_preset(_PRESET.value)
  b, t = _BATCH.value, _LENGTH.value
  params = models.init_params(mc, jax.random.key(0))
  optimizer = optax.adamw(1e-5)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  step = jax.jit(train.make_rl_step(mc, train.RLStepConfig(), optimizer, coef_tx),
                 donate_argnums=(0,))
  rng = np.random.RandomState(0)
  loss_mask = np.zeros((b, t), bool)
  loss_mask[:, t // 4:] = True
  batch = train.RLBatch(rng.randint(0, mc.vocab_size, (b, t)).astype(np.int32),
                        np.ones((b, t), bool), loss_mask,
                        rng.randn(b).astype(np.float32),
                        np.zeros((b, t), np.float32))
  state = train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                           coef_tx.init(jnp.zeros((1, 1))), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  start = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready(m)
  first = time.perf_counter() - start
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - start)
  best = min(times)
  peak = matmul_flops_per_s()
  flops = train_flops(mc, b * t, t) / best
  print(f"rl_step, preset={_PRESET.value} ({models.count_params(params):,} params), "
        f"batch {b} x {t} tokens")
  print(f"  compile + first step: {first:.2f}s; steady step: {best * 1e3:.1f} ms "
        f"(median {statistics.median(times) * 1e3:.1f} ms)")
  print(f"  training tokens/s: {b * t / best:,.0f}")
  print(f"  achieved {flops / 1e9:.1f} GFLOP/s = {100 * flops / peak:.1f}% of the "
        f"measured matmul {peak / 1e9:.1f} GFLOP/s")
  print(f"  compiled programs after {_STEPS.value + 1} steps: {step._cache_size()} "
        f"({'no recompiles' if step._cache_size() == 1 else 'RECOMPILED'})")
  return {"train_tokens_per_s": b * t / best, "fraction_of_matmul": flops / peak,
          "compiled_programs": step._cache_size(), "steady_step_s": best,
          "first_step_s": first}


STAGES = ("sample", "reward", "advantage", "train")


def _split(config, old_logprobs):
  config = copy.deepcopy(config)
  config.rl.old_logprobs = old_logprobs
  with tempfile.TemporaryDirectory() as workdir:
    train.run(config, workdir)
    rows = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r["step"] > 1]  # step 1 includes compiles
  return {k: statistics.mean(r[f"time/{k}"] for r in rows) for k in STAGES}


def part2():
  config = copy.deepcopy(_CONFIG.value)
  config.sft.num_steps = min(config.sft.num_steps, 20)
  config.rl.num_steps = _SPLIT_STEPS.value
  config.eval.every = 10_000
  config.eval.num_examples = 32
  config.checkpoint.every = 10_000
  split = {mode: _split(config, mode) for mode in train.OLD_LOGPROBS}
  print(f"\nRL step time split, mean of steps 2..{_SPLIT_STEPS.value} "
        f"({config.rl.num_epochs} epoch(s) x {config.rl.num_minibatches} "
        "minibatch(es)):")
  print(f"  {'stage':<10} {'recompute':>12} {'sampler':>12}   sampler/recompute")
  for k in STAGES + ("total",):
    a, b = ((sum(split[m].values()) if k == "total" else split[m][k])
            for m in train.OLD_LOGPROBS)
    print(f"  {k:<10} {a * 1e3:9.1f} ms {b * 1e3:9.1f} ms   {b / a:6.2f}x")
  slowest = max(split["recompute"], key=split["recompute"].get)
  print(f"  slowest stage (recompute): {slowest}")
  return {"time_split_s": split}


def main(argv):
  del argv
  figures = {"rl_step": part1()}
  if _SPLIT.value:
    figures["main_job_split"] = part2()
  if _RECORD_DIR.value:
    print("record:", write_record(
        "bench_train_step", figures, _RECORD_DIR.value,
        {"preset": _PRESET.value, "batch": _BATCH.value, "length": _LENGTH.value,
         "split_config": _CONFIG.value.to_dict() if _SPLIT.value else None}))


if __name__ == "__main__":
  app.run(main)
