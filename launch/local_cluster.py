r"""Runs a multi-process JAX job on this machine, for development and tests.

  python -m launch.local_cluster --num_processes=2 --devices_per_process=4 -- \
      --config=configs/arithmetic_grpo.py --workdir=/tmp/x

Starts ``--num_processes`` copies of ``python -m <--module>`` (default
``launch.train``) with the arguments after ``--``, plus ``--distributed``,
``--coordinator_address=127.0.0.1:<port>``, ``--num_processes`` and
``--process_id``, each simulating ``--devices_per_process`` CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=D``). Every line a process
prints comes out here prefixed ``[p<i>] ``, except the chatter of the libraries
below rljax (Gloo's connection lines, XLA's C++ info and warning lines), which
goes only to each process's whole log, ``<--log_dir>/process_<i>.log`` (a
temporary directory, named at start, without ``--log_dir``). When one process fails the others
get SIGTERM (they save and exit), then SIGKILL after ``--grace_s``; Ctrl-C or a
SIGTERM to this launcher is passed on the same way (a second one SIGKILLs).
The exit code is the failed process's (a signal ``s`` as ``128 + s``, like a
shell), else the worst of all.

This is for development and tests only. On a real cluster (a TPU pod, SLURM)
the cluster starts one process per host and ``jax.distributed.initialize()``
detects the coordinator, process count and process id by itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO, TextIO

from absl import app, flags

from launch import cli

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "processes to start")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4,
                                "simulated CPU devices in each process")
_MODULE = flags.DEFINE_string("module", "launch.train",
                              "the module each process runs (python -m)")
_PORT = flags.DEFINE_integer("port", 0,
                             "the coordinator's port on 127.0.0.1 (0: a free one)")
_GRACE_S = flags.DEFINE_float(
    "grace_s", 10.0, "seconds between SIGTERM and SIGKILL when stopping")
_PLATFORM = flags.DEFINE_string(
    "platform", "cpu", "JAX_PLATFORMS for the processes ('': keep the inherited "
    "value, if any)")
# --log_dir is absl.logging's flag (it only names a directory unless a program
# asks absl to log to files; none here does): each process's whole output is
# written to <log_dir>/process_<i>.log (a temporary directory without it).

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# Set by the launcher for each process; a second copy in the forwarded
# arguments would silently win or lose depending on the child's flag parser.
_RESERVED = ("process_id", "num_processes", "coordinator_address", "distributed")
_POLL_S = 0.2
_LOG_PREFIX = "local_cluster:"


# Gloo's connection lines, and the C++ info and warning lines of XLA and
# the libraries below it (glog's "I1205 09:15:06.502495  19960 file.cc:656] "
# prefix); errors ("E", "F") are shown.
_CHATTER = re.compile(r"\[Gloo\] |[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
                      r"[\w.\-]+:\d+\] ")


def is_chatter(line: str) -> bool:
  """Whether a process's output ``line`` is library chatter, which goes to
  its log only: Gloo's connection lines and glog-style info and warning
  lines (XLA's)."""
  # Gloo's threads write concurrently, so a line may start mid-message.
  return (_CHATTER.match(line) is not None
          or "peer ranks. Expected number of connected peer ranks" in line)


def child_env(devices_per_process: int, *, platform: str = "cpu",
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of each process.

  Args:
    devices_per_process: CPU devices XLA simulates in the process.
    platform: ``JAX_PLATFORMS``; ``""`` keeps the inherited value, if any.
    environ: the environment to start from (default ``os.environ``).

  Returns:
    A copy of ``environ`` whose ``XLA_FLAGS`` holds
    ``--xla_force_host_platform_device_count=<devices_per_process>`` in place
    of any earlier one (every other XLA flag kept), with ``JAX_PLATFORMS`` and
    ``PYTHONUNBUFFERED=1`` set.
  """
  env = dict(os.environ if environ is None else environ)
  kept = [f for f in env.get("XLA_FLAGS", "").split()
          if f != _DEVICE_FLAG and not f.startswith(_DEVICE_FLAG + "=")]
  env["XLA_FLAGS"] = " ".join(kept + [f"{_DEVICE_FLAG}={devices_per_process}"])
  if platform:
    env["JAX_PLATFORMS"] = platform
  env["PYTHONUNBUFFERED"] = "1"
  return env


def child_command(args: Sequence[str], *, process_id: int, num_processes: int,
                  port: int, module: str = "launch.train") -> list[str]:
  """The command line of process ``process_id``.

  Args:
    args: the arguments forwarded to every process.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    num_processes: how many processes the job has.
    port: the coordinator's port on 127.0.0.1.
    module: the module to run with ``python -m``.
  """
  return [sys.executable, "-u", "-m", module, *args, "--distributed",
          f"--coordinator_address=127.0.0.1:{port}",
          f"--num_processes={num_processes}", f"--process_id={process_id}"]


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def exit_code(returncode: int) -> int:
  """A process's return code as a shell reports it: signal ``s`` is 128 + s."""
  return 128 - returncode if returncode < 0 else returncode


def _check(args: Sequence[str], num_processes: int, devices_per_process: int,
           port: int, grace_s: float) -> None:
  """Raises ValueError naming the first setting that cannot work."""
  for name, value in (("num_processes", num_processes),
                      ("devices_per_process", devices_per_process)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r}: give an integer >= 1.")
  if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
    raise ValueError(f"port={port!r}: give 0 (a free port) or 1..65535.")
  if not grace_s >= 0:
    raise ValueError(f"grace_s={grace_s!r}: give seconds >= 0.")
  for arg in args:
    if arg == "--":
      break  # what follows is the child's positional arguments
    # absl also reads -flag, and --noflag for a boolean.
    name = arg.split("=", 1)[0].lstrip("-") if arg.startswith("-") else ""
    name = "distributed" if name == "nodistributed" else name
    if name in _RESERVED:
      raise ValueError(
          f"forwarded argument {arg!r}: the launcher sets --{name} itself (it "
          f"sets --process_id, --num_processes, --coordinator_address and "
          f"--distributed for each process); remove it from the arguments after "
          f"'--'.")


def _pump(index: int, stream: BinaryIO, out: TextIO, lock: threading.Lock,
          log: BinaryIO, chatter: list[int]) -> None:
  """Copies process ``index``'s output to its ``log``, and to ``out`` line by
  line, prefixed, unless it is chatter (``is_chatter``; counted in
  ``chatter[index]``)."""
  try:
    for line in iter(stream.readline, b""):
      log.write(line)
      log.flush()
      text = line.decode("utf-8", "replace").rstrip("\r\n")
      if is_chatter(text):
        chatter[index] += 1
        continue
      with lock:
        out.write(f"[p{index}] {text}\n")
        out.flush()
  finally:
    stream.close()
    log.close()


class _Signals:
  """Counts SIGINT/SIGTERM sent to the launcher; wakes the supervising loop."""

  def __init__(self):
    self.count = 0
    self.name = ""
    self.wake = threading.Event()
    self._previous = {}
    if threading.current_thread() is not threading.main_thread():
      return  # signal handlers can only be set from the main thread
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.count += 1
    self.name = signal.Signals(signum).name
    self.wake.set()

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


def _stop(procs: Sequence[subprocess.Popen], indices: Sequence[int],
          sig: signal.Signals) -> None:
  for i in indices:
    try:
      if sig == signal.SIGKILL:
        # The process leads its own group: its helper processes go with it.
        os.killpg(procs[i].pid, sig)
      else:
        procs[i].send_signal(sig)
    except ProcessLookupError:
      pass  # it has just ended


def _supervise(procs: Sequence[subprocess.Popen], grace_s: float,
               signals: _Signals, err: TextIO) -> int:
  """Waits for every process, stopping the rest when one fails; the exit code."""
  failed = None
  kill_at = None  # when the processes sent SIGTERM get SIGKILL
  handled = 0  # signals to the launcher acted on
  while True:
    codes = [p.poll() for p in procs]
    running = [i for i, c in enumerate(codes) if c is None]
    if failed is None and kill_at is None:
      failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
      if failed is not None:
        rc = codes[failed]
        name = f" ({signal.Signals(-rc).name})" if rc < 0 else ""
        stopping = (f"; stopping the other {len(running)} process(es)"
                    if running else "")
        print(f"{_LOG_PREFIX} process {failed} exited with code {rc}{name}"
              f"{stopping}.", file=err, flush=True)
      elif signals.count and running:
        print(f"{_LOG_PREFIX} got {signals.name}; sending SIGTERM to "
              f"{len(running)} process(es).", file=err, flush=True)
      if running and (failed is not None or signals.count):
        _stop(procs, running, signal.SIGTERM)
        kill_at = time.monotonic() + grace_s
        handled = signals.count
    if not running:
      break
    if kill_at is not None and (signals.count > handled
                                or time.monotonic() >= kill_at):
      why = (f"got {signals.name} again" if signals.count > handled
             else f"still running {grace_s:g}s after SIGTERM")
      print(f"{_LOG_PREFIX} {why}; sending SIGKILL to process(es) "
            f"{', '.join(map(str, running))}.", file=err, flush=True)
      _stop(procs, running, signal.SIGKILL)
      kill_at, handled = float("inf"), signals.count
    signals.wake.wait(_POLL_S)
    signals.wake.clear()
  codes = [exit_code(p.returncode) for p in procs]
  return codes[failed] if failed is not None else max(codes)


def run(args: Sequence[str], *, num_processes: int, devices_per_process: int,
        module: str = "launch.train", port: int = 0, grace_s: float = 10.0,
        log_dir: str = "", platform: str = "cpu",
        out: TextIO | None = None) -> int:
  """Runs ``num_processes`` processes of ``module`` as one distributed job.

  Each process runs in the current directory with ``child_env`` and
  ``child_command``; its output (stdout and stderr together) is written to
  ``<log_dir>/process_<i>.log`` and copied to ``out`` line by line as
  ``[p<i>] <line>``, except library chatter (``is_chatter``: Gloo's and
  XLA's info and warning lines), which stays in the log. The launcher's own
  messages go to stderr. SIGINT/SIGTERM sent to the launcher while this runs (in the main
  thread) are passed on as SIGTERM; a second one SIGKILLs.

  Args:
    args: the arguments forwarded to every process; they may not hold
      ``--process_id``, ``--num_processes``, ``--coordinator_address`` or
      ``--distributed`` (set here).
    num_processes: how many processes to start, >= 1.
    devices_per_process: simulated CPU devices in each process, >= 1.
    module: the module each process runs with ``python -m``.
    port: the coordinator's port on 127.0.0.1; 0 picks a free one.
    grace_s: seconds between SIGTERM and SIGKILL when stopping processes.
    log_dir: where each process's whole output goes
      (``process_<i>.log``); "": a new temporary directory, named on stderr.
    platform: ``JAX_PLATFORMS`` for the processes; ``""`` keeps the inherited
      value, if any.
    out: where the prefixed output goes (default ``sys.stdout``).

  Returns:
    0 when every process exits 0; else the code of the first process that
    failed, or after a signal the worst code; a process ended by signal ``s``
    counts as ``128 + s``.

  Raises:
    ValueError: for a setting out of range or a forwarded argument the
      launcher sets itself; nothing has been started then.
  """
  args = list(args)
  _check(args, num_processes, devices_per_process, port, grace_s)
  out = sys.stdout if out is None else out
  env = child_env(devices_per_process, platform=platform)
  port = port or free_port()
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  else:
    log_dir = tempfile.mkdtemp(prefix="rljax-local-cluster-")
  print(f"{_LOG_PREFIX} each process's whole output (Gloo's and XLA's "
        f"messages too) goes to {os.path.join(log_dir, 'process_<i>.log')}.",
        file=sys.stderr, flush=True)
  lock = threading.Lock()
  procs, readers = [], []
  chatter = [0] * num_processes
  signals = _Signals()
  try:
    for i in range(num_processes):
      log = open(os.path.join(log_dir, f"process_{i}.log"), "wb")  # pylint: disable=consider-using-with
      # Its own process group: a Ctrl-C in the terminal reaches only the
      # launcher, so each process gets one SIGTERM (a second would end
      # launch.train at once, without its checkpoint).
      proc = subprocess.Popen(  # pylint: disable=consider-using-with
          child_command(args, process_id=i, num_processes=num_processes,
                        port=port, module=module),
          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, process_group=0)
      procs.append(proc)
      reader = threading.Thread(target=_pump,
                                args=(i, proc.stdout, out, lock, log, chatter),
                                daemon=True, name=f"local_cluster-p{i}")
      reader.start()
      readers.append(reader)
    code = _supervise(procs, grace_s, signals, sys.stderr)
  finally:
    _stop(procs, [i for i, p in enumerate(procs) if p.poll() is None],
          signal.SIGKILL)
    for p in procs:
      p.wait()
    signals.restore()
  for reader in readers:
    # A helper process that outlived its parent may hold the pipe open.
    reader.join(timeout=5.0)
  if sum(chatter):
    print(f"{_LOG_PREFIX} {sum(chatter)} lines of Gloo and XLA messages are "
          f"in {os.path.join(log_dir, 'process_<i>.log')} only.",
          file=sys.stderr, flush=True)
  return code


def main(argv):
  cli.setup_logging()
  try:
    return run(argv[1:], num_processes=_NUM_PROCESSES.value,
               devices_per_process=_DEVICES.value, module=_MODULE.value,
               port=_PORT.value, grace_s=_GRACE_S.value, log_dir=flags.FLAGS.log_dir,
               platform=_PLATFORM.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


if __name__ == "__main__":
  app.run(main)
