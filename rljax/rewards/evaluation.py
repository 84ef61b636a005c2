"""Weighted reward functions, evaluated in parallel with timeouts.

A reward function follows the protocol

  ``reward_fn(prompts, completions, **example_fields) -> list[float | None]``

batched over ``N`` samples; every example field is a list aligned with the
batch (``answer=[...]``). A ``RewardSpec`` names a function and gives it a
weight; a ``RewardEvaluator`` runs a tuple of specs over a batch and returns
the per-function rewards ``[N, R]`` (NaN where there is no reward), a validity
mask, the weighted total and metrics.

A function returns a list, tuple, 1-D array or other iterable (not a string
or a mapping) of one value per sample; each value is converted with
``float()`` (``None`` and NaN mean "no reward"). For a function run in a
worker process, the call and the conversion happen in the worker, and only
plain float64 values and a status byte per sample come back
(``_encode_values``; the evaluator checks their count): nothing the function
returned is ever unpickled, or has a method called, in the calling process.

"No reward" for a sample and a function means one of the following, each
counted in its own metric (numbers of samples) and none of which stops the
evaluator:

* ``reward/<name>/none``: the function returned None or NaN for it.
* ``reward/<name>/errors``: the call raised (any ``BaseException``, also
  ``SystemExit`` and ``MemoryError``; in-process, ``KeyboardInterrupt``
  is re-raised, since it is the user's Ctrl-C), the value's ``float()``
  raised, the return value was not a sequence or had the wrong length (the
  whole call's samples), or the worker died (``os._exit``, a crash, a kill
  by the memory limit; it is replaced).
* ``reward/<name>/timeouts``: the call did not finish within ``timeout_s``;
  its worker and every process the worker started are killed and the worker
  replaced.
* ``reward/<name>/invalid``: the value converted but is not a usable float32
  reward: +-inf, or a magnitude beyond float32's largest (~3.4e38, e.g.
  ``1e300`` or ``10**400``), which would otherwise turn into an infinite
  total. With ``RewardEvaluator(clip=c)`` finite values are instead clipped to
  ``[-c, c]`` and counted in ``reward/<name>/clipped`` (they keep their
  reward); infinities stay invalid.

Worker processes are isolated (see ``pool``): each runs in its own process
group, which is killed whole at a timeout, at ``close()`` and at interpreter
exit, so processes a reward function forks or starts are not left behind; an
optional ``memory_limit_mb`` caps each worker's address space. A function
marked ``in_process`` gets none of this: only its exceptions are contained.

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
import struct
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from rljax.rewards import pool as _pool
from rljax.rewards import verifiers

_log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Per-sample status codes, one byte each on the wire.
_OK, _NONE, _ERROR = 0, 1, 2
_COUNTS = ("errors", "timeouts", "none", "invalid", "clipped")


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


def batch_metrics(names: Sequence[str], rewards_NxR: np.ndarray,
                  valid_NxR: np.ndarray, total_N: np.ndarray,
                  counts: Mapping[str, float], *, restarts: float,
                  seconds: float) -> dict[str, float]:
  """``RewardEvaluator.evaluate``'s metrics of a batch's rewards.

  ``counts``: ``{"reward/<name>/<kind>": samples}`` for the kinds of
  failure (errors, timeouts, none, invalid, clipped).
  """
  n = len(rewards_NxR)
  metrics: dict[str, float] = {}
  for j, name in enumerate(names):
    column = rewards_NxR[valid_NxR[:, j], j]
    metrics[f"reward/{name}/mean"] = (float(column.mean()) if column.size
                                      else math.nan)
    metrics[f"reward/{name}/valid_frac"] = (float(valid_NxR[:, j].mean())
                                            if n else math.nan)
    for kind in _COUNTS:
      metrics[f"reward/{name}/{kind}"] = float(counts[f"reward/{name}/{kind}"])
  # In float64: the float32 square of a large (valid) total overflows.
  finite = total_N[np.isfinite(total_N)].astype(np.float64)
  metrics["reward/total/mean"] = float(finite.mean()) if finite.size else (
      math.nan)
  metrics["reward/total/std"] = float(finite.std()) if finite.size else (
      math.nan)
  metrics["reward/worker_restarts"] = float(restarts)
  metrics["reward/eval_seconds"] = float(seconds)
  return metrics


def merge_results(names: Sequence[str], rewards_NxR: np.ndarray,
                  valid_NxR: np.ndarray, total_N: np.ndarray,
                  metrics: Sequence[Mapping[str, float]]) -> RewardResult:
  """One ``RewardResult`` of a batch scored in blocks (one per process).

  Args:
    names: the reward names.
    rewards_NxR, valid_NxR, total_N: every block's rows, in row order.
    metrics: each block's ``RewardResult.metrics``: failure counts and
      worker restarts are summed, ``reward/eval_seconds`` is the slowest
      block's, and the means are those of the whole batch.
  """
  counts = {f"reward/{name}/{kind}": sum(m[f"reward/{name}/{kind}"]
                                         for m in metrics)
            for name in names for kind in _COUNTS}
  return RewardResult(
      tuple(names), rewards_NxR, valid_NxR, total_N,
      batch_metrics(names, rewards_NxR, valid_NxR, total_N, counts,
                    restarts=sum(m["reward/worker_restarts"] for m in metrics),
                    seconds=max(m["reward/eval_seconds"] for m in metrics)),
      ())


class _Values(NamedTuple):
  """One call's rewards as plain data: what crosses back from a worker."""
  values_n: np.ndarray  # float64; NaN where status_n is not _OK.
  status_n: np.ndarray  # uint8: _OK, _NONE or _ERROR per sample.
  note: str  # The first conversion error, or "".


