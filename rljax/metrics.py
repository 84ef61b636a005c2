"""Metric writers: JSONL, TensorBoard event files, console progress, plots.

TensorBoard event files are written with tensorboardX (numpy and protobuf,
no TensorFlow); progress is drawn with tqdm.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tqdm
from tqdm.contrib import logging as tqdm_logging

Scalars = Mapping[str, Any]


def to_floats(metrics: Scalars) -> dict[str, float]:
  """Converts scalar arrays to Python floats (drops non-scalars)."""
  out = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.size == 1:
      out[k] = float(a.reshape(()))
  return out


class JsonlWriter:
  """Appends one JSON object per step: ``{"step": s, name: value, ...}``."""

  def __init__(self, path: str | os.PathLike):
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    self.path = os.fspath(path)
    self._f = open(self.path, "a", encoding="utf-8")

  def write(self, step: int, metrics: Scalars) -> None:
    row = {"step": int(step)}
    for k, v in to_floats(metrics).items():
      row[k] = v if math.isfinite(v) else str(v)
    self._f.write(json.dumps(row, sort_keys=True) + "\n")
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


# --- TensorBoard ------------------------------------------------------------

class TensorBoardWriter:
  """Writes scalar summaries to ``<logdir>/events.out.tfevents.*`` (tensorboardX)."""

  def __init__(self, logdir: str | os.PathLike):
    # Imported here, not with this module: tensorboardX imports torch at
    # import time when torch is installed (the hf extra), a few seconds.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._writer = SummaryWriter(os.fspath(logdir), flush_secs=5)

  def write(self, step: int, metrics: Scalars) -> None:
    now = time.time()
    for k, v in to_floats(metrics).items():
      self._writer.add_scalar(k, v, int(step), walltime=now)

  def close(self) -> None:
    self._writer.close()


def read_tensorboard_scalars(path: str | os.PathLike
                             ) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of each scalar in an event file.

  Reads with TensorBoard's own loader (the ``tensorboard`` package, in the
  ``test`` extra).
  """
  try:
    # pylint: disable=import-outside-toplevel
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.util import tensor_util
  except ImportError as e:
    raise ImportError("read_tensorboard_scalars needs the tensorboard package: "
                      "pip install -e '.[test]'") from e
  out = []
  for event in event_file_loader.EventFileLoader(os.fspath(path)).Load():
    for value in event.summary.value:
      out.append((event.step, value.tag,
                  float(tensor_util.make_ndarray(value.tensor))))
  return out


# --- console and plots -------------------------------------------------------

class ProgressBar:
  """RL progress: a live tqdm bar on a terminal, else a log line now and then.

  Off a terminal (a log file, a pipe, a notebook's captured stderr) it logs
  one plain line every ``max(1, total // 20)`` steps and at the last one,
  never a carriage return.

  Args:
    total: the last step.
    shown: label -> metric name, the figures shown (those present).
    initial: the step the run starts from (a resumed run's).
    file: where the bar is drawn; its ``isatty()`` chooses bar or lines.
    logger: where the plain lines go.
    active: False shows nothing (processes other than process 0).
  """

  def __init__(self, total: int, shown: Mapping[str, str], *, initial: int = 0,
               file=None, logger: logging.Logger | None = None,
               active: bool = True):
    self.active = active
    self.total, self.shown, self.initial = total, dict(shown), initial
    self.file = file if file is not None else sys.stderr
    self.logger = logger or logging.getLogger("rljax")
    self.every = max(1, total // 20)
    self.start = time.time()
    self._bar, self._redirect = None, contextlib.ExitStack()
    isatty = getattr(self.file, "isatty", None)
    if active and isatty is not None and isatty():
      self._bar = tqdm.tqdm(total=total, initial=initial, file=self.file,
                            unit="step", dynamic_ncols=True, desc="RL")
      # Log lines (warnings) print above the bar instead of through it.
      self._redirect.enter_context(
          tqdm_logging.logging_redirect_tqdm([self.logger]))

  def _figures(self, metrics: Scalars) -> list[str]:
    floats = to_floats(metrics)
    return [f"{label} {floats[k]:,.3g}" if abs(floats[k]) < 1000
            else f"{label} {floats[k]:,.0f}"
            for label, k in self.shown.items() if k in floats]

  def update(self, step: int, metrics: Scalars) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(", ".join(self._figures(metrics)),
                                refresh=False)
      self._bar.update(step - self._bar.n)
      return
    if not self.active or (step % self.every and step != self.total):
      return
    elapsed = time.time() - self.start
    left = elapsed / max(step - self.initial, 1) * (self.total - step)
    self.logger.info(
        "RL step %d/%d: %s [%s elapsed, %s left]", step, self.total,
        ", ".join(self._figures(metrics)),
        tqdm.tqdm.format_interval(elapsed), tqdm.tqdm.format_interval(left))

  def close(self) -> None:
    self._redirect.close()
    if self._bar is not None:
      self._bar.close()


class MetricWriter:
  """Fans out to JSONL and TensorBoard under ``workdir``.

  ``active=False`` writes nothing (the processes of a multi-process run
  other than process 0).
  """

  def __init__(self, workdir: str | os.PathLike, *, active: bool = True):
    self.active = active
    if active:
      self.jsonl = JsonlWriter(os.path.join(workdir, "metrics.jsonl"))
      self.tensorboard = TensorBoardWriter(os.path.join(workdir,
                                                        "tensorboard"))

  def write(self, step: int, metrics: Scalars) -> None:
    if self.active:
      self.jsonl.write(step, metrics)
      self.tensorboard.write(step, metrics)

  def close(self) -> None:
    if self.active:
      self.jsonl.close()
      self.tensorboard.close()


def plot_curves(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                keys: Sequence[str], title: str = "") -> bool:
  """Saves a PNG with one panel per key that appears in ``rows``.

  Returns False (and writes nothing) when matplotlib is unavailable.
  """
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  keys = [k for k in keys if any(k in r for r in rows)]
  if not keys:
    return False
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                           squeeze=False)
  for ax, key in zip(axes[0], keys):
    pts = [(r["step"], float(r[key])) for r in rows
           if key in r and isinstance(r[key], (int, float))]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True
