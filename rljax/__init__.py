"""rljax: JAX-native RL post-training for language models.

Submodules are imported on first access (``rljax.models``, ``rljax.train``,
...), so ``import rljax`` stays cheap; reward worker processes, which import
only ``rljax.rewards``, never pay for JAX.
"""

import importlib

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it)

_SUBMODULES = (
    "advantages", "checkpoint", "data", "envs", "logprobs", "metrics",
    "models", "objectives", "optim", "rewards", "rollout", "safetensors",
    "sampling", "sharding", "tokenizers", "train", "types",
)
__all__ = list(_SUBMODULES)


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"rljax.{name}")
  raise AttributeError(f"module 'rljax' has no attribute {name!r}")
