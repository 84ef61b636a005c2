"""Optax gradient transforms specific to RL, and building an optimizer by name.

`scale_by_ess` is an ordinary optax transform that reads one statistic, the
batch's normalised effective sample size, from the extra arguments of
`update`:

    opt = make_optimizer("adamw", 1e-6, weight_decay=0.1, max_grad_norm=1.0,
                         ess_scaling="sqrt", max_consecutive_nonfinite=10)
    updates, opt_state = opt.update(grads, opt_state, params, ess=ess)

The ESS itself is computed by the caller (e.g. with
`objectives.sequence_importance_weights` and `objectives.normalized_ess`);
this module imports nothing else from rljax but `types`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax import types

_Tx = optax.GradientTransformationExtraArgs
ESS_RULES = ("sqrt", "linear")
OPTIMIZERS = ("adamw", "adam", "sgd", "lion")


class ScaleByEssState(NamedTuple):
  """State of `scale_by_ess`."""
  scale: jax.Array  # [] float32: factor applied by the last update (1 before).


def scale_by_ess(rule: str = "sqrt", base_ess_ratio: float = 1.0) -> _Tx:
  """Shrinks the update when the batch's effective sample size collapses.

      s      = min(1, ess / base_ess_ratio)
      factor = sqrt(s)  (rule="sqrt", VCPO's default)  |  s  (rule="linear")
      updates <- factor * updates

  Placed last in a chain (after the optimizer), this scales the step exactly
  as VCPO scales the learning rate for one step (weight decay included). A
  non-finite `ess` gives factor 0 (VCPO skips the step when the statistic is
  missing).

  Args:
    rule: "sqrt" or "linear".
    base_ess_ratio: the ESS at and above which the step is not shrunk.

  Extra args:
    ess: the batch's normalised ESS in `[0, 1]` (a scalar), required. VCPO
      uses per-trajectory weights `pi_old(y) / mu(y)` over the minibatch:
      `normalized_ess(sequence_importance_weights(old_lp, sampler_lp, mask))`.

  References:
    Huang et al., "Stable Asynchrony: Variance-Controlled Off-Policy RL for
    LLMs", https://arxiv.org/abs/2602.17616.
  """
  fn = "scale_by_ess"
  if rule not in ESS_RULES:
    raise ValueError(f"{fn}: rule={rule!r}; accepted: {ESS_RULES}.")
  if isinstance(base_ess_ratio, (int, float)) and base_ess_ratio <= 0:
    raise ValueError(f"{fn}: base_ess_ratio={base_ess_ratio!r} must be > 0.")

  def init_fn(params):
    del params
    return ScaleByEssState(scale=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, *, ess=None, **extra_args):
    del params, extra_args
    if ess is None:
      raise ValueError(
          f"{fn}: the keyword extra argument ess (the batch's normalised "
          "effective sample size, a scalar) is required.")
    ess = jnp.asarray(ess, jnp.float32)
    if ess.shape != ():
      raise ValueError(f"{fn}: ess must be a scalar; got shape {ess.shape}.")
    s = jnp.clip(ess / jnp.maximum(base_ess_ratio, 1e-8), 0.0, 1.0)
    s = jnp.where(jnp.isfinite(s), s, 0.0)
    factor = jnp.sqrt(s) if rule == "sqrt" else s
    updates = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
    return updates, ScaleByEssState(scale=factor.astype(jnp.float32))

  return _Tx(init_fn, update_fn)


def _base_optimizer(name, learning_rate, weight_decay, b1, b2, eps, momentum):
  inject = lambda f, **kw: optax.inject_hyperparams(
      f, hyperparam_dtype=jnp.float32)(learning_rate=learning_rate, **kw)
  if name == "adamw":
    return inject(optax.adamw, b1=0.9 if b1 is None else b1,
                  b2=0.999 if b2 is None else b2, eps=eps,
                  weight_decay=weight_decay)
  if name == "lion":
    return inject(optax.lion, b1=0.9 if b1 is None else b1,
                  b2=0.99 if b2 is None else b2, weight_decay=weight_decay)
  if weight_decay:
    raise ValueError(
        f"make_optimizer: weight_decay={weight_decay!r} is not supported by "
        f"{name!r}; use 'adamw' or 'lion'.")
  if name == "adam":
    return inject(optax.adam, b1=0.9 if b1 is None else b1,
                  b2=0.999 if b2 is None else b2, eps=eps)
  return inject(optax.sgd, momentum=momentum)


def warmup_cosine(peak: float, num_steps: int) -> optax.Schedule:
  """The warm-up schedule of SFT and reward-model training: linear from 0
  over the first tenth of ``num_steps`` (at least one step), then cosine
  down to ``peak / 10`` at ``num_steps``. Any ``num_steps >= 1`` is
  accepted (one step is all warm-up)."""
  warmup = max(1, num_steps // 10)
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup, max(num_steps, warmup + 1), peak * 0.1)


def make_optimizer(name: str = "adamw", learning_rate: Any = 1e-6, *,
                   weight_decay: float = 0.0, b1: float | None = None,
                   b2: float | None = None, eps: float = 1e-8,
                   momentum: float | None = None,
                   max_grad_norm: float | None = None,
                   ess_scaling: str | None = None,
                   base_ess_ratio: float = 1.0,
                   max_consecutive_nonfinite: int | None = None) -> _Tx:
  """Builds the train step's optimizer from hyperparameters.

  The chain is `clip_by_global_norm(max_grad_norm)` (if given), the named
  optimizer (its hyperparameters injected as float32 state, so
  `optimizer_metrics` can report the current learning rate), then
  `scale_by_ess(ess_scaling)` (if given). With `max_consecutive_nonfinite`
  the whole chain is wrapped in `optax.apply_if_finite`: an update with a NaN
  or Inf is skipped (and counted) unless that many in a row were skipped.

  Args:
    name: one of `OPTIMIZERS`.
    learning_rate: a float or an optax schedule.
    weight_decay: decoupled weight decay (adamw, lion).
    b1, b2: moment decay rates (default 0.9 and 0.999, lion 0.99).
    eps: adam(w) epsilon.
    momentum: sgd momentum (None: plain sgd).
    max_grad_norm: global-norm clip of the gradient, or None.
    ess_scaling: None, "sqrt" or "linear"; requires `ess=` in `update`.
    base_ess_ratio: see `scale_by_ess`.
    max_consecutive_nonfinite: see above, or None for no guard.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"make_optimizer: name={name!r}; accepted: {OPTIMIZERS}.")
  parts = []
  if max_grad_norm is not None:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(_base_optimizer(name, learning_rate, weight_decay, b1, b2, eps,
                               momentum))
  if ess_scaling is not None:
    parts.append(scale_by_ess(ess_scaling, base_ess_ratio))
  tx = optax.chain(*parts)
  if max_consecutive_nonfinite is not None:
    tx = optax.apply_if_finite(tx, max_consecutive_nonfinite)
  return keep_state_dtypes(tx)


