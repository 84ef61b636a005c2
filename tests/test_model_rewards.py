"""Rewards from a reward model: rljax.train.model_rewards and the kind ``model``.

* tokens: the evaluator hands the rollout over and the scores equal a plain
  forward of ``models.reward_model.scores`` on the same rows;
* text with another tokenizer: a tiny transformers reward model with a
  character-level tokenizer and a chat template; the re-rendered text's
  scores equal transformers' own (its tokenizer, its chat template);
* failures: a reward model that returns NaN counts invalid; bad paths,
  causal LMs, several labels and several processes are refused early;
* the loop: a run with ``rewards.names=("model:<dir>", "numeric_match")``
  (the verifier at weight 0, watched only) trains, for every
  ``rewards.models.tokens``.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import distributed, metrics, models, rewards, sampling, train
from rljax import tokenizers as tok_lib
from rljax.models import reward_model as rm
from rljax.train import build, model_rewards
from tests import reward_models
from tests.hf_extra import requires_hf
from tests.test_train import tiny_config

TINY = rm.RewardModelConfig(models.get_preset("tiny"))


def _params(config, seed=0):
  params = rm.init_params(config, jax.random.key(seed))
  kernel = jax.random.normal(jax.random.key(seed + 1),
                             (config.decoder.d_model, 1))
  return {"decoder": params["decoder"], "score": {"kernel": kernel}}


@pytest.fixture(scope="module")
def policy_tokenizer():
  texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
  return tok_lib.train_sentencepiece(texts, vocab_size=32)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, policy_tokenizer):
  """A reward model with the policy's sentencepiece tokenizer."""
  path = tmp_path_factory.mktemp("rm") / "adder_rm"
  rm.save_hf_reward_model(path, TINY, _params(TINY))
  (path / "tokenizer.model").write_bytes(policy_tokenizer.serialized)
  return str(path)


class _Rollout:  # the fields a reward model reads
  def __init__(self, tokenizer, prompts, completions):
    p = [tok_lib.encode_prompts(tokenizer, [x])[0] for x in prompts]
    c = [tokenizer.encode(x) + [tokenizer.eos_id]
         for x in completions]
    self.prompt_tokens, self.prompt_mask = sampling.pad_prompts(p, (8,))
    width = max(map(len, c))
    self.completion_tokens = np.zeros((len(c), width), np.int32)
    self.completion_mask = np.zeros((len(c), width), bool)
    for i, ids in enumerate(c):
      self.completion_tokens[i, :len(ids)] = ids
      self.completion_mask[i, :len(ids)] = True


PROMPTS = ["1+2=", "12+7=", "3+3="]
COMPLETIONS = ["3", "19", "7"]


def test_token_path_equals_a_plain_forward_and_the_text_path(
    rm_dir, policy_tokenizer):
  fn = model_rewards.load(f"model:{rm_dir}", policy_tokenizer=policy_tokenizer)
  assert fn.reads_tokens
  rollout = _Rollout(policy_tokenizer, PROMPTS, COMPLETIONS)
  with rewards.RewardEvaluator([rewards.RewardSpec("rm", fn, in_process=True)],
                               num_workers=0) as evaluator:
    result = evaluator.evaluate(PROMPTS, COMPLETIONS, tokens=rollout)
    text = evaluator.evaluate(PROMPTS, COMPLETIONS)
  # Reference: the model on each row alone, unpadded.
  _, params = rm.load_hf_reward_model(rm_dir)
  want = []
  for i in range(3):
    ids = np.concatenate([rollout.prompt_tokens[i][rollout.prompt_mask[i]],
                          rollout.completion_tokens[i][
                              rollout.completion_mask[i]]])
    want.append(float(rm.scores(params, TINY, jnp.asarray(ids[None]),
                                jnp.ones((1, len(ids)), bool))[0, 0]))
  np.testing.assert_allclose(result.rewards_NxR[:, 0], want, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(text.rewards_NxR[:, 0], want, rtol=1e-5,
                             atol=1e-5)
  assert len(set(np.round(want, 4))) == 3  # the rows' scores differ


def test_nan_scores_count_invalid_and_nothing_stops(rm_dir, policy_tokenizer):
  fn = model_rewards.load(f"model:{rm_dir}", policy_tokenizer=policy_tokenizer)
  fn.params = jax.tree.map(lambda x: x * jnp.nan, fn.params)
  with rewards.RewardEvaluator(
      [rewards.RewardSpec("rm", fn, in_process=True),
       rewards.reward_spec("numeric_match", in_process=True)],
      num_workers=0) as evaluator:
    result = evaluator.evaluate(
        PROMPTS, COMPLETIONS, {"answer": ["3", "19", "6"]},
        tokens=_Rollout(policy_tokenizer, PROMPTS, COMPLETIONS))
  assert result.metrics["reward/rm/invalid"] == 3
  assert not result.valid_NxR[:, 0].any()
  np.testing.assert_array_equal(result.rewards_NxR[:, 1], [1, 1, 0])


@requires_hf("torch", "transformers", "tokenizers", "jinja2")
def test_another_tokenizer_reads_text_through_its_chat_template(
    policy_tokenizer, tmp_path):
  # The policy's tokenizer is sentencepiece; the reward model's is a
  # character-level tokenizer.json with a chat template.
  from tests.test_train_hf import SPECIALS, TEMPLATE, VOCAB  # pylint: disable=g-import-not-at-top
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(
      {t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
  tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.Split(
      hf_tokenizers.Regex(".|\n"), "isolated")
  tok.decoder = hf_tokenizers.decoders.Fuse()
  tok.add_special_tokens(SPECIALS)
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
       "chat_template": TEMPLATE,
       "tokenizer_class": "PreTrainedTokenizerFast"}))
  config = rm.RewardModelConfig(models.get_preset("tiny").replace(
      vocab_size=32))
  rm.save_hf_reward_model(tmp_path, config, _params(config, 3),
                          extra_config={"pad_token_id": 0})
  fn = model_rewards.load(f"model:{tmp_path}",
                          policy_tokenizer=policy_tokenizer)
  assert not fn.reads_tokens
  with rewards.RewardEvaluator([rewards.RewardSpec("rm", fn, in_process=True)],
                               num_workers=0) as evaluator:
    got = evaluator.evaluate(PROMPTS, COMPLETIONS, tokens=_Rollout(
        policy_tokenizer, PROMPTS, COMPLETIONS)).rewards_NxR[:, 0]
  assert np.isfinite(got).all()
  _check_against_transformers(tmp_path, got)


