"""Several processes, one run (docs/multihost.md), tested on loopback.

Two ``jax.distributed`` processes of 4 simulated CPU devices each (mesh
data=2 x fsdp=4 over 8 global devices) run the tiny config, and their
per-step metrics and final params are compared with one process of 8
devices (this pytest process, tests/conftest.py) running the same global
config: the default loop, and each feature (``CASES``: slots, partial
rollouts, sampling ahead, sampler devices, prompt feeders, replay,
environments, teachers, reward models, judges, LoRA, a critic, rollout
allocation: VIGOR and sGPO). Also: one process of a run SIGKILLed after
checkpoint 2 (the other stops naming it; the relaunched run resumes to the
one-process run), processes started with different configs, a mesh that
splits no rows by host, and the main job's programs compiled without XLA
replicating a tensor whole.

The two-process runs share one persistent compilation cache, so a program
compiled by one run is loaded by the next.
"""

import json
import math
import glob
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from launch import local_cluster
from rljax import train
from tests.test_train import load_config, tiny_config

ROOT = os.path.join(os.path.dirname(__file__), "..")

# KL, two minibatches, SFT, held-out evaluation and checkpoints every 2 steps.
COMMON = {
    "rl.num_steps": 4, "rl.kl_coef": 0.01, "rl.num_minibatches": 2,
    "mesh.data": 2, "mesh.fsdp": 4, "sft.num_steps": 2,
    "eval.greedy": False, "eval.num_samples": 4, "eval.num_examples": 8,
    "eval.every": 2, "checkpoint.every": 2,
    # Padded: packed buffers are reduced in an order that depends on the
    # process layout (a 1e-6 difference that a sampled token can amplify),
    # so the bitwise comparison with one process runs the padded step. The
    # runs that are not compared number for number (a killed process,
    # different configs) train packed.
    "rl.padding_free": False,
}
# The feature and kill cases build one decoder block (half the programs to
# compile; stacking blocks is the default case's and the model tests' to
# check).
ONE_BLOCK = {"model.overrides.num_layers": 1}
# Wall-clock figures differ between any two runs.
_CLOCKS = ("time/", "tokens_per_s/", "reward/eval_seconds")


def config_for(overrides, config_file=None):
  c = tiny_config(None) if config_file is None else load_config(
      os.path.join(ROOT, config_file), "tiny")
  for key, value in {**COMMON, **overrides}.items():
    *path, field = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[field] = value
  return c


def flags_for(overrides, workdir, config_file="configs/arithmetic_grpo.py"):
  args = [f"--config={config_file}:tiny", f"--workdir={workdir}"]
  for key, value in {**COMMON, **overrides}.items():
    args.append(f"--config.{key}={value}")
  return args


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("multihost-jax-cache"))


class Cluster:
  """Two ``launch.train`` processes, started directly (so that a test can
  signal each one)."""

  def __init__(self, args, log_dir, jax_cache, *, extra=((), ())):
    port = local_cluster.free_port()
    env = local_cluster.child_env(4)
    env.update(JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    os.makedirs(log_dir, exist_ok=True)
    self.logs = [os.path.join(log_dir, f"process_{i}.log") for i in range(2)]
    self.procs = []
    for i in range(2):
      command = local_cluster.child_command(
          list(args) + list(extra[i]) + ["--heartbeat_timeout_s=10"],
          process_id=i, num_processes=2, port=port)
      with open(self.logs[i], "ab") as log:
        self.procs.append(subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

  def wait(self, timeout=600):
    deadline = time.time() + timeout
    for p in self.procs:
      p.wait(timeout=max(1, deadline - time.time()))
    return [p.returncode for p in self.procs]

  def output(self, i):
    with open(self.logs[i], errors="replace") as f:
      return f.read()

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    for p in self.procs:
      p.wait()


def rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def assert_same_metrics(got_rows, want_rows):
  """Every figure but the clocks equal to 1e-6 (relative, or absolute for
  figures that are themselves rounding noise; 1e-5 for the sampler/trainer
  logprob mismatches, differences of two fp32 logprobs)."""
  assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows]
  for got, want in zip(got_rows, want_rows):
    keys = {k for k in set(got) | set(want) if not k.startswith(_CLOCKS)}
    for k in sorted(keys):
      a, b = got.get(k), want.get(k)
      assert a is not None and b is not None, (got["step"], k, a, b)
      if isinstance(b, float) and math.isnan(b):
        assert math.isnan(a), (got["step"], k, a, b)
      else:
        # A sampler/trainer logprob mismatch is a difference of two fp32
        # logprobs, each computed in the process layout's order.
        atol = 1e-5 if k.startswith("mismatch/") else 1e-6
        assert np.isclose(a, b, rtol=1e-6, atol=atol), (got["step"], k, a, b)


def assert_same_params(workdir_a, workdir_b):
  a = jax.tree.leaves(train.load_policy(workdir_a).params)
  b = jax.tree.leaves(train.load_policy(workdir_b).params)
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):  # within 1e-6 of each tensor's scale
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6 * np.abs(y).max())


