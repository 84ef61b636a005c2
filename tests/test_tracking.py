"""The metric writers a config chooses (``metrics.writers``): W&B offline runs
and MLflow stores read back through each library's own reader, resume into
the same tracker runs without a duplicated step, TensorBoard histograms,
run metadata, and the errors of a wrong writer list or a missing extra."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rljax import metrics, tracking
from rljax.train import build

ALL = ("jsonl", "tensorboard", "wandb", "mlflow")


def wandb_runs(workdir):
  """The records of each offline W&B run segment under ``workdir`` (oldest
  first), read with W&B's own reader (``wandb leet inspect --json``)."""
  runs = []
  for path in sorted(glob.glob(os.path.join(
      workdir, "wandb", "offline-run-*", "run-*.wandb"))):
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
        capture_output=True, text=True, check=True, timeout=120)
    runs.append([json.loads(line) for line in out.stdout.splitlines()
                 if line.strip()])
  return runs


def wandb_history(records):
  return [r["history"]["item"] for r in records if r["type"] == "history"]


def mlflow_client(workdir):
  from mlflow.tracking import MlflowClient
  return MlflowClient(tracking_uri="sqlite:///" + os.path.join(
      workdir, "mlflow.db"))


@pytest.fixture
def offline(monkeypatch):
  pytest.importorskip("wandb")
  pytest.importorskip("mlflow")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# --- the config's writer list -------------------------------------------------

@pytest.mark.parametrize("writers, says", [
    (("jsonl", "tensorbord"), "unknown writer 'tensorbord'"),
    (("jsonl", "jsonl"), "named twice"),
    (("tensorboard",), "must include 'jsonl'"),
    ("jsonl", "a tuple of names"),
])
def test_a_wrong_writer_list_is_refused_naming_it(writers, says):
  with pytest.raises(ValueError, match=says) as e:
    tracking.check_writers(writers)
  assert "metrics.writers" in str(e.value)


def test_a_missing_extra_is_one_line_naming_it_before_any_work(monkeypatch):
  from tests.test_train import tiny_config
  real = tracking.importlib.util.find_spec
  monkeypatch.setattr(tracking.importlib.util, "find_spec",
                      lambda name: None if name == "mlflow" else real(name))
  config = tiny_config()
  config.metrics.writers = ("jsonl", "mlflow")
  with pytest.raises(ImportError) as e:
    build.validate(config)  # what launch.train runs before it builds
  assert str(e.value) == ("metrics.writers includes 'mlflow' but the mlflow "
                          "package is not installed: pip install "
                          "'rljax[mlflow]'.")
  config.metrics.writers = ("jsonl", "tensorboard")
  build.validate(config)


