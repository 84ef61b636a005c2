"""The Python tool's sandbox against adversarial programs.

Each program must end contained: a clear status, the host unchanged, no
process left behind, and (through ``PythonToolEnv`` on an ``EnvRunner``
worker) an error observation while the episode goes on. Where the machine
does not allow a limit (no namespaces, not root), the test that needs it
skips with the reason.
"""

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from rljax import envs
from rljax.envs import sandbox

LIMITS = sandbox.SandboxLimits(timeout_s=3.0, cpu_s=2, memory_mb=512,
                               max_processes=32)


@pytest.fixture(scope="module")
def namespaces():
  ok, why = sandbox.namespaces_available()
  return ok, why


def _needs_namespaces(namespaces):
  ok, why = namespaces
  if not ok:
    pytest.skip(f"no network/mount/PID namespaces here: {why}")


def _needs_root():
  if os.getuid() != 0:
    pytest.skip("not root: the sandbox cannot drop to another user, so the "
                "host's files readable by this user stay readable")


def _parent(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rpartition(")")[2].split()[1])
  except (OSError, IndexError, ValueError):
    return 0


def _another_workers(pid: int) -> bool:
  """Whether ``pid`` descends from this process's parent through another
  child of it (a test running beside this one under pytest-xdist), not
  through this process."""
  me, parent = os.getpid(), os.getppid()
  while pid > 1:
    up = _parent(pid)
    if pid == me or up == me:
      return False
    if up == parent:
      return True
    pid = up
  return False  # orphaned: left behind, whoever started it


def _sandbox_processes() -> list[str]:
  """Command lines of live processes started by the sandbox's bootstrap
  (those of a test running beside this one in another worker aside)."""
  out = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().decode("utf-8", "replace")
    except OSError:
      continue
    if "rljax-sandbox-" in cmd and not _another_workers(int(pid)):
      out.append(f"{pid}: {cmd[:80]}")
  return out


def _run(code, limits=LIMITS):
  result = sandbox.run_python(code, limits)
  time.sleep(0.2)
  assert not _sandbox_processes(), "a sandbox process was left behind"
  return result


def test_a_plain_program_runs_and_prints():
  result = _run("print(6 * 7)")
  assert (result.status, result.stdout) == ("ok", "42\n")


def test_an_infinite_loop_is_stopped():
  result = _run("while True:\n  pass")
  assert result.status in ("timeout", "killed")
  assert result.seconds < LIMITS.timeout_s + 2


@pytest.mark.slow
def test_a_sleeping_program_is_stopped_at_the_wall_clock():
  result = _run("import time\ntime.sleep(60)")
  assert result.status == "timeout"


def test_a_fork_storm_is_bounded(namespaces):
  _needs_root()
  code = ("import os, time\n"
          "n = 0\n"
          "for i in range(5000):  # bounded here, whatever the sandbox\n"
          "  try:\n"
          "    pid = os.fork()\n"
          "  except OSError:\n"
          "    break\n"
          "  if pid == 0:\n"
          "    time.sleep(30)\n"
          "    os._exit(0)\n"
          "  n += 1\n"
          "print(n)\n")
  result = _run(code)
  assert result.status == "ok"
  assert int(result.stdout) < LIMITS.max_processes


def test_a_20_gb_allocation_fails_inside():
  result = _run("x = bytearray(20 * 1024 ** 3)")
  assert result.status == "error" and "MemoryError" in result.stderr


def test_the_shadow_file_is_unreadable():
  _needs_root()
  result = _run("print(open('/etc/shadow').read())")
  assert result.status == "error" and "PermissionError" in result.stderr
  assert "root:" not in result.stdout


def test_the_root_home_is_hidden(namespaces):
  _needs_root()
  _needs_namespaces(namespaces)
  marker = f"rljax-marker-{uuid.uuid4().hex}"
  path = os.path.join(os.path.expanduser("~root"), marker)
  open(path, "w").close()
  try:
    result = _run("import os\nprint(os.listdir('/root'))")
  finally:
    os.remove(path)
  assert marker not in result.stdout
  assert result.status in ("ok", "error")