def one_process_run(workdir, overrides, config_file=None):
  train.run(config_for(overrides, config_file), str(workdir))
  return str(workdir)


def wait_for(predicate, procs, timeout, what):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if any(p.poll() is not None for p in procs):
      raise AssertionError(f"a process exited before {what}")
    time.sleep(0.2)
  raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, jax_cache):
  """The default config's run on one process and on two: ``(one, two,
  return codes, each process's output)``. The two-process run is also the
  teacher of the distillation test (a run that several processes wrote)."""
  root = tmp_path_factory.mktemp("two-runs")
  # Each run keeps its warm-up in one cache (rljax/train/sft_cache.py): on
  # two processes process 0 writes what both gathered.
  cache = {"sft.cache_dir": str(root / "sft_cache")}
  want = one_process_run(root / "one", cache)
  workdir = str(root / "two")
  cluster = Cluster(flags_for(cache, workdir), str(root / "logs"), jax_cache)
  codes = cluster.wait()
  return want, workdir, codes, [cluster.output(i) for i in range(2)]


@pytest.mark.slow
def test_two_processes_match_one(two_runs):
  """GRPO with KL, two minibatches, SFT and held-out evaluation."""
  want, workdir, codes, outputs = two_runs
  assert codes == [0, 0], outputs[0][-3000:]
  got_rows = rows(workdir)
  assert_same_metrics(got_rows, rows(want))
  assert any(r["step"] < 0 and "sft/sft_loss" in r for r in got_rows)
  # Two warm-ups, two entries: the key names the process count.
  cache = os.path.join(os.path.dirname(workdir), "sft_cache")
  assert len([f for f in os.listdir(cache) if f.endswith(".npz")]) == 2
  assert "eval/accuracy" in got_rows[-1] and got_rows[-1]["step"] == 4
  assert_same_params(workdir, want)
  # The run directory holds what one process writes (plus the launcher's
  # run record), written once.
  files = [f for f in os.listdir(workdir) if not f.startswith("train_seed")]
  assert sorted(files) == sorted(os.listdir(want))


def _reward_model_dir(path):
  """A tiny random reward model on the tiny config's tokenizer (it reads
  the policy's tokens)."""
  from rljax import models  # pylint: disable=import-outside-toplevel
  from rljax.models import reward_model as rm  # pylint: disable=import-outside-toplevel
  from rljax.train import build  # pylint: disable=import-outside-toplevel
  c = config_for({})
  task, examples, _ = build.load_task(c)
  tokenizer = build.make_tokenizer(c, task, examples)
  rm_config = rm.RewardModelConfig(models.get_preset("tiny").replace(
      vocab_size=tokenizer.vocab_size))
  params = rm.init_params(rm_config, jax.random.key(0))
  kernel = jax.random.normal(jax.random.key(1), (rm_config.decoder.d_model, 1))
  rm.save_hf_reward_model(path, rm_config, {"decoder": params["decoder"],
                                            "score": {"kernel": kernel}})
  (path / "tokenizer.model").write_bytes(tokenizer.serialized)
  return str(path)


