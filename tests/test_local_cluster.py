"""launch.local_cluster: the processes' environment and command line, output
prefixing, and stopping the rest when one fails or the launcher is signalled.

The processes run ``tests.cluster_child`` (no JAX), so each run takes well
under a second unless a test waits for a grace period on purpose.
"""

import io
import os
import signal
import sys
import threading
import time

import pytest

from launch import local_cluster

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CHILD = "tests.cluster_child"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
  """Processes run in the launcher's directory, where ``-m tests...`` resolves."""
  monkeypatch.chdir(ROOT)


def _lines(out: io.StringIO, index: int) -> list[str]:
  prefix = f"[p{index}] "
  return [l[len(prefix):] for l in out.getvalue().splitlines()
          if l.startswith(prefix)]


def _value(lines: list[str], key: str) -> str:
  found = [l[len(key) + 1:] for l in lines if l.startswith(key + "=")]
  assert len(found) == 1, (key, lines)
  return found[0]


def test_child_env_replaces_the_device_count_and_keeps_other_flags():
  environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d "
                          "--xla_force_host_platform_device_count=8 --xla_cpu_x=1",
             "JAX_PLATFORMS": "tpu", "HOME": "/home/u"}
  env = local_cluster.child_env(4, environ=environ)
  assert env["XLA_FLAGS"].split() == [
      "--xla_dump_to=/tmp/d", "--xla_cpu_x=1",
      "--xla_force_host_platform_device_count=4"]
  assert env["JAX_PLATFORMS"] == "cpu"
  assert env["PYTHONUNBUFFERED"] == "1"
  assert env["HOME"] == "/home/u"
  assert environ["XLA_FLAGS"].count("count=8") == 1  # the input is not changed


def test_child_env_without_xla_flags_and_with_the_platform_left_alone():
  env = local_cluster.child_env(2, platform="", environ={"JAX_PLATFORMS": "tpu"})
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
  assert env["JAX_PLATFORMS"] == "tpu"
  assert "JAX_PLATFORMS" not in local_cluster.child_env(2, platform="", environ={})


def test_child_command_appends_the_four_coordination_flags():
  cmd = local_cluster.child_command(["--config=c.py", "--workdir=/w"],
                                    process_id=1, num_processes=3, port=1234,
                                    module="some.module")
  assert cmd == [sys.executable, "-u", "-m", "some.module", "--config=c.py",
                 "--workdir=/w", "--distributed",
                 "--coordinator_address=127.0.0.1:1234", "--num_processes=3",
                 "--process_id=1"]


def test_all_processes_succeed_and_their_output_is_prefixed(tmp_path):
  out = io.StringIO()
  log_dir = tmp_path / "logs"
  code = local_cluster.run(["--extra=1"], num_processes=2, devices_per_process=3,
                           module=CHILD, log_dir=str(log_dir), out=out)
  assert code == 0, out.getvalue()
  assert all(l.startswith(("[p0] ", "[p1] ")) for l in out.getvalue().splitlines())
  addresses = set()
  for i in range(2):
    lines = _lines(out, i)
    assert _value(lines, "process_id").startswith(
        f"{i} num_processes=2 coordinator_address=127.0.0.1:"), lines
    assert "distributed=True rest=['--extra=1']" in _value(lines, "process_id")
    addresses.add(_value(lines, "process_id").split()[2])
    xla_flags = _value(lines, "XLA_FLAGS").split()
    assert xla_flags.count("--xla_force_host_platform_device_count=3") == 1
    assert not any(f.endswith("count=8") for f in xla_flags)  # conftest's, replaced
    assert _value(lines, "JAX_PLATFORMS") == "cpu"
    assert "to stderr" in lines and lines[-1] == "done"
    logged = (log_dir / f"process_{i}.log").read_text().splitlines()
    assert logged == lines
  assert len(addresses) == 1  # one coordinator for both


