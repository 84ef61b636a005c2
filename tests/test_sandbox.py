"""The Python tool's sandbox against adversarial programs.

Each program must end contained: a clear status, the host unchanged, no
process left behind, and (through ``PythonToolEnv`` on an ``EnvRunner``
worker) an error observation while the episode goes on. Where the machine
does not allow a limit (no namespaces, not root), the test that needs it
skips with the reason.
"""

import os
import signal
import subprocess
import sys
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


def _sandbox_processes() -> list[str]:
  """Command lines of live processes started by the sandbox's bootstrap."""
  out = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().decode("utf-8", "replace")
    except OSError:
      continue
    if "rljax-sandbox-" in cmd:
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
