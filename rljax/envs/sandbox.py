"""Running untrusted Python: a process with its own namespaces and limits.

``run_python(code, limits)`` runs ``code`` in a fresh ``python -I`` process
and returns what it printed, truncated, and how it ended. Before the code
runs, a bootstrap (``_BOOTSTRAP``, run in that process) puts it in:

* **New network, mount and PID namespaces** (``unshare(2)`` through
  ``ctypes``; as root, or as any user where unprivileged user namespaces are
  allowed). No network: the namespace has only a down loopback, so even
  ``127.0.0.1`` is unreachable. Private ``/tmp``, ``/var/tmp``, ``/dev/shm``,
  ``/root`` and ``/home`` (empty tmpfs, discarded at exit) and a ``/proc``
  of its own PID namespace (no host process is visible). The code is PID 1
  of its namespace: when it ends, or is killed, every process it started
  dies with it.
* **Limits** (``resource``): CPU seconds, address space, processes, open
  files, file size (so its output too), no core dumps; and a wall-clock
  timeout enforced by the caller, which SIGKILLs the whole process group.
* **An unprivileged user.** Started as root, it drops to ``nobody``
  (uid/gid 65534, no supplementary groups) before running the code: root
  ignores the process-count limit and can read and write anything. As
  nobody it cannot read ``/etc/shadow`` or signal the trainer's processes.
* **A private scratch directory** (its working directory, owned by it,
  deleted afterwards). Everything else it can reach is read-only to it or a
  private tmpfs.

Where the machine refuses the namespaces (a container without
``CAP_SYS_ADMIN`` and without user namespaces), the code still runs with the
limits and, as root, as nobody; ``SandboxResult.isolated`` says which
isolation was in place, and ``launch`` logs the gap once. This is a best
effort documented as such: without namespaces the network is reachable.

A parent that dies takes the sandbox with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

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
    tmpfs_mb: size of each private tmpfs.
  """

  timeout_s: float = 5.0
  cpu_s: int = 3
  memory_mb: int = 512
  max_processes: int = 32
  max_open_files: int = 64
  max_file_mb: int = 4
  max_output_chars: int = 2000
  tmpfs_mb: int = 16

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
    isolated: the isolation in place: ``{"namespaces": bool, "user":
      "nobody" | "same"}``.
    seconds: wall-clock seconds.
  """

  status: str
  stdout: str
  stderr: str
  returncode: int | None
  isolated: dict
  seconds: float


# Runs in the sandbox process before the code; argv[1] is its JSON config.
_BOOTSTRAP = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
def die_with_parent(parent):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(137)
die_with_parent(cfg["parent"])
NEWNS, NEWNET, NEWPID, NEWUSER = 0x20000, 0x40000000, 0x20000000, 0x10000000
root = os.getuid() == 0
flags = NEWNS | NEWNET | NEWPID
ns = libc.unshare(flags) == 0 or (not root and libc.unshare(flags | NEWUSER) == 0)
with open(cfg["report"], "w") as report:
    report.write("1" if ns else "0")
scratch = os.open(cfg["scratch"], os.O_RDONLY | os.O_DIRECTORY)
if ns:
    MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1 << 14, 1 << 18, 2, 4, 8
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    MS_BIND, MS_REMOUNT, MS_RDONLY = 4096, 32, 1
    # The interpreter's own tree stays readable where a hidden directory
    # holds it (e.g. a pyenv under /root): bound back, read-only.
    keep = {}
    for path in {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}:
        keep[path] = os.open(path, os.O_PATH)
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/root", "/home"):
        if os.path.isdir(d):
            mode = "1777" if d in ("/tmp", "/var/tmp", "/dev/shm") else "755"
            opts = ("size=%dm,mode=%s" % (cfg["tmpfs_mb"], mode)).encode()
            libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts)
            for path, fd in keep.items():
                if path.startswith(d + "/"):
                    os.makedirs(path, 0o755, exist_ok=True)
                    source = ("/proc/self/fd/%d" % fd).encode()
                    libc.mount(source, path.encode(), None, MS_BIND | MS_REC, None)
                    libc.mount(None, path.encode(), None,
                               MS_BIND | MS_REMOUNT | MS_RDONLY, None)
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
os.fchdir(scratch)
os.close(scratch)
limits = {resource.RLIMIT_CPU: cfg["cpu_s"],
          resource.RLIMIT_AS: cfg["memory_mb"] << 20,
          resource.RLIMIT_NPROC: cfg["max_processes"],
          resource.RLIMIT_NOFILE: cfg["max_open_files"],
          resource.RLIMIT_FSIZE: cfg["max_file_mb"] << 20,
          resource.RLIMIT_CORE: 0}
for which, value in limits.items():
    resource.setrlimit(which, (value, value))
if root:
    os.fchown(os.open(".", os.O_RDONLY | os.O_DIRECTORY), cfg["uid"], cfg["uid"])
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
os.environ.clear()
os.environ.update({"PATH": "/usr/bin:/bin", "HOME": os.getcwd(),
                   "TMPDIR": os.getcwd(), "LANG": "C.UTF-8"})
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    source = f.read()
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


def namespaces_available() -> tuple[bool, str]:
  """Whether the sandbox gets its namespaces here, and why not."""
  result = run_python("print('ok')", SandboxLimits(timeout_s=10))
  if result.status != "ok":
    return False, f"the sandbox does not start: {result.stderr[-300:]}"
  if not result.isolated.get("namespaces"):
    return False, ("unshare(2) of network, mount and PID namespaces is "
                   "refused on this machine (no CAP_SYS_ADMIN, no user "
                   "namespaces)")
  return True, ""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()
               ) -> SandboxResult:
  """Runs ``code`` in the sandbox (see the module docstring)."""
  t0 = time.monotonic()
  work = tempfile.mkdtemp(prefix="rljax-sandbox-")
  scratch = os.path.join(work, "scratch")
  os.mkdir(scratch, 0o700)
  with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
    f.write(code)
  root = os.getuid() == 0
  cfg = {"scratch": scratch, "parent": os.getpid(), "uid": NOBODY,
         "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
         "max_processes": limits.max_processes,
         "max_open_files": limits.max_open_files,
         "max_file_mb": limits.max_file_mb, "tmpfs_mb": limits.tmpfs_mb,
         "tag": f"rljax-sandbox-{uuid.uuid4().hex}",
         "report": os.path.join(work, "namespaces")}
  if root:  # nobody must be able to enter the work dir to reach scratch
    os.chmod(work, 0o711)
  out_path, err_path = (os.path.join(work, n) for n in ("stdout", "stderr"))
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
    namespaces = _tail(cfg["report"], 1) == "1"
    shutil.rmtree(work, ignore_errors=True)
  isolated = {"namespaces": namespaces, "user": "nobody" if root else "same"}
  if returncode == 125:
    status, stderr = "error", "the sandbox could not drop root privileges"
  return SandboxResult(status, stdout, stderr, returncode, isolated,
                       time.monotonic() - t0)


__all__ = ["SandboxLimits", "SandboxResult", "namespaces_available",
           "run_python"]