def _rl(rows_):
  return [r for r in rows_ if r["step"] > 0]


_PARITY = {"rewards.names": ("numeric_match", "tests.reward_fixtures:parity"),
           "rewards.weights": (1.0, 0.5)}  # groups whose rewards vary


def _teachers(tmp_path, two_runs):
  """On-policy distillation from a teacher run that one process wrote
  (that crashed on several processes), a reward model reading the
  policy's tokens (the global rollout) and a generative judge, a run that
  two processes wrote (each process's rows judged in one global sampler
  call, keyed by the whole batch), with DAPO's dynamic sampling, on tree
  rollouts with TreePO's advantage (each process samples the trees of its
  block of prompts)."""
  teacher, judge = two_runs[0], two_runs[1]
  names = ("numeric_match", f"model:{_reward_model_dir(tmp_path / 'rm')}",
           f"judge:{judge}")
  return {"rl.distill_coef": 0.1, "teacher.path": teacher,
          "rewards.names": names, "rewards.weights": (1.0, 0.5, 0.1),
          "rewards.judges.parser": "tests.reward_fixtures:verdict_length",
          "rl.selection.name": "dapo",  # refills scored by all three
          "rl.rollout": "tree", "rl.advantage": "treepo"}


def _check_teachers(rl):
  assert all(r["distill/reverse_kl"] > 0 and r["select/rounds"] >= 1
             and r["rollout/tree_token_saving"] > 0 for r in rl)
  assert all(r["reward/rm/valid_frac"] == 1 and r["reward/rm/mean"] != 0
             for r in rl)
  assert all(r["reward/two/valid_frac"] == 1 and r["reward/two/mean"] > 0
             for r in rl)


def _check_slots_async_greso(rl):
  assert all(0 < r["rollout/slot_utilization"] <= 1 for r in rl)
  assert all(r["rollout/kv_blocks_peak"] > 0 and r["rollout/kv_blocks_left"]
             == 0 for r in rl)
  assert [r["rollout/sampler_lag"] for r in rl] == [0, 1]
  assert [r["rollout/sampler_devices"] for r in rl] == [2, 2]
  assert all(r["select/rounds"] >= 2 for r in rl), [r["select/rounds"]
                                                    for r in rl]


def _check_partial_dots_replay(rl):
  assert any(r["rollout/carried_groups"] > 0 for r in rl)
  assert any(r["replay/fraction"] > 0 for r in rl)
  assert all(r["dots/round"] >= 1 for r in rl)
  assert "dots/reference_success" in rl[0]


def _check_online_dpo(rl):
  assert all(r["pref/online/reward_chosen"] > r["pref/online/reward_rejected"]
             for r in rl)
  assert all(r["latr/branches"] > 0 for r in rl)
  assert all(0 < r["pref/online/kept_pairs"] <= 0.5 for r in rl)
  assert all(r["pref/grad_norm"] > 0 for r in rl)