def test_writes_outside_the_scratch_directory_do_not_land(namespaces,
                                                          tmp_path):
  _needs_root()
  _needs_namespaces(namespaces)
  targets = [f"/tmp/rljax-escape-{uuid.uuid4().hex}",
             str(tmp_path / "escape"), f"/var/tmp/rljax-escape-"
             f"{uuid.uuid4().hex}"]
  code = "\n".join(
      f"try:\n  open({t!r}, 'w').write('x')\nexcept OSError as e:\n"
      f"  print('refused', e)" for t in targets)
  code += "\nopen('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())"
  result = _run(code)
  assert result.status == "ok" and result.stdout.endswith("ok\n")
  for target in targets:
    assert not os.path.exists(target), target


def test_no_socket_reaches_the_host(namespaces):
  _needs_namespaces(namespaces)
  import socket  # pylint: disable=g-import-not-at-top
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  try:
    result = _run("import socket\ns = socket.socket()\ns.settimeout(2)\n"
                  f"s.connect(('127.0.0.1', {port}))\nprint('connected')")
  finally:
    server.close()
  assert "connected" not in result.stdout
  assert result.status == "error"


def test_killing_the_parent_is_contained():
  parent = os.getpid()
  result = _run(f"import os, signal\nos.kill({parent}, signal.SIGKILL)\n"
                "os.kill(os.getppid(), signal.SIGKILL)")
  assert os.getpid() == parent  # still here
  assert result.status in ("error", "killed", "ok")


def test_output_is_truncated():
  result = _run("print('x' * 100000)",
                sandbox.SandboxLimits(max_output_chars=50))
  assert len(result.stdout) <= 50 + len("...[truncated]")


def test_a_killed_caller_takes_its_sandbox_with_it():
  code = ("from rljax.envs import sandbox\n"
          "sandbox.run_python('import time\\ntime.sleep(60)', "
          "sandbox.SandboxLimits(timeout_s=60))\n")
  proc = subprocess.Popen([sys.executable, "-c", code])
  deadline = time.monotonic() + 30
  while not _sandbox_processes() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert _sandbox_processes(), "the sandbox did not start"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  deadline = time.monotonic() + 10
  while _sandbox_processes() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _sandbox_processes()


def test_the_python_tool_turns_failures_into_observations():
  env = envs.PythonToolEnv(timeout_s=2.0, cpu_s=1)
  runner = envs.EnvRunner(env, num_workers=1, timeout_s=10.0)
  try:
    programs = ["print(2 + 3)", "while True: pass",
                "x = bytearray(20 * 1024 ** 3)", "raise SystemExit(7)"]
    out = runner.step([{"answer": "5", "calls": 0}] * len(programs),
                      [f"<python>{p}</python>" for p in programs])
  finally:
    runner.close()
  assert [o.status for o in out] == ["ok"] * 4
  obs = [o.value["observation"] for o in out]
  assert obs[0] == "<output>5\n</output>"
  assert "error" in obs[1] and "error: MemoryError" in obs[2]
  assert "error" in obs[3]
  assert [o.value["info"]["tool_errors"] for o in out] == [0, 1, 1, 1]
  assert not _sandbox_processes()


def test_bad_limits_are_refused():
  with pytest.raises(ValueError, match="memory_mb"):
    sandbox.SandboxLimits(memory_mb=0)
  with pytest.raises(ValueError, match="timeout_s"):
    sandbox.SandboxLimits(timeout_s=0)


# Issue 45: what a sandbox or an environment worker starts or writes stays
# inside it. Each case also runs without namespaces, where `isolated` must
# say what is shared with the host.


def _world_writable_dirs(depth=3):
  """Host directories anyone may write, to ``depth`` below ``/`` (without
  ``/proc`` and ``/sys``)."""
  found, frontier = [], ["/"]
  for _ in range(depth):
    nxt = []
    for top in frontier:
      try:
        entries = list(os.scandir(top))
      except OSError:
        continue
      for entry in entries:
        if entry.path in ("/proc", "/sys") or not entry.is_dir(
            follow_symlinks=False):
          continue
        nxt.append(entry.path)
        if entry.stat(follow_symlinks=False).st_mode & 0o002:
          found.append(entry.path)
    frontier = nxt
  return found


