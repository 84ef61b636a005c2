r"""Compiled memory of one RL step: full fine-tuning vs LoRA vs LoRA on an
int8 base.

For each model and each variant the RL step (``train.make_rl_step``: GRPO's
clipped objective, AdamW, a KL term to the reference) is lowered and
compiled for abstract inputs (``jax.ShapeDtypeStruct``s from
``jax.eval_shape``: no weights are created, so the 0.5B and 1B shapes need
no download and little host memory), and ``compiled.memory_analysis()``
gives its buffers:

* ``args``: the train state (params, optimizer state) and the batch, plus
  the reference params of full fine-tuning with KL (a second copy of the
  weights; with LoRA the reference is the frozen base itself);
* ``temp``: everything the step allocates besides its inputs and outputs
  (activations, gradients, optimizer temporaries);
* ``peak = args + temp + out - alias``: the state is donated, so the new
  state reuses its buffers (``alias``).

The ratio to full fine-tuning is the figure to read; absolute bytes are
XLA:CPU's (a GPU or TPU compile would lay buffers out differently). Weights
and matmuls are float32 by default: XLA:CPU runs bfloat16 dots in float32,
so with bfloat16 it adds float32 copies of the weights (for the 0.5B shapes,
two of the tied unembedding: 1 GB) that an accelerator would not
(``--param_dtype``, ``--dtype``).

  python -m launch.bench_memory
  python -m launch.bench_memory --models=small --rows=8 --length=256

Compiled with XLA:CPU's memory-minimising scheduler (see below).
"""

from __future__ import annotations

import os

# XLA:CPU's default, concurrency-optimised scheduler orders work for
# parallelism, not memory; the memory-minimising one is closer to what GPU
# and TPU compiles do with memory. (Before remat="full" recomputed in the
# backward pass, transformer.recompute_in_backward, remat saved nothing on
# XLA:CPU under either scheduler.) Set before JAX starts its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                           "--xla_cpu_enable_concurrency_optimized_scheduler"
                           "=false").strip()

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import optax

from launch.benchlib import write_record
from rljax import models, optim, train
from rljax.train import steps as steps_lib

_MODELS = flags.DEFINE_list("models", ["small", "qwen2.5-0.5b", "llama-3.2-1b"],
                            "model presets")
_ROWS = flags.DEFINE_integer("rows", 8, "rows per RL step (one microbatch)")
_LENGTH = flags.DEFINE_integer("length", 512, "row length L (prompt + "
                               "completion)")
_COMPLETION = flags.DEFINE_integer("completion", 256, "scored completion "
                                   "columns T")
_MICRO = flags.DEFINE_integer("microbatches", 4, "gradient-accumulation "
                              "chunks of the rows")
_PARAM_DTYPE = flags.DEFINE_enum(
    "param_dtype", "float32", ["float32", "bfloat16"],
    "the weights' dtype (float32: master weights, as configs/gsm8k_grpo.py)")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"],
    "the matmuls' dtype. XLA:CPU runs bfloat16 dots in float32, so on this "
    "backend bfloat16 adds float32 copies of the weights (the tied "
    "unembedding's, 1 GB for the 0.5B shapes) that a GPU or TPU would not")
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank (alpha = 2 x rank)")
_REMAT = flags.DEFINE_enum("remat", "full", ["none", "full", "dots"],
                           "rematerialisation of the decoder blocks (all "
                           "variants)")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")

VARIANTS = ("full", "lora", "lora_int8")


def _config(name: str, variant: str) -> models.ModelConfig:
  config = models.get_preset(name, remat=_REMAT.value,
                             param_dtype=_PARAM_DTYPE.value, dtype=_DTYPE.value)
  if variant == "full":
    return config
  return config.replace(lora=models.LoraConfig(
      rank=_RANK.value, alpha=2.0 * _RANK.value,
      quantize_base="int8" if variant == "lora_int8" else "none"))


