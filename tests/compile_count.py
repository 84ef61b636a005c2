"""How many programs a block of code lowers, by function name.

The compile-count tests used ``jitted._cache_size()``, the size of jit's C++
dispatch cache. That is an implementation detail that once read 0 after
three calls in a full CI run (the function had compiled and run), so these
tests count what they mean instead: each new program jit builds is lowered
to MLIR once, and JAX reports every lowering through ``jax.monitoring``
(also when the persistent compilation cache then skips the backend compile).
"""

import collections
import contextlib
from typing import Iterator

import jax

_LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def lowerings() -> Iterator[collections.Counter]:
  """Counts, by the jitted function's name, the programs lowered inside the
  block: ``counts["_sample_impl"]`` is the number of sampler programs."""
  counts: collections.Counter = collections.Counter()

  def listener(event: str, _: float, **kwargs) -> None:
    if event == _LOWERING:
      name = kwargs.get("fun_name", "")
      counts[name.removeprefix("jit(").removesuffix(")")] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@contextlib.contextmanager
def no_compiles() -> Iterator[None]:
  """Fails if XLA compiles anything inside the block (tracing is allowed)."""
  events = []

  def listener(event: str, _: float, **kwargs) -> None:
    del kwargs
    if "backend_compile" in event:
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not events, f"compiled during the block: {events}"
