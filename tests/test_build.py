"""``rljax.train.build``: every check of ``validate`` and the advantage-shape
check of ``build``, all without compiling anything."""

import glob
import importlib.util
import math
import os
import re

import jax
import ml_collections
import optax
import pytest

from rljax import advantages, sharding
from tests import reward_models
from tests.compile_count import no_compiles
from rljax.train import build as build_lib
from rljax.train import algorithm as alg_lib
from rljax.train import model_rewards, schema

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
CONFIGS = sorted(p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                 if os.path.basename(p) != "common.py"
                 and not os.path.basename(p).startswith("_"))


def load_config(name="arithmetic_grpo.py", arg="tiny"):
  path = os.path.join(CONFIG_DIR, name)
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.fixture
def config():
  return load_config()


@pytest.fixture(scope="module")
def mesh8():
  """Eight-way data parallelism: the batch axes split rows 8 ways."""
  return sharding.mesh_from_config(
      ml_collections.ConfigDict({"data": 8, "fsdp": 1, "tensor": 1}))


def raises(*fields_and_values):
  """``pytest.raises(ValueError)`` whose message contains every given text."""
  pattern = "".join(f"(?=.*{re.escape(s)})" for s in fields_and_values)
  return pytest.raises(ValueError, match=re.compile(pattern, re.S))


def test_no_compiles_detects_a_compile():
  with pytest.raises(AssertionError, match="compiled"):
    with no_compiles():
      jax.jit(lambda x: x * 3 + 1)(jax.numpy.float32(2.0)).block_until_ready()


def checkpoint_dir(directory, files=("config.json", "model.safetensors",
                                     "tokenizer.json")):
  """A directory holding the named (empty) files of a Hugging Face checkpoint:
  ``validate`` looks for them and reads none."""
  os.makedirs(directory, exist_ok=True)
  for name in files:
    with open(os.path.join(directory, name), "w"):
      pass
  return str(directory)


def jsonl_file(path):
  with open(path, "w") as f:
    f.write('{"prompt": "1+1=", "answer": "2"}\n')
  return str(path)


def with_local_files(config, directory):
  """``config`` with the files it names made under ``directory``: a JSONL
  task's files, a checkpoint where its chat template needs one, and the
  reward models of an ``ensemble:`` reward (made by ``launch.
  train_reward_model`` before such a run)."""
  for field in ("path", "heldout_path"):
    if config.task[field]:
      config.task[field] = jsonl_file(os.path.join(directory, f"{field}.jsonl"))
  if config.tokenizer.chat_template and not config.model.path:
    config.model.path = checkpoint_dir(os.path.join(directory, "ckpt"))
  names = []
  for name in config.rewards.names:
    if model_rewards.is_ensemble(name):
      members = model_rewards.ensemble_members(name)
      name = "ensemble:" + ",".join(
          reward_models.tiny_reward_model(os.path.join(directory, f"rm{i}"))
          for i in range(len(members)))
    names.append(name)
  config.rewards.names = tuple(names)
  return config


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("arg", ["", "tiny"])
def test_every_config_validates(path, arg, tmp_path):
  config = with_local_files(load_config(path, arg), tmp_path)
  with no_compiles():
    build_lib.validate(config)
    build_lib.validate(config, sharding.mesh_from_config(config.mesh))


def test_tiny_config_validates_on_an_eight_way_data_mesh(config, mesh8):
  with no_compiles():
    build_lib.validate(config, mesh8)


# ----------------------------------------------------------------------------
# Positive integers.


@pytest.mark.parametrize("field", ["num_steps", "prompts_per_step", "group_size",
                                   "num_epochs", "num_minibatches",
                                   "num_microbatches"])
@pytest.mark.parametrize("value", [0, -3])
def test_rl_counts_must_be_positive(config, field, value):
  config.rl[field] = value
  with raises(f"rl.{field}={value}", "positive integer"):
    build_lib.validate(config)