def test_a_failing_process_stops_the_others_and_its_code_is_returned(
    tmp_path, capsys):
  out = io.StringIO()
  start = time.monotonic()
  code = local_cluster.run(
      ["--fail_process=1", "--fail_code=3", "--sleep_s=15",
       f"--ready_dir={tmp_path}"], num_processes=2, devices_per_process=1,
      module=CHILD, out=out)
  elapsed = time.monotonic() - start
  assert code == 3, out.getvalue()
  assert elapsed < 10, elapsed
  err = capsys.readouterr().err
  assert ("local_cluster: process 1 exited with code 3; stopping the other 1 "
          "process(es).") in err
  assert "SIGKILL" not in err
  assert "got SIGTERM" in _lines(out, 0) and "done" not in _lines(out, 0)
  assert "failing with code 3" in _lines(out, 1)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(
    tmp_path, capsys):
  out = io.StringIO()
  start = time.monotonic()
  code = local_cluster.run(
      ["--fail_process=1", "--fail_code=3", "--sleep_s=15", "--ignore_sigterm",
       f"--ready_dir={tmp_path}"], num_processes=2, devices_per_process=1,
      module=CHILD, grace_s=1.0, out=out)
  elapsed = time.monotonic() - start
  assert code == 3, out.getvalue()
  assert 1.0 <= elapsed < 10, elapsed
  err = capsys.readouterr().err
  assert ("still running 1s after SIGTERM; sending SIGKILL to process(es) 0."
          in err), err
  lines = _lines(out, 0)
  assert "got SIGTERM" not in lines and "done" not in lines
  with pytest.raises(ProcessLookupError):
    os.kill(int(_value(lines, "pid")), 0)


def test_sigterm_to_the_launcher_is_passed_on_and_the_processes_exit_cleanly(
    tmp_path, capsys):
  """Sent once every process has set its handler; each saves (here: prints) and
  exits 0, so the launcher returns 0 long before their sleep ends."""
  done = threading.Event()

  def signal_when_ready():
    deadline = time.monotonic() + 20
    while not done.is_set() and time.monotonic() < deadline:
      if len(os.listdir(tmp_path)) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
        return
      time.sleep(0.02)

  # Catches the signal should run() not take it (and puts it back after).
  received = []
  ours = lambda signum, frame: received.append(signum)
  previous = signal.signal(signal.SIGTERM, ours)
  sender = threading.Thread(target=signal_when_ready, daemon=True)
  sender.start()
  out = io.StringIO()
  start = time.monotonic()
  try:
    code = local_cluster.run(["--sleep_s=15", f"--ready_dir={tmp_path}"],
                             num_processes=2, devices_per_process=1,
                             module=CHILD, out=out)
  finally:
    done.set()
    sender.join()
    restored = signal.signal(signal.SIGTERM, previous)
  assert restored is ours and not received
  assert code == 0, out.getvalue()
  assert time.monotonic() - start < 10
  assert "got SIGTERM; sending SIGTERM to 2 process(es)." in capsys.readouterr().err
  for i in range(2):
    assert "got SIGTERM" in _lines(out, i) and "done" not in _lines(out, i)


@pytest.mark.parametrize("arg", ["--process_id=5", "--num_processes=4",
                                 "--coordinator_address=h:1", "--distributed",
                                 "--nodistributed", "-process_id=5"])
def test_a_forwarded_coordination_flag_is_refused(arg):
  name = arg.split("=")[0].lstrip("-").replace("nodistributed", "distributed")
  with pytest.raises(ValueError, match=f"--{name} itself"):
    local_cluster.run(["--sleep_s=15", arg], num_processes=2,
                      devices_per_process=1, module=CHILD)


@pytest.mark.parametrize("field,kwargs", [
    ("num_processes", {"num_processes": 0, "devices_per_process": 1}),
    ("devices_per_process", {"num_processes": 1, "devices_per_process": 0}),
])
def test_a_count_below_one_is_refused(field, kwargs):
  with pytest.raises(ValueError, match=f"{field}=0: give an integer >= 1"):
    local_cluster.run([], module=CHILD, **kwargs)


def test_library_chatter_goes_to_the_logs_only(tmp_path, capsys):
  """Gloo's connection lines and XLA's info and warning lines stay in each
  process's log; the processes' own lines and an XLA error are shown; the
  launcher names the log directory and counts the lines it kept back."""
  from tests import cluster_child  # pylint: disable=import-outside-toplevel
  out = io.StringIO()
  log_dir = tmp_path / "logs"
  code = local_cluster.run(["--chatter"], num_processes=2,
                           devices_per_process=1, module=CHILD,
                           log_dir=str(log_dir), out=out)
  assert code == 0, out.getvalue()
  for i in range(2):
    lines = _lines(out, i)
    assert not set(cluster_child.CHATTER) & set(lines), lines
    assert cluster_child.ERROR in lines and lines[-1] == "done"
    logged = (log_dir / f"process_{i}.log").read_text().splitlines()
    assert [l for l in logged if l not in cluster_child.CHATTER] == lines
    assert all(l in logged for l in cluster_child.CHATTER)
  err = capsys.readouterr().err
  assert str(log_dir) in err and "10 lines of Gloo and XLA messages" in err
  assert not any(local_cluster.is_chatter(l) for l in (
      "09:16:14 process 1 of 2: 4 local of 8 devices",
      cluster_child.ERROR, "[Gloo]no space", "W1205 a warning of rljax"))
