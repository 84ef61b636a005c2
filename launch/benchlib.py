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


def matmul_flops_per_s(sizes: tuple[int, ...] = (1024, 2048),
                       repeats: int = 10) -> float:
  """Measured fp32 matmul throughput of this machine (the roofline): the
  best rate of square matmuls of ``sizes``, best of ``repeats`` calls each.

  One size, best of 5 (before 2026-12-04) read 5-15% low on a noisy 2-core
  host: one 2048 matmul measured 404-487 GFLOP/s in three processes a
  minute apart, 1024 ones 483-499.
  """
  square = jax.jit(lambda a: a @ a)
  return max(2 * n ** 3 / best_time(square, jnp.ones((n, n), jnp.float32),
                                    repeats=repeats) for n in sizes)


def git(*args: str) -> str:
  """``git <args>``'s output in this repository ('' when git fails)."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  try:
    return subprocess.run(["git", *args], cwd=root, capture_output=True,
                          text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def run_train(args: list[str], env: dict, what: str) -> None:
  """``python -m launch.train <args>`` in the repository with ``env``;
  on failure, prints the end of its output and exits naming ``what``."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  result = subprocess.run([sys.executable, "-m", "launch.train", *args],
                          cwd=root, env=env, capture_output=True, text=True)
  if result.returncode:
    print(result.stdout[-3000:], result.stderr[-3000:])
    raise SystemExit(f"{what} failed (exit {result.returncode}).")


def cpu() -> dict:
  """The host CPU as far as XLA:CPU's float results depend on it: vendor,
  family, model, cache size and the vector ISA flags (``/proc/cpuinfo``).

  Two CPUs that differ here may give different float results for the same
  program (XLA:CPU compiles for the host's ISA; Eigen's matrix-product
  blocking follows its caches), and a sampled trajectory that crosses a
  different token then diverges: a run's figures reproduce to the digit on
  a CPU with the same signature. Empty where ``/proc/cpuinfo`` is absent.
  """
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:
    return {}
  first = text.split("\n\n")[0]
  fields = {}
  for line in first.splitlines():
    key, _, value = line.partition(":")
    fields[key.strip()] = value.strip()
  isa = sorted(flag for flag in fields.get("flags", "").split()
               if flag.startswith(("avx", "fma", "sse", "amx", "f16c")))
  return {"vendor": fields.get("vendor_id", ""),
          "family": fields.get("cpu family", ""),
          "model": fields.get("model", ""),
          "model_name": fields.get("model name", ""),
          "cache": fields.get("cache size", ""), "isa": " ".join(isa)}


def provenance() -> dict:
  """Which code and machine a figure belongs to: commit, dirty flag, host."""
  import os  # pylint: disable=import-outside-toplevel
  import platform  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  return {
      "commit": git("rev-parse", "HEAD") or "unknown",
      "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
      "machine": {"platform": platform.platform(),
                  "python": platform.python_version(),
                  "cpu_count": os.cpu_count(), "jax": jax.__version__,
                  "devices": f"{len(devices)} x {devices[0].device_kind}",
                  "cpu": cpu(),
                  "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")},
  }


def write_record(name: str, figures: dict, directory: str,
                 config: dict | None = None) -> str:
  """Writes ``<directory>/<name>-<commit12>.json``: figures, config, provenance.

  Returns the path. Keep records under ``benchmarks/results/`` so that a
  figure in the README can be traced to the code that produced it.
  """
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  record = {"name": name, "figures": figures, "config": config or {},
            **provenance()}
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{name}-{record['commit'][:12]}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=2, sort_keys=True, default=str)
  return path


def rl_step_inputs(mc, b: int, t: int):
  """The RL step the ``bench_train_step`` part 1 and ``bench_attention``
  time: a jitted step (PPO-clip, AdamW; traced at its first call), its
  initial state and a random batch of ``b x t`` tokens whose last
  ``t - t // 4`` are completion tokens. ``mc``: a ``models.ModelConfig``.

  rljax's trainer is imported here, not with this module: the launchers
  that import ``benchlib`` only to write records (``launch.train``,
  ``reproduce_readme``, the benches that start runs) start ~0.5 s sooner.
  """
  # pylint: disable=import-outside-toplevel
  import numpy as np
  import optax
  from rljax import models, train
  params = models.init_params(mc, jax.random.key(0))
  optimizer = optax.adamw(1e-5)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  completion = t - t // 4  # the loss mask below
  step = jax.jit(train.make_rl_step(
      mc, train.RLStepConfig(completion_length=completion), optimizer,
      coef_tx), donate_argnums=(0,))
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
  return step, state, batch
