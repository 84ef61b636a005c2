"""Generative judges (rljax.train.judges, the reward kind ``judge``).

Scripted judges: a tiny decoder whose every position's logits put all the
mass on one token (each embedding is the same unit vector, attention and MLP
outputs are zero, ``lm_head`` reads that vector into one column), saved as a
Hugging Face checkpoint with its own sentencepiece tokenizer. One always
says "yes"; one always says "+", which no parser reads: it counts as no
reward and training continues.
"""

import jax
import numpy as np
import pytest

from rljax import metrics, models, rewards, train
from rljax import tokenizers as tok_lib
from rljax.train import build, judges, policy, schema
from tests.test_train import tiny_config

TEMPLATE = schema.fields()["rewards.judges.template"].default


@pytest.mark.parametrize("text, want", [
    ("yes", 1.0), (" Yes, it is.", 1.0), ("correct", 1.0), ("no", 0.0),
    ("Incorrect!", 0.0), ("7", 7.0), ("score: 8.5/10", 8.5), ("-2", -2.0),
    ("maybe", None), ("", None), ("yesterday", None)])
def test_parse_verdict(text, want):
  assert judges.parse_verdict(text) == want


@pytest.mark.parametrize("values, want", [
    ([1.0, 0.0, 1.0], 1.0), ([None, None], None), ([0.0, 1.0], 0.0),
    ([None, 2.0, 3.0, 3.0], 3.0), ([], None)])
def test_majority(values, want):
  assert judges.majority(values) == want


def plus_count(text):
  """A user parser: the number of '+' in the verdict."""
  return float(text.count("+"))


@pytest.fixture(scope="module")
def judge_tokenizer():
  texts = [TEMPLATE.format(prompt=f"{a}+{b}=", completion=str(a + b))
           + "yes no" for a in range(20) for b in range(20)]
  return tok_lib.train_sentencepiece(texts, vocab_size=96,
                                     user_defined_symbols=("yes",))


def _scripted(tokenizer, piece):
  """Params of a decoder that always emits ``piece``."""
  config = models.get_preset("tiny").replace(
      vocab_size=tokenizer.vocab_size, tie_embeddings=False)
  params = models.init_params(config, jax.random.key(0))
  target = [i for i in range(tokenizer.vocab_size)
            if tokenizer.id_to_piece(i) == piece]
  assert len(target) == 1, piece
  e = np.zeros(config.d_model, np.float32)
  e[0] = 1.0
  params = jax.tree.map(np.asarray, params)
  params["embedding"] = np.tile(e, (config.vocab_size, 1))
  for i in range(config.num_layers):
    layer = params[f"layers_{i}"]
    layer["attn"]["o_kernel"] = np.zeros_like(layer["attn"]["o_kernel"])
    layer["mlp"]["down_kernel"] = np.zeros_like(layer["mlp"]["down_kernel"])
  head = np.zeros((config.d_model, config.vocab_size), np.float32)
  head[0, target[0]] = 10.0
  params["lm_head"] = head
  return config, jax.tree.map(jax.numpy.asarray, params)


@pytest.fixture(scope="module")
def judge_dirs(tmp_path_factory, judge_tokenizer):
  out = {}
  for name, piece in (("yes_judge", "yes"), ("plus_judge", "+")):
    path = tmp_path_factory.mktemp("judges") / name
    config, params = _scripted(judge_tokenizer, piece)
    models.save_hf_checkpoint(path, config, params, extra_config={
        "eos_token_id": judge_tokenizer.eos_id})
    tok_lib.save_hf_tokenizer(judge_tokenizer, path,
                              add_bos_token=judge_tokenizer.bos_id is not None)
    out[name] = str(path)
  return out


def _load(name, settings):
  return judges.load(name, model=policy.load_judge(judges.check(name), None),
                     mesh=None, seed=0, settings=settings)


def _settings(**changes):
  settings = tiny_config().rewards.judges
  settings.max_new_tokens = 1
  for k, v in changes.items():
    setattr(settings, k, v)
  return settings


PROMPTS, COMPLETIONS = ["1+2=", "3+4=", "5+5="], ["3", "8", "10"]


