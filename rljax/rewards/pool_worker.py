"""The worker side of ``rljax/rewards/pool.py``'s ``KillingPool``: the
process that runs the pool's tasks (in its own process group, or as PID 1
of a PID namespace of its own), and the wire format of its answers
(``[header length][JSON header][payload]``; the parent parses them with
``parse_message`` and never unpickles anything a worker sends). The pool's
module docstring describes the isolation this gives.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.connection
import os
import resource
import signal
import struct
import threading
import time
import traceback

MAX_MESSAGE_CHARS = 500
MAX_MESSAGE_BYTES = 1 << 26  # A longer answer is refused as malformed.
HEADER = struct.Struct("<I")
READY = "ready"
DEATH_POLL_S = 0.2
_PARENT_POLL_S = 1.0
_CLONE_NEWPID, _CLONE_NEWUSER = 0x20000000, 0x10000000
_PR_SET_PDEATHSIG = 1


def describe_exception(exc: BaseException) -> str:
  """One line: the exception and where it was raised, truncated.

  Never raises: an exception whose ``__str__`` fails is named by its type.
  """
  try:
    lines = traceback.format_exception_only(type(exc), exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    text = "".join(lines).strip() + where
  except BaseException:  # pylint: disable=broad-exception-caught
    text = f"{type(exc).__name__} (its message could not be formatted)"
  return text[:MAX_MESSAGE_CHARS]


def _address_space_bytes() -> int:
  """This process's virtual size (Linux ``/proc``; 0 where unknown)."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def _limit_address_space(extra_bytes: int) -> None:
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  limit = _address_space_bytes() + extra_bytes
  if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)
  resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _exit_with_parent(parent_pid: int) -> None:
  """Kills this worker's group once its parent has gone (then never returns)."""
  while os.getppid() == parent_pid:
    time.sleep(_PARENT_POLL_S)
  os.killpg(os.getpgid(0), signal.SIGKILL)


def send_message(conn: multiprocessing.connection.Connection, task_id: int | None,
          status: str, message: str = "", payload: bytes = b"") -> None:
  header = json.dumps({"id": task_id, "status": status,
                       "message": message[:MAX_MESSAGE_CHARS]}).encode()
  conn.send_bytes(HEADER.pack(len(header)) + header + payload)


def parse_message(data: bytes) -> tuple[int | None, str, str, bytes]:
  """``(task id, status, message, payload)`` of a worker's answer.

  Raises:
    ValueError: if ``data`` is not an answer a worker would send.
  """
  if len(data) < HEADER.size:
    raise ValueError(f"{len(data)} bytes, shorter than a header")
  (size,) = HEADER.unpack_from(data)
  try:
    header = json.loads(data[HEADER.size:HEADER.size + size])
  except RecursionError as exc:
    raise ValueError("the header nests too deeply") from exc
  if not isinstance(header, dict):
    raise ValueError("the header is not a JSON object")
  task_id, status, message = (header.get("id"), header.get("status"),
                              header.get("message"))
  id_ok = task_id is None or (isinstance(task_id, int)
                              and not isinstance(task_id, bool))
  if (not id_ok or status not in (READY, "ok", "error")
      or not isinstance(message, str)):
    raise ValueError(f"unexpected header {str(header)[:100]}")
  return task_id, status, message[:MAX_MESSAGE_CHARS], data[
      HEADER.size + size:]


def _enter_pid_namespace() -> bool:
  """Puts this process's future children in a new PID namespace.

  As root (``CAP_SYS_ADMIN``), or with a user namespace of its own where
  unprivileged ones are allowed (mapping this user to itself); False where
  the machine refuses both. The caller must fork next: its first child is
  the namespace's PID 1, and the caller itself cannot start threads.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.unshare(_CLONE_NEWPID) == 0:
    return True
  uid, gid = os.getuid(), os.getgid()
  if uid == 0 or libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID) != 0:
    return False
  for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                     ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
      f.write(text)
  return True


def _supervise(child: int, parent_pid: int) -> None:
  """The worker outside the namespace: ends with its PID 1 and takes it down
  when the pool's process has gone (then never returns)."""
  while True:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
      os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    if os.getppid() != parent_pid:
      os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(DEATH_POLL_S)


def worker_main(conn: multiprocessing.connection.Connection,
                 memory_limit_bytes: int | None, contain: bool) -> None:
  """Runs tasks from ``conn`` until it closes or sends None.

  Its first message is the pool's functions: they are unpickled (their
  modules imported) only after the fork into the PID namespace, while this
  process is still single-threaded.
  """
  os.setsid()  # Own session and group, led by this process: pgid == pid.
  # Ctrl-C goes to the parent; the parent decides what to do.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  parent_pid = os.getppid()
  containment = "process-group"
  if contain and _enter_pid_namespace():
    child = os.fork()
    if child:
      conn.close()
      _supervise(child, parent_pid)
    # PID 1 of the namespace: the kernel kills every process in it when this
    # one ends, including those that left the group with setsid.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    containment = "pid-namespace"
  else:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,),
                     daemon=True, name="rljax-parent-watch").start()
  worker_pid = os.getpid()
  try:
    fns, encode = conn.recv()  # from the parent, which trusts its functions
  except (EOFError, OSError):
    fns = None  # The parent has gone.
  if fns is None:
    _end(containment)
  if memory_limit_bytes:
    _limit_address_space(memory_limit_bytes)
  send_message(conn, None, READY, containment)
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      break  # The parent has gone.
    if message is None:
      return
    task_id, (fn_index, args, kwargs) = message
    try:
      status, text, payload = "ok", "", encode(fns[fn_index](*args, **kwargs))
      if not isinstance(payload, bytes):
        raise TypeError(f"encode returned {type(payload).__name__}, not bytes")
    except BaseException as exc:  # pylint: disable=broad-exception-caught
      # A call may raise anything, even SystemExit; none may end the worker.
      status, text, payload = "error", describe_exception(exc), b""
    if os.getpid() != worker_pid:
      os._exit(0)  # A forked child returned from the call: it has no say.
    try:
      send_message(conn, task_id, status, text, payload)
    except (OSError, ValueError):
      break
  _end(containment)


def _end(containment: str) -> None:
  """Ends the worker and every process it started (never returns)."""
  if containment == "pid-namespace":
    os._exit(0)  # PID 1's end is its namespace's end.
  os.killpg(0, signal.SIGKILL)


__all__ = ["DEATH_POLL_S", "HEADER", "MAX_MESSAGE_BYTES", "MAX_MESSAGE_CHARS",
           "READY", "describe_exception", "parse_message", "send_message",
           "worker_main"]