# Each case: (overrides, or fn(tmp_path, two_runs) -> overrides; config
# file; a check of the two-process run's RL rows). The cases cover each
# feature on several processes, paired with others where they combine.
CASES = {
    "teachers": (_teachers, None, _check_teachers),
    # Continuous slots on a paged KV cache on 2 sampler devices (one per
    # process; a 2 x 3 trainer mesh), sampled ahead of the update, GRESO
    # skipping prompts and refilling zero-variance groups (DAPO's dynamic
    # sampling). Rows that split over 6 trainer and 2 sampler devices.
    "slots-devices-async-greso": (
        {"rl.rollout": "continuous", "rl.rollout_slots": 8,
         "sampler.kv_cache": "paged", "sampler.kv_block_size": 4,
         "rl.sampler_devices": 2, "mesh.fsdp": 3, "rl.max_staleness": 1,
         "rl.selection.name": "greso", "rl.prompts_per_step": 12,
         "eval.num_examples": 12}, None, _check_slots_async_greso),
    # Partial rollouts carrying groups, replay (8 prompts, 6 fresh).
    # Online DPO (docs/preference.md): pairs sampled from the global
    # batch with LATR's branching (each process's rows, its block of the
    # prompts' trees: half of each group, as the pairwise test's LATR),
    # labelled by the rewards, the half with the largest
    # score gaps trained against the reference; held-out pairs scored on
    # both processes' rows.
    "online-dpo": ({"preference.loss": "dpo", "preference.online": True,
                    "preference.online_top_fraction": 0.5,
                    "preference.max_length": 22, "preference.num_pairs": 64,
                    "preference.num_heldout": 16, "eval.every": 2,
                    "rl.rollout": "latr", "rl.latr.abs_threshold": 0.0,
                    "rl.latr.rel_threshold": 0.0, "rl.latr.mix_ratio": 0.5,
                    **_PARITY}, None, _check_online_dpo),
    # DOTS choosing the prompts, and every metric writer: process 0 alone
    # logs to W&B and MLflow (offline; one run each, checked below).
    "partial-dots-replay": (
        {"rl.rollout": "partial", "rl.rollout_slots": 8, "rl.num_steps": 3,
         "rl.replay.fraction": 0.25, "rl.selection.name": "dots",
         "rl.selection.dots_reference": 8,
         "metrics.writers": ("jsonl", "tensorboard", "wandb", "mlflow"),
         "metrics.histogram_every": 1, **_PARITY}, None,
        _check_partial_dots_replay),
    # Calculator episodes on 8 slots (a slot plays any process's episode),
    # each process stepping its own (in-process: with workers the decode
    # rounds, and so the slot figures, follow when the steps end; the kill
    # test runs workers), as partial rollouts: an episode unfinished at a
    # step's end is carried with its environment state, which any process
    # can step next; held-out episodes. The slots' KV cache is paged: a
    # group's prompt blocks shared, an episode's blocks released as it ends.
    "calculator-partial-paged": ({"eval.every": 2, "env.num_workers": 0,
                            "rl.rollout": "partial", "rl.rollout_slots": 8,
                            "rl.partial_max_carried": 1.0,
                            "sampler.kv_cache": "paged",
                            "sampler.kv_block_size": 4,
                            "rewards.names": ("env",
                                              "tests.reward_fixtures:parity"),
                            "rewards.weights": (1.0, 0.5)},
                           "configs/calculator_grpo.py",
                           lambda rl: all(r["env/turns/mean"] > 1
                                          and r["env/failed_episodes"] == 0
                                          and r["rollout/slots"] == 8
                                          and r["rollout/kv_blocks_peak"] > 0
                                          and r["rollout/kv_blocks_left"] == 0
                                          for r in rl)
                           and rl[0]["rollout/carried_groups"] > 0),
    # Calculator episodes as trees that fork between turns
    # (rljax/rollout/episode_tree.py), on a paged cache (forks share block
    # tables), TreePO's advantage: every process takes the same forks from
    # the gathered rows, and a child's environment state stays with the
    # process that owns its example.
    "calculator-tree-paged": ({"env.num_workers": 0, "rl.rollout": "tree",
                               "rl.advantage": "treepo",
                               "sampler.kv_cache": "paged",
                               "sampler.kv_block_size": 4,
                               "rewards.names": (
                                   "env", "tests.reward_fixtures:parity"),
                               "rewards.weights": (1.0, 0.5)},
                              "configs/calculator_grpo.py",
                              lambda rl: all(
                                  r["rollout/tree_token_saving"] > 0
                                  and r["env/failed_episodes"] == 0
                                  and r["rollout/kv_blocks_left"] == 0
                                  for r in rl)),
    # Trees on a paged KV cache, LoRA adapters on a frozen base, PPO's
    # critic (GAE), VIGOR's rounds (each prompt entry a tree of 2 leaves,
    # merged into groups of unequal size across the processes' rows)
    # refilled by DAPO's dynamic sampling (passes of new prompts while
    # groups without variance leave rows), with replay (step 2 samples 6
    # fresh prompts in rounds and replays 2 groups of step 1's), and
    # SPEC-RL drafting step 2's trees from step 1's (8 training prompts).
    # The 6 fresh prompts pad to the mesh's 8 on two processes: the
    # padding's copies draft and store nothing.
    "lora-critic-vigor-tree-spec-dapo-replay": (
        {"model.lora.rank": 4, "rl.advantage": "gae",
         "rl.allocation.name": "vigor", "rl.allocation.rounds": 2,
         "rl.rollout": "tree", "rl.tree.roots": 1,
         "rl.selection.name": "dapo", "rl.replay.fraction": 0.25,
         "sampler.kv_cache": "paged", "sampler.speculative": True,
         "task.num_train": 8, **_PARITY}, None,
        lambda rl: all(r["alloc/rounds"] == 2 and r["select/rounds"] >= 1
                       and np.isfinite(r["critic/value_loss"])
                       and r["rollout/tree_token_saving"] > 0
                       and r["rollout/kv_blocks_peak"] > 0 for r in rl)
        and rl[-1]["replay/fraction"] > 0
        and rl[-1]["spec/drafted_rows"] > 0),
    # sGPO's profiling pass over the pool at the first step, then its
    # curriculum's group sizes (16 training prompts: a short pass; the
    # untrained tiny model solves few, so the unsolved ones are kept), with
    # SPEC-RL drafting each prompt entry from the rows of its last step
    # (the profile's, from step 2), and replay (step 2 samples the
    # curriculum's next 6 prompts and replays 2 groups of step 1's).
    "sgpo-spec-replay": ({"rl.allocation.name": "sgpo", "task.num_train": 16,
                          "rl.allocation.unsolved_keep": 1.0,
                          "sampler.speculative": True,
                          "rl.replay.fraction": 0.25, **_PARITY}, None,
                         lambda rl: "alloc/profile_trivial" in rl[0]
                         and rl[0]["spec/drafted_rows"] == 0
                         and all(r["spec/drafted_rows"] > 0 for r in rl[1:])
                         and all(r["alloc/max_group"] >= r["alloc/min_group"]
                                 >= 1 and "alloc/curriculum_position" in r
                                 for r in rl)
                         and rl[-1]["replay/fraction"] > 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_features_on_two_processes_match_one(case, two_runs, tmp_path,
                                             jax_cache, monkeypatch):
  """Each feature on two processes (2 x 4 devices) logs the same per-step
  metrics as on one process of 8 devices, to 1e-6, and acts (its own
  metric). Every decision that changes shapes or the schedule is made on
  the global batch, the same on every process (docs/multihost.md)."""
  overrides, config_file, check = CASES[case]
  if callable(overrides):
    overrides = overrides(tmp_path, two_runs)
  overrides = {"rl.num_steps": 2, "sft.num_steps": 0, "eval.every": 0,
               "checkpoint.every": 100, **ONE_BLOCK, **overrides}
  trackers = "mlflow" in overrides.get("metrics.writers", ())
  if trackers:  # no network: W&B offline, MLflow's store in the run
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  want = one_process_run(tmp_path / "one", overrides, config_file)
  workdir = str(tmp_path / "two")
  flags = (flags_for(overrides, workdir) if config_file is None
           else flags_for(overrides, workdir, config_file))
  cluster = Cluster(flags, str(tmp_path / "logs"), jax_cache)
  assert cluster.wait() == [0, 0], cluster.output(0)[-3000:]
  got_rows = rows(workdir)
  assert_same_metrics(got_rows, rows(want))
  rl = _rl(got_rows)
  assert check(rl) is not False, rl
  if trackers:
    assert_one_tracker_run_each(workdir, got_rows)


def assert_one_tracker_run_each(workdir, jsonl_rows):
  """Process 0 alone logged: one offline W&B run and one MLflow run in the
  shared run directory, holding the steps metrics.jsonl holds."""
  from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
  offline = glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))
  assert len(offline) == 1, offline
  client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(
      workdir, "mlflow.db"))
  [run] = client.search_runs([e.experiment_id for e in
                              client.search_experiments()])
  steps = sorted(r["step"] for r in jsonl_rows if "grad_norm" in r)
  assert [m.step for m in client.get_metric_history(
      run.info.run_id, "grad_norm")] == steps


