"""What stops a run early: a signal, non-finite updates, failing rewards.

``StopSignal`` turns SIGTERM/SIGINT into a flag the loop checks at step
boundaries (it saves a checkpoint there and returns); ``Guards`` stops a run
whose optimizer updates keep being non-finite or whose reward functions keep
failing, naming the setting that allows more and the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from rljax import checkpoint as ckpt_lib
from rljax import metrics as metrics_lib

log = logging.getLogger("rljax")


class StopSignal:
  """Records SIGTERM/SIGINT so the loop can checkpoint at a step boundary."""

  def __init__(self):
    self.received = None
    self._previous = {}
    if threading.current_thread() is not threading.main_thread():
      return  # signal handlers can only be set from the main thread
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    # A second signal takes the default action (the process ends at once),
    # never a KeyboardInterrupt raised inside a running XLA computation.
    # Checkpoints are atomic, so nothing saved is lost.
    for sig in self._previous:
      signal.signal(sig, signal.SIG_DFL)

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


class Guards:
  """Stops a run whose updates keep being non-finite or whose rewards fail."""

  def __init__(self, settings: Any):
    """``settings``: the loop's (``build.LoopSettings``)."""
    self.s = settings
    self.skipped_total = 0
    self.failing_steps = 0

  def check(self, step: int, last: dict[str, float],
            manager: ckpt_lib.CheckpointManager,
            writer: metrics_lib.MetricWriter) -> None:
    """Warns on skipped updates; closes up and raises past a limit."""
    s = self.s
    if last.get("nonfinite_skipped_total", 0) > self.skipped_total:
      self.skipped_total = int(last["nonfinite_skipped_total"])
      log.warning("step %d: non-finite loss or gradient; the update was "
                  "skipped (%d updates skipped so far).", step,
                  self.skipped_total)
    bad = int(last.get("nonfinite_consecutive", 0))
    if s.max_consecutive_nonfinite and bad >= s.max_consecutive_nonfinite:
      writer.close()
      manager.wait()  # a save in flight completes before the message names it
      latest = manager.latest_step()
      where = (f"the newest complete checkpoint is step {latest} in "
               f"{os.path.join(manager.directory, str(latest))}"
               if latest is not None else
               f"no checkpoint was saved yet in {manager.directory}")
      manager.close()
      raise FloatingPointError(
          f"{bad} consecutive optimizer updates up to RL step {step} had a "
          "non-finite loss or gradient (optimizer.max_consecutive_nonfinite="
          f"{s.max_consecutive_nonfinite}): stopping; {where}.")
    failing = last["reward/failure_fraction"] > s.max_reward_failure_fraction
    self.failing_steps = self.failing_steps + 1 if failing else 0
    if self.failing_steps >= s.reward_failure_patience:
      writer.close()
      manager.close()  # a save in flight completes
      raise RuntimeError(
          f"reward/failure_fraction > rewards.max_failure_fraction="
          f"{s.max_reward_failure_fraction} for {self.failing_steps} RL steps "
          f"in a row (rewards.failure_patience={s.reward_failure_patience}, "
          f"last step {step}): the reward functions are failing, see the "
          "warnings above. Fix them, or raise either setting to keep training.")
