"""What a user sees: the launchers' console output, run in subprocesses."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
# absl's format: level letter, MMDD, time, thread id, file:line]
ABSL_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]",
                       re.MULTILINE)


def _launch(module, *flags):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, like a user's run
  proc = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT,
                        env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stdout
  return proc.stdout


@pytest.mark.slow
def test_train_prints_rljax_lines_in_order_and_no_third_party_info(tmp_path):
  workdir = str(tmp_path / "run")
  out = _launch("launch.train", "--config=configs/arithmetic_grpo.py:tiny",
                f"--workdir={workdir}", "--config.checkpoint.every=1")
  info = [m.group(0) for m in ABSL_LINE.finditer(out) if m.group(0)[0] in "DI"]
  assert not info, out
  for noise in ("async_checkpointer", "checkpoint_manager", "orbax",
                "Unable to initialize backend"):
    assert noise not in out, out
  assert "\r" not in out
  expected = ["model:", "task arithmetic", "sft step", "held-out before RL",
              "RL step 3/3", "held-out after RL", "run summary:",
              "held-out accuracy (T=", "wall clock", "tokens/s: sampling",
              f"files in {workdir}", "metrics.jsonl", "tensorboard/",
              "checkpoints/"]
  positions = [out.find(text) for text in expected]
  assert -1 not in positions, (expected[positions.index(-1)], out)
  assert positions == sorted(positions), out


@pytest.mark.slow
def test_verbosity_flag_brings_third_party_logs_back():
  flags = ["--preset=tiny", "--prompt=1+1=", "--max_new_tokens=2"]
  assert not ABSL_LINE.search(_launch("launch.sample", *flags))
  assert ABSL_LINE.search(_launch("launch.sample", *flags, "--verbosity=1"))
