"""Multi-turn and tool-use environments (docs/environments.md).

``Environment`` (``reset`` / ``step``, states as JSON values) and
``EnvRunner`` (worker processes with timeouts) are in ``base``; the rollout
that decodes model turns and prefills observations into each row's KV cache
is ``rollout.MultiTurnSampler``. Built-in environments: ``calculator``
(``CalculatorEnv``), ``guess_number`` (``GuessNumberEnv``) and ``python``
(``PythonToolEnv``, code run in ``sandbox``).
"""

import importlib

from rljax.envs.base import (Environment, EnvOutcome, EnvRunner, Step,
                             check_reset, check_step, env_reward)
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.guess import GuessNumberEnv
from rljax.envs.python_tool import PythonToolEnv
from rljax.envs.registry import builtin_envs, get_env
from rljax.envs.sandbox import SandboxLimits, SandboxResult, run_python

# The rollout (JAX) is imported on first access: an environment's worker
# process imports this package to unpickle its calls, and without JAX a
# worker replaced after a timeout is ready in a fraction of the time.
_ROLLOUT = ("Episodes", "MultiTurnSampler", "ObservationFormat", "TurnConfig")


def __getattr__(name):
  if name in _ROLLOUT or name == "rollout":
    module = importlib.import_module("rljax.envs.rollout")
    return module if name == "rollout" else getattr(module, name)
  raise AttributeError(f"module 'rljax.envs' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_ROLLOUT) | {"rollout"})


__all__ = [
    "CalculatorEnv", "EnvOutcome", "EnvRunner", "Environment", "Episodes",
    "GuessNumberEnv", "MultiTurnSampler", "ObservationFormat",
    "PythonToolEnv", "SandboxLimits", "SandboxResult", "Step", "run_python",
    "TurnConfig", "builtin_envs", "check_reset", "check_step", "env_reward",
    "get_env",
]