KILLED = {
    # Calculator episodes stepped in workers, sampled ahead of the update,
    # MC-GRPO's pivot drop, and SPEC-RL drafting each turn from the
    # prompt's last episode (16 training prompts: steps 3-4 revisit steps
    # 1-2's, drafting from the store restored with the checkpoint).
    "calculator-async-mc-spec": (
        {"env.num_workers": 1, "rl.max_staleness": 1,
         "rl.advantage": "mc_grpo", "sampler.speculative": True,
         "task.num_train": 16,
         "rewards.names": ("env", "tests.reward_fixtures:parity"),
         "rewards.weights": (1.0, 0.5)},
        "configs/calculator_grpo.py"),
}


# The multi-process column of tests/test_pairs.py: the two-process run
# that trains each of its features (and matches one process to 1e-6, or,
# for the killed runs, resumes to it).
COLUMN = {
    "continuous": "slots-devices-async-greso", "partial": "partial-dots-replay",
    "async": "calculator-async-mc-spec",
    "sampler_devices": "slots-devices-async-greso",
    "env": "calculator-async-mc-spec", "spec_rl": "calculator-async-mc-spec",
    "lora": "lora-critic-vigor-tree-spec-dapo-replay", "padded": "default",
    "dapo": "teachers", "critic": "lora-critic-vigor-tree-spec-dapo-replay",
    "reward_model": "teachers", "distillation": "teachers",
    "tree": "teachers", "paged": "lora-critic-vigor-tree-spec-dapo-replay",
    "latr": "online-dpo",
}


