"""Reward functions are user code: each test reproduces one way such code
broke or outlived the trainer, and checks that the evaluation completes, the
failure is counted and no process is left behind.

Processes the fixtures start carry a unique marker in their argv; ``pgrep -f``
finds any left over. The fixtures live in ``tests/reward_fixtures.py`` so that
spawned workers can import them. Linux only (process groups, ``/proc``,
``RLIMIT_AS``).
"""

import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from rljax import rewards
from rljax.rewards import pool_worker
from rljax.rewards import evaluation
from tests import reward_fixtures as rf

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux") or
                       shutil.which("pgrep") is None,
                       reason="needs Linux process groups and pgrep"),
    pytest.mark.timeout(120),
]

REPO = pathlib.Path(__file__).resolve().parents[1]
COMPLETIONS = ["0.5", "1e30", "1e300", "-1e300", "inf", "-inf", "10**400",
               "1"]


def _marker():
  return f"rljax-isolation-{uuid.uuid4().hex}"


def _running(marker):
  """Pids of live processes whose command line contains ``marker``."""
  out = subprocess.run(["pgrep", "-f", marker], capture_output=True,
                       text=True, check=False).stdout
  return [int(pid) for pid in out.split()]


def _alive(pid):
  """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _pids(pid_dir, prefix):
  return [int(p.read_text()) for p in pathlib.Path(pid_dir).glob(
      f"{prefix}-*.pid")]


def _eventually(condition, timeout_s=5.0):
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


# -------------------------------------------------- values and exceptions

VALUE_SPECS = [
    rewards.RewardSpec("huge", rf.huge_values, weight=1.0),
    rewards.RewardSpec("float_raises", rf.float_raises, weight=0.0),
    rewards.RewardSpec("sleeper", rf.returns_sleeper, weight=0.0),
    rewards.RewardSpec("exiter", rf.returns_exiter, weight=0.0),
    rewards.RewardSpec("exits", rf.exits, weight=0.0),
    rewards.RewardSpec("generator_exit", rf.raises_generator_exit, weight=0.0),
]


@pytest.fixture(scope="module", params=[2, 0], ids=["workers", "in_process"])
def value_result(request):
  """One evaluation of ``VALUE_SPECS`` on ``COMPLETIONS``, on workers and
  in-process; the trainer (this process) survives it."""
  with rewards.RewardEvaluator(VALUE_SPECS, num_workers=request.param,
                               timeout_s=3.0, chunk_size=4) as evaluator:
    return evaluator.evaluate(["p"] * len(COMPLETIONS), COMPLETIONS)


def test_values_beyond_float32_are_invalid_not_dropped(value_result):
  m = value_result.metrics
  # 1e300, -1e300, +-inf and 10**400 were float32 infinities, counted nowhere.
  np.testing.assert_array_equal(
      value_result.rewards_NxR[:, 0],
      np.float32([0.5, 1e30] + [np.nan] * 5 + [1.0]))
  assert (m["reward/huge/invalid"], m["reward/huge/errors"],
          m["reward/huge/none"], m["reward/huge/clipped"]) == (5, 0, 0, 0)
  assert m["reward/huge/valid_frac"] == 3 / 8
  assert np.isfinite(value_result.total_N).all()
  assert m["reward/total/mean"] == pytest.approx((0.5 + 1e30 + 1.0) / 8)
  assert np.isfinite(m["reward/total/std"])
  assert any("huge[" in s and "invalid: " in s for s in value_result.messages)


def test_clip_keeps_finite_values_and_counts_them():
  spec = rewards.RewardSpec("huge", rf.huge_values)
  with rewards.RewardEvaluator([spec], num_workers=0, clip=10.0) as evaluator:
    result = evaluator.evaluate([""] * 8, COMPLETIONS)
  np.testing.assert_array_equal(result.rewards_NxR[:, 0], [
      0.5, 10, 10, -10, np.nan, np.nan, 10, 1])
  assert (result.metrics["reward/huge/clipped"],
          result.metrics["reward/huge/invalid"]) == (4, 2)
  for clip in (0.0, -1.0, float("inf"), float("nan"), 1e39):
    with pytest.raises(ValueError, match="clip="):
      rewards.RewardEvaluator([spec], num_workers=0, clip=clip)
  for workers in (0, 1):
    with pytest.raises(ValueError, match="memory_limit_mb=0"):
      rewards.RewardEvaluator([spec], num_workers=workers, memory_limit_mb=0)


def test_value_whose_float_raises_is_an_error(value_result):
  m = value_result.metrics
  # COMPLETIONS[3] and [5] start with "-".
  np.testing.assert_array_equal(value_result.rewards_NxR[:, 1],
                                [1, 1, 1, np.nan, 1, np.nan, 1, 1])
  assert (m["reward/float_raises/errors"],
          m["reward/float_raises/valid_frac"]) == (2, 6 / 8)
  assert any("__float__ exploded" in s for s in value_result.messages)


def test_returned_objects_are_never_unpickled_by_the_trainer(value_result):
  # Unpickling a SleepsOnUnpickle sleeps 60 s; an ExitsOnUnpickle would have
  # ended this process. Only floats came back.
  m = value_result.metrics
  assert m["reward/eval_seconds"] < 20
  np.testing.assert_array_equal(value_result.rewards_NxR[:, 2], [0.25] * 8)
  assert (m["reward/exiter/errors"], m["reward/exiter/valid_frac"]) == (8, 0)
  assert m["reward/worker_restarts"] == 0


def test_system_exit_and_generator_exit_are_errors(value_result):
  m = value_result.metrics
  assert m["reward/exits/errors"] == 8
  assert m["reward/generator_exit/errors"] == 8
  assert any("SystemExit: 3" in s for s in value_result.messages)


def test_a_reward_worker_never_imports_jax():
  """A worker imports ``rljax.rewards`` and the reward's module to unpickle
  its calls, never JAX: it starts, and restarts after a timeout, without
  paying for it (``rljax/__init__.py`` imports submodules lazily)."""
  spec = rewards.RewardSpec("jax_imported", rf.jax_imported, weight=1.0)
  with rewards.RewardEvaluator([spec], num_workers=1,
                               timeout_s=60.0) as evaluator:
    result = evaluator.evaluate(["p", "p"], ["1", "2"])
  assert result.valid_NxR.all(), result.messages
  np.testing.assert_array_equal(result.rewards_NxR[:, 0], [0.0, 0.0])


def test_keyboard_interrupt_in_process_stops_the_caller():
  # In-process rewards run in the trainer's thread: Ctrl-C must still stop it.
  spec = rewards.RewardSpec("ki", rf.raises_keyboard_interrupt)
  with rewards.RewardEvaluator([spec], num_workers=0) as evaluator:
    with pytest.raises(KeyboardInterrupt):
      evaluator.evaluate([""], ["x"])


# pylint: disable=protected-access
def test_wire_formats_refuse_malformed_bytes():
  values = evaluation._decode_values(evaluation._encode_values(
      [1.5, None, float("nan"), rf.FloatRaises(), 10**400]))
  np.testing.assert_array_equal(values.values_n[:2], [1.5, np.nan])
  assert values.status_n.tolist() == [0, 1, 1, 2, 0]
  assert values.values_n[4] == sys.float_info.max
  assert "__float__ exploded" in values.note
  for payload in (b"", b"\x01\x00\x00\x00\x00\x00\x00\x00",
                  evaluation._encode_values([1.0])[:-1] + b"\x07"):
    with pytest.raises(ValueError):
      evaluation._decode_values(payload)
  for data in (b"", b"\x04\x00\x00\x00null", b"\x05\x00\x00\x00[[[[[",
               b"\x02\x00\x00\x00{}"):
    with pytest.raises(ValueError):
      pool_worker.parse_message(data)
# pylint: enable=protected-access


# ------------------------------------------------------ process groups


def test_started_and_forked_processes_die_with_the_evaluator(tmp_path):
  marker = _marker()
  specs = [rewards.RewardSpec("forks", rf.forks_child),
           rewards.RewardSpec("starts", rf.starts_subprocess),
           rewards.RewardSpec("forks_both_return", rf.forks_and_both_return),
           rewards.RewardSpec("ki", rf.raises_keyboard_interrupt)]
  fields = {"marker": [marker] * 2, "pid_dir": [str(tmp_path)] * 2}
  evaluator = rewards.RewardEvaluator(specs, num_workers=2, timeout_s=3.0,
                                      chunk_size=1)
  try:
    result = evaluator.evaluate(["p"] * 2, ["a", "b"], fields)
    m = result.metrics
    np.testing.assert_array_equal(result.rewards_NxR[:, :3],
                                  [[1, 1, 2], [1, 1, 2]])
    # A forked child that returned from the reward is ended before it can
    # answer in its parent's place (it may still be on its way out).
    assert m["reward/forks_both_return/errors"] == 0
    returned = _pids(tmp_path, "forks_and_both_return")
    assert len(returned) == 2
    assert _eventually(lambda: not any(_alive(p) for p in returned))
    # KeyboardInterrupt raised by a reward in a worker is just an error.
    assert m["reward/ki/errors"] == 2
    assert m["reward/worker_restarts"] == 0
    # What a call started may serve later calls: it lives until close().
    assert len(_running(marker)) == 2
    forked = _pids(tmp_path, "forks_child")
    assert len(forked) == 2 and all(_alive(p) for p in forked)
  finally:
    evaluator.close()
  assert _eventually(lambda: not _running(marker)), _running(marker)
  assert _eventually(lambda: not any(_alive(p) for p in forked))


def test_timeout_or_death_kills_the_processes_the_call_started(tmp_path):
  marker = _marker()
  specs = [rewards.RewardSpec("hangs", rf.starts_subprocess_and_hangs),
           rewards.RewardSpec("dies", rf.dies_leaving_child)]
  with rewards.RewardEvaluator(specs, num_workers=1, timeout_s=1.0) as ev:
    result = ev.evaluate([""], ["x"], {"marker": [marker],
                                       "pid_dir": [str(tmp_path)]})
    m = result.metrics
    assert m["reward/hangs/timeouts"] == 1
    # A worker that died is seen at once, not at the timeout, although the
    # child it forked still holds its pipe.
    assert (m["reward/dies/errors"], m["reward/dies/timeouts"]) == (1, 0)
    assert any("died (exit code 3)" in s for s in result.messages)
    assert m["reward/worker_restarts"] == 2
    # Gone before close(): the worker's whole group was killed.
    assert _eventually(lambda: not _running(marker)), _running(marker)
    assert not any(_alive(p) for p in _pids(tmp_path, "dies_leaving_child"))


_SCRIPT = textwrap.dedent("""
    import os
    from rljax import rewards
    from tests import reward_fixtures
    spec = rewards.RewardSpec("r", reward_fixtures.{fn})
    evaluator = rewards.RewardEvaluator([spec], num_workers=1, timeout_s=60)
    evaluator.evaluate([""], ["x"], {{"marker": [os.environ["MARKER"]]}})
    print("evaluated, exiting without close()", flush=True)
