import glob
import io
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from rljax import metrics


def _event_file(logdir):
  (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  return path


def test_tensorboard_round_trip_including_negative_steps(tmp_path):
  w = metrics.TensorBoardWriter(tmp_path)
  w.write(-5, {"sft/loss": 2.5})
  w.write(3, {"reward": np.float32(0.25), "acc": 1.0, "vector": np.ones(3)})
  w.close()
  records = metrics.read_tensorboard_scalars(_event_file(tmp_path))
  assert sorted(records) == [(-5, "sft/loss", 2.5), (3, "acc", 1.0),
                             (3, "reward", 0.25)]


def test_tensorboard_file_reads_with_tensorboards_accumulator(tmp_path):
  # What the TensorBoard UI itself loads, independent of our reader.
  from tensorboard.backend.event_processing import event_accumulator
  w = metrics.MetricWriter(tmp_path)
  for step in (1, 2):
    w.write(step, {"reward/total/mean": step / 4})
  w.close()
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars("reward/total/mean")] == [
      (1, 0.25), (2, 0.5)]


def test_tensorboard_keeps_extreme_values_unicode_tags_and_large_steps(tmp_path):
  w = metrics.TensorBoardWriter(tmp_path)
  w.write(2**40, {"nan": float("nan"), "inf": -np.inf, "big": 1e40,
                  "tiny": 1e-50, "précision/µ": 0.5, "vector": np.ones(2)})
  w.write(7, {})  # nothing to write: no event
  w.close()
  records = {tag: (step, value) for step, tag, value
             in metrics.read_tensorboard_scalars(_event_file(tmp_path))}
  assert set(records) == {"nan", "inf", "big", "tiny", "précision/µ"}
  assert all(step == 2**40 for step, _ in records.values())
  assert np.isnan(records["nan"][1])
  assert records["inf"][1] == -np.inf and records["big"][1] == np.inf
  assert records["tiny"][1] == 0.0 and records["précision/µ"][1] == 0.5


def test_a_run_killed_mid_write_keeps_its_complete_steps(tmp_path):
  w = metrics.TensorBoardWriter(tmp_path)
  for step in (1, 2, 3):
    w.write(step, {"loss": step / 2})
  path = _event_file(tmp_path)  # flushed after each write, before close
  size = os.path.getsize(path)
  with open(path, "r+b") as f:  # the last record loses its last 5 bytes
    f.truncate(size - 5)
  assert metrics.read_tensorboard_scalars(path) == [(1, "loss", 0.5),
                                                    (2, "loss", 1.0)]


