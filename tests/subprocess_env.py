"""The environment of a launcher a test starts in its own process.

``one_device_env()`` keeps the test session's fast XLA:CPU code generation
(``tests/conftest.py``: compiles ~15-25% faster; ``python -m
launch.bench_rlhf --quick`` 68 s instead of 81 s on 2 cores) and drops its
8 simulated devices, so the launcher sees one CPU device as a user's run
does. Tests of what a user sees as typed (console output, the README's
commands, the finished tiny run) start launchers with no XLA flags at all.
"""

import os
import re


def one_device_env() -> dict[str, str]:
  """``os.environ`` without the simulated device count in ``XLA_FLAGS``."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 env.get("XLA_FLAGS", "")).strip()
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env
