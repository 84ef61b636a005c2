"""The launchers (evaluate, sample, export) on one tiny finished run.

Each launcher runs in a real subprocess, as a user would type it.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rljax import models, train

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _run(module, *flags):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("run"))
  _run("launch.train", "--config=configs/arithmetic_grpo.py:tiny",
       f"--workdir={path}", "--config.rl.num_steps=2")
  return path


@pytest.mark.slow
def test_train_writes_its_record_named_after_the_config_and_seed(workdir):
  """The main job's config records as ``train_seed<N>-<commit>.json`` (other
  configs as ``<config stem>_seed<N>``), with the before/after figures."""
  names = [n for n in os.listdir(workdir) if n.endswith(".json")
           and n != "config.json"]
  assert len(names) == 1 and names[0].startswith("train_seed0-"), names
  with open(os.path.join(workdir, names[0])) as f:
    record = json.load(f)
  assert set(record["figures"]["before"]) == set(record["figures"]["after"])
  assert record["config"]["seed"] == 0


@pytest.mark.slow
def test_evaluate_prints_a_table_and_writes_the_json(workdir, tmp_path):
  output = str(tmp_path / "eval.json")
  stdout = _run("launch.evaluate", f"--workdir={workdir}", "--num_samples=2",
                f"--output={output}")
  with open(output) as f:
    results = json.load(f)
  metrics = {k: v for k, v in results.items() if k != "step"}
  assert results["step"] == 2
  assert set(metrics) == {
      "eval/greedy_accuracy", "eval/greedy_avg@1", "eval/greedy_pass@1",
      "eval/greedy_maj@1", "eval/greedy_completion_length",
      "eval/accuracy", "eval/avg@2", "eval/pass@1", "eval/pass@2",
      "eval/maj@2", "eval/completion_length"}
  for name, value in metrics.items():
    if not name.endswith("completion_length"):
      assert 0.0 <= value <= 1.0, (name, value)
  # Unbiased pass@1 is the mean single-sample accuracy.
  assert results["eval/pass@1"] == pytest.approx(results["eval/accuracy"])
  assert results["eval/pass@1"] <= results["eval/pass@2"]
  table = {line.split()[0]: line for line in stdout.splitlines()
           if line.startswith("eval/")}
  assert set(table) == set(metrics)
  assert len({line.rindex(" ") for line in table.values()}) == 1  # aligned


@pytest.mark.slow
def test_sample_prints_the_prompt_and_its_completions(workdir):
  stdout = _run("launch.sample", f"--workdir={workdir}", "--prompt=12+34=",
                "--num_samples=2")
  lines = stdout.strip().splitlines()
  assert lines[0] == "=== '12+34='"
  assert len(lines) == 3 and all(line.startswith("  ") for line in lines[1:])


@pytest.mark.slow
def test_export_hf_loads_back_to_the_run_params(workdir, tmp_path):
  out = str(tmp_path / "hf")
  _run("launch.export", f"--workdir={workdir}", "--format=hf", f"--out={out}")
  policy = train.load_policy(workdir)
  config, params = models.load_hf_checkpoint(out)
  assert config.num_layers == policy.model_config.num_layers
  assert config.d_model == policy.model_config.d_model
  expected = jax.device_get(policy.params)
  got = jax.device_get(params)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(e, np.float32))
