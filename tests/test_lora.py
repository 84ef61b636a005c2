"""LoRA adapters and the int8 frozen base (``rljax/models/lora.py``): the
forward against an independent numpy reference, training only the
adapters, the KL reference as the base, the critic, config errors, and the
loop (slow: a killed and resumed LoRA run with an int8 base and KL)."""

import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import checkpoint, models, optim, train
from rljax.models import lora
from rljax.train import build, critic, schema
from rljax.train import steps as steps_lib
from tests import reference_model
from tests.test_resume import _by_step, _launch, _wait_for_step

BASE = models.get_preset("tiny")
LORA = BASE.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
INT8 = BASE.replace(lora=models.LoraConfig(rank=4, alpha=8.0,
                                           quantize_base="int8"))


def _with_random_b(params, seed=0, scale=0.3):
  """``params`` with every adapter's B random (fresh ones are zero)."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))

  def fill(tree):
    return {k: (fill(v) if isinstance(v, dict) else
                (scale * jax.random.normal(next(keys), v.shape, v.dtype)
                 if k.endswith("_lora_b") else v)) for k, v in tree.items()}
  return fill(params)


def _logits(config, params, tokens, mask=None):
  tokens = jnp.asarray(tokens)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
  return np.asarray(jax.jit(lambda p, t, m: models.Decoder(config).apply(
      {"params": p}, t, models.positions_from_mask(m), input_mask_BxT=m,
      return_logits=True)[0])(params, tokens, mask))


@pytest.fixture(scope="module")
def lora_params():
  return models.init_params(LORA, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
  return np.random.RandomState(0).randint(4, BASE.vocab_size, (2, 9))


def test_fresh_adapters_compute_exactly_the_base(lora_params, tokens):
  base = lora.split(lora_params)[1]
  assert all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(base),
      jax.tree.leaves(models.init_params(BASE, jax.random.key(0)))))
  assert lora.has_adapters(lora_params)
  np.testing.assert_array_equal(_logits(LORA, lora_params, tokens),
                                _logits(BASE, base, tokens))


def _numpy_merged(params, config):
  """Float64 kernels ``W + (alpha / r) A B``, computed here with numpy."""
  s = config.lora.alpha / config.lora.rank
  out = jax.tree.map(lambda x: np.asarray(x, np.float64),
                     lora.split(params)[1])
  for name in out:
    if not name.startswith("layers_"):
      continue
    for module, sub in params[name].items():
      for key, a in sub.items():
        if not key.endswith("_lora_a"):
          continue
        target = key[:-len("_lora_a")]
        b = np.asarray(sub[f"{target}_lora_b"], np.float64)
        w = out[name][module][f"{target}_kernel"]
        in_dims = a.ndim - 1
        delta = (np.asarray(a, np.float64).reshape(-1, a.shape[-1])
                 @ b.reshape(b.shape[0], -1)).reshape(w.shape)
        assert w.shape[:in_dims] == a.shape[:-1]
        out[name][module][f"{target}_kernel"] = w + s * delta
  return out


def test_adapted_forward_equals_a_numpy_reference_with_merged_kernels(
    lora_params, tokens):
  params = _with_random_b(lora_params)
  reference = np.stack([reference_model.forward(
      _numpy_merged(params, LORA), BASE, row) for row in tokens])
  ours = _logits(LORA, params, tokens)
  assert np.abs(ours - _logits(BASE, lora.split(params)[1], tokens)).max() > 0.1
  np.testing.assert_allclose(ours, reference, atol=2e-4, rtol=1e-4)
  merged = lora.merged_params(params, LORA)  # what the export writes
  assert not lora.has_adapters(merged)
  np.testing.assert_allclose(_logits(BASE, merged, tokens), ours, atol=1e-5)


def test_some_targets_only_get_adapters():
  config = BASE.replace(lora=models.LoraConfig(rank=2, targets=("v", "down")))
  adapters = lora.adapters_of(models.init_params(config, jax.random.key(1)))
  names = {k for layer in adapters.values() for sub in layer.values()
           for k in sub}
  assert names == {"v_lora_a", "v_lora_b", "down_lora_a", "down_lora_b"}
  axes = models.param_logical_axes(config)["layers_0"]
  assert axes["attn"]["v_lora_b"] == ("lora_rank", "kv_heads", "head_dim")
  assert axes["mlp"]["down_lora_a"] == ("mlp", "lora_rank")


def test_adapters_shard_on_the_mesh_by_their_logical_axes():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2),
                           ("data", "fsdp", "tensor"))
  shardings = models.param_shardings(LORA, mesh)["layers_0"]
  spec = shardings["attn"]["q_lora_a"].spec
  assert tuple(spec) in (("fsdp", None), ("fsdp",))
  assert tuple(shardings["mlp"]["up_lora_b"].spec)[-1] == "tensor"


def test_cached_decoding_runs_the_adapters(lora_params, tokens):
  """Prefill + one-token decode steps (the sampler's fused projections)
  give the full forward's logits with nonzero adapters."""
  params = _with_random_b(lora_params, seed=3)
  apply = jax.jit(lambda p, t, pos, c, m: models.Decoder(LORA).apply(
      {"params": p}, t, pos, c, input_mask_BxT=m, return_logits=True))
  b, t = tokens.shape
  mask = np.ones((b, t), bool)
  positions = models.positions_from_mask(jnp.asarray(mask))
  cache = models.init_cache(LORA, b, t, dtype=jnp.float32)
  out, cache = apply(params, tokens[:, :5], positions[:, :5], cache,
                     mask[:, :5])
  steps = [np.asarray(out)]
  for i in range(5, t):
    out, cache = apply(params, tokens[:, i:i + 1], positions[:, i:i + 1],
                       cache, mask[:, i:i + 1])
    steps.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(steps, 1),
                             _logits(LORA, params, tokens), atol=2e-5)