def test_every_feature_of_the_pairwise_test_runs_on_two_processes():
  from tests import test_pairs  # pylint: disable=import-outside-toplevel
  assert set(COLUMN) == set(test_pairs.FEATURES)
  for feature, case in COLUMN.items():
    assert case == "default" or case in CASES or case in KILLED, case
    overrides, config_file = (({}, None) if case == "default"
                              else (CASES.get(case) or KILLED[case])[:2])
    if callable(overrides):  # the teachers: names and settings of run dirs
      continue
    config = config_for(overrides, config_file)
    for key, value in test_pairs.FEATURES[feature].settings.items():
      got = config
      for part in key.split("."):
        got = got[part]
      if feature == "sampler_devices":  # 2 of 8 here, 4 of 8 in the pairs
        assert got > 0, (feature, case, key, got)
      else:
        assert got == value, (feature, case, key, got)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLED))
def test_a_killed_process_stops_the_other_and_the_run_resumes(case, tmp_path,
                                                             jax_cache):
  """Process 1 of an asynchronous environment run (SPEC-RL drafting its
  turns, MC-GRPO; its workers with it) is SIGKILLed once checkpoint 2 is
  on disk: process 0
  stops within 2 minutes with a non-zero code, naming it; relaunched, the
  run resumes from checkpoint 2 and ends as the uninterrupted one-process
  run, every step's metrics (steps 1-2 from the first launch, 3-4 from the
  resumed one) and the params."""
  extra, config_file = KILLED[case]
  overrides = {"rl.num_steps": 4, "sft.num_steps": 0, "eval.every": 0,
               "checkpoint.every": 2, **ONE_BLOCK, **extra}
  want = one_process_run(tmp_path / "one", overrides, config_file)
  workdir = str(tmp_path / "two")
  args = flags_for(overrides, workdir, config_file)
  cluster = Cluster(args, str(tmp_path / "logs"), jax_cache)
  try:
    wait_for(lambda: os.path.isdir(os.path.join(workdir, "checkpoints", "2")),
             cluster.procs, 400, "checkpoint 2")
    cluster.procs[1].send_signal(signal.SIGKILL)
    start = time.time()
    cluster.procs[0].wait(timeout=120)
    elapsed = time.time() - start
  finally:
    cluster.kill()
  assert cluster.procs[0].returncode != 0
  assert elapsed < 120
  out = cluster.output(0)
  assert "unhealthy (stopped sending heartbeats)" in out, out[-2000:]
  lost = out.split("unhealthy (stopped sending heartbeats):", 1)[1]
  assert lost.split()[0] == "1", lost[:200]
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", "4"))
  resumed = Cluster(args, str(tmp_path / "logs"), jax_cache)
  assert resumed.wait() == [0, 0], resumed.output(0)[-3000:]
  assert "resumed from step 2" in resumed.output(0)
  got_rows = rows(workdir)
  assert_same_metrics(got_rows, rows(want))
  assert_same_params(workdir, want)
  # Drafts from the restored store (episodes: their turns).
  assert [r["spec/drafted_rows"] > 0 for r in _rl(got_rows)] == [
      False, False, True, True]