""")


def _trainer(fn, marker):
  """A stand-in trainer process that scores one batch with ``fn``."""
  return subprocess.Popen(
      [sys.executable, "-c", _SCRIPT.format(fn=fn)], cwd=REPO,
      env={**os.environ, "MARKER": marker}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)


def test_processes_die_when_the_trainer_exits_without_close():
  marker = _marker()
  trainer = _trainer("starts_subprocess", marker)
  out, _ = trainer.communicate(timeout=60)
  assert trainer.returncode == 0 and "evaluated" in out, out
  assert _eventually(lambda: not _running(marker)), _running(marker)


def test_processes_die_when_the_trainer_is_killed():
  marker = _marker()
  trainer = _trainer("starts_subprocess_and_hangs", marker)
  try:
    assert _eventually(lambda: _running(marker), timeout_s=60)
  finally:
    trainer.kill()  # No atexit, no close(): the workers must notice.
    trainer.communicate()
  assert trainer.returncode == -signal.SIGKILL
  assert _eventually(lambda: not _running(marker)), _running(marker)


# -------------------------------------------------------------- memory


def test_memory_limit_makes_a_hog_an_error_and_the_worker_goes_on():
  specs = [rewards.RewardSpec("hog", rf.hogs_memory),
           rewards.RewardSpec("parity", rf.parity)]
  with rewards.RewardEvaluator(specs, num_workers=1, timeout_s=10.0,
                               memory_limit_mb=256) as evaluator:
    for _ in range(2):
      result = evaluator.evaluate(["p"] * 2, ["a", "bb"])
      assert result.metrics["reward/hog/errors"] == 2
      assert any("MemoryError" in s for s in result.messages)
      np.testing.assert_array_equal(result.rewards_NxR[:, 1], [1.0, 0.0])
      assert result.metrics["reward/worker_restarts"] == 0


@pytest.mark.slow
def test_training_completes_with_misbehaving_rewards_and_leaves_no_process(
    tmp_path, monkeypatch):
  """Issue 11's probes, through the training loop: huge values, a raising
  __float__, results that sleep or exit on unpickling, a reward that starts a
  subprocess. Training completes, each failure is counted, no process is
  left behind."""
  import subprocess as sp  # pylint: disable=import-outside-toplevel
  import uuid  # pylint: disable=import-outside-toplevel

  from rljax import metrics, train  # pylint: disable=import-outside-toplevel
  from tests.test_loop import loop_config  # pylint: disable=import-outside-toplevel
  marker = f"rljax-loop-marker-{uuid.uuid4().hex}"
  monkeypatch.setenv("RLJAX_TEST_MARKER", marker)
  config = loop_config()
  names = ("numeric_match", "huge_cycle", "float_raises", "returns_sleeper",
           "returns_exiter", "starts_marked_subprocess")
  config.rewards.names = ("numeric_match",) + tuple(
      f"tests.reward_fixtures:{n}" for n in names[1:])
  config.rewards.weights = (1.0,) * len(names)
  config.rewards.num_workers = 2
  config.rewards.timeout_s = 5.0
  train.run(config, str(tmp_path))
  rows = [r for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")
          if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  n = config.rl.prompts_per_step * config.rl.group_size
  for r in rows:
    assert r["reward/huge_cycle/invalid"] == n // 2  # 1e300 and inf
    assert r["reward/returns_exiter/errors"] == n
    assert r["reward/returns_sleeper/valid_frac"] == 1.0  # 0.25, converted
    assert r["reward/starts_marked_subprocess/valid_frac"] == 1.0
    assert r["reward/float_raises/errors"] + r["reward/float_raises/valid_frac"] * n == n
    assert math.isfinite(r["pg_loss"]) and math.isfinite(r["reward/total/mean"])
  # The sleepers are SIGKILLed with their worker's group at close; on a
  # loaded machine one may not have been scheduled to die yet. A sleeper
  # that escaped would live 300 s.
  deadline = time.time() + 10
  while True:
    left = sp.run(["pgrep", "-f", marker], capture_output=True, text=True)
    if not left.stdout.strip() or time.time() > deadline:
      break
    time.sleep(0.2)
  assert left.stdout.strip() == "", left.stdout