# ----------------------------------------------------------------------------
# The int8 base.


def test_int8_quantization_is_within_half_a_step_per_channel():
  w = np.random.RandomState(0).randn(16, 3, 5).astype(np.float32)
  w[:, 0, 0] = 0.0  # an all-zero channel
  q, scale = lora.quantize(w, in_dims=1)
  assert q.dtype == jnp.int8 and scale.shape == (3, 5)
  step = np.abs(w).max(0) / 127.0
  np.testing.assert_allclose(np.asarray(scale)[1:, 1:], step[1:, 1:],
                             rtol=1e-6)
  back = np.asarray(lora.dequantize(q, scale, jnp.float32))
  assert np.all(np.abs(back - w) <= step / 2 + 1e-7)
  assert np.all(back[:, 0, 0] == 0)


@pytest.mark.slow  # compiles model steps: the fast tier stays near 5 min
def test_int8_base_logits_stay_close_to_the_float_base(tokens):
  params = models.init_params(INT8, jax.random.key(0))
  leaves = lora.split(params)[1]["layers_0"]["attn"]
  assert leaves["q_kernel"].dtype == jnp.int8
  assert "q_kernel_scale" in leaves
  float_base = models.init_params(BASE, jax.random.key(0))
  ours, exact = _logits(INT8, params, tokens), _logits(BASE, float_base,
                                                       tokens)
  err = np.abs(ours - exact).max() / np.abs(exact).max()
  assert 0 < err < 0.05, err
  # Dequantized, the base is a float model that computes the same logits.
  deq = lora.merged_params(params, INT8)
  assert deq["layers_0"]["attn"]["q_kernel"].dtype == jnp.float32
  np.testing.assert_allclose(_logits(BASE, deq, tokens), ours, atol=1e-5)


# ----------------------------------------------------------------------------
# Training only the adapters.

MC = LORA.replace(vocab_size=64)


