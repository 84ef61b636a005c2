"""Experiment trackers: Weights & Biases and MLflow, through their own clients.

``metrics.MetricWriter`` fans a run's metrics out to the writers that
``metrics.writers`` names; this module holds the two that log to an
experiment tracker (optional extras: ``pip install 'rljax[wandb]'``,
``'rljax[mlflow]'``):

* ``WandbWriter``: ``wandb.init`` in ``<workdir>/wandb``, one ``log`` per
  step with the step as the x axis (``"step"``, so that the warm-up's
  negative steps are kept), histograms as ``wandb.Histogram``. Offline with
  ``WANDB_MODE=offline`` or ``metrics.wandb.mode="offline"``.
* ``MlflowWriter``: ``MlflowClient`` on ``metrics.mlflow.tracking_uri``
  (default ``$MLFLOW_TRACKING_URI``, else a local store,
  ``sqlite:///<workdir>/mlflow.db`` with artifacts in
  ``<workdir>/mlflow_artifacts``), one ``log_batch`` per step.

Both log the run's metadata (``run_metadata``: the config, the commit, the
algorithm table's entries and the hardware): W&B as the run's config,
MLflow as params, tags and a ``config.json`` artifact.

**Resume.** ``trackers.json`` in the run directory holds each tracker's run
id and the last step logged. A resumed run continues the same W&B run
(``resume="allow"`` with that id) and the same MLflow run, and skips the
steps they already hold: the run recomputes the steps after its checkpoint
bitwise, so the tracker's rows of those steps are the ones it would log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

WRITERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# writer -> (the module it imports, the extra that installs it)
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
STATE_FILE = "trackers.json"


def check_writers(writers: Sequence[str]) -> None:
  """Checks ``metrics.writers`` before any work.

  Raises:
    ValueError: an unknown or repeated name, or no ``"jsonl"`` (a resumed
      run reads its metrics back from ``metrics.jsonl``).
    ImportError: a tracker whose package is not installed, in one line
      naming the extra that installs it.
  """
  if isinstance(writers, str) or not all(isinstance(w, str) for w in writers):
    raise ValueError(f"metrics.writers={writers!r}: a tuple of names; "
                     f"accepted: {', '.join(WRITERS)}.")
  for name in writers:
    if name not in WRITERS:
      raise ValueError(f"metrics.writers={tuple(writers)!r}: unknown writer "
                       f"{name!r}; accepted: {', '.join(WRITERS)}.")
  if len(set(writers)) != len(writers):
    raise ValueError(f"metrics.writers={tuple(writers)!r}: a writer is named "
                     "twice.")
  if "jsonl" not in writers:
    raise ValueError(f"metrics.writers={tuple(writers)!r}: must include "
                     "'jsonl' (a resumed run reads its metrics back from "
                     "metrics.jsonl).")
  for name in writers:
    if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
      raise ImportError(
          f"metrics.writers includes {name!r} but the {EXTRAS[name][0]} "
          f"package is not installed: pip install 'rljax[{EXTRAS[name][1]}]'.")


# --- run metadata ------------------------------------------------------------

def git_commit(directory: str | os.PathLike | None = None) -> str:
  """The commit of the git checkout that holds ``directory`` (default: this
  package's source), or ``"unknown"`` (an installed wheel)."""
  directory = os.fspath(directory or os.path.dirname(os.path.abspath(
      __file__)))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory,
                         capture_output=True, text=True, timeout=10,
                         check=False)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  commit = out.stdout.strip()
  return commit if out.returncode == 0 and commit else "unknown"


def hardware() -> dict[str, Any]:
  """The host and JAX's devices."""
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  return {"platform": platform.platform(), "python":
          platform.python_version(), "cpu_count": os.cpu_count(),
          "processor": platform.processor() or platform.machine(),
          "jax": jax.__version__, "backend": devices[0].platform,
          "devices": len(devices), "device_kind": devices[0].device_kind,
          "processes": jax.process_count()}


def algorithm_entries(rl: Mapping[str, Any]) -> dict[str, Any]:
  """The algorithm table's entry of each name the ``rl`` section chose:
  ``{axis: {"name": ..., "doc": ...}}`` (an advantage chain ``"a+b"``: one
  doc per link)."""
  from rljax.train import table  # pylint: disable=import-outside-toplevel
  out = {}
  for axis, entries in table.AXES.items():
    if axis == "rl.rejection":
      continue
    name = rl.get(axis.removeprefix("rl."))
    if not isinstance(name, str):
      continue
    docs = [entries[part].doc for part in name.split("+") if part in entries]
    out[axis] = {"name": name, "doc": " + ".join(docs)}
  return out


def run_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
  """What a tracker records about a run: ``{"config", "commit",
  "algorithm", "hardware"}``."""
  return {"config": dict(config), "commit": git_commit(),
          "algorithm": algorithm_entries(config.get("rl", {})),
          "hardware": hardware()}


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and value:
      out.update(_flat(value, name + "."))
    else:
      out[name] = json.dumps(value, default=str)
  return out


# --- what a resumed run finds ------------------------------------------------

def read_state(workdir: str | os.PathLike) -> dict[str, Any]:
  """``trackers.json`` of a run directory (``{}`` when absent; a damaged
  file is an error naming it)."""
  path = os.path.join(os.fspath(workdir), STATE_FILE)
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      state = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: unreadable ({e}); it names the W&B and MLflow "
                     "runs this run continues: delete it to start new "
                     "tracker runs.") from e
  if not isinstance(state, dict):
    raise ValueError(f"{path}: not a JSON object; delete it to start new "
                     "tracker runs.")
  return state