def test_no_world_writable_host_directory_keeps_a_file(namespaces):
  _needs_namespaces(namespaces)
  # One outside every private place the sandbox mounts, so that its
  # read-only remount is what must stop the write.
  own = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__)))
  os.chmod(own, 0o1777)
  try:
    targets = sorted(set(_world_writable_dirs()) | {own})
    name = f"rljax-escape-{uuid.uuid4().hex}"
    code = "\n".join(
        f"try:\n  open({os.path.join(t, name)!r}, 'w').write('x')\n"
        f"  print('wrote', {t!r})\nexcept OSError as e:\n  print('refused', "
        f"{t!r})" for t in targets)
    result = _run(code)
    assert result.status == "ok", result.stderr
    assert f"refused {own}" in result.stdout
    left = [t for t in targets if os.path.exists(os.path.join(t, name))]
  finally:
    shutil.rmtree(own)
  assert len(targets) >= 2 and not left
  assert result.isolated["filesystem"] == "read-only"


def test_without_namespaces_the_host_directories_are_reported_shared():
  own = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__)))
  os.chmod(own, 0o1777)
  try:
    result = sandbox.run_python(
        f"open({own!r} + '/x', 'w').write('x')", LIMITS, namespaces=False)
    landed = os.path.exists(os.path.join(own, "x"))
  finally:
    shutil.rmtree(own)
  assert result.status == "ok" and landed
  assert result.isolated == {
      "namespaces": False, "user": "nobody" if os.getuid() == 0 else "same",
      "network": "host", "filesystem": "host",
      "ipc": "host, cleaned at the end", "processes": "process-group"}


_BOMB = """
import os
written = 0
try:
    for i in range({files}):
        place = ("/tmp", "/dev/shm", "/var/tmp", ".")[i % 4]
        with open(os.path.join(place, "bomb%d" % i), "wb") as f:
            f.write(b"x" * (2 << 20))
        written += 2
    print("wrote", written)
except OSError as e:
    print("stopped", written, e.errno)
"""


@pytest.mark.parametrize("files,expect", [(3, "wrote 6"), (6, "stopped")])
def test_the_bytes_written_in_all_are_bounded(namespaces, files, expect):
  # 2 MiB files under a 4 MiB file limit: only the total can stop them.
  _needs_namespaces(namespaces)
  limits = sandbox.SandboxLimits(timeout_s=5, tmpfs_mb=8, max_file_mb=4)
  free = shutil.disk_usage(tempfile.gettempdir()).free
  result = _run(_BOMB.format(files=files), limits)
  assert result.status == "ok", result.stderr
  assert result.stdout.startswith(expect), result.stdout
  if expect == "stopped":  # ENOSPC, at 8 MiB: the third 2 MiB write at most
    _, written, errno_ = result.stdout.split()
    assert int(written) in (6, 4) and int(errno_) == 28
  assert free - shutil.disk_usage(tempfile.gettempdir()).free < 4 << 20