@pytest.mark.parametrize("field", ["checkpoint.every",
                                   "eval.num_examples", "eval.num_samples",
                                   "sampler.max_new_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_section_counts_must_be_positive(config, field, value):
  section, name = field.split(".")
  config[section][name] = value
  with raises(f"{field}={value}", "positive integer"):
    build_lib.validate(config)


def test_evaluation_steps_are_every_eval_every_and_the_last(config):
  """Steps 0 (before RL), each multiple of ``eval.every`` and the last;
  none with ``eval.every=0``."""
  config.rl.num_steps, config.eval.every = 5, 2
  s = build_lib.loop_settings(config)
  assert [t for t in range(6) if s.evaluates_at(t)] == [0, 2, 4, 5]
  config.eval.every = 0
  s = build_lib.loop_settings(config)
  assert not [t for t in range(6) if s.evaluates_at(t)]


def test_eval_every_zero_turns_evaluation_off_and_below_is_refused(config):
  """``eval.every=0``: no held-out evaluation (the bound's accepted side);
  -1 is refused, naming the field."""
  config.eval.every = 0
  build_lib.validate(config)
  config.eval.every = -1
  with no_compiles(), raises("eval.every=-1"):
    build_lib.validate(config)


# ----------------------------------------------------------------------------
# Names chosen from a list.


def test_unknown_advantage_preset(config):
  config.rl.advantage = "gpro"
  with raises("rl.advantage='gpro' is unknown", "'grpo'",
              "center_by_group_mean"):
    build_lib.validate(config)


def test_unknown_link_of_an_advantage_chain(config):
  config.rl.advantage = "center_by_group_mean+scale_by_group_sdt"
  with raises("rl.advantage (a link of a '+' chain)='scale_by_group_sdt'",
              "'scale_by_group_std'"):
    build_lib.validate(config)


def test_a_preset_is_not_a_link_of_a_chain(config):
  config.rl.advantage = "grpo+clip_advantages"
  with raises("rl.advantage (a link of a '+' chain)='grpo' is unknown"):
    build_lib.validate(config)


def test_a_known_chain_validates(config):
  config.rl.advantage = "center_by_group_median+scale_by_group_mad"
  build_lib.validate(config)


@pytest.mark.parametrize("path,value,accepted", [
    ("rl.objective", "ppo", "ppo_clip"),
    ("rl.is_correction", "truncated", "tis"),
    ("rl.is_level", "word", "sequence"),
    ("rl.aggregation", "sequence_sum", "sequence_mean_token_sum_norm"),
    ("rl.old_logprobs", "cached", "recompute"),
    ("rl.ess_pooling", "batch", "minibatch"),
    ("optimizer.name", "sgdm", "adamw"),
    ("optimizer.ess_scaling", "cubic", "sqrt"),
])
def test_unknown_choice(config, path, value, accepted):
  section, name = path.split(".")
  config[section][name] = value
  with raises(f"{path}={value!r} is unknown", f"'{accepted}'"):
    build_lib.validate(config)


def test_every_accepted_choice_validates(config):
  for path, values in [("rl.objective", alg_lib.OBJECTIVES),
                       ("rl.is_correction", alg_lib.IS_CORRECTIONS),
                       ("rl.is_level", ("token", "sequence")),
                       ("rl.aggregation", ("token_mean",
                                           "sequence_mean_token_mean",
                                           "sequence_mean_token_sum",
                                           "sequence_mean_token_sum_norm")),
                       ("rl.old_logprobs", ("recompute", "sampler")),
                       ("rl.ess_pooling", ("microbatch", "minibatch")),
                       ("optimizer.name", ("adamw", "adam", "sgd", "lion")),
                       ("optimizer.ess_scaling", ("sqrt", "linear"))]:
    section, name = path.split(".")
    default = config[section][name]
    for value in values:
      config[section][name] = value
      build_lib.validate(config)
    config[section][name] = default


# ----------------------------------------------------------------------------
# Finite numbers.


@pytest.mark.parametrize("value", [-1e-3, float("nan"), 0.0, float("inf")])
def test_learning_rate_must_be_finite_and_positive(config, value):
  config.optimizer.learning_rate = value
  with raises(f"optimizer.learning_rate={value!r}", "finite number > 0"):
    build_lib.validate(config)


@pytest.mark.parametrize("field", ["kl_coef", "entropy_coef"])
@pytest.mark.parametrize("value", [-0.1, float("nan")])
def test_penalty_coefficients_must_be_finite_and_nonnegative(config, field,
                                                             value):
  config.rl[field] = value
  with raises(f"rl.{field}={value!r}", "finite number >= 0"):
    build_lib.validate(config)


def test_zero_penalty_coefficients_validate(config):
  config.rl.kl_coef = 0.0
  config.rl.entropy_coef = 0.0
  build_lib.validate(config)


@pytest.mark.parametrize("value", [0.0, -1.5, float("inf")])
def test_training_temperature_must_be_positive(config, value):
  config.rl.training_temperature = value
  with raises(f"rl.training_temperature={value!r}", "finite number > 0"):
    build_lib.validate(config)


# ----------------------------------------------------------------------------
# Rank weights and group baselines.


@pytest.mark.parametrize("spec,expected", [
    ("mean:3", ("rl.rank_weights preset='mean' is unknown", "'median'")),
    ("median:4", ("rl.rank_weights='median:4'", "k=4", "[1, 3]")),
    ("median:0", ("rl.rank_weights='median:0'", "k=0")),
    ("median", ("rl.rank_weights='median'", "'median:k'")),
    ("cvar:2", ("rl.rank_weights='cvar:2'", "'cvar:k:alpha'")),
    ("median:two", ("rl.rank_weights='median:two'", "k='two'", "integer")),
    ("cvar:3:2.0", ("rl.rank_weights='cvar:3:2.0'", "alpha")),
    ("trimmed_mean:3:5", ("rl.rank_weights='trimmed_mean:3:5'", "trim")),
])
def test_bad_rank_weights(config, spec, expected):
  config.rl.advantage = "rank_weights"
  config.rl.rank_weights = spec
  assert config.rl.group_size == 4
  with raises(*expected):
    build_lib.validate(config)


@pytest.mark.parametrize("pass_k,refused", [(4, False), (5, True)])
def test_pass_k_is_bounded_by_the_group_size_on_both_sides(config, pass_k,
                                                           refused):
  """``rl.group_size`` is G everywhere: pass@k's k may be G, not G + 1, and
  the error names G as the config gives it."""
  config.rl.advantage = "pass_at_k"
  config.rl.pass_k = pass_k
  assert config.rl.group_size == 4
  if not refused:
    build_lib.validate(config)
    return
  with raises("rl.pass_k=5", "the 4 samples per prompt",
              "rl.group_size=4"):
    build_lib.validate(config)


def test_bad_rank_weights_in_a_chain(config):
  config.rl.advantage = "center_by_group_mean+rank_weights"
  config.rl.rank_weights = "best_of_k:9"
  with raises("rl.rank_weights='best_of_k:9'", "k=9"):
    build_lib.validate(config)


def test_good_rank_weights_validate(config):
  config.rl.advantage = "rank_weights"
  for spec in ("median:3", "best_of_k:1", "cvar:3:0.5", "trimmed_mean:3:1"):
    config.rl.rank_weights = spec
    build_lib.validate(config)


@pytest.mark.parametrize("advantage", ["grpo", "rloo",
                                       "center_by_batch_mean+scale_by_group_std"])
def test_group_baseline_needs_two_samples(config, advantage):
  config.rl.group_size = 1
  config.rl.advantage = advantage
  with raises("rl.group_size=1", f"rl.advantage={advantage!r}",
              "rl.group_size >= 2"):
    build_lib.validate(config)


def test_batch_baseline_accepts_one_sample_per_prompt(config):
  config.rl.group_size = 1
  config.rl.advantage = "batch_std"
  build_lib.validate(config)


def test_rows_must_split_into_minibatches_and_microbatches(config):
  assert config.rl.prompts_per_step * config.rl.group_size == 32
  config.rl.num_minibatches = 3
  config.rl.num_microbatches = 2
  with raises("= 32 rows", "rl.num_minibatches=3", "rl.num_microbatches=2"):
    build_lib.validate(config)


# ----------------------------------------------------------------------------
# Task and rewards.


def test_unknown_task_without_a_path(config):
  config.task.name = "sudoku"
  config.task.path = ""
  with raises("task.name='sudoku' is unknown", "'arithmetic'", "task.path"):
    build_lib.validate(config)


def test_unknown_task_with_a_path_validates(config, tmp_path):
  config.task.name = "sudoku"
  config.task.path = jsonl_file(tmp_path / "sudoku.jsonl")
  build_lib.validate(config)


@pytest.mark.parametrize("field", ["path", "heldout_path"])
def test_a_missing_task_file_is_named_before_anything_is_built(
    config, tmp_path, monkeypatch, field):
  monkeypatch.chdir(tmp_path)
  config.task.path = jsonl_file(tmp_path / "train.jsonl")
  config.task[field] = "data/gsm8k/absent.jsonl"
  with no_compiles(), raises(
      f"task.{field}='data/gsm8k/absent.jsonl'", "does not exist",
      f"({tmp_path}/data/gsm8k/absent.jsonl)",
      "python -m launch.prepare_data --input=FILE "
      "--output=data/gsm8k/absent.jsonl"):
    build_lib.validate(config)


def test_a_task_path_that_is_a_directory(config, tmp_path):
  config.task.path = str(tmp_path)
  with raises(f"task.path='{tmp_path}'", "is a directory, not a file"):
    build_lib.validate(config)


def test_rewards_are_required(config):
  config.rewards.names = ()
  config.rewards.weights = ()
  with raises("rewards.names=()", "at least one"):
    build_lib.validate(config)


def test_unknown_reward_name(config):
  config.rewards.names = ("numeric_mtach",)
  with raises("rewards.names contains 'numeric_mtach'", "'numeric_match'"):
    build_lib.validate(config)


@pytest.mark.parametrize("name", ["no_such_package_rljax.mod:fn",
                                  "math:no_such_function"])
def test_unimportable_reward(config, name):
  config.rewards.names = (name,)
  with raises(f"rewards.names contains {name!r}", "cannot be imported"):
    build_lib.validate(config)


def test_importable_reward_validates(config):
  config.rewards.names = ("math:isfinite",)
  build_lib.validate(config)


def test_reward_weights_one_per_name(config):
  config.rewards.names = ("numeric_match", "format")
  config.rewards.weights = (1.0,)
  with raises("rewards.weights has 1 entries for 2 rewards.names"):
    build_lib.validate(config)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_reward_weights_must_be_finite(config, value):
  config.rewards.names = ("numeric_match", "format")
  config.rewards.weights = (1.0, value)
  with raises(f"rewards.weights[1]={value!r}", "finite number"):
    build_lib.validate(config)


def test_eval_reward_must_be_a_reward(config):
  config.eval.reward = "format"
  with raises("eval.reward='format'", "('numeric_match',)"):
    build_lib.validate(config)


def test_eval_reward_of_an_imported_function_is_its_attribute_name(config):
  config.rewards.names = ("numeric_match", "math:isfinite")
  config.rewards.weights = (1.0, 0.5)
  config.eval.reward = "isfinite"
  build_lib.validate(config)


# ----------------------------------------------------------------------------
# Hugging Face checkpoints.


def test_hf_overrides_only_change_numerics(config):
  config.model.path = "/ckpt/qwen"
  config.model.overrides = ml_collections.ConfigDict({"d_model": 32})
  with raises("model.overrides.d_model", "model.path='/ckpt/qwen'",
              "'param_dtype'"):
    build_lib.validate(config)


def test_allowed_hf_overrides_validate(config, tmp_path):
  config.model.path = checkpoint_dir(tmp_path / "qwen")
  config.model.overrides = ml_collections.ConfigDict(
      {"param_dtype": "float32", "dtype": "bfloat16", "remat": "full"})
  build_lib.validate(config)


def test_preset_overrides_are_free_without_a_checkpoint(config):
  config.model.overrides = ml_collections.ConfigDict({"d_model": 32})
  build_lib.validate(config)


def test_tokenizer_path_with_a_checkpoint(config):
  config.model.path = "/ckpt/qwen"
  config.tokenizer.path = "/tok/sp.model"
  with raises("tokenizer.path='/tok/sp.model'", "model.path='/ckpt/qwen'"):
    build_lib.validate(config)


def test_a_chat_template_needs_model_path(config):
  config.tokenizer.chat_template = True
  with no_compiles(), raises(
      "model.path=''", "tokenizer.chat_template=True", "config.json",
      "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir"):
    build_lib.validate(config)
  config.tokenizer.chat_template = False  # a sentencepiece run needs none
  build_lib.validate(config)


def test_a_model_path_that_does_not_exist(config, tmp_path):
  config.model.path = str(tmp_path / "Qwen2.5-0.5B-Instruct")
  with no_compiles(), raises(f"model.path='{tmp_path}/Qwen2.5-0.5B-Instruct'",
                             "no such directory", "config.json"):
    build_lib.validate(config)


@pytest.mark.parametrize("files,missing", [
    (("model.safetensors", "tokenizer.json"), "no config.json;"),
    (("config.json", "tokenizer.json"), "no *.safetensors;"),
    (("config.json", "model-00001-of-00002.safetensors"),
     "no tokenizer.json or tokenizer.model;"),
    ((), "no config.json and no *.safetensors and no tokenizer.json"),
])
def test_a_model_path_without_checkpoint_files(config, tmp_path, files,
                                               missing):
  config.model.path = checkpoint_dir(tmp_path / "ckpt", files)
  with raises(f"model.path='{tmp_path}/ckpt'", missing):
    build_lib.validate(config)


@pytest.mark.parametrize("files", [
    ("config.json", "model.safetensors", "tokenizer.json"),
    ("config.json", "model-00001-of-00002.safetensors", "tokenizer.model"),
])
def test_a_checkpoint_directory_validates(config, tmp_path, files):
  config.model.path = checkpoint_dir(tmp_path / "ckpt", files)
  build_lib.validate(config)


def test_a_tokenizer_vocabulary_smaller_than_the_characters(config):
  # 36 characters, the word-start piece and 4 special tokens: 41 pieces.
  examples = [{"prompt": "abcdefghijklmnopqrstuvwxyz0123456789"}] * 20
  config.tokenizer.vocab_size = 40
  with raises("tokenizer.vocab_size=40", ">= 41", "model.path"):
    build_lib.make_tokenizer(config, None, examples)
  config.tokenizer.vocab_size = 41
  assert build_lib.make_tokenizer(config, None, examples).vocab_size == 41


# ----------------------------------------------------------------------------
# Mesh divisibility (8 data-parallel ways).


def test_prompts_per_step_must_divide_over_the_mesh(config, mesh8):
  config.rl.prompts_per_step = 4  # 16 rows: the microbatch still divides.
  with raises("rl.prompts_per_step=4", "multiple of 8"):
    build_lib.validate(config, mesh8)
  build_lib.validate(config)


def test_eval_examples_must_divide_over_the_mesh(config, mesh8):
  config.eval.num_examples = 12
  with raises("eval.num_examples=12", "multiple of 8"):
    build_lib.validate(config, mesh8)
  build_lib.validate(config)


def test_rows_per_microbatch_must_divide_over_the_mesh(config, mesh8):
  config.rl.num_minibatches = 2
  config.rl.num_microbatches = 4  # 32 rows / 8 = 4 rows per microbatch.
  with raises("rows per microbatch", "=4 does not divide", "multiple of 8"):
    build_lib.validate(config, mesh8)
  build_lib.validate(config)


# ----------------------------------------------------------------------------
# build(): the advantage chain's shapes, checked before any compile.


def _user_algorithm(advantage):
  return alg_lib.Algorithm(
      advantage=advantage,
      coefficient=alg_lib.coefficient_chain({"objective": "reinforce"}),
      optimizer=optax.sgd(1e-3))


@pytest.mark.parametrize("advantage", [
    # Fails on [N, R] input: it wants rewards [N].
    optax.chain(advantages.center_by_group_mean()),
    # Runs, but returns [N, R] instead of [N].
    optax.with_extra_args_support(optax.identity()),
], ids=["raises_on_2d", "keeps_2d"])
def test_build_rejects_an_advantage_chain_without_a_reward_head(
    config, monkeypatch, advantage):

  def too_late(*args, **kwargs):
    raise AssertionError("build loaded the task before checking the chain")

  monkeypatch.setattr(build_lib, "load_task", too_late)
  with no_compiles():
    with raises("Algorithm.advantage", "[32, 1]", "sum_rewards"):
      build_lib.build(config, algorithm_override=_user_algorithm(advantage))


def test_build_accepts_a_chain_with_a_reward_head(config, monkeypatch):
  """The same check passes once the chain starts with sum_rewards."""

  class Reached(Exception):
    pass

  def reached(*args, **kwargs):
    raise Reached

  monkeypatch.setattr(build_lib, "load_task", reached)
  chain = optax.chain(advantages.sum_rewards(),
                      advantages.center_by_group_mean())
  with no_compiles():
    with pytest.raises(Reached):
      build_lib.build(config, algorithm_override=_user_algorithm(chain))


def test_build_validates_first(config):
  config.rl.objective = "ppo"
  with raises("rl.objective='ppo'"):
    build_lib.build(config)


def test_build_rejects_a_non_algorithm(config):
  with pytest.raises(TypeError, match="rljax.train.Algorithm"):
    build_lib.build(config, algorithm_override=optax.sgd(1e-3))


def test_math_isfinite_is_a_callable_reward():
  """The importable reward used above resolves to the function itself."""
  assert build_lib.reward_fn("math:isfinite") == ("isfinite", math.isfinite)


@pytest.mark.parametrize("field, value, expected", [
    ("max_failure_fraction", 1.5, "rewards.max_failure_fraction=1.5"),
    ("max_failure_fraction", -0.1, "rewards.max_failure_fraction=-0.1"),
    ("failure_patience", 0, "rewards.failure_patience=0"),
])
def test_reward_failure_stop_settings_are_checked(config, field, value,
                                                  expected):
  config.rewards[field] = value
  with no_compiles(), raises(expected):
    build_lib.validate(config)


def test_on_data_problem_is_checked(config):
  config.task.on_data_problem = "ignore"
  with raises("task.on_data_problem='ignore'", "'error', 'warn'"):
    build_lib.check_data(config, [], [])


@pytest.mark.parametrize("field, value, expected", [
    ("clip", -1.0, "rewards.clip=-1.0"),
    ("clip", math.inf, "rewards.clip=inf"),
    ("memory_limit_mb", 0, "rewards.memory_limit_mb=0"),
])
def test_reward_isolation_settings_are_checked(config, field, value, expected):
  config.rewards[field] = value
  with no_compiles(), raises(expected):
    build_lib.validate(config)


_BAD = {"int>=1": 0, "int>=0": -1, "int>=2": 1, ">0": -1.0, ">1": 1.0, ">=0": -0.5, "(0,1]": 1.5,
        "[0,1)": 1.0, "[0,1]": 1.5, "(0,1)": 1.0, "[0,0.5)": 0.5}


RANGES = sorted((name, field.rule) for name, field in schema.fields().items()
                if field.rule is not None and "." in name)


@pytest.mark.parametrize("field, rule", RANGES)
def test_every_numeric_field_has_its_range_checked(config, field, rule):
  *path, name = field.split(".")
  section = config
  for part in path:  # a section may nest (model.lora.rank)
    section = section[part]
  assert name in section, f"{field} is not a config field"
  bad = _BAD[rule.rstrip("?")]
  if isinstance(section[name], float) or (
      section[name] is None and not rule.startswith("int")):
    bad = float(bad)
  section[name] = bad
  with no_compiles(), raises(f"{field}={bad!r}", "is required"):
    build_lib.validate(config)


def test_nan_learning_rate_is_refused(config):
  config.optimizer.learning_rate = math.nan
  with raises("optimizer.learning_rate=nan", "finite number > 0"):
    build_lib.validate(config)


# --- issue 25: validation that a careless config cannot slip past -----------


@pytest.mark.parametrize("field,value,match", [
    ("rl.advantage", "grpo++", "empty link at position 1"),
    ("rl.advantage", "+grpo", "empty link at position 0"),
    ("rl.rank_weights", "nonsense", "rl.rank_weights preset='nonsense'"),
    ("rl.rank_weights", "median:x", "must be an integer"),
])
def test_resume_fields_are_validated_even_when_unused(field, value, match):
  from configs import common  # pylint: disable=g-import-not-at-top
  c = common.tiny(common.base())
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=match):
    build_lib.validate(c)


def test_a_tiny_temperature_warns(caplog):
  from configs import common  # pylint: disable=g-import-not-at-top
  c = common.tiny(common.base())
  c.rl.training_temperature = 1e-6
  build_lib.validate(c)
  assert any("rl.training_temperature=1e-06 is below 0.05" in r.getMessage()
             for r in caplog.records)
  c.rl.training_temperature = 1.0
  caplog.clear()
  build_lib.validate(c)
  assert not any("below" in r.getMessage() for r in caplog.records)
