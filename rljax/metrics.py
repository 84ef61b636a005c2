"""Metric writers: JSONL, TensorBoard event files, console progress, plots.

TensorBoard event files are written with TensorBoard's own writer
(``TensorBoardWriter``; the ``tensorboard`` package, without TensorFlow);
progress is drawn with tqdm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tqdm
from tqdm.contrib import logging as tqdm_logging

from rljax import tracking

Scalars = Mapping[str, Any]
HISTOGRAM_BUCKETS = 30  # TensorBoard's default


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
  """The rows of a ``metrics.jsonl``, one dict per line.

  A last line without its newline that does not parse is left out: the row
  a running job is writing, or one a kill cut short (a resumed run writes
  it again). Any other line that does not parse raises ``ValueError``
  naming the file and the line.
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  rows = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number == len(lines):  # unterminated: still being written
        break
      raise ValueError(f"{path}:{number}: not a JSON row ({e.msg}); each "
                       "line of a metrics file is one JSON object.") from None
  return rows


# --- TensorBoard ------------------------------------------------------------

def _import_tensorboard() -> None:
  """Imports what ``TensorBoardWriter.write`` uses. An import error is
  raised again, with its traceback, by the first write's own import."""
  # pylint: disable=import-outside-toplevel,unused-import
  try:
    from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: F401
    from tensorboard.plugins.histogram import summary_v2  # noqa: F401
    from tensorboard.summary.writer import event_file_writer  # noqa: F401
  except ImportError:
    pass


class TensorBoardWriter:
  """Writes scalar and histogram summaries to
  ``<logdir>/events.out.tfevents.*`` with TensorBoard's own event-file writer
  and protocol buffers (the ``tensorboard`` package; neither TensorFlow nor
  torch is imported): one event per ``write`` (all of a step's summaries),
  flushed at once, so a killed run's file ends at its last complete step
  (TensorBoard's reader drops a record cut short). Each writer starts a file
  of its own (a resumed run adds one, as TensorFlow's writers do).

  TensorBoard's modules are imported on a thread started here (~50 ms the
  first time in a process), so that the run's first row, after its set-up
  and compiles, does not wait for them; the event file is created by the
  first write (a writer that writes nothing leaves no file).
  """

  def __init__(self, logdir: str | os.PathLike):
    self._logdir = os.fspath(logdir)
    self._writer = None
    self._imported = threading.Thread(target=_import_tensorboard, daemon=True,
                                      name="rljax-tensorboard-import")
    self._imported.start()

  def write(self, step: int, metrics: Scalars,
            histograms: Mapping[str, Any] | None = None) -> None:
    scalars = to_floats(metrics)
    histograms = {tag: values for tag, values in (histograms or {}).items()
                  if tracking.finite(values).size}
    if not scalars and not histograms:
      return
    self._imported.join()
    # pylint: disable=import-outside-toplevel
    from tensorboard.compat.proto import event_pb2, summary_pb2
    if self._writer is None:
      from tensorboard.summary.writer import event_file_writer
      os.makedirs(self._logdir, exist_ok=True)
      self._writer = event_file_writer.EventFileWriter(self._logdir)
    with np.errstate(over="ignore"):  # beyond float32's range: +-inf
      values = np.asarray(list(scalars.values()), np.float32)
    summary = summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
        for tag, v in zip(scalars, values)])
    if histograms:
      from tensorboard.plugins.histogram import summary_v2
      for tag, data in histograms.items():
        summary.value.extend(summary_v2.histogram_pb(
            tag, tracking.finite(data), buckets=HISTOGRAM_BUCKETS).value)
    self._writer.add_event(event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=summary))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _tensorboard_values(path: str | os.PathLike):
  """``(step, tag, plugin, array)`` of each summary value in an event file,
  read with TensorBoard's own loader (the ``tensorboard`` package)."""
  # pylint: disable=import-outside-toplevel
  from tensorboard.backend.event_processing import event_file_loader
  from tensorboard.util import tensor_util
  for event in event_file_loader.EventFileLoader(os.fspath(path)).Load():
    for value in event.summary.value:
      yield (event.step, value.tag, value.metadata.plugin_data.plugin_name,
             tensor_util.make_ndarray(value.tensor))


