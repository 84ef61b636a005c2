"""Weighted reward functions, evaluated in parallel with timeouts.

A reward function follows the protocol

  ``reward_fn(prompts, completions, **example_fields) -> list[float | None]``

batched over ``N`` samples; every example field is a list aligned with the
batch (``answer=[...]``). A ``RewardSpec`` names a function and gives it a
weight; a ``RewardEvaluator`` runs a tuple of specs over a batch and returns
the per-function rewards ``[N, R]`` (NaN where there is no reward), a validity
mask, the weighted total and metrics.

"No reward" for a sample and a function means: the function returned None or
NaN for it (counted as ``reward/<name>/none``), raised, returned something
malformed or killed its worker (``reward/<name>/errors``), or did not finish
within ``timeout_s`` (``reward/<name>/timeouts``; the worker is killed and
replaced). None of these stops the evaluator; the counts are numbers of
samples.

Example:
  >>> from rljax import rewards
  >>> specs = [rewards.reward_spec("numeric_match", in_process=True)]
  >>> with rewards.RewardEvaluator(specs, num_workers=0) as evaluator:
  ...   result = evaluator.evaluate(["1+1=", "2+2="], ["2", "5"],
  ...                               {"answer": ["2", "4"]})
  >>> result.total_N.tolist()
  [1.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pickle
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from rljax.rewards import _pool
from rljax.rewards import verifiers

_log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")


class RewardFn(Protocol):
  """``(prompts, completions, **example_fields) -> list[float | None]``.

  A function receives every example field of the batch, so it should accept
  ``**kwargs`` and ignore the fields it does not use.
  """

  def __call__(self, prompts: list[str], completions: list[str],
               **example_fields: list[Any]) -> Sequence[float | None]: ...


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """One reward function in a weighted sum.

  Attributes:
    name: metric label, ``[A-Za-z0-9_.-]+``, unique within an evaluator.
    fn: the reward function; picklable unless ``in_process``.
    weight: its weight in the total.
    in_process: run it in the calling process (for cheap, trusted functions:
      no pickling, no timeout).
  """
  name: str
  fn: RewardFn
  weight: float = 1.0
  in_process: bool = False

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
      raise ValueError(f"RewardSpec.name={self.name!r}: accepted are "
                       "non-empty names of letters, digits, '_', '.', '-'.")
    if not callable(self.fn):
      raise TypeError(f"RewardSpec({self.name!r}).fn={self.fn!r} is not "
                      "callable.")
    if not math.isfinite(self.weight):
      raise ValueError(f"RewardSpec({self.name!r}).weight={self.weight}: "
                       "must be finite.")


def reward_spec(fn_name: str, *, weight: float = 1.0, name: str | None = None,
                in_process: bool = False, **options: Any) -> RewardSpec:
  """A ``RewardSpec`` for a built-in reward chosen by name (for configs).

  Args:
    fn_name: a key of ``verifiers.REWARD_FNS``.
    weight: weight in the total.
    name: metric label; defaults to ``fn_name``.
    in_process: run in the calling process.
    **options: the function's keyword-only options (see ``get_reward_fn``).

  Example:
    >>> reward_spec("format", weight=0.1, pattern=r"<answer>.*</answer>").name
    'format'
  """
  return RewardSpec(name=name or fn_name,
                    fn=verifiers.get_reward_fn(fn_name, **options),
                    weight=weight, in_process=in_process)


def combine_rewards(
    rewards_NxR: np.ndarray,
    weights_R: Sequence[float] | np.ndarray,
    *,
    missing: Literal["zero", "nan"] = "zero",
) -> np.ndarray:
  """Weighted sum over reward functions, with a rule for missing rewards.

  Args:
    rewards_NxR: per-function rewards, NaN where there is none.
    weights_R: one weight per function.
    missing: ``"zero"``: a missing reward adds nothing (``nansum``, as TRL
      does); ``"nan"``: a sample missing any reward with a nonzero weight gets
      a NaN total, for a caller that wants to drop it.

  Returns:
    ``total_N`` as float32.
  """
  rewards_NxR = np.asarray(rewards_NxR, np.float32)
  weights_R = np.asarray(weights_R, np.float32)
  if rewards_NxR.ndim != 2 or weights_R.shape != rewards_NxR.shape[1:]:
    raise ValueError(f"rewards_NxR has shape {rewards_NxR.shape} and weights_R "
                     f"{weights_R.shape}: expected [N, R] and [R].")
  accepted = ("zero", "nan")
  if missing not in accepted:
    raise ValueError(f"missing={missing!r}: accepted {accepted}.")
  weighted_NxR = np.where(weights_R == 0, 0.0, rewards_NxR * weights_R)
  if missing == "nan":
    return weighted_NxR.sum(axis=1).astype(np.float32)
  return np.nansum(weighted_NxR, axis=1).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """Rewards of one batch.

  Attributes:
    names: the reward names, in column order.
    rewards_NxR: float32 per-function rewards, NaN where there is none.
    valid_NxR: bool, True where a reward was produced.
    total_N: float32 weighted total (see ``combine_rewards``).
    metrics: flat ``{name: float}``; see ``RewardEvaluator.evaluate``.
    messages: what went wrong, one line per failed call (truncated).
  """
  names: tuple[str, ...]
  rewards_NxR: np.ndarray
  valid_NxR: np.ndarray
  total_N: np.ndarray
  metrics: dict[str, float]
  messages: tuple[str, ...]


def _to_float(value: Any) -> tuple[float, str]:
  """Converts one returned value; the string is "" | "none" | "errors"."""
  if value is None:
    return math.nan, "none"
  if isinstance(value, (bool, np.bool_)):
    return float(value), ""
  try:
    x = float(value)
  except (TypeError, ValueError, OverflowError):
    return math.nan, "errors"
  if math.isnan(x):
    return x, "none"
  return (x, "") if math.isfinite(x) else (math.nan, "errors")


class RewardEvaluator:
  """Evaluates weighted reward functions on batches of completions.

  Functions not marked ``in_process`` run on a pool of ``num_workers``
  processes (started here, reused across calls). Each function's batch is
  split into chunks of ``chunk_size`` samples (default: ``N / num_workers``,
  rounded up) and each chunk is one call with its own ``timeout_s``. A failed
  chunk costs only its own samples, for that function only.

  Workers are daemon processes started with ``spawn``: create the evaluator
  under ``if __name__ == "__main__":`` (as absl's ``app.run`` does), and keep
  reward functions' modules light, since each worker imports them (and the
  main module). A reward function cannot itself start ``multiprocessing``
  children (``subprocess`` is fine).

  Args:
    specs: the reward functions.
    num_workers: worker processes; 0 runs every function in-process.
    timeout_s: seconds one call may run in a worker. In-process calls cannot
      be interrupted; mark only cheap functions ``in_process``.
    chunk_size: samples per call; None for ``ceil(N / num_workers)``.
    missing: how a missing reward enters the total (``combine_rewards``).
    start_method: ``"spawn"`` (default) or ``"forkserver"``; never ``"fork"``.
    startup_timeout_s: seconds a new worker may take to start and import the
      reward functions' modules.

  Raises:
    ValueError: on duplicate names or a worker function that cannot be
      pickled (named in the message).
  """

  def __init__(
      self,
      specs: Sequence[RewardSpec],
      *,
      num_workers: int = 2,
      timeout_s: float = 10.0,
      chunk_size: int | None = None,
      missing: Literal["zero", "nan"] = "zero",
      start_method: str = "spawn",
      startup_timeout_s: float = 120.0,
  ):
    self._specs = tuple(specs)
    if not self._specs:
      raise ValueError("specs is empty: give at least one RewardSpec.")
    names = [s.name for s in self._specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"reward names {duplicates} appear more than once; "
                       "give each RewardSpec a unique name.")
    if num_workers < 0:
      raise ValueError(f"num_workers={num_workers}: must be >= 0.")
    if chunk_size is not None and chunk_size < 1:
      raise ValueError(f"chunk_size={chunk_size}: must be >= 1 or None.")
    combine_rewards(np.zeros((0, len(names))), [s.weight for s in self._specs],
                    missing=missing)
    self._num_workers = num_workers
    self._chunk_size = chunk_size
    self._missing = missing
    self._pooled = [i for i, s in enumerate(self._specs)
                    if num_workers > 0 and not s.in_process]
    for i in self._pooled:
      try:
        pickle.dumps(self._specs[i].fn)
      except Exception as exc:  # pylint: disable=broad-exception-caught
        raise ValueError(
            f"reward {self._specs[i].name!r}: its function cannot be pickled "
            f"for a worker process ({exc}); use a module-level function or a "
            "functools.partial of one, or set in_process=True.") from exc
    self._pool = None
    if self._pooled:
      self._pool = _pool.KillingPool(
          [self._specs[i].fn for i in self._pooled], num_workers=num_workers,
          timeout_s=timeout_s, start_method=start_method,
          startup_timeout_s=startup_timeout_s)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(s.name for s in self._specs)

  @property
  def weights(self) -> np.ndarray:
    return np.asarray([s.weight for s in self._specs], np.float32)

  def evaluate(
      self,
      prompts: Sequence[str],
      completions: Sequence[str],
      example_fields: Mapping[str, Sequence[Any]] | None = None,
  ) -> RewardResult:
    """Scores a batch with every reward function.

    Args:
      prompts: ``N`` prompt strings.
      completions: ``N`` completion strings.
      example_fields: ``{field: list of N values}``, passed to every function
        as keyword arguments (e.g. ``answer``, ``numbers``, ``target``).

    Returns:
      A ``RewardResult``. Its metrics, for each reward ``<name>``:
      ``reward/<name>/mean`` (over valid samples; NaN if none),
      ``reward/<name>/valid_frac``, ``reward/<name>/errors``,
      ``reward/<name>/timeouts``, ``reward/<name>/none`` (sample counts); and
      ``reward/total/mean``, ``reward/total/std``, ``reward/eval_seconds``,
      ``reward/worker_restarts`` (workers replaced during this call).

    Raises:
      ValueError: if the inputs are not aligned lists (a caller bug; a reward
        function's failure never raises).
      RuntimeError: if worker processes repeatedly fail to start (e.g. a
        reward function's module cannot be imported in a fresh process).
    """
    start = time.monotonic()
    n = len(completions)
    if len(prompts) != n:
      raise ValueError(f"prompts has {len(prompts)} items and completions "
                       f"{n}: they must be aligned.")
    fields = {k: list(v) for k, v in (example_fields or {}).items()}
    for k, v in fields.items():
      if len(v) != n:
        raise ValueError(f"example field {k!r} has {len(v)} values for {n} "
                         "completions: fields must be aligned with the batch.")
    prompts, completions = list(prompts), list(completions)
    r = len(self._specs)
    rewards_NxR = np.full((n, r), np.nan, np.float32)
    counts = {(name, kind): 0 for name in self.names
              for kind in ("errors", "timeouts", "none")}
    messages: list[str] = []

    def record(j: int, lo: int, hi: int, outcome: _pool.Outcome) -> None:
      name = self._specs[j].name
      if outcome.status != "ok":
        counts[name, "errors" if outcome.status == "error" else "timeouts"] += (
            hi - lo)
        messages.append(f"{name}[{lo}:{hi}]: {outcome.status}: "
                        f"{outcome.message}")
        return
      values = outcome.value
      if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != (
          hi - lo):
        got = (f"{len(values)} values" if hasattr(values, "__len__")
               else type(values).__name__)
        counts[name, "errors"] += hi - lo
        messages.append(f"{name}[{lo}:{hi}]: error: returned {got} for "
                        f"{hi - lo} samples")
        return
      for i, value in zip(range(lo, hi), values):
        rewards_NxR[i, j], kind = _to_float(value)
        if kind:
          counts[name, kind] += 1

    if n:
      for j, spec in enumerate(self._specs):
        if j not in self._pooled:
          record(j, 0, n, _call_in_process(spec.fn, prompts, completions,
                                           fields))
      restarts_before = self._pool.restarts if self._pool else 0
      if self._pool is not None:
        size = self._chunk_size or -(-n // self._num_workers)
        spans = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        tasks, where = [], []
        for k, j in enumerate(self._pooled):
          for lo, hi in spans:
            tasks.append(_pool.Task(k, (prompts[lo:hi], completions[lo:hi]),
                                    {f: v[lo:hi] for f, v in fields.items()}))
            where.append((j, lo, hi))
        for (j, lo, hi), outcome in zip(where, self._pool.run(tasks)):
          record(j, lo, hi, outcome)
      restarts = (self._pool.restarts if self._pool else 0) - restarts_before
    else:
      restarts = 0
    for message in messages:
      _log.warning("reward %s", message)

    valid_NxR = ~np.isnan(rewards_NxR)
    total_N = combine_rewards(rewards_NxR, self.weights, missing=self._missing)
    metrics: dict[str, float] = {}
    for j, name in enumerate(self.names):
      column = rewards_NxR[valid_NxR[:, j], j]
      metrics[f"reward/{name}/mean"] = (float(column.mean()) if column.size
                                        else math.nan)
      metrics[f"reward/{name}/valid_frac"] = (float(valid_NxR[:, j].mean())
                                              if n else math.nan)
      for kind in ("errors", "timeouts", "none"):
        metrics[f"reward/{name}/{kind}"] = float(counts[name, kind])
    finite = total_N[np.isfinite(total_N)]
    metrics["reward/total/mean"] = float(finite.mean()) if finite.size else (
        math.nan)
    metrics["reward/total/std"] = float(finite.std()) if finite.size else (
        math.nan)
    metrics["reward/worker_restarts"] = float(restarts)
    metrics["reward/eval_seconds"] = time.monotonic() - start
    return RewardResult(self.names, rewards_NxR, valid_NxR, total_N, metrics,
                        tuple(messages))

  def close(self) -> None:
    """Stops the worker processes (idempotent)."""
    if self._pool is not None:
      self._pool.close()

  def __enter__(self) -> RewardEvaluator:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _call_in_process(fn: Callable[..., Any], prompts: list[str],
                     completions: list[str], fields: dict[str, list[Any]]
                     ) -> _pool.Outcome:
  try:
    value = fn(list(prompts), list(completions), **fields)
    if not isinstance(value, (list, tuple, np.ndarray)) and hasattr(
        value, "__iter__"):
      value = list(value)
    return _pool.Outcome("ok", value, "")
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return _pool.Outcome("error", None, _pool.describe_exception(exc))


__all__ = ["RewardFn", "RewardSpec", "RewardResult", "RewardEvaluator",
           "reward_spec", "combine_rewards"]
