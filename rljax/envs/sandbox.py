"""Running untrusted Python: a process with its own namespaces and limits.

``run_python(code, limits)`` runs ``code`` in a fresh ``python -I`` process
and returns what it printed, truncated, and how it ended. Before the code
runs, a bootstrap (``_BOOTSTRAP``, run in that process) puts it in:

* **New network, mount, PID and IPC namespaces** (``unshare(2)`` through
  ``ctypes``; as root, or as any user where unprivileged user namespaces are
  allowed). No network: the namespace has only a down loopback, so even
  ``127.0.0.1`` is unreachable. The code is PID 1 of its PID namespace, with
  a ``/proc`` of its own: when it ends, or is killed, every process it
  started dies with it, ``setsid`` or not. Its SysV shared memory, message
  queues and semaphores live in its IPC namespace and end with it.
* **A filesystem that is read-only except its scratch.** Every host mount is
  remounted read-only in its mount namespace. ``/tmp``, ``/var/tmp``,
  ``/dev/shm``, ``/run``, ``/root`` and ``/home`` are directories of one
  private tmpfs of ``tmpfs_mb`` MiB, so that size bounds the bytes the code
  writes in all, wherever it writes them. Its working directory and
  ``HOME`` is ``/tmp/work``, ``TMPDIR`` is ``/tmp``; the interpreter's own
  tree is bound back read-only where a hidden directory holds it (a pyenv
  under ``/root``). Every unix socket file bound on the host, in any network
  namespace the bootstrap can see, is covered by an empty file it cannot
  open, so no host service is reachable through a socket file either.
* **Limits** (``resource``): CPU seconds, address space, processes, open
  files, file size (so its output too), no core dumps; and a wall-clock
  timeout enforced by the caller, which SIGKILLs the whole process group.
* **An unprivileged user.** Started as root, it drops to ``nobody``
  (uid/gid 65534, no supplementary groups) before running the code: root
  ignores the process-count limit and can read and write anything. As
  nobody it cannot read ``/etc/shadow`` or signal the trainer's processes.

Where the machine refuses the namespaces (a container without
``CAP_SYS_ADMIN`` and without user namespaces), or the caller passes
``namespaces=False``, the code still runs with the limits, in a private
scratch directory (its working directory, ``HOME`` and ``TMPDIR``, deleted
afterwards) and, as root, as nobody; then the network, the host's writable
directories and host sockets are reachable, a process that calls ``setsid``
outlives the run, and the SysV IPC objects it made are removed when it ends
(those created by its user since it started, whose creator is gone or was
its own). ``SandboxResult.isolated`` says which isolation was in place,
field by field; ``docs/environments.md`` holds the threat model.

A parent that dies takes the sandbox with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """What one run of code may use.

  Attributes:
    timeout_s: wall-clock seconds before the process group is killed.
    cpu_s: CPU seconds (``RLIMIT_CPU``).
    memory_mb: address space in MiB (``RLIMIT_AS``; a larger allocation
      raises ``MemoryError`` in the code).
    max_processes: processes of the sandbox user (``RLIMIT_NPROC``).
    max_open_files: ``RLIMIT_NOFILE``.
    max_file_mb: size of any file it writes, its output included
      (``RLIMIT_FSIZE``).
    max_output_chars: characters of stdout and of stderr returned.
    tmpfs_mb: MiB the code may write in all: its scratch, ``/tmp``,
      ``/dev/shm`` and the other private places share one tmpfs of this
      size (a write past it fails with ``ENOSPC``).
  """

  timeout_s: float = 5.0
  cpu_s: int = 3
  memory_mb: int = 512
  max_processes: int = 32
  max_open_files: int = 64
  max_file_mb: int = 4
  max_output_chars: int = 2000
  tmpfs_mb: int = 32

  def __post_init__(self):
    for name in ("cpu_s", "memory_mb", "max_processes", "max_open_files",
                 "max_file_mb", "max_output_chars", "tmpfs_mb"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"sandbox {name}={value!r}: a positive integer is "
                         "required.")
    if not self.timeout_s > 0:
      raise ValueError(f"sandbox timeout_s={self.timeout_s!r}: > 0 required.")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """How a run ended.

  Attributes:
    status: ``"ok"`` (exit 0), ``"error"`` (a non-zero exit: an exception,
      ``MemoryError`` included), ``"killed"`` (a signal: the CPU limit, the
      file-size limit, its own ``kill``) or ``"timeout"`` (the wall clock).
    stdout, stderr: what it wrote, each cut to ``max_output_chars``.
    returncode: the exit code (negative: the signal).
    isolated: the isolation in place, field by field:
      ``namespaces`` (bool: network, mount, PID and IPC namespaces),
      ``user`` (``"nobody"``: dropped from root; ``"same"``: the caller's),
      ``network`` (``"none"`` | ``"host"``), ``filesystem`` (``"read-only"``:
      every host mount read-only, the private tmpfs the only writable place;
      ``"read-only except A, B"``: mounts that refused the remount;
      ``"host"``: whatever ``user`` may write), ``ipc`` (``"private"`` |
      ``"host, cleaned at the end"``) and ``processes``
      (``"pid-namespace"``: all end with the code; ``"process-group"``: a
      process that calls ``setsid`` escapes).
    seconds: wall-clock seconds.
  """

  status: str
  stdout: str
  stderr: str
  returncode: int | None
  isolated: dict
  seconds: float


# Runs in the sandbox process before the code; argv[1] is its JSON config.
# Every path the sandbox sees is final before it drops to nobody: the host's
# mounts read-only, one size-capped tmpfs behind every writable place, host
# socket files masked.
_BOOTSTRAP = r'''
import ctypes, json, os, re, resource, signal, stat, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
def die_with_parent(parent):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(137)
die_with_parent(cfg["parent"])
NEWNS, NEWNET, NEWPID, NEWIPC, NEWUSER = (
    0x20000, 0x40000000, 0x20000000, 0x08000000, 0x10000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 1 << 14, 1 << 18
KEPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
        "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
root = os.getuid() == 0
with open(os.path.join(cfg["scratch"], "main.py"), encoding="utf-8") as f:
    source = f.read()
report = os.open(cfg["report"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
def host_sockets():
    # Filesystem unix sockets of every network namespace this process can
    # see (a socket file is reachable from any of them), read before
    # leaving the host's.
    seen, paths = set(), set()
    for pid in ["self"] + [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            net = os.readlink("/proc/%s/ns/net" % pid)
            if net in seen:
                continue
            seen.add(net)
            with open("/proc/%s/net/unix" % pid, encoding="utf-8",
                      errors="surrogateescape") as f:
                for line in f.readlines()[1:]:
                    fields = line.rstrip("\n").split(None, 7)
                    if len(fields) == 8 and fields[7].startswith("/"):
                        paths.add(fields[7])
        except OSError:
            pass
    return sorted(paths)
ns = False
if cfg["namespaces"]:
    sockets = host_sockets()
    flags = NEWNS | NEWNET | NEWPID | NEWIPC
    ns = libc.unshare(flags) == 0 or (
        not root and libc.unshare(flags | NEWUSER) == 0)
scratch = cfg["scratch"]
writable = []
if ns:
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    def unescape(path):
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)
    with open("/proc/self/mountinfo", encoding="utf-8",
              errors="surrogateescape") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point, options = unescape(fields[4]), fields[5].split(",")
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for option in options:
            flags |= KEPT.get(option, 0)
        if libc.mount(None, point.encode("utf-8", "surrogateescape"), None,
                      flags, None) != 0 and point not in writable:
            writable.append(point)
    # One tmpfs holds every writable place, so its size bounds the bytes
    # the code can write in all.
    box = cfg["box"]
    libc.mount(b"tmpfs", box.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
               ("size=%dm,mode=755" % cfg["tmpfs_mb"]).encode())
    # Reached through its descriptor: binding /tmp hides the path.
    box_fd = os.open(box, os.O_PATH | os.O_DIRECTORY)
    box = "/proc/self/fd/%d" % box_fd
    mask = os.path.join(box, "mask")
    os.close(os.open(mask, os.O_WRONLY | os.O_CREAT, 0))
    mask_fd = os.open(mask, os.O_PATH)
    keep = {}  # the interpreter's tree, bound back where a place hides it
    for path in {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}:
        keep[path] = os.open(path, os.O_PATH)
    def bind(source, target, readonly):
        libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC,
                   None)
        libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT
                   | MS_NOSUID | MS_NODEV | (MS_RDONLY if readonly else 0),
                   None)
    places = {"/tmp": 0o1777, "/var/tmp": 0o1777, "/dev/shm": 0o1777,
              "/run": 0o755, "/root": 0o755, "/home": 0o755}
    hidden = []
    for place, mode in places.items():
        if os.path.isdir(place) and not os.path.islink(place):
            inside = os.path.join(box, place.strip("/").replace("/", "-"))
            os.mkdir(inside)
            os.chmod(inside, mode)
            if place == "/tmp":
                scratch = os.path.join(inside, "work")
                os.mkdir(scratch, 0o700)
            bind(inside, place, readonly=False)
            hidden.append(place)
            for path, fd in keep.items():
                if path.startswith(place + "/"):
                    os.makedirs(path, 0o755, exist_ok=True)
                    bind("/proc/self/fd/%d" % fd, path, readonly=True)
    if scratch != cfg["scratch"]:
        with open(os.path.join(scratch, "main.py"), "w",
                  encoding="utf-8") as f:
            f.write(source)
        scratch = "/tmp/work"
    for path in sockets:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                bind("/proc/self/fd/%d" % mask_fd, path, readonly=True)
        except OSError:
            pass
    writable = [p for p in writable if p != "/proc" and not any(
        p == h or p.startswith(h + "/") for h in hidden + ["/proc"])]
os.write(report, json.dumps({"namespaces": ns, "writable": writable}).encode())
os.close(report)
if ns:
    child = os.fork()
    if child:  # the outer process: waits for PID 1 and passes on its end
        _, status = os.waitpid(child, 0)
        if os.WIFSIGNALED(status):
            os._exit(128 + os.WTERMSIG(status))
        os._exit(os.WEXITSTATUS(status))
    # PID 1 of the new namespace: its parent is outside it (getppid() is 0),
    # so only the death signal is set.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
os.chdir(scratch)
limits = {resource.RLIMIT_CPU: cfg["cpu_s"],
          resource.RLIMIT_AS: cfg["memory_mb"] << 20,
          resource.RLIMIT_NPROC: cfg["max_processes"],
          resource.RLIMIT_NOFILE: cfg["max_open_files"],
          resource.RLIMIT_FSIZE: cfg["max_file_mb"] << 20,
          resource.RLIMIT_CORE: 0}
for which, value in limits.items():
    resource.setrlimit(which, (value, value))
if root:
    os.chown(".", cfg["uid"], cfg["uid"])
    os.chown("main.py", cfg["uid"], cfg["uid"])
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    if os.getuid() == 0 or os.geteuid() == 0:
        os._exit(125)
    # A change of credentials clears the death signal: set it again.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not ns and os.getppid() != cfg["parent"]:
        os._exit(137)
home = os.getcwd()
os.environ.clear()
os.environ.update({"PATH": "/usr/bin:/bin", "HOME": home,
                   "TMPDIR": "/tmp" if ns else home, "LANG": "C.UTF-8"})
sys.argv = ["main.py"]
del cfg, libc, limits, f
exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
'''


def _tail(path: str, limit: int) -> str:
  try:
    with open(path, "rb") as f:
      data = f.read(limit * 4 + 4)
  except OSError:
    return ""
  text = data.decode("utf-8", "replace")
  return text[:limit] + ("...[truncated]" if len(text) > limit else "")


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


# /proc/sysvipc/<kind>: the columns of the object's id, its creator's uid
# and its creator's pid (only shared memory records one).
_SYSV = {"shm": (1, 9, 4), "msg": (1, 9, None), "sem": (1, 6, None)}
_IPC_RMID = 0


def _sysv_objects() -> dict[tuple[str, int], tuple[int, int | None]]:
  """``{(kind, id): (creator uid, creator pid or None)}`` of the host's SysV
  IPC objects (shared memory, message queues, semaphores)."""
  out = {}
  for kind, (id_col, uid_col, pid_col) in _SYSV.items():
    try:
      with open(f"/proc/sysvipc/{kind}", encoding="ascii") as f:
        lines = f.read().splitlines()[1:]
    except OSError:
      continue
    for line in lines:
      fields = line.split()
      try:
        out[(kind, int(fields[id_col]))] = (
            int(fields[uid_col]),
            None if pid_col is None else int(fields[pid_col]))
      except (IndexError, ValueError):
        continue
  return out


def _session_of(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return int(f.read().rsplit(")", 1)[1].split()[3])
  except (OSError, ValueError, IndexError):
    return None


def _remove_sysv(before: dict, uid: int, session: int) -> int:
  """Removes the SysV IPC objects that a sandbox run without an IPC
  namespace left: created since ``before`` by ``uid``, by a process of
  ``session`` or one that has ended. Returns how many."""
  libc = ctypes.CDLL(None, use_errno=True)
  removed = 0
  for (kind, ident), (cuid, cpid) in _sysv_objects().items():
    if (kind, ident) in before or cuid != uid:
      continue
    if cpid is not None and _session_of(cpid) not in (None, session):
      continue  # made by a live process of another session
    control = {"shm": libc.shmctl, "msg": libc.msgctl}.get(kind)
    if control is not None:
      ok = control(ident, _IPC_RMID, None) == 0
    else:
      ok = libc.semctl(ident, 0, _IPC_RMID) == 0
    removed += ok
  return removed


def namespaces_available() -> tuple[bool, str]:
  """Whether the sandbox gets its namespaces here, and why not."""
  result = run_python("print('ok')", SandboxLimits(timeout_s=10))
  if result.status != "ok":
    return False, f"the sandbox does not start: {result.stderr[-300:]}"
  if not result.isolated.get("namespaces"):
    return False, ("unshare(2) of network, mount, PID and IPC namespaces is "
                   "refused on this machine (no CAP_SYS_ADMIN, no user "
                   "namespaces)")
  return True, ""


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *,
               namespaces: bool = True) -> SandboxResult:
  """Runs ``code`` in the sandbox (see the module docstring).

  Args:
    code: the program (``main.py`` in its working directory).
    limits: what it may use.
    namespaces: False runs it without namespaces, as on a machine that
      refuses them (``isolated`` then says what is shared with the host).
  """
  t0 = time.monotonic()
  work = tempfile.mkdtemp(prefix="rljax-sandbox-")
  scratch = os.path.join(work, "scratch")
  os.mkdir(scratch, 0o700)
  os.mkdir(os.path.join(work, "box"), 0o755)
  with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
    f.write(code)
  root = os.getuid() == 0
  uid = NOBODY if root else os.getuid()
  cfg = {"scratch": scratch, "box": os.path.join(work, "box"),
         "parent": os.getpid(), "uid": NOBODY, "namespaces": namespaces,
         "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
         "max_processes": limits.max_processes,
         "max_open_files": limits.max_open_files,
         "max_file_mb": limits.max_file_mb, "tmpfs_mb": limits.tmpfs_mb,
         "tag": f"rljax-sandbox-{uuid.uuid4().hex}",
         "report": os.path.join(work, "report.json")}
  if root:  # nobody must be able to enter the work dir to reach scratch
    os.chmod(work, 0o711)
  out_path, err_path = (os.path.join(work, n) for n in ("stdout", "stderr"))
  ipc_before = _sysv_objects()
  proc = None
  try:
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
          stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
          start_new_session=True, env={"PATH": "/usr/bin:/bin"}, cwd=work)
      try:
        returncode = proc.wait(timeout=limits.timeout_s)
        status = ("ok" if returncode == 0 else "killed"
                  if returncode < 0 or returncode > 128 else "error")
      except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        returncode = proc.wait()
        status = "timeout"
  finally:
    if proc is not None:
      _kill_group(proc.pid)
    stdout = _tail(out_path, limits.max_output_chars)
    stderr = _tail(err_path, limits.max_output_chars)
    try:
      with open(cfg["report"], encoding="utf-8") as f:
        report = json.load(f)
    except (OSError, ValueError):
      report = {"namespaces": False, "writable": []}
    shutil.rmtree(work, ignore_errors=True)
  ns = bool(report.get("namespaces"))
  if ns:
    ipc = "private"
  else:
    _remove_sysv(ipc_before, uid, proc.pid)
    ipc = "host, cleaned at the end"
  writable = report.get("writable") or []
  isolated = {
      "namespaces": ns, "user": "nobody" if root else "same",
      "network": "none" if ns else "host",
      "filesystem": ("host" if not ns else "read-only" if not writable else
                     "read-only except " + ", ".join(writable)),
      "ipc": ipc, "processes": "pid-namespace" if ns else "process-group"}
  if returncode == 125:
    status, stderr = "error", "the sandbox could not drop root privileges"
  return SandboxResult(status, stdout, stderr, returncode, isolated,
                       time.monotonic() - t0)


__all__ = ["SandboxLimits", "SandboxResult", "namespaces_available",
           "run_python"]