def _check_against_transformers(path, got):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
      path).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
        tokenize=True, add_generation_prompt=False, return_dict=False)
    with torch.no_grad():
      want = model(torch.tensor([ids])).logits[0, 0].item()
    assert got[i] == pytest.approx(want, abs=1e-4)


def test_bad_model_rewards_are_refused_before_anything_loads(
    rm_dir, tmp_path, policy_tokenizer):
  config = tiny_config()
  config.rewards.names = (f"model:{tmp_path}/nowhere",)
  with pytest.raises(FileNotFoundError, match="nowhere/config.json.*"
                     "reward_model/config.json"):
    build.validate(config)
  models.save_hf_checkpoint(tmp_path / "lm", TINY.decoder,
                            _params(TINY)["decoder"])
  config.rewards.names = (f"model:{tmp_path}/lm",)
  with pytest.raises(ValueError, match="a causal LM"):
    build.validate(config)
  two = rm.RewardModelConfig(TINY.decoder, num_labels=2)
  rm.save_hf_reward_model(tmp_path / "two", two,
                          {"decoder": _params(TINY)["decoder"],
                           "score": {"kernel": jnp.zeros((64, 2))}})
  config.rewards.names = (f"model:{tmp_path}/two",)
  with pytest.raises(ValueError, match="num_labels=2.*accepted: num_labels=1"):
    build.validate(config)
  config.rewards.names = (f"model:{rm_dir}",)
  build.validate(config)
  with pytest.raises(ValueError, match="several processes needs the mesh"):
    build.reward_specs(config, tokenizer=policy_tokenizer,
                       group=distributed.ProcessGroup(0, 2))
  config.rewards.models.tokens = "tokens"
  with pytest.raises(ValueError, match="rewards.models.tokens"):
    build.validate(config)


def test_a_vocabulary_smaller_than_the_policy_s_is_refused(tmp_path,
                                                           policy_tokenizer):
  small = rm.RewardModelConfig(models.get_preset("tiny").replace(vocab_size=8))
  rm.save_hf_reward_model(tmp_path, small, _params(small))
  with pytest.raises(ValueError, match="vocab_size=8"):
    model_rewards.load(f"model:{tmp_path}", policy_tokenizer=policy_tokenizer,
                       tokens="policy")


# --------------------------------------------------------------------------
# The loop


@pytest.mark.slow
@pytest.mark.parametrize("tokens", ["auto", "policy", "text"])
def test_a_run_trains_on_a_reward_model(tmp_path, tokens):
  config = tiny_config()
  config.rl.num_steps = 2
  config.eval.every = 2
  task, train_examples, _ = build.load_task(config)
  tokenizer = build.make_tokenizer(config, task, train_examples)
  rm_config = rm.RewardModelConfig(models.get_preset("tiny").replace(
      vocab_size=tokenizer.vocab_size))
  path = tmp_path / "arith_rm"
  rm.save_hf_reward_model(path, rm_config, _params(rm_config))
  (path / "tokenizer.model").write_bytes(tokenizer.serialized)
  config.rewards.names = (f"model:{path}", "numeric_match")
  config.rewards.weights = (1.0, 0.0)
  config.rewards.models.tokens = tokens
  config.eval.reward = "numeric_match"
  train.run(config, str(tmp_path / "run"))
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "run" /
                                            "metrics.jsonl")) if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["reward/arith_rm/valid_frac"] == 1.0
    assert np.isfinite(r["reward/arith_rm/mean"])
    assert r["reward/arith_rm/mean"] != 0.0  # the head is not zero
    assert np.isfinite(r["reward/numeric_match/mean"])
  assert "eval/accuracy" in rows[-1]


