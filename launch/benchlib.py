"""Shared helpers of the ``bench_*.py`` scripts (no flags here)."""

import time

import jax
import jax.numpy as jnp


def best_time(fn, *args, repeats: int = 5) -> float:
  """Best wall time of ``repeats`` calls after one warm-up call."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
  """Measured fp32 matmul throughput of this machine (the roofline)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  return 2 * n ** 3 / best_time(f, a, repeats=repeats)
