"""Multi-turn and tool-use environments (docs/environments.md).

``Environment`` (``reset`` / ``step``, states as JSON values) and
``EnvRunner`` (worker processes with timeouts) are in ``base``; the rollout
that decodes model turns and prefills observations into each row's KV cache
is ``rljax.rollout.MultiTurnSampler``. This package imports no JAX: an
environment's worker process imports it to unpickle its calls. Built-in environments: ``calculator``
(``CalculatorEnv``), ``guess_number`` (``GuessNumberEnv``) and ``python``
(``PythonToolEnv``, code run in ``sandbox``).
"""

from rljax.envs.base import (Environment, EnvOutcome, EnvRunner, Step,
                             check_reset, check_step, env_reward)
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.guess import GuessNumberEnv
from rljax.envs.python_tool import PythonToolEnv
from rljax.envs.registry import builtin_envs, get_env
from rljax.envs.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "CalculatorEnv", "EnvOutcome", "EnvRunner", "Environment",
    "GuessNumberEnv", "PythonToolEnv", "SandboxLimits", "SandboxResult",
    "Step", "builtin_envs", "check_reset", "check_step", "env_reward",
    "get_env", "run_python",
]