def test_bfloat16_params_score_close_to_float32(rm_dir, policy_tokenizer):
  rollout = _Rollout(policy_tokenizer, PROMPTS, COMPLETIONS)
  scores = {}
  for dtype in (None, "bfloat16"):
    fn = model_rewards.load(f"model:{rm_dir}", policy_tokenizer=policy_tokenizer,
                            param_dtype=dtype)
    leaves = jax.tree.leaves(fn.params["decoder"])
    assert {x.dtype for x in leaves} == {jnp.dtype(dtype or "float32")}
    scores[dtype] = fn.score_tokens(rollout)
  np.testing.assert_allclose(scores["bfloat16"], scores[None], rtol=0.05)
  assert not np.array_equal(scores["bfloat16"], scores[None])


# --------------------------------------------------------------------------
# Ensembles (Coste et al. 2023)


def test_ensemble_aggregations_by_hand():
  scores = np.array([[1.0, 2.0, 0.0, 5.0],
                     [3.0, 2.0, -4.0, np.nan],
                     [2.0, 2.0, 1.0, 1.0]])
  got = {a: model_rewards.aggregate(scores, a, 1.5)
         for a in model_rewards.AGGREGATIONS}
  np.testing.assert_allclose(got["mean"][:3], [2.0, 2.0, -1.0])
  np.testing.assert_allclose(got["worst"][:3], [1.0, 2.0, -4.0])
  std0 = np.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2 + 0) / 3)  # ddof=0
  std2 = np.sqrt((1 + 9 + 4) / 3)
  np.testing.assert_allclose(got["mean_minus_std"][:3],
                             [2.0 - 1.5 * std0, 2.0, -1.0 - 1.5 * std2])
  for a in model_rewards.AGGREGATIONS:  # a member's failure fails the row
    assert got[a][3] == np.inf
  with pytest.raises(ValueError, match="aggregation='median'"):
    model_rewards.aggregate(scores, "median", 1.0)


def test_an_ensemble_scores_each_member_and_aggregates(tmp_path, rm_dir,
                                                       policy_tokenizer):
  other = tmp_path / "other_rm"
  rm.save_hf_reward_model(other, TINY, _params(TINY, seed=5))
  (other / "tokenizer.model").write_bytes(policy_tokenizer.serialized)
  rollout = _Rollout(policy_tokenizer, PROMPTS, COMPLETIONS)
  members = [model_rewards.load(f"model:{p}", policy_tokenizer=policy_tokenizer)
             for p in (rm_dir, other)]
  each = np.stack([m.score_tokens(rollout) for m in members])
  assert not np.allclose(each[0], each[1])
  fn = model_rewards.EnsembleReward(members, "worst")
  assert fn.reads_tokens
  np.testing.assert_allclose(fn.score_tokens(rollout), each.min(0))
  np.testing.assert_allclose(fn(PROMPTS, COMPLETIONS), each.min(0),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="at least two reward models"):
    model_rewards.ensemble_members(f"ensemble:{rm_dir}")
  with pytest.raises(FileNotFoundError, match="nope"):
    build.reward_fn(f"ensemble:{rm_dir},{tmp_path}/nope")


@pytest.mark.slow
def test_a_run_trains_on_a_reward_model_ensemble(tmp_path):
  config = tiny_config()
  config.rl.num_steps = 2
  config.eval.every = 0
  task, train_examples, _ = build.load_task(config)
  tokenizer = build.make_tokenizer(config, task, train_examples)
  paths = [reward_models.tiny_reward_model(tmp_path / f"rm{seed}", tokenizer,
                                           seed) for seed in (0, 3)]
  config.rewards.names = ("ensemble:" + ",".join(paths), "numeric_match")
  config.rewards.weights = (1.0, 0.0)
  config.rewards.ensemble.aggregation = "mean_minus_std"
  config.rewards.ensemble.k = 0.5
  config.eval.reward = "numeric_match"
  train.run(config, str(tmp_path / "run"))
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "run" /
                                            "metrics.jsonl")) if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["reward/ensemble/valid_frac"] == 1.0
    assert np.isfinite(r["reward/ensemble/mean"])
    assert r["grad_norm"] > 0