def test_a_sigkilled_writer_leaves_every_step_it_wrote(tmp_path):
  """A process writes three steps (scalars and a histogram) through
  TensorBoard's writer and is SIGKILLed before it closes: TensorBoard's
  reader gets all three."""
  code = ("import sys, time; from rljax import metrics; "
          f"w = metrics.TensorBoardWriter({str(tmp_path)!r}); "
          "[w.write(s, {'loss': s / 2, 'acc': 1.0}, "
          "{'rows/reward': [0.0] * s + [1.0]}) for s in (1, 2, 3)]; "
          "print('written', flush=True); time.sleep(60)")
  proc = subprocess.Popen([sys.executable, "-c", code],
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "written"
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -9
  assert sorted(metrics.read_tensorboard_scalars(_event_file(tmp_path))) == [
      (1, "acc", 1.0), (1, "loss", 0.5), (2, "acc", 1.0), (2, "loss", 1.0),
      (3, "acc", 1.0), (3, "loss", 1.5)]
  histograms = metrics.read_tensorboard_histograms(_event_file(tmp_path))
  assert [(step, tag, buckets[:, 2].sum()) for step, tag, buckets
          in histograms] == [(s, "rows/reward", s + 1) for s in (1, 2, 3)]


def test_two_writers_in_one_directory_write_two_files(tmp_path):
  a, b = metrics.TensorBoardWriter(tmp_path), metrics.TensorBoardWriter(tmp_path)
  a.write(1, {"x": 1.0})
  b.write(1, {"x": 2.0})
  a.close()
  b.close()
  paths = glob.glob(os.path.join(tmp_path, "events.out.tfevents.*"))
  assert len(paths) == 2
  assert sorted(metrics.read_tensorboard_scalars(p)[0][2] for p in paths) == [
      1.0, 2.0]


def test_writing_event_files_imports_neither_torch_nor_tensorboardx(tmp_path):
  code = ("import sys; from rljax import metrics; "
          f"w = metrics.MetricWriter({str(tmp_path)!r}); "
          "w.write(1, {'reward': 0.5}); w.close(); "
          "print(sorted(m for m in ('torch', 'tensorboardX', 'tensorflow') "
          "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=120)
  assert out.stdout.strip() == "[]", out
  assert metrics.read_tensorboard_scalars(
      _event_file(tmp_path / "tensorboard")) == [(1, "reward", 0.5)]


class _Pipe(io.StringIO):
  """A stream that is not a terminal (a log file, a pipe)."""

  def isatty(self):
    return False


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def test_progress_off_a_terminal_logs_plain_lines_now_and_then(caplog):
  stream = _Pipe()
  progress = metrics.ProgressBar(
      45, {"reward": "reward/total/mean", "tokens/s": "tokens_per_s/sample"},
      file=stream)
  with caplog.at_level(logging.INFO, logger="rljax"):
    for step in range(1, 46):
      progress.update(step, {"reward/total/mean": np.float32(0.5),
                             "tokens_per_s/sample": 12345.6})
    progress.close()
  lines = [r.getMessage() for r in caplog.records]
  assert [line.split(":")[0] for line in lines] == [
      f"RL step {s}/45" for s in (*range(2, 45, 2), 45)]
  assert "reward 0.5, tokens/s 12,346" in lines[-1]
  assert stream.getvalue() == ""
  assert not any("\r" in line for line in lines)


def test_progress_on_a_terminal_draws_one_bar(caplog):
  stream = _Terminal()
  progress = metrics.ProgressBar(4, {"accuracy": "accuracy"}, initial=1,
                                 file=stream)
  with caplog.at_level(logging.INFO, logger="rljax"):
    for step in range(2, 5):
      progress.update(step, {"accuracy": 0.75})
    progress.close()
  assert not caplog.records
  assert "4/4" in stream.getvalue() and "accuracy 0.75" in stream.getvalue()


def test_jsonl_writer(tmp_path):
  w = metrics.JsonlWriter(tmp_path / "m.jsonl")
  w.write(1, {"a": np.float32(0.5), "b": float("nan")})
  w.write(2, {"a": 1})
  w.close()
  rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
  assert rows == [{"step": 1, "a": 0.5, "b": "nan"}, {"step": 2, "a": 1.0}]


def test_plot_writes_png(tmp_path):
  rows = [{"step": i, "reward": i / 10} for i in range(5)]
  assert metrics.plot_curves(rows, tmp_path / "p.png", ["reward", "missing"])
  assert open(tmp_path / "p.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_curves_have_titles_labels_fixed_accuracy_axes_and_a_smoothed_reward():
  rng = np.random.default_rng(0)
  rewards = list(0.5 + 0.01 * np.arange(40) + 0.1 * rng.standard_normal(40))
  rows = [{"step": i, "reward/total/mean": r} for i, r in enumerate(rewards)]
  rows += [{"step": i, "eval/accuracy": 0.92 + 0.001 * i}
           for i in range(0, 40, 10)]
  rows += [{"step": 0, "custom/metric": 1.0}]
  fig = metrics.curves_figure(
      rows, ["reward/total/mean", "eval/accuracy", "custom/metric", "absent"])
  reward, accuracy, custom = fig.axes[:3]
  assert len(fig.axes) == 3  # the absent key has no panel
  assert reward.get_title() == "Reward (mean per step)"
  assert reward.get_ylabel() == "reward"
  assert accuracy.get_ylim() == (0.0, 1.0)
  assert custom.get_title() == "custom/metric"  # unknown keys: their name
  raw, smooth = reward.get_lines()
  np.testing.assert_allclose(raw.get_ydata(), rewards)
  # TensorBoard's debiased EMA, by its recurrence written out in closed form.
  w, t = 0.9, np.arange(40)
  expected = [sum((1 - w) * w ** (k - j) * rewards[j] for j in range(k + 1))
              / (1 - w ** (k + 1)) for k in t]
  np.testing.assert_allclose(smooth.get_ydata(), expected, rtol=1e-12)
  assert raw.get_alpha() == 0.25 and smooth.get_alpha() is None  # raw faint
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  plt.close(fig)


def test_a_tensorboard_writer_that_writes_nothing_leaves_no_file(tmp_path):
  """The import runs ahead on a thread; the file comes with the first row (a
  rerun of a finished run writes nothing and must leave nothing)."""
  w = metrics.TensorBoardWriter(tmp_path / "tb")
  w.write(3, {})
  w.close()
  assert not (tmp_path / "tb").exists()
  w = metrics.TensorBoardWriter(tmp_path / "tb")
  w.write(4, {"x": 1.0})
  w.close()
  assert metrics.read_tensorboard_scalars(_event_file(tmp_path / "tb")) == [
      (4, "x", 1.0)]


def test_read_jsonl_leaves_out_a_row_being_written_and_names_a_bad_line(
    tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2]
  # The last row cut short by a kill, or still being written: left out.
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1]
  # A whole last row without its newline is a row.
  path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2}')
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2]
  # A bad line that ends is corruption, not a row being written.
  path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
    metrics.read_jsonl(path)