def read_tensorboard_scalars(path: str | os.PathLike
                             ) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of each scalar in an event file."""
  return [(step, tag, float(a)) for step, tag, plugin, a
          in _tensorboard_values(path) if plugin != "histograms"]


def read_tensorboard_histograms(path: str | os.PathLike
                                ) -> list[tuple[int, str, np.ndarray]]:
  """``(step, tag, buckets)`` of each histogram in an event file; buckets
  ``[k, 3]``: left edge, right edge, count."""
  return [(step, tag, a) for step, tag, plugin, a
          in _tensorboard_values(path) if plugin == "histograms"]


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
    self._clock = (self.start, initial)  # what the estimate counts from
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
    now = time.time()
    elapsed = now - self.start
    since, from_step = self._clock
    left = (now - since) / max(step - from_step, 1) * (self.total - step)
    self.logger.info(
        "RL step %d/%d: %s [%s elapsed, %s left]", step, self.total,
        ", ".join(self._figures(metrics)),
        tqdm.tqdm.format_interval(elapsed), tqdm.tqdm.format_interval(left))

  def restart_clock(self, step: int) -> None:
    """Estimates the time left from now and ``step`` on (after a first step
    that compiled); the elapsed time still counts from the start."""
    self._clock = (time.time(), step)

  def close(self) -> None:
    self._redirect.close()
    if self._bar is not None:
      self._bar.close()


class MetricWriter:
  """Fans a run's metrics out to the writers ``metrics.writers`` names under
  ``workdir``: ``"jsonl"`` (``metrics.jsonl``), ``"tensorboard"``
  (``tensorboard/``), ``"wandb"`` and ``"mlflow"`` (``rljax.tracking``).

  Args:
    workdir: the run directory.
    active: False writes nothing (the processes of a multi-process run other
      than process 0).
    writers: the writers' names (``tracking.check_writers``).
    metadata: ``tracking.run_metadata``'s dict, logged by the trackers.
    options: each tracker's keyword arguments (``{"wandb": {"project": ...},
      "mlflow": {"experiment": ...}}``).
  """

  def __init__(self, workdir: str | os.PathLike, *, active: bool = True,
               writers: Sequence[str] = ("jsonl", "tensorboard"),
               metadata: Mapping[str, Any] | None = None,
               options: Mapping[str, Mapping[str, Any]] | None = None):
    self.active = active
    self.jsonl = self.tensorboard = None
    self.trackers: dict[str, Any] = {}
    if not active:
      return
    tracking.check_writers(writers)
    self.workdir = os.fspath(workdir)
    self.jsonl = JsonlWriter(os.path.join(workdir, "metrics.jsonl"))
    if "tensorboard" in writers:
      self.tensorboard = TensorBoardWriter(os.path.join(workdir,
                                                        "tensorboard"))
    options = options or {}
    self._state = tracking.read_state(workdir)
    self._resume_after: dict[str, int | None] = {}
    for name, cls in (("wandb", tracking.WandbWriter),
                      ("mlflow", tracking.MlflowWriter)):
      if name in writers:
        saved = dict(self._state.get(name, {}))
        tracker = cls(workdir, run_id=saved.get("run_id"),
                      metadata=metadata or {}, **options.get(name, {}))
        self.trackers[name] = tracker
        # The steps up to its "last_step" are in the tracker already.
        self._resume_after[name] = saved.get("last_step")
        self._state[name] = {**saved, "run_id": tracker.run_id}
    if self.trackers:
      tracking.write_state(workdir, self._state)

  def write(self, step: int, metrics: Scalars,
            histograms: Mapping[str, Any] | None = None) -> None:
    """Writes ``metrics``' scalars and ``histograms`` (name -> values, for
    TensorBoard and W&B) at ``step``. A tracker skips the steps it holds
    already (a resumed run's steps up to its last row there)."""
    if not self.active:
      return
    self.jsonl.write(step, metrics)
    if self.tensorboard is not None:
      self.tensorboard.write(step, metrics, histograms)
    if not self.trackers:
      return
    scalars, wrote = to_floats(metrics), False
    for name, tracker in self.trackers.items():
      after = self._resume_after[name]
      if after is not None and step <= after:
        continue
      tracker.write(step, scalars, histograms or {})
      self._state[name]["last_step"] = step
      wrote = True
    if wrote:
      tracking.write_state(self.workdir, self._state)

  def close(self) -> None:
    if not self.active:
      return
    self.jsonl.close()
    if self.tensorboard is not None:
      self.tensorboard.close()
    for tracker in self.trackers.values():
      tracker.close()
    self.trackers = {}


def from_config(config: Mapping[str, Any], workdir: str | os.PathLike, *,
                active: bool = True) -> MetricWriter:
  """The run's ``MetricWriter`` from its config (a JSON dict): the writers of
  ``metrics.writers``, the trackers' options (``metrics.wandb``,
  ``metrics.mlflow``) and the run's metadata (``tracking.run_metadata``)."""
  section = config.get("metrics", {})
  writers = tuple(section.get("writers", ("jsonl", "tensorboard")))
  trackers = [w for w in writers if w in tracking.EXTRAS]
  return MetricWriter(
      workdir, active=active, writers=writers,
      metadata=tracking.run_metadata(config) if trackers and active else None,
      options={w: dict(section.get(w, {})) for w in trackers})


@dataclasses.dataclass(frozen=True)
class Curve:
  """How ``plot_curves`` draws one metric.

  Attributes:
    title: the panel's title.
    ylabel: the y axis label.
    ylim: a fixed y range (accuracies: 0 to 1, so that 0.92 -> 0.95 does
      not look like a swing); None fits the data.
    smooth: also draw an exponential moving average, the raw line faint.
  """

  title: str
  ylabel: str = ""
  ylim: tuple[float, float] | None = None
  smooth: bool = False


CURVES = {
    "reward/total/mean": Curve("Reward (mean per step)", "reward",
                               smooth=True),
    "eval/accuracy": Curve("Held-out accuracy (sampled)", "accuracy",
                           (0.0, 1.0)),
    "eval/greedy_accuracy": Curve("Held-out accuracy (greedy)", "accuracy",
                                  (0.0, 1.0)),
    "completion_length/mean": Curve("Completion length (mean)", "tokens",
                                    smooth=True),
    "accuracy": Curve("Training accuracy", "accuracy", (0.0, 1.0),
                      smooth=True),
}


def smoothed(values: Sequence[float], weight: float = 0.9) -> np.ndarray:
  """TensorBoard's debiased exponential moving average of ``values``.

  ``s_t = weight * s_{t-1} + (1 - weight) * x_t`` from ``s_0 = 0``, divided
  by ``1 - weight**(t+1)`` so the first points are not pulled to 0.
  """
  out, acc = np.empty(len(values)), 0.0
  for t, x in enumerate(values):
    acc = weight * acc + (1.0 - weight) * float(x)
    out[t] = acc / (1.0 - weight ** (t + 1))
  return out


def curves_figure(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                  title: str = "", curves: Mapping[str, Curve] | None = None):
  """A matplotlib figure with one panel per key of ``keys`` in ``rows``.

  Known metrics (``CURVES``, updated by ``curves``) get a readable title, a
  y label, a fixed range for accuracies, and a smoothed line over the raw
  one for noisy per-step figures; others are titled by their key. Returns
  None when no key appears in ``rows``. Needs matplotlib.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  styles = {**CURVES, **(curves or {})}
  keys = [k for k in keys if any(k in r for r in rows)]
  if not keys:
    return None
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                           squeeze=False)
  for ax, key in zip(axes[0], keys):
    style = styles.get(key, Curve(key))
    pts = [(r["step"], float(r[key])) for r in rows
           if key in r and isinstance(r[key], (int, float))]
    if pts:
      xs, ys = zip(*pts)
      marker = "o" if len(pts) < 30 else None
      if style.smooth and len(pts) >= 10:
        ax.plot(xs, ys, color="C0", alpha=0.25, linewidth=1, label="raw")
        ax.plot(xs, smoothed(ys), color="C0", linewidth=2,
                label="smoothed (EMA 0.9)")
        ax.legend(fontsize="small", loc="best")
      else:
        ax.plot(xs, ys, color="C0", marker=marker, markersize=3)
    ax.set_title(style.title)
    ax.set_xlabel("RL step")
    ax.set_ylabel(style.ylabel)
    if style.ylim is not None:
      ax.set_ylim(*style.ylim)
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig


def plot_curves(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                keys: Sequence[str], title: str = "",
                curves: Mapping[str, Curve] | None = None) -> bool:
  """Saves ``curves_figure(rows, keys, title, curves)`` as a PNG.

  Returns False (and writes nothing) when matplotlib is unavailable or no
  key appears in ``rows``.
  """
  try:
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig = curves_figure(rows, keys, title, curves)
  if fig is None:
    return False
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True
