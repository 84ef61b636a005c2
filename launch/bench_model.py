r"""Forward-pass throughput and compiled memory of a model preset.

Prints, for a few (batch, length) points: forward tokens/s, achieved FLOP/s
next to the machine's matmul FLOP/s measured in the same run (a large
``jnp.dot``), and the compiled temporary memory of the forward pass and its output size
with hidden states only vs. with full ``B x T x V`` logits (what
``rljax.logprobs`` avoids materialising).

  python -m launch.bench_model --preset=small --points=4x128,8x256,16x512
"""

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.benchlib import best_time, matmul_flops_per_s, write_record
from rljax import models

_PRESET = flags.DEFINE_string("preset", "small", "model preset")
_POINTS = flags.DEFINE_list("points", ["4x128", "8x256", "16x512"],
                            "BxT points")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per point")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")


def forward_flops(config: models.ModelConfig, b: int, t: int) -> float:
  """Matmul FLOPs of one forward pass (projections, attention, logits)."""
  n_matmul = config.num_params() - config.vocab_size * config.d_model
  attn = 2 * config.num_layers * config.num_heads * config.head_dim * t
  return 2 * b * t * (n_matmul + config.vocab_size * config.d_model) + 2 * b * t * attn


def main(argv):
  del argv
  config = models.get_preset(_PRESET.value)
  params = models.init_params(config, jax.random.key(_SEED.value))
  peak = matmul_flops_per_s()
  print(f"preset={_PRESET.value} params={models.count_params(params):,} "
        f"devices={jax.device_count()} ({jax.devices()[0].platform})")
  print(f"machine matmul: {peak / 1e9:.1f} GFLOP/s (fp32 2048^3 dot)")
  model = models.Decoder(config)
  header = (f"{'B':>4} {'T':>5} {'tokens/s':>10} {'GFLOP/s':>8} {'%peak':>6} "
            f"{'temp MiB':>9} {'out MiB hidden':>15} {'out MiB logits':>15}")
  print(header)
  figures = {"matmul_gflops": peak / 1e9}
  for point in _POINTS.value:
    b, t = (int(x) for x in point.split("x"))
    tokens = jnp.asarray(np.random.RandomState(0).randint(
        0, config.vocab_size, (b, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    hidden_fn = jax.jit(lambda p, x, pos: model.apply({"params": p}, x, pos)[0])
    logits_fn = jax.jit(lambda p, x, pos: model.apply(
        {"params": p}, x, pos, return_logits=True)[0])
    analyses = [f.lower(params, tokens, positions).compile().memory_analysis()
                for f in (hidden_fn, logits_fn)]
    mem = [a.temp_size_in_bytes / 2**20 for a in analyses]
    out_mib = [a.output_size_in_bytes / 2**20 for a in analyses]
    seconds = best_time(logits_fn, params, tokens, positions,
                        repeats=_REPEATS.value)
    flops = forward_flops(config, b, t) / seconds
    print(f"{b:>4} {t:>5} {b * t / seconds:>10,.0f} {flops / 1e9:>8.1f} "
          f"{100 * flops / peak:>5.1f}% {mem[1]:>9.1f} {out_mib[0]:>15.1f} "
          f"{out_mib[1]:>15.1f}")
    figures[point] = {"tokens_per_s": b * t / seconds,
                      "fraction_of_matmul": flops / peak,
                      "temp_mib_logits": mem[1], "out_mib_hidden": out_mib[0],
                      "out_mib_logits": out_mib[1]}
  if _RECORD_DIR.value:
    print("record:", write_record(f"bench_model_{_PRESET.value}", figures,
                                  _RECORD_DIR.value,
                                  {"preset": _PRESET.value,
                                   "points": list(_POINTS.value)}))


if __name__ == "__main__":
  app.run(main)