def test_other_processes_write_nothing_and_import_no_tracker(tmp_path):
  code = ("import sys; from rljax import metrics; "
          f"w = metrics.MetricWriter({str(tmp_path)!r}, active=False, "
          f"writers={ALL!r}); w.write(1, {{'a': 1.0}}); w.close(); "
          "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=120)
  assert out.stdout.strip() == "[]"
  assert os.listdir(tmp_path) == []


# --- histograms ---------------------------------------------------------------

def test_tensorboard_histograms_count_every_finite_value(tmp_path):
  rng = np.random.default_rng(0)
  values = rng.normal(size=200)
  values[:5] = np.nan  # rows out of the loss
  w = metrics.TensorBoardWriter(tmp_path)
  w.write(4, {"loss": 1.0}, {"rows/advantage": values,
                             "rows/empty": np.full(3, np.nan)})
  w.close()
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  [(step, tag, buckets)] = metrics.read_tensorboard_histograms(path)
  assert (step, tag) == (4, "rows/advantage")
  kept = values[5:]
  assert buckets[:, 2].sum() == kept.size
  assert buckets.shape == (metrics.HISTOGRAM_BUCKETS, 3)
  np.testing.assert_allclose([buckets[0, 0], buckets[-1, 1]],
                             [kept.min(), kept.max()])
  # Each bucket's count, against numpy's over the same edges.
  edges = np.append(buckets[:, 0], buckets[-1, 1])
  np.testing.assert_array_equal(buckets[:, 2], np.histogram(kept, edges)[0])
  assert metrics.read_tensorboard_scalars(path) == [(4, "loss", 1.0)]


# --- W&B and MLflow ---------------------------------------------------------

CONFIG = {"seed": 3, "rl": {"advantage": "grpo+rank_weights",
                            "objective": "cispo", "group_size": 4}}


def test_wandb_and_mlflow_hold_the_metrics_config_and_commit(tmp_path, offline):
  del offline
  w = metrics.MetricWriter(tmp_path, writers=ALL,
                           metadata=tracking.run_metadata(CONFIG))
  w.write(-1, {"sft/loss": 2.0})
  w.write(0, {"sft/loss": 1.5})
  w.write(0, {"eval/accuracy": 0.25})
  w.write(1, {"reward/total/mean": 0.5, "weird key@1": 3.0},
          {"rows/reward": [0.0, 1.0, 1.0]})
  w.close()
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True,
                          cwd=os.path.dirname(tracking.__file__)).stdout.strip()

  [records] = wandb_runs(tmp_path)
  [run] = [r["run"] for r in records if r["type"] == "run"]
  config = run["config"]["update"]
  assert config["config"] == CONFIG and config["commit"] == commit
  assert config["algorithm"]["rl.objective"]["name"] == "cispo"
  assert config["hardware"]["backend"] == "cpu"
  history = wandb_history(records)
  assert [(h["step"], sorted(k for k in h if not k.startswith("_")))
          for h in history] == [
              (-1, ["sft/loss", "step"]), (0, ["sft/loss", "step"]),
              (0, ["eval/accuracy", "step"]),
              (1, ["reward/total/mean", "rows/reward._type",
                   "rows/reward.bins", "rows/reward.values", "step",
                   "weird key@1"])]
  assert history[3]["rows/reward._type"] == "histogram"
  assert sum(history[3]["rows/reward.values"]) == 3

  client = mlflow_client(tmp_path)
  [experiment] = [e for e in client.search_experiments()
                  if e.name == "rljax"]
  [found] = client.search_runs([experiment.experiment_id])
  run_id = json.loads((tmp_path / tracking.STATE_FILE).read_text())[
      "mlflow"]["run_id"]
  assert found.info.run_id == run_id and found.info.status == "FINISHED"
  assert found.data.tags["rljax.commit"] == commit
  assert found.data.tags["rljax.rl.advantage"] == "grpo+rank_weights"
  assert found.data.params["rl.group_size"] == "4"
  assert [(m.step, m.value) for m in client.get_metric_history(
      run_id, "sft/loss")] == [(-1, 2.0), (0, 1.5)]
  assert [m.value for m in client.get_metric_history(
      run_id, "weird key_1")] == [3.0]  # MLflow's key alphabet
  saved = client.download_artifacts(run_id, "config.json", str(tmp_path))
  with open(saved) as f:
    assert json.load(f)["config"] == CONFIG


def test_a_resumed_writer_continues_both_runs_without_a_duplicated_step(
    tmp_path, offline):
  """A run wrote steps 1-3, its checkpoint was at 1: the resumed run writes
  2-5 again (bitwise the same rows), and each tracker keeps one of each."""
  del offline
  for steps in ((1, 2, 3), (2, 3, 4, 5)):
    w = metrics.MetricWriter(tmp_path, writers=ALL,
                             metadata=tracking.run_metadata(CONFIG))
    for step in steps:
      w.write(step, {"loss": step / 4})
    w.close()
  first, second = wandb_runs(tmp_path)
  ids = {r["run"]["run_id"] for r in first + second if r["type"] == "run"}
  assert len(ids) == 1
  assert [h["step"] for h in wandb_history(first)] == [1, 2, 3]
  assert [h["step"] for h in wandb_history(second)] == [4, 5]
  client = mlflow_client(tmp_path)
  [run] = client.search_runs([e.experiment_id for e in
                              client.search_experiments()])
  assert [(m.step, m.value) for m in client.get_metric_history(
      run.info.run_id, "loss")] == [(s, s / 4) for s in (1, 2, 3, 4, 5)]
  # JSONL is the loop's to trim (rundir.trim_metrics): both writes are there.
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")
          ] == [1, 2, 3, 2, 3, 4, 5]