def _batch(n=4, length=8, seed=0):
  rng = np.random.RandomState(seed)
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 4:] = True
  return train.RLBatch(
      rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32),
      np.ones((n, length), bool), loss_mask,
      rng.randn(n).astype(np.float32), np.zeros((n, length), np.float32))


@pytest.fixture(scope="module")
def trained_step():
  """``(params before, state after one step, metrics)`` of an rl_step on a
  LoRA policy with a KL term (the reference: the base)."""
  params = _with_random_b(models.init_params(MC, jax.random.key(2)), seed=5)
  optimizer = optax.adam(1e-2)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  cfg = train.RLStepConfig(kl_coef=0.1, completion_length=4)
  state = train.TrainState(
      params, optimizer.init(steps_lib.trainable(MC, params)),
      optax.EmptyState(), coef_tx.init(jnp.zeros((1, 1))),
      jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(0)))
  step = jax.jit(train.make_rl_step(MC, cfg, optimizer, coef_tx))
  new, m = step(jax.tree.map(jnp.copy, state), _batch())
  return params, state, new, m, cfg


@pytest.mark.slow  # compiles model steps: the fast tier stays near 5 min
def test_an_rl_step_updates_the_adapters_only(trained_step):
  params, state, new, m, _ = trained_step
  before_a, before_base = lora.split(params)
  after_a, after_base = lora.split(new.params)
  for a, b in zip(jax.tree.leaves(before_base), jax.tree.leaves(after_base)):
    np.testing.assert_array_equal(a, b)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      jax.tree.leaves(before_a), jax.tree.leaves(after_a))]
  assert min(moved) > 0
  # Adam's moments exist for the adapters alone.
  mu = state.opt_state[0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(before_a)
  assert len(jax.tree.leaves(new.opt_state)) == 1 + 2 * len(
      jax.tree.leaves(before_a))
  assert np.isfinite(m["kl"]) and m["kl"] > 0


@pytest.mark.slow  # compiles model steps: the fast tier stays near 5 min
def test_the_kl_reference_is_the_base_without_adapters(trained_step):
  params, state, _, _, cfg = trained_step
  batch = _batch()
  inputs, _, _ = steps_lib.prepare_inputs(cfg, MC, state, batch)
  base = lora.split(params)[1]
  expected = models.sequence_logprobs(
      base, MC.without_lora(), batch.tokens_NxL, batch.input_mask_NxL,
      num_scored=4)[0]
  np.testing.assert_allclose(inputs.ref_logprobs_NxT, expected, atol=1e-6)
  adapted = models.sequence_logprobs(params, MC, batch.tokens_NxL,
                                     batch.input_mask_NxL, num_scored=4)[0]
  assert np.abs(np.asarray(adapted) - np.asarray(expected)).max() > 1e-3


@pytest.mark.slow  # compiles model steps: the fast tier stays near 5 min
def test_the_critic_shares_the_frozen_base_and_trains_its_own_adapters(
    lora_params, tokens):
  params = _with_random_b(lora_params, seed=7)
  c = critic.init_params(params, LORA)
  assert jax.tree.structure(c["decoder"]) == jax.tree.structure(
      lora.adapters_of(params))
  full = {"decoder": params, "head": {"kernel": jnp.ones(BASE.d_model),
                                      "bias": jnp.zeros(())}}
  shared = critic.with_base({"decoder": c["decoder"], "head": full["head"]},
                            lora.split(params)[1])
  mask = jnp.ones(tokens.shape, bool)
  np.testing.assert_array_equal(critic.values(shared, LORA, tokens, mask),
                                critic.values(full, LORA, tokens, mask))


# ----------------------------------------------------------------------------
# Config errors, before anything is built.


def _config(**lora_fields):
  config = schema.base_config()
  for k, v in lora_fields.items():
    config.model.lora[k] = v
  return config


@pytest.mark.parametrize("fields,match", [
    ({"rank": -1}, "model.lora.rank"),
    ({"rank": 4, "targets": ("q", "qq")}, "'qq' is unknown"),
    ({"rank": 4, "targets": ()}, "model.lora.targets"),
    ({"rank": 4, "alpha": 0.0}, "model.lora.alpha"),
    ({"rank": 0, "quantize_base": "int8"}, "model.lora.quantize_base"),
    ({"rank": 4, "quantize_base": "int4"}, "model.lora.quantize_base"),
])
def test_bad_lora_fields_are_refused_naming_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    build.validate(_config(**fields))


def test_a_rank_larger_than_a_projection_is_refused():
  # tiny's k projection: 64 -> 2 x 16 = 32
  config = _preset(_config(rank=33, targets=("q", "k")), "tiny")
  with pytest.raises(ValueError, match=r"model.lora.rank=33 .* k projection"):
    build.preset_model_config(config, 32)
  fits = _preset(_config(rank=32, targets=("q", "k")), "tiny")
  assert build.preset_model_config(fits, 32).lora.rank == 32


def _preset(config, name):
  config.model.preset = name
  return config


def test_lora_in_model_overrides_is_refused():
  config = _preset(_config(rank=2), "tiny")
  config.model.overrides = {"lora": None}
  with pytest.raises(ValueError, match="model.overrides.lora"):
    build.preset_model_config(config, 32)


def test_an_older_config_without_lora_completes_to_rank_0():
  old = json.loads(schema.base_config().to_json_best_effort())
  del old["model"]["lora"]
  old["model"]["preset"] = "tiny"
  done = schema.complete_config(old)
  assert done.model.lora.rank == 0 and done.model.preset == "tiny"
  partial = schema.complete_config({"model": {"lora": {"rank": 3}}})
  assert partial.model.lora.rank == 3 and partial.model.lora.alpha == 16.0


# ----------------------------------------------------------------------------
# The loop (slow): a LoRA run with an int8 base and KL, killed and resumed.

FLAGS = ["--config.model.lora.rank=4", "--config.model.lora.quantize_base=int8",
         "--config.rl.kl_coef=0.05"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lora_full"))
  proc = _launch(workdir, *FLAGS)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  return workdir


@pytest.mark.slow
def test_a_lora_run_checkpoints_adapters_and_names_its_base(lora_run):
  manager = checkpoint.CheckpointManager(os.path.join(lora_run, "checkpoints"))
  tree, meta = manager.restore(None, None)
  manager.close()
  saved = tree["state"]["params"]
  assert jax.tree.structure(saved) == jax.tree.structure(
      lora.adapters_of(saved)) and jax.tree.leaves(saved)
  assert "ref_params" not in tree  # the KL reference is the base itself
  assert meta["lora_base"] == {"source": "checkpoint", "path": "lora_base"}
  policy = train.load_policy(lora_run)
  assert policy.model_config.lora.quantize_base == "int8"
  shapes = models.param_shapes(policy.model_config)
  assert jax.tree.structure(policy.params) == jax.tree.structure(shapes)
  rows = [r for r in _rows(lora_run) if r["step"] > 0]
  assert all(np.isfinite(r["kl"]) for r in rows) and rows[-1]["kl"] > 0


def _rows(workdir):
  from rljax import metrics  # pylint: disable=import-outside-toplevel
  return metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.slow
def test_a_killed_lora_run_resumes_exactly(lora_run, tmp_path):
  workdir = str(tmp_path / "run")
  proc = _launch(workdir, *FLAGS)
  _wait_for_step(workdir, 3, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = _launch(workdir, *FLAGS)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  assert "resumed from step" in out
  full, again = _by_step(lora_run), _by_step(workdir)
  for step in range(4, max(full) + 1):
    assert again[step] == full[step], step
  for a, b in zip(jax.tree.leaves(train.load_policy(lora_run).params),
                  jax.tree.leaves(train.load_policy(workdir).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Without its frozen base the run's checkpoints cannot be read: a clear
  # error names the directory.
  shutil.rmtree(os.path.join(workdir, "lora_base"))
  with pytest.raises(FileNotFoundError, match="lora_base"):
    train.load_policy(workdir)


@pytest.mark.slow
def test_lora_trains_with_a_critic_spec_rl_and_a_lora_teacher(lora_run,
                                                               tmp_path):
  """Some targets only, PPO's critic (sharing the frozen base), SPEC-RL's
  drafts verified by the adapted forward, and on-policy distillation from
  the int8 LoRA run as the teacher: two steps, every loss finite."""
  from tests.test_critic import loop_config, rl_rows  # pylint: disable=import-outside-toplevel
  config = loop_config(**{"rl.advantage": "gae", "sampler.speculative": True,
                          "rl.distill_coef": 0.5, "teacher.path": lora_run})
  config.model.lora.rank = 2
  config.model.lora.alpha = 4.0
  config.model.lora.targets = ("q", "v", "down")
  config.rl.num_steps = 3
  config.task.num_train = config.rl.prompts_per_step  # drafts from step 2
  workdir = str(tmp_path / "student")
  train.run(config, workdir)
  rows = rl_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    for key in ("pg_loss", "critic/value_loss", "distill/reverse_kl",
                "grad_norm", "critic/grad_norm"):
      assert np.isfinite(r[key]) and (key == "pg_loss" or r[key] != 0), key
  assert all(r["spec/drafted_rows"] > 0 for r in rows[1:]), rows
  tree, _ = checkpoint.CheckpointManager(
      os.path.join(workdir, "checkpoints")).restore(None, None)
  names = {k for layer in tree["state"]["params"].values()
           for sub in layer.values() for k in sub}
  assert names == {"q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b",
                   "down_lora_a", "down_lora_b"}
  critic_names = {k for layer in tree["state"]["critic"]["params"]["decoder"]
                  .values() for sub in layer.values() for k in sub}
  assert critic_names == names


@pytest.mark.slow  # compiles model steps: the fast tier stays near 5 min
def test_a_bfloat16_int8_lora_step_keeps_float32_adapters():
  """bfloat16 params: the adapters (trained) are float32, the base int8,
  and two updates run in the step's scan."""
  mc = MC.replace(param_dtype="bfloat16", dtype="bfloat16",
                  lora=models.LoraConfig(rank=4, quantize_base="int8"))
  params = models.init_params(mc, jax.random.key(0))
  adapters, base = lora.split(params)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype("float32")}
  assert base["layers_0"]["mlp"]["up_kernel"].dtype == jnp.int8
  assert base["embedding"].dtype == jnp.bfloat16
  optimizer = optim.make_optimizer("adamw", 1e-2)
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  state = train.TrainState(
      params, optimizer.init(adapters), optax.EmptyState(),
      coef_tx.init(jnp.zeros((1, 1))), jnp.zeros((), jnp.int32),
      jax.random.key_data(jax.random.key(0)))
  step = jax.jit(train.make_rl_step(
      mc, train.RLStepConfig(num_minibatches=2, kl_coef=0.1), optimizer,
      coef_tx))
  new, m = step(state, _batch())
  assert np.isfinite(m["pg_loss"]) and np.isfinite(m["kl"])
  after_a, after_base = lora.split(new.params)
  assert jax.tree.map(lambda x: x.dtype, after_a) == jax.tree.map(
      lambda x: x.dtype, adapters)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(after_base)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field,value", [("rank", 8), ("alpha", 4.0),
                                         ("targets", ("q",)),
                                         ("quantize_base", "int8")])
def test_the_resume_check_covers_the_lora_fields(field, value):
  from rljax.train import rundir  # pylint: disable=import-outside-toplevel
  saved = json.loads(_config(rank=4).to_json_best_effort())
  new = json.loads(_config(**{"rank": 4, field: value}).to_json_best_effort())
  rundir.check_resumable(saved, saved, "/tmp/run")
  with pytest.raises(ValueError, match="model"):
    rundir.check_resumable(saved, new, "/tmp/run")
