import glob
import importlib.util
import os

import numpy as np
import pytest

from rljax import metrics, train

def load_config(path, arg=None):
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tiny_config(num_layers: int | None = 1):
  """``configs/arithmetic_grpo.py:tiny`` for runs inside the test process,
  with one decoder block (``num_layers=None``: the tiny preset's two, as a
  launcher given ``:tiny`` builds). A loop's programs then compile ~25%
  faster (a 2-step loop run: 5.0 s instead of 7.0 s on 2 cores); stacking
  blocks is the model's tests' business, on the two-block preset."""
  c = load_config(os.path.join(os.path.dirname(__file__), "..", "configs",
                               "arithmetic_grpo.py"), "tiny")
  if num_layers is not None:
    c.model.overrides.num_layers = num_layers
  return c


def _clean(rows):
  """Metrics without wall-clock figures."""
  return [{k: v for k, v in r.items()
           if not k.startswith(("time/", "tokens_per_s/", "reward/eval_seconds"))}
          for r in rows]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  summary = train.run(tiny_config(), workdir)
  return workdir, summary


@pytest.mark.slow
def test_end_to_end_tiny_run_writes_everything(tiny_run):
  workdir, summary = tiny_run
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  rl_rows = [r for r in rows if r["step"] > 0]
  assert [r["step"] for r in rl_rows] == [1, 2, 3]
  for r in rl_rows:
    for key in ("pg_loss", "grad_norm", "entropy", "reward/total/mean",
                "accuracy", "adv/frac_zero_variance_groups", "learning_rate",
                "clip_frac", "time/sample", "tokens_per_s/train"):
      assert key in r and np.isfinite(r[key]), key
  assert "eval/accuracy" in rows[-1] and "eval/greedy_accuracy" in rows[-1]
  assert any(r["step"] < 0 and "sft/sft_loss" in r for r in rows)
  assert os.path.exists(os.path.join(workdir, "curves.png"))
  events = glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
  scalars = metrics.read_tensorboard_scalars(events[0])
  assert (3, "pg_loss", pytest.approx(rl_rows[-1]["pg_loss"])) in [
      (s, t, v) for s, t, v in scalars]
  steps = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  assert "3" in steps
  assert set(summary["before"]) >= {"eval/accuracy", "eval/pass@1"}


@pytest.mark.slow
def test_same_config_and_seed_give_identical_metrics(tiny_run, tmp_path):
  workdir, _ = tiny_run
  train.run(tiny_config(), str(tmp_path))
  first = _clean(metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")))
  second = _clean(metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl")))
  assert first == second


@pytest.mark.slow
def test_failing_rewards_count_as_missing_and_training_goes_on(tmp_path):
  config = tiny_config()
  config.rl.num_steps = 2
  config.eval.every = 0
  config.rewards.names = ("numeric_match", "tests.reward_fixtures:raises",
                          "tests.reward_fixtures:hangs",
                          "tests.reward_fixtures:returns_none")
  config.rewards.weights = (1.0, 1.0, 1.0, 1.0)
  config.rewards.num_workers = 2
  config.rewards.timeout_s = 2.0
  train.run(config, str(tmp_path))
  rows = [r for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")
          if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  n = config.rl.prompts_per_step * config.rl.group_size
  for r in rows:
    assert r["reward/raises/errors"] == n
    assert r["reward/hangs/timeouts"] == n
    assert r["reward/returns_none/none"] == n
    assert r["reward/numeric_match/valid_frac"] == 1.0
    assert np.isfinite(r["pg_loss"])


# --- validation, before any compile -----------------------------------------

@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c.rl, "advantage", "ppo9000"),
     r"rl.advantage='ppo9000' is unknown; accepted: \('grpo'"),
    (lambda c: setattr(c.rl, "objective", "trpo"), r"rl.objective='trpo'"),
    (lambda c: setattr(c.rl, "group_size", 1), r"rl.group_size=1 with rl.advantage='grpo'"),
    (lambda c: setattr(c.rl, "aggregation", "mean"), r"rl.aggregation='mean'"),
    (lambda c: setattr(c.rewards, "names", ("nope",)), r"rewards.names contains 'nope'"),
    (lambda c: setattr(c.rl, "num_minibatches", 3), r"do not split into"),
])
def test_bad_config_fails_early_naming_the_field(change, match):
  config = tiny_config()
  change(config)
  with pytest.raises(ValueError, match=match):
    train.validate(config)


def test_batch_not_divisible_by_mesh_fails_before_compile(tmp_path):
  config = tiny_config()
  config.mesh.data, config.mesh.fsdp = 8, 1
  config.rl.prompts_per_step = 6
  with pytest.raises(ValueError, match=r"rl.prompts_per_step=6 does not divide"):
    train.run(config, str(tmp_path))


def test_prompt_bucket_shorter_than_longest_prompt_fails(tmp_path):
  config = tiny_config()
  config.sampler.prompt_buckets = (2,)
  with pytest.raises(ValueError, match=r"sampler.prompt_buckets=\(2,\): the longest prompt"):
    train.run(config, str(tmp_path))