@pytest.mark.parametrize("content", ['{"wandb": {"run_id": "ab', "[1, 2]"])
def test_a_damaged_state_file_is_an_error_naming_it(tmp_path, content):
  (tmp_path / tracking.STATE_FILE).write_text(content)
  with pytest.raises(ValueError, match="trackers.json") as e:
    metrics.MetricWriter(tmp_path, writers=("jsonl", "mlflow"))
  assert "delete it" in str(e.value)


# --- from the config, through the loop ----------------------------------------

@pytest.mark.slow
def test_a_run_logs_everywhere_and_a_crash_resumes_into_the_same_runs(
    tmp_path, offline):
  """Three RL steps with every writer and histograms at each; then the
  newest checkpoint is lost (a kill before it was written): the rerun
  restores step 2, recomputes step 3, and each tracker holds each step once,
  with the values metrics.jsonl holds."""
  del offline
  import shutil
  from rljax import train
  from tests.test_loop import loop_config
  config = loop_config(**{"metrics.writers": ALL,
                          "metrics.histogram_every": 1,
                          "checkpoint.every": 2, "rl.num_steps": 3,
                          "eval.every": 100})  # step 0: the before-RL row
  train.run(config, str(tmp_path))
  shutil.rmtree(tmp_path / "checkpoints" / "3")
  summary = train.run(config, str(tmp_path))
  assert summary["steps"] == 1  # step 3 again
  rows = {r["step"]: r for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")}
  assert sorted(rows) == [0, 1, 2, 3]

  segments = wandb_runs(tmp_path)
  assert len(segments) == 2
  assert len({r["run"]["run_id"] for s in segments for r in s
              if r["type"] == "run"}) == 1
  logged = [h for s in segments for h in wandb_history(s)]
  assert [h["step"] for h in logged] == [0, 1, 2, 3]
  for h in logged:
    for key in ("reward/total/mean", "grad_norm"):
      if key in rows[h["step"]]:
        assert h[key] == pytest.approx(rows[h["step"]][key], rel=1e-6)
  assert all(h["rows/advantage._type"] == "histogram" for h in logged[1:])

  client = mlflow_client(tmp_path)
  [run] = client.search_runs([e.experiment_id for e in
                              client.search_experiments()])
  assert [(m.step, m.value) for m in client.get_metric_history(
      run.info.run_id, "grad_norm")] == [
          (s, pytest.approx(rows[s]["grad_norm"], rel=1e-6)) for s in (1, 2, 3)]
  assert run.data.params["rl.num_steps"] == "3"

  # TensorBoard: one file per process, histograms of every RL step.
  histograms = {(step, tag): buckets for path in glob.glob(
      str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
      for step, tag, buckets in metrics.read_tensorboard_histograms(path)}
  rows_per_step = config.rl.prompts_per_step * config.rl.group_size
  for step in (1, 2, 3):
    for tag in ("rows/reward", "rows/completion_length"):  # every row
      assert histograms[step, tag][:, 2].sum() == rows_per_step
    # Trained rows only (a zero-variance group is out of the loss).
    assert 0 < histograms[step, "rows/advantage"][:, 2].sum() <= rows_per_step
    assert (step, "rows/log_ratio") in histograms  # two minibatches


def test_non_finite_values_from_user_code_do_not_stop_the_trackers(
    tmp_path, offline):
  """NaN and infinities (a user's reward, a diverging loss) are logged, not
  raised: MLflow keeps NaN and clamps infinities to the largest float; a
  histogram keeps its finite values."""
  del offline
  w = metrics.MetricWriter(tmp_path, writers=ALL)
  w.write(1, {"nan": float("nan"), "inf": float("inf"), "ok": 1.0},
          {"rows/reward": [float("nan"), 1.0, float("-inf")]})
  w.close()
  client = mlflow_client(tmp_path)
  [run] = client.search_runs([e.experiment_id for e in
                              client.search_experiments()])
  history = {k: [m.value for m in client.get_metric_history(
      run.info.run_id, k)] for k in ("nan", "inf", "ok")}
  assert np.isnan(history["nan"][0]) and history["ok"] == [1.0]
  assert history["inf"][0] >= np.finfo(np.float64).max
  [records] = wandb_runs(tmp_path)
  [row] = wandb_history(records)
  assert row["ok"] == 1.0 and sum(row["rows/reward.values"]) == 1
