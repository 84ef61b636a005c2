"""Marks for the tests that need packages of the ``hf`` extra.

Only those tests skip without the extra; the rest of their module (pure-JAX
config and weights I/O, chat rendering with test doubles) still runs.
"""

import importlib.util

import pytest


def requires_hf(*packages: str):
  """Marks a test ``requires_hf`` and skips it unless ``packages`` are installed.

  Example:
    >>> @requires_hf("torch", "transformers")  # doctest: +SKIP
    ... def test_parity(): ...
  """
  missing = [p for p in packages if importlib.util.find_spec(p) is None]

  def mark(fn):
    fn = pytest.mark.skipif(
        bool(missing), reason=f"needs the hf extra: {missing} not installed")(fn)
    return pytest.mark.requires_hf(fn)

  return mark
