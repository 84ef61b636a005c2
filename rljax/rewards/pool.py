"""A process pool whose stuck workers are killed and replaced, and which
never runs a worker's code in the parent.

``concurrent.futures`` can stop waiting for a hung call but cannot stop the
call: the worker stays busy forever and the pool shrinks by one each time.
Here each worker is a ``multiprocessing.Process`` with its own pipe; the
parent tracks which task each worker runs and when it started, and when a task
passes its deadline the parent kills that worker, reports a timeout and starts
a fresh worker in its place. Other workers are not disturbed.

Isolation, in the order a task meets it:

* Results come back as bytes, never as pickles. A worker passes the called
  function's return value to ``encode`` (a function given to the pool, run in
  the worker) and sends ``[header length][JSON header][payload]`` with
  ``send_bytes``; the parent reads it with ``recv_bytes`` and ``json.loads``.
  Unpickling a returned object could run any code in the parent (an object's
  ``__reduce__`` may sleep or call ``os._exit``); parsing JSON and handing
  over bytes runs none. Error messages are plain, truncated strings.
* Each worker leads its own session and process group (``os.setsid`` at
  start), and whatever the called functions start (``os.fork``,
  ``subprocess``) joins that group. A worker is stopped by killing the whole
  group with SIGKILL: at a timeout, after the worker dies, at ``close()``,
  when the pool is garbage-collected and at interpreter exit
  (``weakref.finalize``). If the parent itself is killed, each worker sees
  it within a second and kills its own group.
* With ``pid_namespace`` (the environment workers' pool), where the machine
  allows it (root, or unprivileged user namespaces), each worker runs the functions as PID 1 of a PID namespace of its own:
  the worker process forks at start, its child serves the tasks, and when
  that child ends (killed with the group, or at its own exit) the kernel
  ends every process in the namespace, including one that left the group on
  purpose (``os.setsid``, ``start_new_session=True``). Without it such a
  process escapes; ``KillingPool.containment`` says which held. Processes
  that a namespace's PID 1 inherits are reaped when the worker ends (the
  worker cannot tell an orphan from a child its function still waits on).
* A forked child that returns from the called function instead of exiting is
  ended (``os._exit``) before it can answer in its parent's place.
* ``memory_limit_mb`` caps a worker's address space (``RLIMIT_AS``) at its
  size after start-up (Python, numpy, the functions' modules) plus that many
  MiB; the processes it starts inherit the cap. An allocation past it raises
  ``MemoryError`` in the call (an ``"error"`` outcome), and a worker that
  dies of it is replaced.
* Any ``BaseException`` a call raises (``SystemExit`` included) is an
  ``"error"`` outcome; workers ignore SIGINT (Ctrl-C is the parent's).

Workers are started with ``spawn`` (or ``forkserver``), never ``fork``: the
parent runs JAX, which is multithreaded, and forking a multithreaded process
can deadlock the child. The functions a pool runs (and ``encode``) are
pickled by ``multiprocessing``, so they must be picklable
(module-level functions, or ``functools.partial`` of them); the parent trusts
its own functions, so this direction may use pickle. They reach the worker
as its first message, after the fork into its namespace, and it says "ready"
once it has unpickled them (importing their modules), so start-up time is
not charged to the first task's timeout. The worker's side and the wire
format are ``rljax/rewards/pool_worker.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from rljax.rewards.pool_worker import (DEATH_POLL_S, MAX_MESSAGE_CHARS,
                                      MAX_MESSAGE_BYTES, READY,
                                      describe_exception, parse_message,
                                      worker_main)


class Task(NamedTuple):
  """One call: ``fns[fn_index](*args, **kwargs)``."""
  fn_index: int
  args: tuple
  kwargs: dict


class Outcome(NamedTuple):
  """How a task ended.

  Attributes:
    status: ``"ok"`` (``value`` holds the bytes ``encode`` made of the return
      value), ``"error"`` (the call or ``encode`` raised, the answer was
      malformed, or the worker died) or ``"timeout"`` (its worker was killed
      at the deadline).
    value: the encoded return value for ``"ok"``, else None.
    message: what went wrong, empty for ``"ok"``.
  """
  status: Literal["ok", "error", "timeout"]
  value: bytes | None
  message: str


def kill_group(pgid: int) -> None:
  """SIGKILLs process group ``pgid`` if it exists."""
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _kill_groups(pgids: set[int]) -> None:
  for pgid in list(pgids):
    kill_group(pgid)
  pgids.clear()


def _has_exited(pid: int) -> bool:
  """Whether child ``pid`` has ended, without reaping it (its pid, which is
  its group's id, stays reserved until ``join``)."""
  try:
    return os.waitid(os.P_PID, pid,
                     os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:  # Already reaped.
    return True


def _exits_soon(pid: int, seconds: float = 1.0) -> bool:
  """``_has_exited``, polled for up to ``seconds``."""
  deadline = time.monotonic() + seconds
  while not _has_exited(pid):
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.005)
  return True


def _send_functions(conn: multiprocessing.connection.Connection,
                    functions: tuple) -> None:
  try:
    conn.send(functions)
  except (OSError, ValueError):
    pass  # The worker died first: the pool replaces it.


@dataclasses.dataclass
class _Worker:
  process: multiprocessing.process.BaseProcess
  conn: multiprocessing.connection.Connection
  deadline: float  # monotonic seconds; start-up deadline until ready.
  ready: bool = False
  task_id: int | None = None
  containment: str = ""  # what its ready message said
  sender: threading.Thread | None = None  # sends the functions at start


class KillingPool:
  """Runs batches of tasks on worker processes with a per-task timeout.

  Args:
    fns: the functions tasks may call, by index; must be picklable.
    encode: ``encode(return value) -> bytes``, run in the worker on each
      return value; must be picklable. Its bytes are the ``"ok"`` outcome's
      value, and the only thing of the result that reaches the parent.
    num_workers: number of worker processes, at least 1.
    timeout_s: seconds one task may run before its worker is killed.
    start_method: ``"spawn"`` or ``"forkserver"``.
    startup_timeout_s: seconds a new worker may take to import ``fns``.
    max_startup_failures: consecutive failed worker starts after which
      ``run`` raises (the functions cannot be imported in a fresh process).
    memory_limit_mb: address space (MiB) a worker may add to its size after
      start-up (``RLIMIT_AS``, inherited by the processes it starts); None
      for no limit.
    pid_namespace: run each worker as PID 1 of its own PID namespace where
      the machine allows it, so that stopping it ends every process it
      started, ``setsid`` or not (``containment`` says what each got). The
      functions then see namespace pids: ``os.getpid()`` is 1 in every
      worker, so no function may name a shared file by its pid.
  """

  def __init__(
      self,
      fns: Sequence[Callable[..., Any]],
      *,
      encode: Callable[[Any], bytes],
      num_workers: int,
      timeout_s: float,
      start_method: str = "spawn",
      startup_timeout_s: float = 120.0,
      max_startup_failures: int = 3,
      memory_limit_mb: int | None = None,
      pid_namespace: bool = False,
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
    self._functions = (tuple(fns), encode)
    self._contain = bool(pid_namespace)
    self._memory_limit_bytes = (memory_limit_mb << 20 if memory_limit_mb
                                else None)
    self._num_workers = num_workers
    self._timeout_s = float(timeout_s)
    self._startup_timeout_s = float(startup_timeout_s)
    self._max_startup_failures = max_startup_failures
    self._ctx = multiprocessing.get_context(start_method)
    self._workers: list[_Worker] = []
    # Process groups still to kill; shared with the finalizer, which must not
    # hold the pool itself.
    self._groups: set[int] = set()
    self._finalizer = weakref.finalize(self, _kill_groups, self._groups)
    self._startup_failures = 0
    self._next_task_id = 0
    # Submitted tasks not yet sent, in order, and ended ones not yet taken.
    self._queue: collections.deque[tuple[int, tuple]] = collections.deque()
    self._done: dict[int, Outcome] = {}
    self._outstanding: set[int] = set()  # submitted, not yet given back
    self._closed = False
    self.restarts = 0  # Workers replaced after a timeout or a crash.
    for _ in range(num_workers):
      self._start_worker()

  @property
  def num_workers(self) -> int:
    return self._num_workers

  @property
  def containment(self) -> str | None:
    """What ends with a stopped worker: ``"pid-namespace"`` (every process
    it started), ``"process-group"`` (those that stayed in its group: one
    that calls ``setsid`` escapes), or None before a worker is ready. The
    weaker of the two when workers differ."""
    seen = {w.containment for w in self._workers if w.ready}
    if not seen:
      return None
    return "process-group" if "process-group" in seen else "pid-namespace"

  def _start_worker(self) -> None:
    parent_conn, child_conn = self._ctx.Pipe(duplex=True)
    process = self._ctx.Process(
        target=worker_main,
        args=(child_conn, self._memory_limit_bytes, self._contain),
        daemon=True, name="rljax-reward-worker")
    process.start()
    self._groups.add(process.pid)
    child_conn.close()
    # The functions follow through the pipe, from a thread: a large closure
    # must not block the pool while the worker starts (or fails to).
    sender = threading.Thread(target=_send_functions,
                              args=(parent_conn, self._functions),
                              daemon=True, name="rljax-pool-send")
    sender.start()
    self._workers.append(_Worker(
        process, parent_conn, time.monotonic() + self._startup_timeout_s,
        sender=sender))

  def _kill(self, worker: _Worker) -> None:
    # The group first, while the worker is not yet reaped: its pid (the
    # group's id) cannot be reused by an unrelated process before the kill.
    kill_group(worker.process.pid)
    if worker.process.is_alive():
      worker.process.kill()
    worker.process.join(timeout=5.0)
    self._groups.discard(worker.process.pid)
    # The pipe is closed only once its sender has stopped (the dead worker's
    # end fails its write): a descriptor closed under a writing thread is
    # reused by the next worker's pipe, which would then read the rest.
    if worker.sender is not None:
      worker.sender.join(timeout=5.0)
    if worker.sender is None or not worker.sender.is_alive():
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
    ``timeout_s``, answers malformed bytes or kills its worker gets an
    ``"error"`` or ``"timeout"`` outcome. Raises RuntimeError only if workers
    cannot start at all.
    """
    ids = self.submit(tasks)
    while any(i not in self._done for i in ids):
      self._advance(None)
    self._outstanding -= set(ids)
    return [self._done.pop(i) for i in ids]

  def submit(self, tasks: Sequence[Task]) -> list[int]:
    """Queues ``tasks`` and starts them on idle workers without waiting;
    returns their ids for ``poll``. Workers take queued tasks in order."""
    if self._closed:
      raise RuntimeError("submit() on a closed KillingPool.")
    ids = list(range(self._next_task_id, self._next_task_id + len(tasks)))
    self._next_task_id += len(tasks)
    self._queue.extend(zip(ids, (tuple(t) for t in tasks)))
    self._outstanding.update(ids)
    self._dispatch()
    return ids

  def poll(self, ids: Sequence[int], timeout_s: float | None = 0.0
           ) -> dict[int, Outcome]:
    """The outcomes of the tasks ``ids`` (from ``submit``) that have ended,
    by id; each is returned once. Waits up to ``timeout_s`` (None: as long
    as it takes) for at least one when none has ended; 0 only looks."""
    if self._closed:
      raise RuntimeError("poll() on a closed KillingPool.")
    wanted = set(ids) & self._outstanding  # those not yet given back
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      ended = wanted & self._done.keys()
      left = None if deadline is None else deadline - time.monotonic()
      if ended or not wanted or (left is not None and left <= 0):
        if not ended and wanted:
          self._advance(0.0)  # one look: answers already in the pipes
          ended = wanted & self._done.keys()
        self._outstanding -= ended
        return {i: self._done.pop(i) for i in sorted(ended)}
      self._advance(left)

  def _dispatch(self) -> None:
    """Sends queued tasks to idle, ready workers."""
    for worker in list(self._workers):
      if self._queue and worker.ready and worker.task_id is None:
        if _has_exited(worker.process.pid):  # Died idle (a stray thread?).
          self._replace(worker, during_startup=False)
          continue
        task_id, task = self._queue.popleft()
        try:
          worker.conn.send((task_id, task))
        except (OSError, ValueError) as exc:
          self._done[task_id] = Outcome(
              "error", None,
              f"could not send the task: {describe_exception(exc)}")
          self._replace(worker, during_startup=False)
          continue
        worker.task_id = task_id
        worker.deadline = time.monotonic() + self._timeout_s

  def _advance(self, timeout_s: float | None) -> None:
    """One round: queued tasks to idle workers, then a wait of at most
    ``timeout_s`` (None: until the next event) for answers, deaths and
    deadlines, each handled."""
    self._dispatch()
    waiting = [w for w in self._workers if w.task_id is not None
               or (not w.ready and self._queue)]
    if not waiting:
      return
    wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
    if timeout_s is not None:
      wait_s = min(wait_s, max(timeout_s, 0.0))
    # A dead worker's pipe and sentinel stay open while a process it forked
    # holds their other ends, so deaths are also polled for.
    readable = multiprocessing.connection.wait(
        [w.conn for w in waiting] + [w.process.sentinel for w in waiting],
        timeout=min(wait_s, DEATH_POLL_S))
    for worker in waiting:
      if worker.conn in readable:
        self._receive(worker)
      elif (worker.process.sentinel in readable
            or _has_exited(worker.process.pid)):
        self._fail(worker, "the worker died")
      elif time.monotonic() >= worker.deadline:
        if worker.task_id is not None:
          self._done[worker.task_id] = Outcome(
              "timeout", None,
              f"no result after {self._timeout_s}s; worker killed")
          worker.task_id = None
        self._replace(worker, during_startup=not worker.ready)
    self._dispatch()

  def _fail(self, worker: _Worker, what: str) -> None:
    """Records an error for the worker's task and replaces the worker."""
    kill_group(worker.process.pid)
    worker.process.join(timeout=1.0)
    if worker.task_id is not None:
      self._done[worker.task_id] = Outcome(
          "error", None,
          f"{what} (exit code {worker.process.exitcode})"[:MAX_MESSAGE_CHARS])
      worker.task_id = None
    self._replace(worker, during_startup=not worker.ready)

  def _receive(self, worker: _Worker) -> None:
    try:
      data = worker.conn.recv_bytes(MAX_MESSAGE_BYTES)
    except (EOFError, OSError) as exc:
      # A dying worker closes its pipe a moment before its exit status
      # exists: wait for it briefly, so a death reads as one.
      what = ("the worker died" if _exits_soon(worker.process.pid) else
              f"its answer could not be read ({type(exc).__name__}: {exc})")
      self._fail(worker, what)
      return
    try:
      task_id, status, message, payload = parse_message(data)
      if status == READY:
        if worker.ready:
          raise ValueError("a second 'ready'")
      elif task_id is None or task_id != worker.task_id:
        raise ValueError(f"an answer to task {task_id} while running task "
                         f"{worker.task_id}")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError.
      # Only the worker's own code writes there, so its stream is corrupt.
      self._fail(worker, f"the worker sent a malformed answer ({exc})")
      return
    if status == READY:
      worker.ready = True
      worker.containment = message
      self._startup_failures = 0
      return
    if status == "ok":
      self._done[task_id] = Outcome("ok", payload, "")
    else:
      self._done[task_id] = Outcome("error", None, message)
    worker.task_id = None

  def close(self) -> None:
    """Stops all workers and their process groups (idempotent).

    Idle workers are asked to exit first (so their functions' modules can
    clean up), then every worker's group is killed.
    """
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
    deadline = time.monotonic() + 1.0
    for worker in stopping:
      while (not _has_exited(worker.process.pid)
             and time.monotonic() < deadline):
        time.sleep(0.01)
    for worker in list(self._workers):
      self._kill(worker)
    self._finalizer()