_VALUES_HEADER = struct.Struct("<II")  # Sample count, note length in bytes.


def _to_float(value: Any) -> tuple[float, int, str]:
  """One returned value as ``(float64, status, error message)``."""
  if value is None:
    return math.nan, _NONE, ""
  try:
    x = float(value)
  except OverflowError:
    # A finite number beyond float64 (an int like 10**400): keep it as the
    # largest float64 of its sign, so that it is clipped or counted invalid.
    try:
      negative = bool(value < 0)
    except Exception as exc:  # pylint: disable=broad-exception-caught
      return math.nan, _ERROR, _pool.describe_exception(exc)
    return math.copysign(sys.float_info.max, -1.0 if negative else 1.0), _OK, ""
  except Exception as exc:  # pylint: disable=broad-exception-caught
    return math.nan, _ERROR, _pool.describe_exception(exc)
  return (math.nan, _NONE, "") if math.isnan(x) else (x, _OK, "")


def _convert(returned: Any) -> _Values:
  """A reward function's return value as plain floats and status codes.

  Raises:
    TypeError: if ``returned`` is not an iterable of per-sample values.
  """
  if isinstance(returned, (str, bytes, Mapping)) or not isinstance(
      returned, Iterable):
    raise TypeError(f"returned {type(returned).__name__}; expected a list of "
                    "one float or None per sample")
  if (isinstance(returned, np.ndarray) and returned.ndim == 1
      and returned.dtype.kind in "biuf"):
    values_n = returned.astype(np.float64)
    status_n = np.where(np.isnan(values_n), _NONE, _OK).astype(np.uint8)
    return _Values(values_n, status_n, "")
  items = list(returned)
  values_n = np.empty(len(items), np.float64)
  status_n = np.empty(len(items), np.uint8)
  note = ""
  for i, item in enumerate(items):
    values_n[i], status_n[i], message = _to_float(item)
    if message and not note:
      note = f"sample {i}: {message}"
  return _Values(values_n, status_n, note)