def step_memory(config: models.ModelConfig) -> dict[str, float]:
  """Compiled buffer sizes (bytes) of one RL step of ``config``."""
  rows, length, completion = _ROWS.value, _LENGTH.value, _COMPLETION.value
  optimizer = optim.make_optimizer("adamw", 1e-5)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  cfg = train.RLStepConfig(kl_coef=0.01, completion_length=completion,
                           num_microbatches=_MICRO.value)
  lora = config.lora is not None

  def state_fn(params):
    return train.TrainState(
        params, optimizer.init(steps_lib.trainable(config, params)),
        optax.EmptyState(),
        coef_tx.init(jnp.zeros((rows // _MICRO.value, completion))),
        jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))

  state = jax.eval_shape(state_fn, models.param_shapes(config))
  batch = train.RLBatch(
      jax.ShapeDtypeStruct((rows, length), jnp.int32),
      jax.ShapeDtypeStruct((rows, length), jnp.bool_),
      jax.ShapeDtypeStruct((rows, length), jnp.bool_),
      jax.ShapeDtypeStruct((rows,), jnp.float32),
      jax.ShapeDtypeStruct((rows, length), jnp.float32))
  ref = None if lora else state.params
  step = jax.jit(train.make_rl_step(config, cfg, optimizer, coef_tx),
                 donate_argnums=(0,))
  compiled = step.lower(state, batch, ref).compile()
  m = compiled.memory_analysis()
  out = {"args": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes,
         "out": m.output_size_in_bytes, "alias": m.alias_size_in_bytes}
  out["peak"] = out["args"] + out["temp"] + out["out"] - out["alias"]
  sizes = jax.tree.map(lambda x: x.size * x.dtype.itemsize, state.params)
  out["params"] = sum(jax.tree.leaves(sizes))
  out["trained"] = sum(jax.tree.leaves(steps_lib.trainable(config, sizes)))
  return out


def int8_logit_error(name: str, rows: int = 8, length: int = 128
                     ) -> dict[str, float]:
  """The int8 base against the float base on random tokens: the largest
  logit error relative to the largest logit, and the mean per-token
  KL(float || int8) of the next-token distributions (``name``'s weights
  initialised from seed 0)."""
  config = models.get_preset(name)
  float_params = models.init_params(config, jax.random.key(0))
  int8 = _config(name, "lora_int8")
  int8_params = models.attach_base(float_params, int8, jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (rows, length), 0,
                              config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(length), (rows, length))

  def logits(c, p):
    return jax.jit(lambda p: models.Decoder(c).apply(
        {"params": p}, tokens, positions, return_logits=True)[0])(p)

  exact, approx = logits(config, float_params), logits(int8, int8_params)
  logp, logq = jax.nn.log_softmax(exact), jax.nn.log_softmax(approx)
  kl = jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1))
  return {"max_abs_error_rel": float(jnp.max(jnp.abs(approx - exact))
                                     / jnp.max(jnp.abs(exact))),
          "mean_kl": float(kl)}


def main(argv):
  del argv
  gib = 2.0 ** 30
  print(f"one RL step: {_ROWS.value} rows x {_LENGTH.value} tokens "
        f"({_COMPLETION.value} scored) in {_MICRO.value} microbatches, "
        f"AdamW, KL to the reference, {_PARAM_DTYPE.value} weights, "
        f"{_DTYPE.value} matmuls, remat="
        f"{_REMAT.value}; LoRA rank {_RANK.value} on q,k,v,o,gate,up,down; "
        f"{jax.devices()[0].platform} compile")
  print(f"{'model':<14} {'variant':<10} {'params GiB':>10} {'trained':>10} "
        f"{'args GiB':>9} {'temp GiB':>9} {'peak GiB':>9} {'vs full':>8}")
  figures: dict[str, dict[str, dict[str, float]]] = {}
  for name in _MODELS.value:
    figures[name] = {}
    for variant in VARIANTS:
      m = step_memory(_config(name, variant))
      figures[name][variant] = m
      full = figures[name]["full"]["peak"]
      m["vs_full"] = m["peak"] / full
      print(f"{name:<14} {variant:<10} {m['params'] / gib:>10.3f} "
            f"{m['trained'] / gib:>10.4f} {m['args'] / gib:>9.3f} "
            f"{m['temp'] / gib:>9.3f} {m['peak'] / gib:>9.3f} "
            f"{m['vs_full']:>7.0%}", flush=True)
  if "small" in _MODELS.value:
    err = int8_logit_error("small")
    figures["small"]["int8_logit_error"] = err
    print(f"int8 base vs float base (small, random weights, 8 x 128 random "
          f"tokens): max |logit error| {err['max_abs_error_rel']:.2%} of the "
          f"largest logit, mean KL(float || int8) {err['mean_kl']:.2e} nats")
  if _RECORD_DIR.value:
    settings = {"rows": _ROWS.value, "microbatches": _MICRO.value,
                "length": _LENGTH.value,
                "completion": _COMPLETION.value, "rank": _RANK.value,
                "remat": _REMAT.value, "param_dtype": _PARAM_DTYPE.value,
                "dtype": _DTYPE.value}
    print("record:", write_record("bench_memory", figures, _RECORD_DIR.value,
                                  settings))


if __name__ == "__main__":
  app.run(main)