def write_state(workdir: str | os.PathLike, state: Mapping[str, Any]) -> None:
  """Replaces ``trackers.json`` atomically (a kill leaves the old or the
  new file, never half of one)."""
  path = os.path.join(os.fspath(workdir), STATE_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(state, f, sort_keys=True)
  os.replace(tmp, path)


def finite(values: Any) -> np.ndarray:
  """The finite entries of ``values``, flattened, as float64."""
  a = np.asarray(values, np.float64).reshape(-1)
  return a[np.isfinite(a)]


# --- the writers --------------------------------------------------------------

class WandbWriter:
  """Logs to a Weights & Biases run (``wandb.init(dir=workdir,
  id=run_id, resume="allow")``).

  Args:
    workdir: the run directory (W&B writes ``<workdir>/wandb``).
    run_id: the run to continue (None: a new one; ``run_id`` tells its id).
    metadata: ``run_metadata``'s dict, the run's config.
    project, entity, mode, name: ``wandb.init``'s (empty: W&B's default;
      ``mode=""`` follows ``WANDB_MODE``).
  """

  def __init__(self, workdir: str | os.PathLike, *, run_id: str | None,
               metadata: Mapping[str, Any], project: str = "rljax",
               entity: str = "", mode: str = "", name: str = ""):
    import wandb  # pylint: disable=import-outside-toplevel
    self._wandb = wandb
    self._run = wandb.init(
        project=project or None, entity=entity or None, mode=mode or None,
        dir=os.fspath(workdir), id=run_id, resume="allow", name=name or None,
        config=dict(metadata),
        settings=wandb.Settings(console="off", silent=True))
    # The x axis is the run's step ("step"), not W&B's own counter: the
    # warm-up's steps are negative and step 0 is written twice.
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")
    self.run_id = self._run.id

  def write(self, step: int, scalars: Mapping[str, float],
            histograms: Mapping[str, np.ndarray]) -> None:
    row: dict[str, Any] = {"step": int(step), **scalars}
    for tag, values in histograms.items():
      values = finite(values)
      if values.size:
        row[tag] = self._wandb.Histogram(values, num_bins=64)
    self._run.log(row)

  def close(self) -> None:
    self._run.finish()


_MLFLOW_KEY = re.compile(r"[^\w./\- :]")


class MlflowWriter:
  """Logs to an MLflow run through ``MlflowClient``.

  Args:
    workdir: the run directory.
    run_id: the run to continue (None: a new one in ``experiment``).
    metadata: ``run_metadata``'s dict: params (the config, flattened), tags
      (commit, algorithm, hardware) and a ``config.json`` artifact.
    tracking_uri: empty: ``$MLFLOW_TRACKING_URI``, else
      ``sqlite:///<workdir>/mlflow.db`` (artifacts in
      ``<workdir>/mlflow_artifacts``).
    experiment: the experiment's name (created when missing).
    name: the run's name (empty: the run directory's).
  """

  def __init__(self, workdir: str | os.PathLike, *, run_id: str | None,
               metadata: Mapping[str, Any], tracking_uri: str = "",
               experiment: str = "rljax", name: str = ""):
    # pylint: disable=import-outside-toplevel
    from mlflow.entities import Param, RunStatus, RunTag
    from mlflow.tracking import MlflowClient
    workdir = os.path.abspath(os.fspath(workdir))
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    artifacts = None
    if not uri:
      uri = f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
      artifacts = "file://" + os.path.join(workdir, "mlflow_artifacts")
    self.tracking_uri = uri
    self._client = client = MlflowClient(tracking_uri=uri)
    if run_id is not None:
      client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
      self.run_id = run_id
      return
    found = client.get_experiment_by_name(experiment)
    experiment_id = (found.experiment_id if found is not None else
                     client.create_experiment(experiment,
                                              artifact_location=artifacts))
    hw = metadata.get("hardware", {})
    tags = {"rljax.commit": str(metadata.get("commit", "unknown")),
            **{f"rljax.hardware.{k}": str(v) for k, v in hw.items()},
            **{f"rljax.{axis}": entry["name"] for axis, entry in
               metadata.get("algorithm", {}).items()}}
    run = client.create_run(experiment_id, tags=tags,
                            run_name=name or os.path.basename(workdir))
    self.run_id = run.info.run_id
    params = [Param(k[:250], v[:6000]) for k, v in
              _flat(metadata.get("config", {})).items()]
    for i in range(0, len(params), 100):  # MLflow's limit per batch
      client.log_batch(self.run_id, params=params[i:i + 100])
    client.log_batch(self.run_id, tags=[RunTag(
        "rljax.algorithm", json.dumps(metadata.get("algorithm", {})))])
    client.log_dict(self.run_id, dict(metadata), "config.json")

  def write(self, step: int, scalars: Mapping[str, float],
            histograms: Mapping[str, np.ndarray]) -> None:
    del histograms  # MLflow has no histogram type
    from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
    stamp = int(time.time() * 1000)
    metrics = [Metric(_MLFLOW_KEY.sub("_", k)[:250], float(v), stamp,
                      int(step)) for k, v in scalars.items()]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
      self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

  def close(self) -> None:
    self._client.set_terminated(self.run_id)


__all__ = ["EXTRAS", "MlflowWriter", "STATE_FILE", "WRITERS", "WandbWriter",
           "algorithm_entries", "check_writers", "finite", "git_commit",
           "hardware", "read_state", "run_metadata", "write_state"]