def _encode_values(returned: Any) -> bytes:
  """``_convert(returned)`` as bytes (run in the worker; see ``pool``)."""
  values_n, status_n, note = _convert(returned)
  note_bytes = note.encode("utf-8", "backslashreplace")[:500]
  return (_VALUES_HEADER.pack(len(values_n), len(note_bytes))
          + values_n.astype("<f8").tobytes() + status_n.tobytes()
          + note_bytes)


def _decode_values(payload: bytes) -> _Values:
  """Parses ``_encode_values`` bytes; runs no code of the worker's.

  Raises:
    ValueError: if ``payload`` is malformed.
  """
  head = _VALUES_HEADER.size
  if len(payload) < head:
    raise ValueError(f"{len(payload)} bytes, shorter than a header")
  n, note_size = _VALUES_HEADER.unpack_from(payload)
  if len(payload) != head + 9 * n + note_size:
    raise ValueError(f"{len(payload)} bytes for {n} values and a note of "
                     f"{note_size} bytes")
  values_n = np.frombuffer(payload, "<f8", n, head).astype(np.float64)
  status_n = np.frombuffer(payload, np.uint8, n, head + 8 * n).copy()
  if np.any(status_n > _ERROR):
    raise ValueError(f"status codes {sorted(set(status_n.tolist()))}")
  note = payload[head + 9 * n:].decode("utf-8", "replace")
  return _Values(values_n, status_n, note)


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
  children (``subprocess`` and ``os.fork`` are fine: whatever it starts is
  killed with its worker's process group, at a timeout or at ``close()``; a
  process it starts that should outlive one call lives until then).

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
    clip: if set, finite rewards are clipped to ``[-clip, clip]`` (counted in
      ``reward/<name>/clipped``) instead of being counted invalid when beyond
      float32's range; None (default) clips nothing.
    memory_limit_mb: if set, the address space (virtual memory, MiB) each
      worker may add to its size after start-up (``RLIMIT_AS``, Linux;
      inherited by the processes it starts). A reward that allocates past it
      gets a ``MemoryError`` (its chunk counts as errors). Threads and memory
      maps count too, so leave headroom. No effect on in-process functions.

  Raises:
    ValueError: on duplicate names, a worker function that cannot be
      pickled (named in the message), or an out-of-range option.
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
      clip: float | None = None,
      memory_limit_mb: int | None = None,
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
    if memory_limit_mb is not None and not (
        isinstance(memory_limit_mb, int) and memory_limit_mb >= 1):
      raise ValueError(f"memory_limit_mb={memory_limit_mb!r}: accepted an "
                       "int >= 1 or None.")
    if clip is not None and not 0 < clip <= _FLOAT32_MAX:
      raise ValueError(f"clip={clip}: accepted None or a number in (0, "
                       f"{_FLOAT32_MAX:.4g}] (float32's largest).")
    combine_rewards(np.zeros((0, len(names))), [s.weight for s in self._specs],
                    missing=missing)
    self._clip = None if clip is None else float(clip)
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
          [self._specs[i].fn for i in self._pooled], encode=_encode_values,
          num_workers=num_workers, timeout_s=timeout_s,
          start_method=start_method, startup_timeout_s=startup_timeout_s,
          memory_limit_mb=memory_limit_mb)

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
      *,
      tokens: Any = None,
  ) -> RewardResult:
    """Scores a batch with every reward function.

    Args:
      prompts: ``N`` prompt strings.
      completions: ``N`` completion strings.
      example_fields: ``{field: list of N values}``, passed to every function
        as keyword arguments (e.g. ``answer``, ``numbers``, ``target``).
      tokens: the batch's token ids (the rollout: ``prompt_tokens``,
        ``prompt_mask``, ``completion_tokens``, ``completion_mask``), for
        in-process functions that read tokens rather than text (those with
        ``reads_tokens`` true are called as ``fn.score_tokens(tokens)``: a
        reward model, ``rljax.train.model_rewards``). Opaque here.

    Returns:
      A ``RewardResult``. Its metrics, for each reward ``<name>``:
      ``reward/<name>/mean`` (over valid samples; NaN if none),
      ``reward/<name>/valid_frac``, and the sample counts
      ``reward/<name>/errors``, ``reward/<name>/timeouts``,
      ``reward/<name>/none``, ``reward/<name>/invalid`` and
      ``reward/<name>/clipped`` (see the module docstring); and
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
    counts = {(name, kind): 0 for name in self.names for kind in _COUNTS}
    messages: list[str] = []

    def record(j: int, lo: int, hi: int, outcome: _pool.Outcome) -> None:
      name = self._specs[j].name
      if outcome.status == "ok":
        try:
          converted = _decode_values(outcome.value)
        except ValueError as exc:
          outcome = _pool.Outcome("error", None, f"malformed values: {exc}")
      if outcome.status != "ok":
        counts[name, "errors" if outcome.status == "error" else "timeouts"] += (
            hi - lo)
        messages.append(f"{name}[{lo}:{hi}]: {outcome.status}: "
                        f"{outcome.message}")
        return
      values_n, status_n, note = converted
      if len(values_n) != hi - lo:
        counts[name, "errors"] += hi - lo
        messages.append(f"{name}[{lo}:{hi}]: error: returned {len(values_n)} "
                        f"values for {hi - lo} samples")
        return
      ok_n = status_n == _OK
      if self._clip is None:
        invalid_n = ok_n & ~(np.abs(values_n) <= _FLOAT32_MAX)
      else:
        invalid_n = ok_n & ~np.isfinite(values_n)
      invalid_values = values_n[invalid_n]
      if self._clip is not None:
        clipped_n = ok_n & ~invalid_n & (np.abs(values_n) > self._clip)
        counts[name, "clipped"] += int(clipped_n.sum())
        values_n = np.clip(values_n, -self._clip, self._clip)
      good_n = ok_n & ~invalid_n
      rewards_NxR[lo:hi, j] = np.where(good_n, values_n, np.nan)
      counts[name, "none"] += int(np.sum(status_n == _NONE))
      errors = int(np.sum(status_n == _ERROR))
      counts[name, "errors"] += errors
      if errors:
        messages.append(f"{name}[{lo}:{hi}]: error: {errors} values could "
                        f"not be converted to float; {note}")
      counts[name, "invalid"] += len(invalid_values)
      if len(invalid_values):
        example = float(invalid_values[0])
        messages.append(
            f"{name}[{lo}:{hi}]: invalid: {len(invalid_values)} values "
            f"infinite or beyond float32's range (e.g. {example!r}); "
            "RewardEvaluator(clip=...) clips finite ones")

    if n:
      for j, spec in enumerate(self._specs):
        if j not in self._pooled:
          fn = spec.fn
          if tokens is not None and getattr(fn, "reads_tokens", False):
            fn = lambda *_, score=fn.score_tokens, **__: score(tokens)  # pylint: disable=unnecessary-lambda-assignment
          record(j, 0, n, _call_in_process(fn, prompts, completions, fields))
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
    metrics = batch_metrics(
        self.names, rewards_NxR, valid_NxR, total_N,
        {f"reward/{name}/{kind}": float(c) for (name, kind), c
         in counts.items()},
        restarts=float(restarts), seconds=time.monotonic() - start)
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
  """Calls ``fn`` here, containing whatever it raises but Ctrl-C."""
  try:
    value = fn(list(prompts), list(completions),
               **{k: list(v) for k, v in fields.items()})
    return _pool.Outcome("ok", _encode_values(value), "")
  except KeyboardInterrupt:
    raise  # The user's Ctrl-C: in-process calls run in the trainer's thread.
  except BaseException as exc:  # pylint: disable=broad-exception-caught
    # SystemExit, GeneratorExit, MemoryError...: a reward never ends training.
    return _pool.Outcome("error", None, _pool.describe_exception(exc))


__all__ = ["RewardFn", "RewardSpec", "RewardResult", "RewardEvaluator",
           "reward_spec", "combine_rewards"]