_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ident = libc.shmget({key}, {size}, 0o1000 | 0o600)
print(ident, libc.shmget({key}, 0, 0))
"""


def _host_segments(key):
  with open("/proc/sysvipc/shm", encoding="ascii") as f:
    return [line for line in f.read().splitlines()[1:]
            if int(line.split()[0]) == key]


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_a_sysv_segment_ends_with_its_run(namespaces, use_namespaces):
  if use_namespaces:
    _needs_namespaces(namespaces)
  # A key of this test's own: a segment another run left cannot match.
  key, size = 0x5EED0000 + uuid.uuid4().int % 0xFFFF, 1234567
  first = _run(_SHM.format(key=key, size=size), LIMITS) if use_namespaces \
      else sandbox.run_python(_SHM.format(key=key, size=size), LIMITS,
                              namespaces=False)
  assert first.status == "ok" and int(first.stdout.split()[0]) >= 0
  assert not _host_segments(key)
  # The next run cannot find it by its key: nothing carries over.
  second = sandbox.run_python(
      "import ctypes\nprint(ctypes.CDLL(None).shmget(%d, 0, 0))" % key,
      LIMITS, namespaces=use_namespaces)
  assert second.stdout.strip() == "-1"
  assert first.isolated["ipc"] == ("private" if use_namespaces
                                   else "host, cleaned at the end")


def test_a_host_socket_file_is_unreachable(namespaces):
  _needs_namespaces(namespaces)
  import socket  # pylint: disable=g-import-not-at-top
  own = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(__file__)))
  os.chmod(own, 0o755)
  path = os.path.join(own, "service.sock")
  server = socket.socket(socket.AF_UNIX)
  server.bind(path)
  server.listen(1)
  os.chmod(path, 0o777)  # anyone on the host may connect
  try:
    result = _run("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                  "try:\n  s.connect(%r)\n  print('connected')\n"
                  "except OSError as e:\n  print('refused', e.errno)" % path)
  finally:
    server.close()
    shutil.rmtree(own)
  assert result.status == "ok", result.stderr
  assert result.stdout.startswith("refused")


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_home_and_tmpdir_exist_inside(namespaces, use_namespaces):
  if use_namespaces:
    _needs_namespaces(namespaces)
  code = ("import os\nhome, tmp = os.environ['HOME'], os.environ['TMPDIR']\n"
          "open(os.path.join(home, 'h'), 'w').write('1')\n"
          "open(os.path.join(tmp, 't'), 'w').write('2')\n"
          "print(os.path.isdir(home), os.path.isdir(tmp), "
          "os.getcwd() == home, open('h').read())")
  result = sandbox.run_python(code, LIMITS, namespaces=use_namespaces)
  assert (result.status, result.stdout) == ("ok", "True True True 1\n"), (
      result.stderr)


def _processes_with(marker):
  out = []
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
              out.append(int(pid))
    except (OSError, ValueError):
      continue
  return out


def _appears(marker, seconds=5.0):
  deadline = time.monotonic() + seconds
  while not _processes_with(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
  return bool(_processes_with(marker))


def _gone(marker, seconds=5.0):
  deadline = time.monotonic() + seconds
  while _processes_with(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
  return not _processes_with(marker)


def test_an_environment_daemon_ends_with_close_and_with_a_restart():
  from tests import env_fixtures  # pylint: disable=g-import-not-at-top
  runner = envs.EnvRunner(env_fixtures.StartsDaemon(), num_workers=1,
                          timeout_s=3.0)
  first, hung, last = (f"{what}-{uuid.uuid4().hex}"
                       for what in ("daemon", "hang", "daemon"))
  try:
    out = runner.step([{}], [first])[0]
    assert out.status == "ok", out
    assert runner.isolated == {"processes": "pid-namespace"}
    assert _appears(first), "the daemon did not start"
    out = runner.step([{}], [hung])  # killed at the timeout, replaced
    assert out[0].status == "timeout" and runner.restarts == 1
    assert _gone(hung) and _gone(first)  # both of the replaced worker
    assert runner.step([{}], [last])[0].status == "ok"
    assert _appears(last), "the new worker's daemon did not start"
  finally:
    runner.close()
  assert _gone(last)


def test_without_a_pid_namespace_a_setsid_daemon_escapes_and_says_so():
  from rljax.rewards import pool as _pool  # pylint: disable=g-import-not-at-top
  from tests import env_fixtures  # pylint: disable=g-import-not-at-top
  runner = envs.EnvRunner(env_fixtures.StartsDaemon(), num_workers=1,
                          timeout_s=3.0)
  runner._pool.close()  # pylint: disable=protected-access
  runner._pool = _pool.KillingPool(  # pylint: disable=protected-access
      [functools.partial(envs.base._call_reset, runner.env),  # pylint: disable=protected-access
       functools.partial(envs.base._call_step, runner.env)],  # pylint: disable=protected-access
      encode=envs.base._identity, num_workers=1, timeout_s=3.0,  # pylint: disable=protected-access
      pid_namespace=False)
  marker = f"daemon-{uuid.uuid4().hex}"
  try:
    out = runner.step([{}], [marker])[0]
    assert out.status == "ok", out
    assert runner.isolated == {"processes": "process-group"}
  finally:
    runner.close()
  try:
    time.sleep(0.5)
    assert _appears(marker)  # still there, after close()
  finally:
    for pid in _processes_with(marker):
      os.kill(pid, signal.SIGKILL)
