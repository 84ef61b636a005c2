"""The adaptive KL coefficient (``rljax/train/kl_control.py``): the update
by hand on both sides of its clip, from the config through the loop (the
logged coefficients follow the logged KLs), and across a resume."""

import math

import pytest

from rljax.train import build, kl_control
from tests.test_loop import assert_stop_and_resume_matches, loop_config, rl_rows


def test_the_update_by_hand():
  # e = kl / target - 1, clipped to +-0.2; coef * (1 + e * n / horizon).
  assert kl_control.next_coef(0.1, 0.15, 0.1, 50, 100) == pytest.approx(
      0.1 * (1 + 0.2 * 0.5))                      # e = 0.5 -> 0.2
  assert kl_control.next_coef(0.1, 0.12, 0.1, 50, 100) == pytest.approx(
      0.1 * (1 + 0.2 * 0.5))                      # e = 0.2: at the clip
  assert kl_control.next_coef(0.1, 0.11, 0.1, 50, 100) == pytest.approx(
      0.1 * (1 + 0.1 * 0.5))                      # e = 0.1: inside
  assert kl_control.next_coef(0.1, 0.09, 0.1, 50, 100) == pytest.approx(
      0.1 * (1 - 0.1 * 0.5))
  assert kl_control.next_coef(0.1, 0.0, 0.1, 50, 100) == pytest.approx(
      0.1 * (1 - 0.2 * 0.5))                      # e = -1 -> -0.2
  assert kl_control.next_coef(0.1, 0.1, 0.1, 50, 100) == 0.1
  assert kl_control.next_coef(0.1, math.nan, 0.1, 50, 100) == 0.1


def test_a_target_needs_a_starting_coefficient():
  with pytest.raises(ValueError, match="rl.kl_target=0.01 with rl.kl_coef=0"):
    build.validate(loop_config(**{"rl.kl_target": 0.01}))
  with pytest.raises(ValueError, match="rl.kl_target"):
    build.validate(loop_config(**{"rl.kl_coef": 0.1, "rl.kl_target": -1.0}))


@pytest.mark.slow
def test_the_coefficient_follows_the_measured_kl_and_resumes(tmp_path):
  config = loop_config(**{"rl.kl_coef": 0.1, "rl.kl_target": 1e-4,
                          "rl.kl_horizon": 64, "rl.num_steps": 4,
                          "checkpoint.every": 1})
  from rljax import train  # pylint: disable=import-outside-toplevel
  train.run(config, str(tmp_path / "whole"))
  rows = rl_rows(tmp_path / "whole")
  n = config.rl.prompts_per_step * config.rl.group_size
  coef = 0.1
  for r in rows:  # the step trained with coef, then measured r["kl"]
    assert r["kl_coef"] == pytest.approx(coef, rel=1e-6)
    coef = kl_control.next_coef(coef, r["kl"], 1e-4, n, 64)
  # The KL moved both ways around the target, so did the coefficient.
  assert len({round(r["kl_coef"], 6) for r in rows}) == len(rows)
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)
