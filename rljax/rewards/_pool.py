"""A process pool whose stuck workers are killed and replaced.

``concurrent.futures`` can stop waiting for a hung call but cannot stop the
call: the worker stays busy forever and the pool shrinks by one each time.
Here each worker is a ``multiprocessing.Process`` with its own pipe; the
parent tracks which task each worker runs and when it started, and when a task
passes its deadline the parent kills that worker (SIGKILL), reports a timeout
and starts a fresh worker in its place. Other workers are not disturbed.

Workers are started with ``spawn`` (or ``forkserver``), never ``fork``: the
parent runs JAX, which is multithreaded, and forking a multithreaded process
can deadlock the child. The functions a pool runs are sent once, when a worker
starts, so they must be picklable (module-level functions, or
``functools.partial`` of them). A worker says "ready" after it has unpickled
them (importing their modules), so start-up time is not charged to the first
task's timeout.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

_MAX_MESSAGE_CHARS = 500
_READY = "ready"


class Task(NamedTuple):
  """One call: ``fns[fn_index](*args, **kwargs)``."""
  fn_index: int
  args: tuple
  kwargs: dict


class Outcome(NamedTuple):
  """How a task ended.

  Attributes:
    status: ``"ok"`` (``value`` holds the return value), ``"error"`` (the
      call raised, its result could not be sent back, or its worker died) or
      ``"timeout"`` (its worker was killed at the deadline).
    value: the return value for ``"ok"``, else None.
    message: what went wrong, empty for ``"ok"``.
  """
  status: Literal["ok", "error", "timeout"]
  value: Any
  message: str


def describe_exception(exc: BaseException) -> str:
  """One line: the exception and where it was raised, truncated."""
  lines = traceback.format_exception_only(type(exc), exc)
  tb = traceback.extract_tb(exc.__traceback__)
  where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
  return ("".join(lines).strip() + where)[:_MAX_MESSAGE_CHARS]


def _worker_main(conn: multiprocessing.connection.Connection,
                 fns: Sequence[Callable[..., Any]]) -> None:
  """Runs tasks from ``conn`` until it closes or sends None."""
  # Ctrl-C goes to the whole process group; the parent decides what to do.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  conn.send((_READY, None, None))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message is None:
      return
    task_id, (fn_index, args, kwargs) = message
    try:
      value = fns[fn_index](*args, **kwargs)
      if not isinstance(value, (list, tuple)) and hasattr(value, "__iter__"):
        value = list(value)
      conn.send((task_id, "ok", value))
    except BaseException as exc:  # pylint: disable=broad-exception-caught
      # A reward may raise anything, even SystemExit; none may end the worker.
      try:
        conn.send((task_id, "error", describe_exception(exc)))
      except (OSError, ValueError):
        return


@dataclasses.dataclass
class _Worker:
  process: multiprocessing.process.BaseProcess
  conn: multiprocessing.connection.Connection
  deadline: float  # monotonic seconds; start-up deadline until ready.
  ready: bool = False
  task_id: int | None = None


class KillingPool:
  """Runs batches of tasks on worker processes with a per-task timeout.

  Args:
    fns: the functions tasks may call, by index; must be picklable.
    num_workers: number of worker processes, at least 1.
    timeout_s: seconds one task may run before its worker is killed.
    start_method: ``"spawn"`` or ``"forkserver"``.
    startup_timeout_s: seconds a new worker may take to import ``fns``.
    max_startup_failures: consecutive failed worker starts after which
      ``run`` raises (the functions cannot be imported in a fresh process).
  """

  def __init__(
      self,
      fns: Sequence[Callable[..., Any]],
      *,
      num_workers: int,
      timeout_s: float,
      start_method: str = "spawn",
      startup_timeout_s: float = 120.0,
      max_startup_failures: int = 3,
  ):
    accepted = ("spawn", "forkserver")
    if start_method not in accepted:
      raise ValueError(
          f"start_method={start_method!r}: accepted {accepted} ('fork' is "
          "unsafe in a process that runs JAX, which is multithreaded).")
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers}: at least 1 is required.")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s={timeout_s}: must be > 0.")
    self._fns = tuple(fns)
    self._num_workers = num_workers
    self._timeout_s = float(timeout_s)
    self._startup_timeout_s = float(startup_timeout_s)
    self._max_startup_failures = max_startup_failures
    self._ctx = multiprocessing.get_context(start_method)
    self._workers: list[_Worker] = []
    self._startup_failures = 0
    self._next_task_id = 0
    self._closed = False
    self.restarts = 0  # Workers replaced after a timeout or a crash.
    for _ in range(num_workers):
      self._start_worker()

  @property
  def num_workers(self) -> int:
    return self._num_workers

  def _start_worker(self) -> None:
    parent_conn, child_conn = self._ctx.Pipe(duplex=True)
    process = self._ctx.Process(
        target=_worker_main, args=(child_conn, self._fns), daemon=True,
        name="rljax-reward-worker")
    process.start()
    child_conn.close()
    self._workers.append(_Worker(
        process, parent_conn, time.monotonic() + self._startup_timeout_s))

  def _kill(self, worker: _Worker) -> None:
    if worker.process.is_alive():
      worker.process.kill()
    worker.process.join(timeout=5.0)
    worker.conn.close()
    self._workers.remove(worker)

  def _replace(self, worker: _Worker, during_startup: bool) -> None:
    self._kill(worker)
    if during_startup:
      self._startup_failures += 1
      if self._startup_failures >= self._max_startup_failures:
        raise RuntimeError(
            f"{self._startup_failures} reward workers in a row failed to start "
            f"within {self._startup_timeout_s}s (exit code "
            f"{worker.process.exitcode}); check that every reward function "
            "is importable in a fresh Python process.")
    else:
      self.restarts += 1
    self._start_worker()

  def run(self, tasks: Sequence[Task]) -> list[Outcome]:
    """Runs all tasks and returns their outcomes, in order.

    Never raises for a task's failure; a task that raises, hangs past
    ``timeout_s`` or kills its worker gets an ``"error"`` or ``"timeout"``
    outcome. Raises RuntimeError only if workers cannot start at all.
    """
    if self._closed:
      raise RuntimeError("run() on a closed KillingPool.")
    outcomes: list[Outcome | None] = [None] * len(tasks)
    first_id = self._next_task_id
    self._next_task_id += len(tasks)
    pending = collections.deque(range(len(tasks)))
    while pending or any(w.task_id is not None for w in self._workers):
      for worker in list(self._workers):
        if pending and worker.ready and worker.task_id is None:
          i = pending.popleft()
          try:
            worker.conn.send((first_id + i, tuple(tasks[i])))
          except (OSError, ValueError) as exc:
            outcomes[i] = Outcome(
                "error", None,
                f"could not send the task: {describe_exception(exc)}")
            self._replace(worker, during_startup=False)
            continue
          worker.task_id = first_id + i
          worker.deadline = time.monotonic() + self._timeout_s
      waiting = [w for w in self._workers if w.task_id is not None
                 or (not w.ready and pending)]
      if not waiting:
        continue
      wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
      readable = multiprocessing.connection.wait(
          [w.conn for w in waiting], timeout=wait_s)
      for worker in waiting:
        if worker.conn in readable:
          self._receive(worker, first_id, outcomes)
        elif time.monotonic() >= worker.deadline:
          if worker.task_id is not None:
            outcomes[worker.task_id - first_id] = Outcome(
                "timeout", None,
                f"no result after {self._timeout_s}s; worker killed")
          self._replace(worker, during_startup=not worker.ready)
    return outcomes  # type: ignore[return-value]

  def _receive(self, worker: _Worker, first_id: int,
               outcomes: list[Outcome | None]) -> None:
    try:
      task_id, status, payload = worker.conn.recv()
    except (EOFError, OSError) as exc:
      worker.process.join(timeout=1.0)
      if worker.task_id is not None:
        outcomes[worker.task_id - first_id] = Outcome(
            "error", None, f"the worker died (exit code "
            f"{worker.process.exitcode}, {type(exc).__name__})")
      self._replace(worker, during_startup=not worker.ready)
      return
    except Exception as exc:  # pylint: disable=broad-exception-caught
      # The result could not be unpickled here; the worker itself is fine.
      if worker.task_id is not None:
        outcomes[worker.task_id - first_id] = Outcome(
            "error", None,
            f"could not receive the result: {describe_exception(exc)}")
      worker.task_id = None
      return
    if task_id == _READY:
      worker.ready = True
      self._startup_failures = 0
      return
    index = task_id - first_id
    if status == "ok":
      outcomes[index] = Outcome("ok", payload, "")
    else:
      outcomes[index] = Outcome("error", None, payload)
    worker.task_id = None

  def close(self) -> None:
    """Stops all workers (idempotent). Idle ones exit; others are killed."""
    if self._closed:
      return
    self._closed = True
    stopping = []
    for worker in self._workers:
      try:
        if worker.ready and worker.task_id is None:
          worker.conn.send(None)
          stopping.append(worker)
      except (OSError, ValueError):
        pass
    for worker in stopping:
      worker.process.join(timeout=1.0)
    for worker in list(self._workers):
      self._kill(worker)
