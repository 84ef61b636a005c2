"""The environment of a launcher a test starts in its own process.

``one_device_env()`` keeps the test session's fast XLA:CPU code generation
(``tests/conftest.py``: compiles ~15-25% faster; ``python -m
launch.bench_rlhf --quick`` 68 s instead of 81 s on 2 cores) and sets one
simulated device in place of the session's 8, so the launcher sees one CPU
device as a user's run does. Tests of what a user sees as typed (console
output, the README's commands, the finished tiny run) start launchers with
no XLA flags at all, and without the session's compilation cache.
"""

import os
import subprocess
import sys

from launch import local_cluster


def one_device_env(fast_codegen: bool = True) -> dict[str, str]:
  """``os.environ`` with one simulated CPU device, every other XLA flag kept
  (``launch.local_cluster.child_env``, the environment of a local cluster's
  process), the session's persistent compilation cache and its directory
  of finished warm-ups (``tests/conftest.py``). ``fast_codegen=False``: XLA's default code
  generation instead, for a process that trains long enough for optimised
  code to pay for its compiles (the RLHF and quickstart notebooks, which
  train the main job: 141 s instead of 180 s for the two)."""
  env = local_cluster.child_env(1, platform="")
  if not fast_codegen:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  cache = os.environ.get("RLJAX_TEST_JAX_CACHE")
  if cache:
    env.update(JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  sft_cache = os.environ.get("RLJAX_TEST_SFT_CACHE")
  if sft_cache:
    env["RLJAX_SFT_CACHE"] = sft_cache
  return env


def run_as_pasted(code: str, cwd) -> subprocess.CompletedProcess:
  """``code`` in a fresh interpreter in ``cwd`` (outside the repository), as
  a user pastes a snippet: one CPU device, the user's XLA flags."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=900,
                        check=False)
