r"""The training attention's hand-written backward against JAX's derivative.

  python -m launch.bench_attention                 # both workloads, 12 rounds
  python -m launch.bench_attention --rounds=4 --record_dir=

``rljax.models.attention.attend`` runs rows longer than one query block as
blocks with a hand-written backward (``jax.custom_vjp``). The baseline here
is what it replaced: the same blocks, each one dense attention
(``attention._attend_dense``), concatenated and differentiated by JAX. Both
are traced into the same jitted RL step (PPO-clip, AdamW) and timed in one
process, alternating, after a warm-up each; the loss and the gradient norm of
the two agree to float32 rounding (printed). Workloads:

* ``small``: the ``small`` preset, 16 rows x 256 tokens (6 blocks of 43
  query rows; ``launch/bench_train_step.py``'s part 1).
* ``issue12``: the PyTorch comparison's Llama (vocab 2048, width 256, 4
  layers, 8/4 heads, MLP 1024), 64 rows x 192 tokens (4 blocks of 48).
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from launch.benchlib import rl_step_inputs, write_record
from rljax import models
from rljax.models import attention, transformer

_ROUNDS = flags.DEFINE_integer("rounds", 12, "timed steps of each side")
_WORKLOADS = flags.DEFINE_list("workloads", ["small", "issue12"],
                               "small, issue12")
_RECORD_DIR = flags.DEFINE_string("record_dir", "benchmarks/results",
                                  "where the JSON record goes ('' for none)")

WORKLOADS = {
    "small": (dict(), 16, 256),
    "issue12": (dict(vocab_size=2048, d_model=256, num_layers=4, num_heads=8,
                     num_kv_heads=4, head_dim=32, mlp_dim=1024), 64, 192),
}


def autodiff_blocks(q, k, v, mask, *, scale, softcap=None, causal=False):
  """``attend``'s blocks before the hand-written backward: each block dense,
  differentiated by JAX."""
  blocks = attention.causal_blocks(q.shape[1])
  if not causal or len(blocks) == 1:
    return attention._attend_dense(q, k, v, mask, scale, softcap)  # pylint: disable=protected-access
  return jnp.concatenate([
      attention._attend_dense(  # pylint: disable=protected-access
          q[:, lo:hi], k[:, :end], v[:, :end], mask[:, lo:hi, :end], scale,
          softcap)
      for lo, hi, end in blocks], axis=1)


def _step(config, rows, length, attend):
  """``bench_train_step``'s part-1 RL step traced with ``attend``, its state
  and batch, run once."""
  step, state, batch = rl_step_inputs(config, rows, length)
  saved = transformer.attend
  transformer.attend = attend
  try:
    state, first = step(state, batch)  # traced here, with ``attend``
    jax.block_until_ready(first)
  finally:
    transformer.attend = saved
  return step, state, batch, first


def compare(name: str, rounds: int) -> dict:
  overrides, rows, length = WORKLOADS[name]
  config = models.get_preset("small").replace(**overrides)
  sides = {"custom_vjp": _step(config, rows, length, attention.attend),
           "autodiff": _step(config, rows, length, autodiff_blocks)}
  first = {k: v[3] for k, v in sides.items()}
  rel = {key: abs(float(first["custom_vjp"][key]) - float(first["autodiff"][key]))
         / max(abs(float(first["autodiff"][key])), 1e-30)
         for key in ("pg_loss", "grad_norm")}
  times = {k: [] for k in sides}
  states = {k: v[1] for k, v in sides.items()}
  for _ in range(rounds):
    for k, (step, _, batch, _) in sides.items():
      start = time.perf_counter()
      states[k], m = step(states[k], batch)
      jax.block_until_ready(m)
      times[k].append(time.perf_counter() - start)
  best = {k: min(v) for k, v in times.items()}
  median = {k: statistics.median(v) for k, v in times.items()}
  print(f"{name}: {rows} x {length} tokens, "
        f"{models.count_params(sides['autodiff'][1].params):,} params")
  for k in sides:
    print(f"  {k:10s} best {best[k] * 1e3:7.1f} ms, median "
          f"{median[k] * 1e3:7.1f} ms over {rounds} steps")
  print(f"  autodiff / custom_vjp: {best['autodiff'] / best['custom_vjp']:.3f}x "
        f"(medians {median['autodiff'] / median['custom_vjp']:.3f}x); first "
        f"step's " + ", ".join(f"{k} rel {v:.1e}" for k, v in rel.items()))
  return {"rows": rows, "length": length, "best_s": best, "median_s": median,
          "speedup": best["autodiff"] / best["custom_vjp"],
          "median_speedup": median["autodiff"] / median["custom_vjp"],
          "first_step_rel_diff": rel}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name in _WORKLOADS.value:
    if name not in WORKLOADS:
      raise app.UsageError(f"--workloads={name!r}: accepted are "
                           f"{sorted(WORKLOADS)}.")
  figures = {name: compare(name, _ROUNDS.value) for name in _WORKLOADS.value}
  if _RECORD_DIR.value:
    print("record:", write_record("bench_attention", figures, _RECORD_DIR.value,
                                  {"rounds": _ROUNDS.value}))


if __name__ == "__main__":
  app.run(main)