def keep_state_dtypes(tx: _Tx) -> _Tx:
  """``tx`` whose new state has the dtypes of its initial state.

  With bfloat16 params the injected float32 hyperparameters (``b1``,
  ``b2``) promote Adam's moments to float32 in ``update``; a state that
  changes dtype cannot be a ``lax.scan`` carry (the RL step's updates), and
  would double the moments' memory. The moments stay in the params' dtype.
  """
  tx = optax.with_extra_args_support(tx)

  def update(updates, state, params=None, **extra_args):
    updates, new_state = tx.update(updates, state, params, **extra_args)
    new_state = jax.tree.map(
        lambda new, old: new.astype(old.dtype) if hasattr(old, "dtype")
        else new, new_state, state)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(tx.init, update)


def _walk(node):
  yield node
  if isinstance(node, dict):
    children = node.values()
  elif isinstance(node, (tuple, list)):
    children = node
  else:
    return
  for child in children:
    yield from _walk(child)


def optimizer_metrics(opt_state: Any) -> types.Metrics:
  """Scalars found in an optimizer state built by `make_optimizer`.

  Returns (those present): `learning_rate` (the injected value used by the
  last update), `ess_scale` (the factor `scale_by_ess` applied last),
  `nonfinite_skipped_total` and `nonfinite_consecutive` (from
  `apply_if_finite`).
  """
  out = {}
  for node in _walk(opt_state):
    if isinstance(node, ScaleByEssState):
      out["ess_scale"] = node.scale
    elif isinstance(node, optax.ApplyIfFiniteState):
      out["nonfinite_skipped_total"] = node.total_notfinite
      out["nonfinite_consecutive"] = node.notfinite_count
    elif hasattr(node, "hyperparams") and isinstance(node.hyperparams, dict):
      if "learning_rate" in node.hyperparams:
        out["learning_rate"] = node.hyperparams["learning_rate"]
  return out
