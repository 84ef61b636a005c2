"""Property checks shared by every rljax optax-protocol transform.

A `Case` names a factory, its hyperparameters and a function that makes
inputs; each `check_*` function asserts one property, modelled on optax's
`contrib/_common_test.py`:

* under `jit`, a second call with new values of the same shapes does not
  retrace;
* it works under `optax.inject_hyperparams(..., hyperparam_dtype=float32)`
  and gives the same result (float hyperparameters stored as float32);
* under `vmap`, with unknown extra arguments added (which must be accepted
  and ignored), it gives the per-example `jit` results;
* the output keeps the input's dtype and the state keeps its dtypes and
  shapes (also through `lax.cond`, which rejects any change), for float32
  and, under inject_hyperparams, bfloat16 inputs;
* `init` runs on `jax.ShapeDtypeStruct`s (abstractly, and directly).

The computations of all checks of a case share one compiled program to
keep the suite fast on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Case:
  """One transform under test.

  Attributes:
    name: test id.
    factory: the transform factory.
    kwargs: hyperparameters passed to `factory`.
    make_inputs: `seed -> (updates, extra_args)`; every extra-arg leaf is an
      array (they are traced, stacked for vmap and cast to bf16).
    static_extra: extra arguments closed over (not traced), e.g. group_size.
    static_args: factory arguments `inject_hyperparams` must leave static.
  """
  name: str
  factory: Callable[..., Any]
  kwargs: Mapping[str, Any]
  make_inputs: Callable[[int], tuple[Any, dict[str, Any]]]
  static_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  static_args: tuple[str, ...] = ()

  def build(self):
    return self.factory(**self.kwargs)

  def update_fn(self, tx):
    return lambda u, s, e: tx.update(u, s, None, **self.static_extra, **e)

  def __str__(self):
    return self.name


def _spec(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _assert_close(actual, expected, rtol=1e-5, atol=1e-6):
  jax.tree.map(
      lambda a, e: np.testing.assert_allclose(
          np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol,
          atol=atol), actual, expected)


def _to_bf16(tree):
  return jax.tree.map(
      lambda x: x.astype(jnp.bfloat16)
      if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


class _Compiled:
  """All checks' computations for one case, in one jitted program.

  On CPU a compile costs far more than running these tiny programs, so one
  program computes, from two inputs: the plain and the injected updates of
  each; the plain update under vmap over both, with unknown extra arguments;
  and the injected update of bf16 inputs, with its new state passed through
  `lax.cond` (which rejects any change of state type).
  """

  def __init__(self, case: Case):
    self.case = case
    self.tx = case.build()
    self.injected = optax.inject_hyperparams(
        case.factory, static_args=case.static_args,
        hyperparam_dtype=jnp.float32)(**case.kwargs)
    self.traces = 0
    self.inputs = [case.make_inputs(seed) for seed in (0, 1)]
    self.step = jax.jit(self._all)
    self.out = self.step(self.inputs)

  def _all(self, inputs):
    self.traces += 1
    case, tx, injected = self.case, self.tx, self.injected
    plain_fn, injected_fn = case.update_fn(tx), case.update_fn(injected)
    out = {
        "plain": [plain_fn(u, tx.init(u), e) for u, e in inputs],
        "injected": [injected_fn(u, injected.init(u), e) for u, e in inputs],
    }
    unknown = lambda u, e: tx.update(
        u, tx.init(u), None, **case.static_extra, **e,
        unknown_extra_array=jnp.ones(3), unknown_extra_flag="ignored")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *inputs)
    out["vmapped"] = jax.vmap(unknown)(*stacked)
    u16, e16 = _to_bf16(inputs[0])
    state16 = injected.init(u16)
    out16, new16 = injected_fn(u16, state16, e16)
    pred = jnp.sum(jnp.asarray(jax.tree.leaves(u16)[0], jnp.float32)) > -1e30
    out["bf16"] = (out16, jax.lax.cond(pred, lambda: new16, lambda: state16),
                   state16)
    return out


_COMPILED: dict[int, _Compiled] = {}


def _compiled(case: Case) -> _Compiled:
  if id(case) not in _COMPILED:
    _COMPILED[id(case)] = _Compiled(case)
  return _COMPILED[id(case)]


def check_no_recompile(case: Case) -> None:
  c = _compiled(case)
  jax.block_until_ready(c.step(c.inputs[::-1]))
  assert c.traces == 1, f"{case}: retraced ({c.traces} traces) on new values."


def check_inject_hyperparams(case: Case) -> None:
  c = _compiled(case)
  for (plain, _), (injected, state) in zip(c.out["plain"], c.out["injected"]):
    _assert_close(injected, plain)
    for leaf in jax.tree.leaves(state.hyperparams):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert leaf.dtype == jnp.float32, f"{case}: hyperparam {leaf.dtype}."


def check_vmap_with_unknown_extra_args(case: Case) -> None:
  c = _compiled(case)
  batched, states = c.out["vmapped"]
  for i, (plain, plain_state) in enumerate(c.out["plain"]):
    _assert_close(jax.tree.map(lambda x: x[i], batched), plain, rtol=1e-6,
                  atol=1e-7)
    _assert_close(jax.tree.map(lambda x: x[i], states), plain_state)


def check_dtype_and_state_stable(case: Case) -> None:
  c = _compiled(case)
  u = c.inputs[0][0]
  out, new_state = c.out["plain"][0]
  assert _spec(new_state) == _spec(c.tx.init(u)), f"{case}: state changed."
  _assert_dtype_like(case, out, u)
  out16, new16, state16 = c.out["bf16"]
  assert _spec(new16) == _spec(state16), f"{case}: bf16 state spec changed."
  _assert_dtype_like(case, out16, _to_bf16(u))


def _assert_dtype_like(case, out, u):
  in_dtype = jax.tree.leaves(u)[0].dtype
  for leaf in jax.tree.leaves(out):
    assert leaf.dtype == in_dtype, (
        f"{case}: output dtype {leaf.dtype} != input dtype {in_dtype}.")
    assert bool(jnp.all(jnp.isfinite(leaf))), f"{case}: non-finite output."


def check_init_from_shape_dtype_struct(case: Case) -> None:
  tx = case.build()
  u, _ = case.make_inputs(0)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), u)
  concrete = _spec(tx.init(u))
  assert _spec(jax.eval_shape(tx.init, sds)) == concrete
  assert _spec(tx.init(sds)) == concrete


ALL_CHECKS = (
    check_no_recompile,
    check_inject_hyperparams,
    check_vmap_with_unknown_extra_args,
    check_dtype_and_state_stable,
    check_init_from_shape_dtype_struct,
)