def test_a_yes_judge_scores_one_greedy_and_by_majority(judge_dirs):
  for k in (1, 3):
    judge = _load(f"judge:{judge_dirs['yes_judge']}",
                        settings=_settings(num_samples=k))
    verdicts = judge.verdicts(PROMPTS, COMPLETIONS)
    assert [len(v) for v in verdicts] == [k] * 3
    assert all(t == "yes" for v in verdicts for t in v)
    with rewards.RewardEvaluator(
        [rewards.RewardSpec("yes_judge", judge, in_process=True)],
        num_workers=0) as evaluator:
      result = evaluator.evaluate(PROMPTS, COMPLETIONS)
    np.testing.assert_array_equal(result.rewards_NxR[:, 0], 1.0)
    assert result.metrics["reward/yes_judge/none"] == 0


def test_the_judge_reads_the_template_with_the_question_and_answer(
    judge_dirs):
  judge = _load(f"judge:{judge_dirs['yes_judge']}",
                      settings=_settings())
  ids = judge.encode("1+2=", "3")
  text = judge.tokenizer.decode(ids)
  assert text.replace(" ", "") == TEMPLATE.format(
      prompt="1+2=", completion="3").replace(" ", "")


def test_a_garbage_judge_counts_as_no_reward_and_a_user_parser_reads_it(
    judge_dirs):
  name = f"judge:{judge_dirs['plus_judge']}"
  judge = _load(name, settings=_settings())
  with rewards.RewardEvaluator(
      [rewards.RewardSpec("plus_judge", judge, in_process=True),
       rewards.reward_spec("numeric_match", in_process=True)],
      num_workers=0) as evaluator:
    result = evaluator.evaluate(PROMPTS, COMPLETIONS,
                                {"answer": ["3", "7", "10"]})
  assert result.metrics["reward/plus_judge/none"] == 3
  assert result.metrics["reward/plus_judge/valid_frac"] == 0.0
  np.testing.assert_array_equal(result.rewards_NxR[:, 1], [1, 0, 1])
  parsed = _load(name, settings=_settings(
      parser="tests.test_judges:plus_count"))
  assert parsed(PROMPTS, COMPLETIONS) == [1.0, 1.0, 1.0]


def test_bad_judge_settings_are_clear_errors(judge_dirs, tmp_path):
  with pytest.raises(ValueError, match="rewards.judges.parser='nowhere:fn'"):
    judges.get_parser("nowhere:fn")
  with pytest.raises(ValueError, match=r"rewards.judges.template=.*\{prompt\} "
                     r"and \{completion\}"):
    _load(f"judge:{judge_dirs['yes_judge']}",
                settings=_settings(template="{question} {completion}"))
  config = tiny_config()
  config.rewards.names = ("numeric_match", f"judge:{tmp_path}/none")
  config.rewards.weights = (1.0, 1.0)
  with pytest.raises(FileNotFoundError, match="neither checkpoints/"):
    build.validate(config)


@pytest.mark.slow
def test_a_run_trains_with_two_judges_one_of_them_garbage(judge_dirs,
                                                          tmp_path):
  config = tiny_config()
  config.rl.num_steps = 2
  config.eval.every = 2
  config.rewards.names = ("numeric_match", f"judge:{judge_dirs['yes_judge']}",
                          f"judge:{judge_dirs['plus_judge']}")
  config.rewards.weights = (1.0, 0.5, 0.5)
  config.rewards.judges.max_new_tokens = 1
  train.run(config, str(tmp_path / "run"))
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "run" /
                                            "metrics.jsonl")) if r["step"] > 0]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["reward/yes_judge/mean"] == 1.0
    assert r["reward/yes_judge/valid_frac"] == 1.0
    assert r["reward/plus_judge/valid_frac"] == 0.0
    assert r["reward/plus_judge/none"] > 0
  # The finished run is itself a judge (an rljax run directory).
  judge = _load(f"judge:{tmp_path / 'run'}",
                      settings=_settings(max_new_tokens=3))
  verdicts = judge.verdicts(["1+2="], ["3"])
  assert len(verdicts) == 1 and isinstance(verdicts[0][0], str)
  assert judge.model_config.vocab_size >= judge.tokenizer.vocab_size
