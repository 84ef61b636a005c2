"""Run directories that a second writer, a changed config or a crash can't damage.

* ``WorkdirLock``: an exclusive ``flock`` on ``<workdir>/.lock``, holding the
  owner's pid and host; a second run on the same directory fails at once,
  naming them. The kernel drops the lock when its process dies, so a killed
  run never leaves a stale lock.
* ``check_resumable``: the fields whose change makes a run's checkpoints
  impossible to continue (the model's shape, the batch layout, the
  optimizer's state structure, ...) are compared with the run's saved
  ``config.json`` before anything is written.
* ``trim_metrics``: on resume, rows of ``metrics.jsonl`` after the restored
  step are dropped, so each step appears once.

Configs arrive as plain JSON dicts (``json.loads(config.to_json())``); this
module reads no ConfigDict.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

LOCK_FILE = ".lock"

# Dotted config fields (or whole sections) a resumed run must keep: they fix
# the params' shapes, the data order, or the structure of the train state.
RESUME_FIELDS = (
    "seed", "model", "tokenizer", "task", "rl.prompts_per_step",
    "rl.group_size", "rl.advantage", "rl.rank_weights", "rl.objective",
    "rl.is_correction", "rl.kl_coef", "rl.log_kl", "optimizer.name",
    "optimizer.ess_scaling",
    "optimizer.max_grad_norm", "optimizer.max_consecutive_nonfinite",
    "rewards.names", "critic.max_grad_norm",
)
# Fields where only "zero or not" changes the state (a reference copy of the
# params exists iff rl.kl_coef > 0).
_ONLY_PRESENCE = ("rl.kl_coef", "optimizer.max_grad_norm",
                  "optimizer.max_consecutive_nonfinite", "critic.max_grad_norm")


class WorkdirLock:
  """An exclusive lock on a run directory (a context manager).

  Raises:
    RuntimeError: naming the pid and host that hold the lock.
  """

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
      os.close(self._fd)
      self._fd = None
      holder = holder or "holder unknown"
      raise RuntimeError(
          f"workdir {workdir!r} is in use by another run ({holder}; lock "
          f"{self.path}): wait for it to finish, stop it, or use another "
          "--workdir.") from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, f"pid {os.getpid()} on host {socket.gethostname()}\n"
              .encode(), 0)

  def release(self) -> None:
    """Releases the lock (idempotent)."""
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> WorkdirLock:
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
  node: Any = config
  for part in dotted.split("."):
    if not isinstance(node, Mapping) or part not in node:
      return None
    node = node[part]
  return node


def _normalised(field: str, value: Any) -> Any:
  if field in _ONLY_PRESENCE:
    return bool(value)
  if isinstance(value, list):
    return tuple(_normalised(field, v) for v in value)
  if isinstance(value, Mapping):
    return {k: _normalised(field, v) for k, v in value.items()}
  return value


def check_resumable(saved: Mapping[str, Any], new: Mapping[str, Any],
                    workdir: str) -> None:
  """Raises if ``new`` cannot continue the checkpoints written under ``saved``.

  Args:
    saved: the run's saved config (``<workdir>/config.json``), a JSON dict.
    new: the config of this call, a JSON dict.
    workdir: for the message.

  Raises:
    ValueError: naming every differing field, its saved and new value, and
      how to start fresh.
  """
  diffs = []
  for field in RESUME_FIELDS:
    old, now = _lookup(saved, field), _lookup(new, field)
    if _normalised(field, old) != _normalised(field, now):
      diffs.append(f"{field}: {old!r} -> {now!r}")
  if diffs:
    raise ValueError(
        f"workdir {workdir!r} holds checkpoints of a run that this config "
        f"cannot continue; these fields differ: {'; '.join(diffs)}. Restore "
        "them to resume, or start fresh with another --workdir (or delete "
        f"{os.path.join(workdir, 'checkpoints')}).")


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The run's ``config.json`` as a dict, or None if there is none."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def trim_metrics(path: str, last_step: int) -> int:
  """Drops the rows of a ``metrics.jsonl`` after ``last_step``; returns how many.

  The file is rewritten atomically (a temporary file, then a rename).
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
    if row.get("step", 0) <= last_step:
      keep.append(line if line.endswith("\n") else line + "\n")
  dropped = len(lines) - len(keep)
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(keep)
    os.replace(tmp, path)
  return dropped


def disk_full(error: BaseException) -> OSError | None:
  """The ENOSPC ``OSError`` in ``error``'s chain of causes, if any."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
      return error
    error = error.__cause__ or error.__context__
  return None
