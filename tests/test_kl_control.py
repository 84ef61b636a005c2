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


@pytest.mark.slow
def test_log_kl_reports_the_kl_and_trains_as_without_it(tmp_path):
  """``rl.log_kl`` with ``kl_coef = 0``: each step reports a KL to the
  reference (0 at the first update, the params still the reference's; > 0
  after), and the run's other figures and final params are the run's
  without it (a gradient from the KL would move them)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from rljax import train  # pylint: disable=import-outside-toplevel
  base = {"rl.num_steps": 3}
  train.run(loop_config(**base), str(tmp_path / "plain"))
  train.run(loop_config(**base, **{"rl.log_kl": True}), str(tmp_path / "kl"))
  plain, logged = rl_rows(tmp_path / "plain"), rl_rows(tmp_path / "kl")
  assert all("kl" not in r for r in plain)
  assert [r["kl"] for r in logged][0] == pytest.approx(0.0, abs=1e-6)
  assert all(r["kl"] > 0 for r in logged[1:])
  for a, b in zip(plain, logged):
    for k in ("loss", "grad_norm", "reward/total/mean", "pg_loss"):
      if k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
  for x, y in zip(jax.tree.leaves(train.load_policy(tmp_path / "plain").params),
                  jax.tree.leaves(train.load_policy(tmp_path / "kl").params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                               atol=1e-5 * float(np.abs(y).max()))
