"""On-policy distillation: the per-token reverse-KL advantage, its gradient
against the exact reverse KL, the step against an independent surrogate, and
a loop whose teacher is a run directory loaded from the config."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models, train
from rljax import objectives as obj
from rljax.train import distill
from tests.test_critic import loop_config, rl_rows


def test_distill_advantages_equal_the_formula():
  rng = np.random.RandomState(0)
  old, teacher = rng.randn(3, 5), rng.randn(3, 5)
  mask = rng.rand(3, 5) > 0.3
  adv_N = rng.randn(3).astype(np.float32)
  a, rkl = distill.distill_advantages(adv_N, old, teacher, mask, 0.7)
  want_rkl = np.where(mask, old - teacher, 0.0)
  np.testing.assert_allclose(rkl, want_rkl, rtol=1e-6)
  np.testing.assert_allclose(a, adv_N[:, None] - 0.7 * want_rkl, rtol=1e-6)
  a2, _ = distill.distill_advantages(np.broadcast_to(adv_N[:, None], (3, 5)),
                                     old, teacher, mask, 0.7)
  np.testing.assert_allclose(a2, a, rtol=1e-6)


@pytest.mark.slow
def test_expected_gradient_is_the_exact_reverse_kl_gradient():
  """Over one position with V tokens: the pi-weighted sum of the per-token
  policy-gradient losses' gradients is beta * grad KL(pi || pi_T), the
  exact divergence computed over the vocabulary."""
  v, beta = 7, 0.5
  theta = jax.random.normal(jax.random.key(0), (v,))
  teacher_logits = jax.random.normal(jax.random.key(1), (v,))
  log_t = jax.nn.log_softmax(teacher_logits)
  mask = jnp.ones((1, 1), bool)

  def token_loss(theta, y):
    lp = jax.nn.log_softmax(theta)[y].reshape(1, 1)
    adv, _ = distill.distill_advantages(
        jnp.zeros((1,)), jax.lax.stop_gradient(lp), log_t[y].reshape(1, 1),
        mask, beta)
    return obj.policy_gradient_loss(jnp.ones((1, 1)), adv, lp, mask,
                                    "token_mean")

  grads = jax.vmap(jax.grad(token_loss), (None, 0))(theta, jnp.arange(v))
  pi = jax.nn.softmax(theta)
  expected = jnp.einsum("v,vd->d", pi, grads)

  def reverse_kl(theta):
    log_p = jax.nn.log_softmax(theta)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_t))

  want = beta * jax.grad(reverse_kl)(theta)
  assert float(jnp.abs(want).max()) > 1e-3
  np.testing.assert_allclose(expected, want, rtol=1e-5, atol=1e-6)


MC = models.get_preset("tiny")


@pytest.mark.slow
def test_the_step_follows_the_reverse_kl_surrogate():
  """One on-policy SGD step with zero rewards moves the params by
  -lr * grad of beta * token_mean(sg(lp - lp_T) * lp), the surrogate
  written from models.sequence_logprobs alone."""
  rng = np.random.RandomState(2)
  n, length = 4, 9
  tokens = rng.randint(4, MC.vocab_size, (n, length)).astype(np.int32)
  input_mask = np.ones((n, length), bool)
  loss_mask = np.zeros((n, length), bool)
  loss_mask[:, 5:] = True
  loss_mask[1, 7:] = False
  batch = train.RLBatch(tokens, input_mask, loss_mask,
                        np.zeros((n,), np.float32),
                        np.zeros((n, length), np.float32))
  student = models.init_params(MC, jax.random.key(0))
  teacher = models.init_params(MC, jax.random.key(1))
  beta, lr = 0.3, 0.5
  coef_tx = obj.ppo_clip(0.2)
  sgd = optax.sgd(lr)
  step = jax.jit(train.make_rl_step(
      MC, train.RLStepConfig(distill_coef=beta, teacher_temperature=1.0),
      sgd, coef_tx))
  state = train.TrainState(student, sgd.init(student), optax.EmptyState(),
                           coef_tx.init(jnp.zeros((1, 1))),
                           jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
  new, out = step(state, batch, None, teacher)

  lp_t = models.sequence_logprobs(teacher, MC, tokens, input_mask)[0]

  def surrogate(params):
    lp = models.sequence_logprobs(params, MC, tokens, input_mask)[0]
    per_token = jax.lax.stop_gradient(lp - lp_t) * lp
    return beta * jnp.sum(jnp.where(loss_mask, per_token, 0.0)) / loss_mask.sum()

  grads = jax.grad(surrogate)(student)
  for p, g, q in zip(jax.tree.leaves(student), jax.tree.leaves(grads),
                     jax.tree.leaves(new.params)):
    np.testing.assert_allclose(q, p - lr * g, rtol=1e-4, atol=1e-6)
  lp_s = models.sequence_logprobs(student, MC, tokens, input_mask)[0]
  want_rkl = float(np.asarray(lp_s - lp_t)[loss_mask].mean())
  np.testing.assert_allclose(out["distill/reverse_kl"], want_rkl, rtol=1e-4)


@pytest.mark.slow
def test_distillation_from_a_run_directory_in_the_loop(tmp_path):
  teacher_dir = str(tmp_path / "teacher")
  train.run(loop_config(**{"rl.num_steps": 1,
                           "optimizer.learning_rate": 1e-2}), teacher_dir)
  config = loop_config(**{"rl.distill_coef": 1.0, "teacher.path": teacher_dir})
  train.run(config, str(tmp_path / "student"))
  rows = rl_rows(tmp_path / "student")
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert math.isfinite(r["distill/reverse_kl"]) and r["grad_norm"] > 0
  # Same seed, same initial params: the teacher is the student one update on.
  assert rows[0]["distill/reverse_kl"] != 0.0


@pytest.mark.parametrize("overrides, match", [
    ({"rl.distill_coef": 0.5}, r"rl.distill_coef=0.5 > 0 needs a teacher"),
    ({"teacher.path": "/tmp"}, r"teacher.path='/tmp' is set but rl.distill_coef"),
    ({"rl.distill_coef": 1.0, "teacher.path": "/nonexistent/run"},
     r"teacher.path='/nonexistent/run' is not a directory"),
    ({"rl.distill_coef": -1.0}, r"rl.distill_coef=-1.0"),
])
def test_bad_distillation_settings_fail_before_compile(overrides, match):
  with pytest.raises(ValueError, match=match):
    train.build.validate(loop_config(**overrides))


def test_a_directory_that_is_no_teacher_is_named(tmp_path):
  with pytest.raises(ValueError, match="neither an rljax run directory"):
    train.load_teacher(str(tmp_path), None, MC.vocab_size)


def _tiny_hf_config():
  """A one-layer Qwen2 of 32 tokens, as a Hugging Face config.json gives it."""
  return models.model_config_from_hf({
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 1, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "tie_word_embeddings": True, "torch_dtype": "float32"})


def test_a_hugging_face_checkpoint_is_a_teacher(tmp_path):
  config = _tiny_hf_config()
  params = models.init_params(config, jax.random.key(3))
  models.save_hf_checkpoint(tmp_path, config, params)
  got_config, got = train.load_teacher(str(tmp_path), None, 32)
  assert got_config.vocab_size == 32 and got_config.num_layers == 1
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"vocab_size=32, the student 40"):
    train.load_teacher(str(tmp_path), None, 40)
  with pytest.raises(ValueError, match=r"teacher.step=3"):
    train.load_teacher(str(tmp_path), None, 32, step=3)


# --- issue 25: a teacher must share the student's tokenizer, by content ------


def test_a_teacher_tokenizer_of_the_same_size_with_other_ids_is_refused():
  from rljax import tokenizers  # pylint: disable=g-import-not-at-top
  from rljax.train import policy  # pylint: disable=g-import-not-at-top
  # Same size, same characters, other frequencies: other ids.
  a = tokenizers.train_sentencepiece(["aaab abab"] * 50 + ["0123456789"], 24)
  b = tokenizers.train_sentencepiece(["abbb baba"] * 50 + ["0123456789"], 24)
  assert a.vocab_size == b.vocab_size == 24
  policy.check_same_tokenizer(a, a, "/teacher")  # the same: accepted
  with pytest.raises(ValueError, match=r"teacher.path='/teacher': token \d+ "
                     r"is .* for the teacher and .* for the student"):
    policy.check_same_tokenizer(a, b, "/teacher")


def test_a_hugging_face_teacher_without_tokenizer_files_is_refused(tmp_path):
  config = _tiny_hf_config()
  models.save_hf_checkpoint(tmp_path, config,
                            models.init_params(config, jax.random.key(3)))
  from rljax import tokenizers  # pylint: disable=g-import-not-at-top
  student = tokenizers.train_sentencepiece(
      [f"{x}+{y}={x + y}" for x in range(40) for y in range(40)], 32)
  with pytest.raises(ValueError, match=r"has no tokenizer.json or "
                     r"tokenizer.model"):
    train.load_teacher(str(tmp_path), None, 32, tokenizer=student)


def test_a_hugging_face_teacher_with_another_32_token_vocabulary_is_refused(
    tmp_path):
  """The issue's case: an HF directory whose WordLevel tokenizer has the
  student's 32 tokens' count but its own ids passes the size check; the
  content check names a differing token."""
  hf_tokenizers = pytest.importorskip("tokenizers")
  import json as json_lib  # pylint: disable=g-import-not-at-top
  from rljax import tokenizers  # pylint: disable=g-import-not-at-top
  student = tokenizers.train_sentencepiece(
      ["aaab abab cd"] * 50 + ["0123456789 efghij"] * 20, 32)
  words = ["<pad>", "<s>", "</s>"] + list("0123456789+=abcdefghijklmnopq")
  assert len(words) == student.vocab_size == 32
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(
      {t: i for i, t in enumerate(words)}, unk_token="<pad>"))
  tok.add_special_tokens(words[:3])
  tok.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json_lib.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>"}, f)
  config = _tiny_hf_config()
  models.save_hf_checkpoint(tmp_path, config,
                            models.init_params(config, jax.random.key(3)))
  with pytest.raises(ValueError, match=r"teacher.path=.*(token \d+ is|its "
                     r"(bos|eos|pad)_id is)"):
    train.load_teacher(str(tmp_path), None, 32, tokenizer=student)


def _MESH1():  # pylint: disable=invalid-name
  from rljax import sharding  # pylint: disable=g-import-not-at-top
  return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _teacher_run(directory, steps=(1, 2)):
  """A run directory as training leaves it: config.json, tokenizer.model and
  checkpoints of {"state": {"params"}} (each step's params scaled by it)."""
  import json as json_lib  # pylint: disable=g-import-not-at-top
  from configs import common  # pylint: disable=g-import-not-at-top
  from rljax import checkpoint, tokenizers  # pylint: disable=g-import-not-at-top
  os.makedirs(directory)
  config = common.tiny(common.base())
  tok = tokenizers.train_sentencepiece(["aaab abab"] * 50 + ["0123456789"], 24)
  tok.save(os.path.join(directory, "tokenizer.model"))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json_lib.dump(json_lib.loads(config.to_json_best_effort()), f)
  mc = train.build.preset_model_config(config, tok.vocab_size)
  params = models.init_params(mc, jax.random.key(0))
  m = checkpoint.CheckpointManager(os.path.join(directory, "checkpoints"),
                                   async_save=False)
  for step in steps:
    m.save(step, {"state": {"params": jax.tree.map(lambda x: x * step,
                                                   params)}})
  m.wait()
  m.close()
  return tok, params


def test_a_teacher_whose_newest_checkpoint_is_corrupt_falls_back(tmp_path,
                                                                 caplog):
  import glob  # pylint: disable=g-import-not-at-top
  teacher = str(tmp_path / "teacher")
  tok, params = _teacher_run(teacher)
  for f in glob.glob(os.path.join(teacher, "checkpoints", "2", "**", "*"),
                     recursive=True):
    if os.path.isfile(f) and "metadata" not in os.path.basename(f).lower():
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 3)
  _, got = train.load_teacher(teacher, _MESH1(), tok.vocab_size,
                              tokenizer=tok)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # step 1's
  assert f"teacher.path={teacher!r}: checkpoint 2 is unreadable" in caplog.text
  # Both unreadable: a named error, not an orbax traceback.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(teacher, "checkpoints", "1"))
  with pytest.raises(ValueError, match=r"teacher.path=.*no readable "
                     r"checkpoint \(step 2: "):
    train.load_teacher(teacher, _MESH1(), tok.vocab_size)


def test_a_teacher_run_is_pinned_against_pruning(tmp_path, monkeypatch):
  """The checkpoint is copied before it is read: pruning the live run's step
  while it is read (here: right after the copy) cannot break the load."""
  from rljax.train import policy  # pylint: disable=g-import-not-at-top
  teacher = str(tmp_path / "teacher")
  tok, params = _teacher_run(teacher, steps=(3,))
  real_load = policy.load_policy

  def prune_then_load(workdir, step):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(os.path.join(teacher, "checkpoints", str(step)))
    return real_load(workdir, step)

  monkeypatch.setattr(policy, "load_policy", prune_then_load)
  _, got = train.load_teacher(teacher, _MESH1(), tok.vocab_size)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a) * 3, np.asarray(b))
