"""The ``Environment`` protocol and the runner that steps environments in
worker processes.

An environment turns a dataset example into an episode: ``reset(example)``
gives the episode's prompt and its first state, and ``step(state, action)``
takes the model's turn (its text) and gives a ``Step``: the observation to
append, an optional reward, whether the episode is done, and the next state.

States are data, not objects: a state is a JSON value (``None``, numbers,
strings, lists, dicts) that the trainer keeps and hands back on the next
step. So an environment itself is stateless, any worker can step any episode,
a worker that crashes or hangs loses nothing but the step it ran, and a
test can replay an episode from its states. Every ``reset`` and ``step``
result crosses a JSON round trip, in worker processes and in-process alike,
so an environment that works in one works in the other.

``EnvRunner`` runs ``reset`` and ``step`` on a ``rewards.pool.KillingPool``
(the reward functions' pool): each call has a timeout, a worker that hangs
past it is killed with its process group and replaced, a memory limit caps
each worker, and results come back as JSON bytes, never pickles. Each
worker is PID 1 of a PID namespace of its own where the machine allows it,
so ``close()`` and a replacement end every process the environment started,
``setsid`` or not (``EnvRunner.isolated`` says whether it held). A call that
raises, hangs, or returns something that is not a ``Step`` ends its episode
as failed (``EnvOutcome.status``); training goes on.

Writing one (``colabs/write_an_environment.ipynb``)::

    @dataclasses.dataclass(frozen=True)
    class Echo:
      stop_strings = ()
      def reset(self, example):
        return example["prompt"], {"turns": 0}
      def step(self, state, action):
        turns = state["turns"] + 1
        return Step(observation=" ok", reward=1.0 if "yes" in action else 0.0,
                    done=turns == 2, state={"turns": turns})
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from rljax.rewards import pool as pool_lib
from rljax.rewards.verifiers import env_reward  # noqa: F401  (re-exported)


@dataclasses.dataclass(frozen=True)
class Step:
  """What ``Environment.step`` returns.

  Attributes:
    observation: text appended to the episode after the model's turn (through
      the chat template for a chat model, as is otherwise); "" appends
      nothing.
    reward: added to the episode's environment reward; None: no reward for
      this step.
    done: the episode is over (no observation is appended then).
    state: the next state, a JSON value.
    info: counters summed into the ``env/<name>`` metrics (e.g.
      ``{"tool_calls": 1, "tool_errors": 0}``); numbers only.
  """

  observation: str = ""
  reward: float | None = None
  done: bool = False
  state: Any = None
  info: Mapping[str, float] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
  """A multi-turn environment (see the module docstring).

  Attributes:
    stop_strings: texts that end a model turn besides the end-of-turn (EOS)
      token, e.g. ``("</calc>",)`` for a tool call; the stop text is part of
      the turn. Each must encode to the same ids wherever it occurs (a
      tokenizer piece of its own, e.g. a sentencepiece user-defined symbol).
  """

  stop_strings: tuple[str, ...]

  def reset(self, example: Mapping[str, Any]) -> tuple[str, Any]:
    """``(prompt, state)`` of a new episode of ``example``.

    Must depend on the example only: the ``G`` rows of a group share one
    reset (each gets its own copy of the state)."""

  def step(self, state: Any, action: str) -> Step:
    """The environment's answer to the model's turn ``action`` (its text,
    without the end-of-turn token)."""


class EnvOutcome(NamedTuple):
  """One call's result.

  Attributes:
    status: ``"ok"``, ``"error"`` (raised, or returned something malformed),
      or ``"timeout"`` (the worker was killed at ``timeout_s``).
    value: the checked result (``reset``: ``{"prompt", "state"}``;
      ``step``: ``Step`` fields) for ``"ok"``, else None.
    message: what went wrong ("" for ``"ok"``).
  """

  status: Literal["ok", "error", "timeout"]
  value: dict[str, Any] | None
  message: str


_MAX_TEXT = 1 << 20  # characters an observation or prompt may have


def _number(value: Any, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{what} is {type(value).__name__} {value!r:.60}, not a "
                    "number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{what} is {value}, not finite")
  return value


def check_reset(value: Any) -> dict[str, Any]:
  """``{"prompt", "state"}`` of a ``reset`` result; raises on a malformed one."""
  if not (isinstance(value, tuple) and len(value) == 2):
    raise TypeError(f"reset returned {type(value).__name__} {value!r:.80}, "
                    "not a (prompt, state) tuple")
  prompt, state = value
  if not isinstance(prompt, str) or not prompt:
    raise TypeError(f"reset's prompt is {type(prompt).__name__} "
                    f"{prompt!r:.60}: a non-empty str is required")
  if len(prompt) > _MAX_TEXT:
    raise ValueError(f"reset's prompt has {len(prompt)} characters, more "
                     f"than {_MAX_TEXT}")
  return {"prompt": prompt, "state": state}


def check_step(value: Any) -> dict[str, Any]:
  """The fields of a ``Step`` result as a dict; raises on a malformed one."""
  if not isinstance(value, Step):
    raise TypeError(f"step returned {type(value).__name__} {value!r:.80}, "
                    "not an rljax.envs.Step")
  if not isinstance(value.observation, str):
    raise TypeError(f"Step.observation is {type(value.observation).__name__},"
                    " not str")
  if len(value.observation) > _MAX_TEXT:
    raise ValueError(f"Step.observation has {len(value.observation)} "
                     f"characters, more than {_MAX_TEXT}")
  if not isinstance(value.done, bool):
    raise TypeError(f"Step.done is {type(value.done).__name__}, not bool")
  reward = (None if value.reward is None
            else _number(value.reward, "Step.reward"))
  if not isinstance(value.info, Mapping):
    raise TypeError(f"Step.info is {type(value.info).__name__}, not a dict")
  info = {str(k): _number(v, f"Step.info[{k!r}]")
          for k, v in value.info.items()}
  return {"observation": value.observation, "reward": reward,
          "done": value.done, "state": value.state, "info": info}


def _encode(checked: dict[str, Any]) -> bytes:
  # allow_nan=False: a state holding NaN is not JSON and is refused here.
  return json.dumps(checked, allow_nan=False).encode()


def _decode(payload: bytes, check) -> dict[str, Any]:
  value = json.loads(payload)
  if not isinstance(value, dict):
    raise ValueError("not a JSON object")
  if check is check_reset:
    if set(value) != {"prompt", "state"} or not isinstance(
        value["prompt"], str):
      raise ValueError(f"unexpected reset result {str(value)[:80]}")
  elif set(value) != {"observation", "reward", "done", "state", "info"}:
    raise ValueError(f"unexpected step result {str(value)[:80]}")
  return value


def _call_reset(env: Environment, example: Mapping[str, Any]) -> bytes:
  return _encode(check_reset(env.reset(example)))


def _call_step(env: Environment, state: Any, action: str) -> bytes:
  return _encode(check_step(env.step(state, action)))


def _identity(payload: bytes) -> bytes:
  return payload


def _outcome(raw: pool_lib.Outcome, check) -> EnvOutcome:
  """A worker's (or an inline call's) outcome, its JSON checked."""
  if raw.status != "ok":
    return EnvOutcome(raw.status, None, raw.message)
  try:
    return EnvOutcome("ok", _decode(raw.value, check), "")
  except (ValueError, UnicodeDecodeError, RecursionError) as exc:
    return EnvOutcome("error", None, f"malformed result: {exc}")


class EnvRunner:
  """Runs an environment's ``reset`` and ``step`` calls, batched.

  Args:
    env: the environment (picklable when ``num_workers > 0``: a module-level
      class, as the reward functions).
    num_workers: worker processes; 0 calls the environment in this process
      (no timeout, no memory limit: for cheap, trusted environments and
      tests).
    timeout_s: seconds one call may run in a worker.
    memory_limit_mb: address space a worker may add after start-up
      (``RLIMIT_AS``), or None.
    start_method: ``"spawn"`` or ``"forkserver"``.
  """

  def __init__(self, env: Environment, *, num_workers: int = 2,
               timeout_s: float = 10.0, memory_limit_mb: int | None = None,
               start_method: str = "spawn"):
    for name in ("reset", "step"):
      if not callable(getattr(env, name, None)):
        raise TypeError(f"env={env!r:.80} has no {name}() method: an "
                        "rljax.envs.Environment is required.")
    stops = getattr(env, "stop_strings", ())
    if not isinstance(stops, (tuple, list)) or not all(
        isinstance(s, str) and s for s in stops):
      raise TypeError(f"env.stop_strings={stops!r}: a tuple of non-empty "
                      "strings is required.")
    if isinstance(num_workers, bool) or not isinstance(
        num_workers, int) or num_workers < 0:
      raise ValueError(f"env.num_workers={num_workers!r}: an int >= 0 is "
                       "required.")
    self.env = env
    self.stop_strings = tuple(stops)
    self.num_workers = num_workers
    self._pool = None
    self._next_ticket = 0  # inline calls' tickets, and their outcomes
    self._inline_done: dict[int, pool_lib.Outcome] = {}
    if num_workers:
      self._pool = pool_lib.KillingPool(
          [functools.partial(_call_reset, env),
           functools.partial(_call_step, env)],
          encode=_identity, num_workers=num_workers, timeout_s=timeout_s,
          start_method=start_method, memory_limit_mb=memory_limit_mb,
          pid_namespace=True)

  @property
  def isolated(self) -> dict[str, str | None]:
    """What ends with a worker (at ``close()``, or when one is replaced):
    ``{"processes": "pid-namespace"}``: every process its calls started,
    ``setsid`` or not; ``"process-group"``: those that stayed in its process
    group (the machine refused the namespace: one that calls ``setsid``
    outlives the run); ``"in-process"``: no workers, the calls run in the
    trainer's process and what they start is the trainer's; None until a
    worker has started (after the first call)."""
    if self._pool is None:
      return {"processes": "in-process"}
    return {"processes": self._pool.containment}

  @property
  def restarts(self) -> int:
    """Workers replaced so far (after a timeout or a crash)."""
    return self._pool.restarts if self._pool else 0

  def _inline(self, index: int, args: tuple) -> pool_lib.Outcome:
    try:
      return pool_lib.Outcome("ok", (_call_reset, _call_step)[index](
          self.env, *args), "")
    except KeyboardInterrupt:
      raise
    except BaseException as exc:  # pylint: disable=broad-exception-caught
      return pool_lib.Outcome("error", None, pool_lib.describe_exception(exc))

  def _run(self, index: int, calls: Sequence[tuple], check) -> list[EnvOutcome]:
    if self._pool is not None:
      raw = self._pool.run([pool_lib.Task(index, tuple(args), {})
                            for args in calls])
    else:
      raw = [self._inline(index, tuple(args)) for args in calls]
    return [_outcome(r, check) for r in raw]

  def submit_steps(self, states: Sequence[Any], actions: Sequence[str]
                   ) -> list[int]:
    """Starts ``step`` of each (state, action) without waiting (in the
    workers; without workers the calls run here, now) and returns their
    tickets for ``poll_steps``."""
    if len(states) != len(actions):
      raise ValueError(f"{len(states)} states for {len(actions)} actions.")
    calls = list(zip(states, actions))
    if self._pool is not None:
      return self._pool.submit([pool_lib.Task(1, args, {}) for args in calls])
    tickets = list(range(self._next_ticket, self._next_ticket + len(calls)))
    self._next_ticket += len(calls)
    self._inline_done.update(
        (t, self._inline(1, args)) for t, args in zip(tickets, calls))
    return tickets

  def poll_steps(self, tickets: Sequence[int], *, wait: bool
                 ) -> dict[int, EnvOutcome]:
    """The outcomes of the ``submit_steps`` calls ``tickets`` that have
    ended, by ticket, each once; with ``wait``, at least one when any is
    left (their timeouts still apply)."""
    if self._pool is not None:
      raw = self._pool.poll(tickets, None if wait else 0.0)
    else:
      raw = {t: self._inline_done.pop(t) for t in tickets
             if t in self._inline_done}
    return {t: _outcome(r, check_step) for t, r in raw.items()}

  def reset(self, examples: Sequence[Mapping[str, Any]]) -> list[EnvOutcome]:
    """``reset`` of each example (``value``: ``{"prompt", "state"}``)."""
    return self._run(0, [(dict(e),) for e in examples], check_reset)

  def step(self, states: Sequence[Any], actions: Sequence[str]
           ) -> list[EnvOutcome]:
    """``step`` of each (state, action) (``value``: the ``Step`` fields)."""
    if len(states) != len(actions):
      raise ValueError(f"{len(states)} states for {len(actions)} actions.")
    return self._run(1, list(zip(states, actions)), check_step)

  def close(self) -> None:
    """Stops the worker processes (idempotent)."""
    if self._pool is not None:
      self._pool.close()

  def __enter__(self) -> EnvRunner:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
