"""Misbehaving reward functions for the training-loop tests (module-level so
that spawned reward workers can import them)."""

import time


def raises(prompts, completions, **fields):
  raise RuntimeError("this reward function always fails")


def hangs(prompts, completions, **fields):
  time.sleep(60)
  return [1.0] * len(completions)


def returns_none(prompts, completions, **fields):
  return [None] * len(completions)


def parity(prompts, completions, **fields):
  """1 for completions of odd length: a reward with variance in every group."""
  return [float(len(c) % 2) for c in completions]


def none_on_first_row(prompts, completions, **fields):
  """None for the first sample of the batch (used with `raises` to make one
  row whose every reward failed)."""
  return [None] + [1.0] * (len(completions) - 1)


# ------------------------------------------------------------- isolation
# Reward functions that misbehave the ways user code does; used by
# tests/test_reward_isolation.py. Processes they start carry the caller's
# `marker` in their argv, so that a test can find any left behind.

import math  # pylint: disable=wrong-import-position
import os  # pylint: disable=wrong-import-position
import subprocess  # pylint: disable=wrong-import-position
import sys  # pylint: disable=wrong-import-position

HUGE = {"1e30": 1e30, "1e300": 1e300, "-1e300": -1e300, "inf": math.inf,
        "-inf": -math.inf, "10**400": 10**400}


def huge_values(prompts, completions, **fields):
  """The value its completion names (see HUGE), else the completion's float."""
  return [HUGE[c] if c in HUGE else float(c) for c in completions]


def jax_imported(prompts, completions, **fields):
  """1.0 per completion where the process has imported JAX, else 0.0."""
  return [float("jax" in sys.modules)] * len(completions)


class FloatRaises:
  def __float__(self):
    raise RuntimeError("__float__ exploded")


def float_raises(prompts, completions, **fields):
  """A value whose float() raises where the completion starts with "-"; else
  1.0."""
  return [FloatRaises() if c.startswith("-") else 1.0 for c in completions]


class SleepsOnUnpickle:
  """0.25 as a float; unpickling it sleeps for a minute."""

  def __float__(self):
    return 0.25

  def __reduce__(self):
    return (time.sleep, (60,))


class ExitsOnUnpickle:
  """Not a number; unpickling it ends the process with exit code 7."""

  def __reduce__(self):
    return (os._exit, (7,))  # pylint: disable=protected-access


def returns_sleeper(prompts, completions, **fields):
  return [SleepsOnUnpickle() for _ in completions]


def returns_exiter(prompts, completions, **fields):
  return [ExitsOnUnpickle() for _ in completions]


def exits(prompts, completions, **fields):
  sys.exit(3)


def raises_generator_exit(prompts, completions, **fields):
  raise GeneratorExit


def raises_keyboard_interrupt(prompts, completions, **fields):
  raise KeyboardInterrupt


def _start_sleeper(marker):
  return subprocess.Popen(
      [sys.executable, "-c", "import time; time.sleep(300)", marker],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)


def starts_subprocess(prompts, completions, *, marker, **fields):
  """Starts a 300 s sleeper (argv holds `marker`) and returns 1.0s."""
  _start_sleeper(marker[0])
  return [1.0] * len(completions)


def starts_subprocess_and_hangs(prompts, completions, *, marker, **fields):
  _start_sleeper(marker[0])
  time.sleep(60)
  return [1.0] * len(completions)


def _write_pid(pid_dir, prefix, pid):
  with open(os.path.join(pid_dir, f"{prefix}-{pid}.pid"), "w") as f:
    f.write(str(pid))


def _fork_sleeper(pid_dir, prefix):
  pid = os.fork()
  if pid == 0:
    try:
      time.sleep(300)
    finally:
      os._exit(0)  # pylint: disable=protected-access
  _write_pid(pid_dir, prefix, pid)


def forks_child(prompts, completions, *, pid_dir, **fields):
  """Forks a child that sleeps 300 s (pid in `pid_dir`/forks_child-*)."""
  _fork_sleeper(pid_dir[0], "forks_child")
  return [1.0] * len(completions)


def forks_and_both_return(prompts, completions, *, pid_dir, **fields):
  """Forks, and the child returns from the reward too, as a careless
  os.fork() would (pid in `pid_dir`/forks_and_both_return-*)."""
  pid = os.fork()
  if pid:
    _write_pid(pid_dir[0], "forks_and_both_return", pid)
  return [2.0] * len(completions)


def dies_leaving_child(prompts, completions, *, pid_dir, **fields):
  """Forks a sleeping child, which keeps the worker's pipe open, then dies
  (the child's pid in `pid_dir`/dies_leaving_child-*)."""
  _fork_sleeper(pid_dir[0], "dies_leaving_child")
  os._exit(3)  # pylint: disable=protected-access


def hogs_memory(prompts, completions, **fields):
  """Allocates 16 MiB at a time, up to 1 GiB."""
  chunks = [bytearray(1 << 24) for _ in range(64)]
  return [float(len(chunks) > 0)] * len(completions)


# ------------------------------------------------------------- in the loop
# Misbehaving rewards that take only the task's own fields, for a training
# run (tests/test_reward_isolation.py::test_training_completes_*).


def huge_cycle(prompts, completions, **fields):
  """1e30, 1e300, inf and 1.0 in turn: finite-but-huge and non-finite."""
  values = [1e30, 1e300, math.inf, 1.0]
  return [values[i % 4] for i in range(len(completions))]


def starts_marked_subprocess(prompts, completions, **fields):
  """Starts a 300 s sleeper whose argv holds $RLJAX_TEST_MARKER."""
  _start_sleeper(os.environ["RLJAX_TEST_MARKER"])
  return [1.0] * len(completions)


def verdict_length(text):
  """A judge parser that reads every verdict: its length in characters."""
  return float(len(text))
