"""The built-in environments by name, and ``get_env`` for configs
(``env.name``, ``env.kwargs``)."""

from __future__ import annotations

import importlib
from typing import Any

from rljax.envs import calculator, guess, python_tool
from rljax.envs.base import Environment


def builtin_envs() -> dict[str, type]:
  """The built-in environments by name."""
  return {"calculator": calculator.CalculatorEnv,
          "guess_number": guess.GuessNumberEnv,
          "python": python_tool.PythonToolEnv}


def get_env(name: str, **kwargs: Any) -> Environment:
  """A built-in environment by name, or ``"package.module:factory"``
  called with ``kwargs``; a clear error naming ``env.name`` otherwise."""
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
      raise ValueError(f"env.name={name!r} cannot be imported ({exc}); "
                       "accepted: a built-in name or "
                       "'package.module:factory'.") from exc
  else:
    envs = builtin_envs()
    if name not in envs:
      raise ValueError(f"env.name={name!r}: accepted {tuple(sorted(envs))} "
                       "or 'package.module:factory'.")
    factory = envs[name]
  try:
    env = factory(**kwargs)
  except TypeError as exc:
    raise ValueError(f"env.kwargs={kwargs!r} for env.name={name!r}: "
                     f"{exc}") from exc
  if not isinstance(env, Environment):
    raise TypeError(f"env.name={name!r} made {type(env).__name__}, which has "
                    "no reset/step/stop_strings: an rljax.envs.Environment "
                    "is required.")
  return env
