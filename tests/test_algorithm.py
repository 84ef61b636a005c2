"""``rljax.train.table``, ``schema`` and ``algorithm``: the algorithm table is
the one place names, fields and defaults live, and everything derives from it.

References are independent of the table: hand-written transforms, the
README's text, configs/common.py's values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from launch import algorithm_table
from rljax import advantages as adv
from rljax import objectives as obj
from rljax.train import algorithm as alg_lib
from rljax.train import build as build_lib
from rljax.train import schema, table
from tests.test_train import tiny_config
from tests import compile_count


def test_readme_lists_exactly_the_table():
  readme = algorithm_table.GUIDE.read_text()
  assert algorithm_table.START in readme and algorithm_table.END in readme
  assert algorithm_table.with_tables(readme) == readme, (
      "docs/guides/algorithms.md's algorithm tables differ from rljax/train/table.py: run "
      "python -m launch.algorithm_table --write")


def test_readme_check_fails_on_a_missing_name():
  readme = algorithm_table.GUIDE.read_text()
  broken = readme.replace("| `cispo` |", "| `cispo_typo` |")
  assert algorithm_table.with_tables(broken) != broken


def test_every_entry_field_is_a_config_field_with_its_default():
  config = schema.base_config()
  for axis, entries in table.AXES.items():
    for name, entry in entries.items():
      for field, spec in entry.fields.items():
        assert field in config.rl, (axis, name, field)
        assert config.rl[field] == spec.default, (name, field)
      for field in entry.reads:
        assert field in config.rl, (axis, name, field)


def test_defaults_live_in_one_place():
  """configs/common.base() is the schema; a field no entry or base declares
  is not accepted, and a restated default elsewhere is caught by
  tests/test_layout.py."""
  from configs import common
  assert common.base().to_dict() == schema.base_config().to_dict()


def test_partial_sections_take_the_schema_defaults():
  # clip_eps_high: the schema's 0.28 (DAPO), not a second default of eps_low.
  coef = alg_lib.coefficient_chain({"objective": "ppo_clip"})
  ratio = jnp.array([[1.25, 1.3, 0.75]], jnp.float32)
  a = jnp.ones((1,), jnp.float32)
  c, _ = coef.update(ratio, coef.init(ratio), advantages_BxT=a)
  # r = 1.25 < 1.28 keeps its coefficient; 1.3 > 1.28 is clipped (A > 0).
  np.testing.assert_allclose(c, [[1.25, 0.0, 0.75]])


@pytest.mark.parametrize("name", sorted(table.ADVANTAGES))
def test_every_advantage_name_builds_and_maps_rewards_to_advantages(name):
  rl = {"advantage": name, "group_size": 4, "num_steps": 1,
        "pass_threshold": 0.5}
  needs = alg_lib.sampling_needs(name)
  alg = alg_lib.from_config(rl, {}, max_new_tokens=8, seed=0)
  assert alg.extra_samples == needs["extra_samples"]
  g = 4 + alg.extra_samples
  alg.check_advantage_shapes(2 * g, 2, g)


def test_grpo_preset_equals_the_hand_built_chain():
  rewards = jnp.asarray(np.random.default_rng(0).normal(size=(8, 2)),
                        jnp.float32)
  kwargs = dict(group_size=4, mask_N=jnp.ones(8, bool),
                reward_weights_R=jnp.array([1.0, 0.5]))
  got = alg_lib.advantage_chain({"advantage": "grpo"}, 4)
  want = optax.chain(adv.sum_rewards(), adv.center_by_group_mean(),
                     adv.scale_by_group_std(1e-6))
  a = got.update(rewards, got.init(rewards), **kwargs)[0]
  b = want.update(rewards, want.init(rewards), **kwargs)[0]
  np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_chain_takes_one_head_and_the_links_in_order():
  rewards = jnp.asarray([[1.0], [3.0], [2.0], [0.0]], jnp.float32)
  kwargs = dict(group_size=4, mask_N=jnp.ones(4, bool),
                reward_weights_R=jnp.ones(1))
  chain = alg_lib.advantage_chain(
      {"advantage": "center_by_group_mean+clip_advantages",
       "advantage_clip": 1.0}, 4)
  a = chain.update(rewards, chain.init(rewards), **kwargs)[0]
  np.testing.assert_allclose(a, [-0.5, 1.0, 0.5, -1.0])


def test_objective_traits_reach_the_algorithm_and_the_step():
  assert alg_lib.from_config({"objective": "ess", "group_size": 2,
                              "num_steps": 1}, {}).ess_kl_coef == 1.0
  config = tiny_config()
  config.rl.objective = "dro"
  config.rl.dro_beta = 0.1
  assert build_lib.step_config(config).dro_beta == 0.1
  config.rl.objective = "kl_cov"
  cfg = build_lib.step_config(config)
  assert cfg.kl_cov_coef == config.rl.kl_cov_coef and cfg.dro_beta == 0.0


def test_dppo_cap_is_a_field():
  """The DPPO cap reaches the transform: the coefficient is the ratio to the
  sampler, min(pi / mu, cap), inside the trust region."""
  ratio = jnp.array([[2.5, 2.5]], jnp.float32)
  lp = jnp.log(jnp.array([[0.5, 0.5]], jnp.float32))
  kwargs = dict(advantages_BxT=jnp.ones((1,)), old_logprobs_BxT=lp - jnp.log(
      2.5), sampler_logprobs_BxT=lp - jnp.log(2.5))
  for cap, want in ((10.0, 2.5), (2.0, 2.0)):
    tx = alg_lib.coefficient_chain({"objective": "dppo_tv", "dppo_cap": cap,
                                    "clip_eps_low": 0.9, "clip_eps_high": 0.9})
    c, _ = tx.update(ratio, tx.init(ratio), **kwargs)
    np.testing.assert_allclose(c, [[want, want]], rtol=1e-6)


# --- hostile input -----------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("advantage", "grpoo", "rl.advantage='grpoo' is unknown"),
    ("advantage", "grpo+center_by_group_mean", "a link of a '+' chain"),
    ("objective", "ppo", "rl.objective='ppo' is unknown"),
    ("is_correction", "ti", "rl.is_correction='ti' is unknown"),
    ("kl_estimator", "k4", "rl.kl_estimator='k4' is unknown"),
    ("aggregation", "mean", "rl.aggregation='mean' is unknown"),
    ("dro_beta", 0.0, "rl.dro_beta=0.0"),
    ("gamma", 1.5, "rl.gamma=1.5"),
    ("dppo_cap", -1.0, "rl.dppo_cap=-1.0"),
    ("opsm_delta", float("nan"), "rl.opsm_delta=nan"),
    ("vespo_lambda_pos", 0.0, "rl.vespo_lambda_pos=0.0"),
])
def test_bad_names_and_fields_are_refused_with_the_field(field, value,
                                                         message):
  config = tiny_config()
  config.rl[field] = value
  with pytest.raises(ValueError, match=message.replace("+", r"\+")):
    build_lib.validate(config)


def test_raw_singletons_are_refused_by_a_chain_that_ignores_them():
  config = tiny_config()
  config.rl.singleton_groups = "raw"
  config.rl.advantage = "rloo"
  build_lib.validate(config)
  for name in ("gdpo", "center_by_group_mean+scale_by_group_mad"):
    config.rl.advantage = name
    with pytest.raises(ValueError, match="rl.singleton_groups='raw' with "
                       "rl.advantage="):
      build_lib.validate(config)


def test_vespo_refuses_a_second_sampler_correction():
  config = tiny_config()
  config.rl.objective = "vespo"
  config.rl.is_correction = "tis"
  with pytest.raises(ValueError, match="rl.is_correction='tis' with "
                     "rl.objective='vespo'"):
    build_lib.validate(config)
  config.rl.is_correction = "none"
  config.rl.vespo_is_mode = "clip"
  with pytest.raises(ValueError, match="rl.vespo_is_mode='clip'"):
    build_lib.validate(config)


def test_an_older_config_json_without_new_fields_is_completed():
  old = tiny_config().to_dict()
  for field in ("gamma", "dro_beta", "opsm_delta", "dppo_cap"):
    del old["rl"][field]
  del old["teacher"]
  full = schema.complete_config(old)
  assert full.rl.gamma == 1.0 and full.teacher.path == ""
  build_lib.validate(full)


def test_the_table_and_the_step_agree_on_the_names():
  assert set(table.KL_ESTIMATORS) == set(obj.KL_ESTIMATORS)
  assert set(table.AGGREGATIONS) == set(obj.AGGREGATIONS)
  assert set(table.REJECTION_STATISTICS) == set(obj.REJECTION_STATISTICS)


def test_algorithm_built_by_hand_still_trains_shapes():
  alg = alg_lib.Algorithm(
      advantage=optax.chain(adv.sum_rewards(), adv.grpo_passk()),
      coefficient=obj.reinforce(), optimizer=optax.sgd(0.1))
  alg.check_advantage_shapes(8, 1, 4)
  ratio = jnp.ones((2, 3))
  c, _ = alg.coefficient.update(ratio, alg.coefficient.init(ratio))
  np.testing.assert_array_equal(c, 1.0)
  with pytest.raises(ValueError, match="ratio_BxT must have shape"):
    alg.coefficient.update(jnp.ones(3), None)


def test_jit_of_a_table_chain_does_not_recompile():
  tx = alg_lib.coefficient_chain({"objective": "opsm"})
  fn = jax.jit(lambda r, a, m, s: tx.update(
      r, tx.init(r), advantages_BxT=a, mask_BxT=m, sampler_logprobs_BxT=s,
      old_logprobs_BxT=s)[0])
  r = jnp.ones((2, 3))
  args = (r, jnp.ones(2), jnp.ones((2, 3), bool), jnp.zeros((2, 3)))
  with compile_count.lowerings() as programs:
    fn(*args)
    fn(*(jnp.array(np.asarray(x)) for x in args))
  assert programs["<lambda>"] == 1, programs