@pytest.mark.slow
def test_processes_with_different_configs_fail_at_start_naming_the_field(
    tmp_path, jax_cache):
  workdir = str(tmp_path / "run")
  cluster = Cluster(flags_for({}, workdir), str(tmp_path / "logs"), jax_cache,
                    extra=((), ("--config.rl.kl_coef=0.02",)))
  codes = cluster.wait(timeout=300)
  assert codes[0] != 0 and codes[1] != 0
  for i in range(2):
    assert ("field rl.kl_coef is 0.01 on process 0 and 0.02 on process 1"
            in cluster.output(i)), cluster.output(i)[-2000:]
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


@pytest.mark.slow
def test_a_mesh_that_splits_no_rows_by_host_is_refused(tmp_path, jax_cache):
  """tensor=8 over both hosts leaves the batch whole on every process: no
  process has rows of its own, so the run stops before compiling."""
  workdir = str(tmp_path / "run")
  cluster = Cluster(
      flags_for({"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 8}, workdir),
      str(tmp_path / "logs"), jax_cache)
  assert cluster.wait(timeout=300) == [1, 1]
  for i in range(2):
    out = cluster.output(i)
    assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 8}" in out, out[-2000:]
    assert "must be a multiple of the process count" in out


# XLA's SPMD partitioner prints this when it cannot reshard a tensor with
# collectives and replicates it whole instead.
_REMAT = "Involuntary full rematerialization"
_BAD_RESHARD = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from rljax import sharding
mesh = sharding.make_mesh(data=2, fsdp=4, tensor=1)
x = jax.device_put(np.ones((8, 4, 8), np.float32),
                   NamedSharding(mesh, P(("data", "fsdp"))))
jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P(None, None, "fsdp"))
        ).lower(x).compile()
"""


@pytest.mark.slow
def test_the_main_jobs_programs_compile_without_full_rematerialization(
    tmp_path):
  """SFT, the sampler, the packed RL step and held-out evaluation of the
  main job's config, compiled afresh (no cache) for a 2 x 4 mesh: XLA
  warns of no tensor replicated whole. One process of 8 devices compiles
  them: XLA partitions the same global program for the mesh however many
  processes hold its devices (two would compile it twice). The control, a
  reshard XLA cannot do with collectives, shows the warning reaches the
  captured output."""
  env = local_cluster.child_env(8)
  control = subprocess.run([sys.executable, "-c", _BAD_RESHARD], cwd=ROOT,
                           env=env, capture_output=True, text=True,
                           timeout=120, check=True)
  assert _REMAT in control.stderr, control.stderr[-2000:]

  workdir = str(tmp_path / "run")
  args = ["--config=configs/arithmetic_grpo.py:tiny", f"--workdir={workdir}",
          "--config.mesh.data=2", "--config.mesh.fsdp=4",
          "--config.rl.num_steps=2", "--config.sft.num_steps=2",
          "--config.eval.every=2", "--config.eval.num_examples=8"]
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  run = subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600,
                       check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "8 cpu device(s), mesh {'data': 2, 'fsdp': 4" in run.stderr, (
      run.stderr[-3000:])
  assert any("eval/accuracy" in r for r in rows(workdir))
  assert _REMAT not in run.stderr, run.stderr[-3000:]
