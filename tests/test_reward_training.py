"""Reward-model training: rljax.train.reward_training and launch.train_reward_model.

The Bradley–Terry loss and its gradient against NumPy (the derivative of
``-log sigmoid(d)`` is ``sigmoid(d) - 1``); pair files and pair encoding
with hostile input; a tiny run that exports a model ``"model:<workdir>"``
reads, resumes without retraining (and exactly after a SIGKILL), and
refuses what it cannot do.
"""

import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import data, metrics
from rljax import tokenizers as tok_lib
from rljax.models import reward_model as rm
from rljax.train import model_rewards, reward_training as rt
from rljax.train import sft
from tests.test_resume import ROOT, _wait_for_step
from tests.test_train import tiny_config
from tests import subprocess_env


def _np_loss(c, r, m, k):
  d = c - r - m
  return np.mean(np.log1p(np.exp(-d))) + k * np.mean((c + r) ** 2)


@pytest.mark.parametrize("margin, center", [(False, 0.0), (True, 0.0),
                                            (True, 0.05)])
def test_bradley_terry_loss_and_gradient_match_numpy(margin, center):
  rng = np.random.default_rng(0)
  c, r = rng.normal(size=6), rng.normal(size=6)
  m = rng.uniform(0, 1, 6) if margin else np.zeros(6)
  loss, out = rt.bradley_terry_loss(jnp.asarray(c), jnp.asarray(r),
                                    jnp.asarray(m) if margin else None, center)
  np.testing.assert_allclose(loss, _np_loss(c, r, m, center), rtol=1e-6)
  assert out["accuracy"] == pytest.approx(np.mean(c > r))
  grad_c, grad_r = jax.grad(lambda a, b: rt.bradley_terry_loss(
      a, b, jnp.asarray(m) if margin else None, center)[0], (0, 1))(
          jnp.asarray(c), jnp.asarray(r))
  sig = 1 / (1 + np.exp(-(c - r - m)))
  want_c = (sig - 1) / 6 + 2 * center * (c + r) / 6
  want_r = (1 - sig) / 6 + 2 * center * (c + r) / 6
  np.testing.assert_allclose(grad_c, want_c, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad_r, want_r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "1+1=", "chosen": "2"}', "rejected"),
    ('{"prompt": "1+1=", "chosen": 2, "rejected": "3"}', "'chosen' is 2"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": NaN}',
     "'margin' is nan"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"}',
     "'margin' is 'big'"),
    ('{"prompt": "1+1=", "chosen": "2", "rej',
     r"pairs.jsonl:1: not valid JSON"),
])
def test_bad_pair_files_name_the_line_and_field(tmp_path, line, match):
  path = tmp_path / "pairs.jsonl"
  path.write_text(line + "\n")
  with pytest.raises(ValueError, match=match):
    rt.read_pairs(str(path))


def test_an_empty_pair_file_is_refused(tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text("")
  with pytest.raises(ValueError, match="pairs.jsonl: no examples"):
    rt.read_pairs(str(path))


@pytest.fixture(scope="module")
def tokenizer():
  texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
  return tok_lib.train_sentencepiece(texts, vocab_size=32)


def test_pairs_encode_as_the_reward_model_reads_them(tokenizer):
  pairs = [{"prompt": "1+2=", "chosen": "3", "rejected": "5", "margin": 0.5}]
  out = rt.encode_pairs(tokenizer, pairs, 12)
  for side, tokens, mask in (("chosen", out.chosen, out.chosen_mask),
                             ("rejected", out.rejected, out.rejected_mask)):
    want = model_rewards.encode(tokenizer, "1+2=", pairs[0][side])
    assert list(tokens[0][mask[0]]) == want and want[-1] == tokenizer.eos_id
    assert mask[0].sum() == len(want) and not mask[0][len(want):].any()
  assert out.margin.tolist() == [0.5]
  with pytest.raises(ValueError, match=r"reward_model.max_length=3 is "
                     r"shorter \(accepted: >= \d+\)"):
    rt.encode_pairs(tokenizer, pairs, 3)


@pytest.mark.parametrize("negatives", ["near", "mixed"])
def test_builtin_pairs_prefer_the_answer_over_a_wrong_one(negatives):
  task = data.get_task("arithmetic")
  pairs = rt.builtin_pairs(task, "train", 400, 0, negatives)
  examples = task.examples("train", 400, 0)
  assert [p["prompt"] for p in pairs] == [e["prompt"] for e in examples]
  far = 0
  for p, e in zip(pairs, examples):
    assert p["chosen"] == e["answer"]
    assert p["rejected"] != p["chosen"] and int(p["rejected"]) >= 0
    assert p["rejected"] == str(int(p["rejected"]))  # a plain integer
    far += abs(int(p["rejected"]) - int(p["chosen"])) > 9
  if negatives == "near":
    assert far == 0
  else:  # a quarter random, a quarter digit edits: most of those are far
    assert 0.2 < far / len(pairs) < 0.5
  assert rt.builtin_pairs(task, "train", 400, 0, negatives) == pairs  # seeded
  assert sft.near_miss("0", np.random.default_rng(0)) != "0"
  with pytest.raises(ValueError, match="reward_model.negatives='far'"):
    rt.builtin_pairs(task, "train", 4, 0, "far")


def test_wrong_answers_of_each_kind_are_wrong_integers():
  rng = np.random.default_rng(0)
  for answer in ("0", "7", "10", "99", "100", "12345"):
    for kind in ("near", "random", "digits"):
      for _ in range(50):
        wrong = rt.wrong_answer(answer, rng, kind)
        assert wrong != answer and wrong.isdigit() and str(int(wrong)) == wrong


def test_pairs_from_samples_pair_distinct_right_and_wrong_answers():
  pairs = rt.pairs_from_samples(
      ["1+1=", "2+2=", "3+3="],
      [["2", "3", "2", "5", "3"], ["4", "4"], ["7", "6", "8"]],
      [[1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 1.0], [0.0, 1.0, float("nan")]])
  assert pairs == [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                   {"prompt": "3+3=", "chosen": "6", "rejected": "7"}]


def _tiny(workdir_steps=20):
  config = tiny_config()
  config.reward_model.num_steps = workdir_steps
  config.reward_model.eval_every = 10
  config.reward_model.checkpoint_every = 10
  config.reward_model.num_pairs = 256
  config.reward_model.num_heldout = 64
  config.reward_model.batch_size = 16
  return config


@pytest.mark.slow
def test_a_tiny_run_exports_a_reward_model_and_resumes(tmp_path):
  workdir = str(tmp_path / "rm")
  summary = rt.run(_tiny(), workdir)
  assert summary["steps"] == 20 and 0.0 <= summary["heldout_accuracy"] <= 1.0
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows if "rm/loss" in r] == [10, 20]
  assert all(np.isfinite(r["rm/loss"]) for r in rows if "rm/loss" in r)
  config, params = rm.load_hf_reward_model(os.path.join(workdir,
                                                        "reward_model"))
  assert config.num_labels == 1
  # The export reads the policy's tokens: the same tokenizer as a run of
  # the same config and seed.
  task, train_examples, _ = _build().load_task(_tiny())
  policy_tok = _build().make_tokenizer(_tiny(), task, train_examples)
  fn = model_rewards.load(f"model:{workdir}", policy_tokenizer=policy_tok)
  assert fn.reads_tokens
  jax.tree.map(np.testing.assert_array_equal, fn.params, params)
  # A rerun with more steps resumes from step 20.
  longer = rt.run(_tiny(30), workdir)
  rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows if "rm/loss" in r] == [10, 20, 30]
  assert longer["heldout_accuracy_before"] == summary["heldout_accuracy_before"]


@pytest.mark.slow
def test_a_run_from_scratch_skips_the_warm_up(tmp_path):
  config = _tiny(10)
  config.reward_model.init = "scratch"
  summary = rt.run(config, str(tmp_path))
  rows = metrics.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert not any("sft/sft_loss" in r for r in rows)
  assert [r["step"] for r in rows if "rm/loss" in r] == [10]
  assert summary["heldout_accuracy_before"] == 0.5  # a zero head: all ties


@pytest.mark.slow
def test_pairs_from_the_sft_model_s_samples_are_labelled_and_kept(tmp_path):
  config = _tiny(10)
  config.sft.num_steps = 40
  config.reward_model.policy_prompts = 32
  config.reward_model.policy_samples = 4
  rt.run(config, str(tmp_path))
  rows = metrics.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
  [count] = [r["rm/policy_pairs"] for r in rows if "rm/policy_pairs" in r]
  path = os.path.join(str(tmp_path), "policy_pairs.jsonl")
  pairs = rt.read_pairs(path) if os.path.getsize(path) else []
  assert len(pairs) == count
  def last_number(text):
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None

  for p in pairs:
    answer = str(eval(p["prompt"].rstrip("=")))  # pylint: disable=eval-used
    assert last_number(p["chosen"]) == answer
    assert last_number(p["rejected"]) != answer


@pytest.mark.parametrize("init, sft_steps", [("scratch", 40),
                                              ("policy_sft", 0)])
def test_policy_pairs_need_the_sft_model(tmp_path, init, sft_steps):
  config = _tiny()
  config.reward_model.policy_prompts = 8
  config.reward_model.init = init
  config.sft.num_steps = sft_steps
  with pytest.raises(ValueError, match="reward_model.policy_prompts=8"):
    rt.run(config, str(tmp_path))


@pytest.mark.slow
def test_a_reward_model_on_the_policys_warm_up_starts_where_the_policy_does(
    tmp_path):
  """``reward_model.init="policy_sft"``: the reward model's decoder is the
  warm-up that ``launch.train`` of the same config and seed trains. The
  warm-up cache's key covers the initial params, the demonstrations and the
  program, so the policy's run loads the reward model's entry; ``"sft"``
  trains a warm-up of its own (a second entry)."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  cache = tmp_path / "sft_cache"

  def entries():
    return sorted(f for f in os.listdir(cache) if f.endswith(".npz"))

  config = _tiny(10)
  config.sft.num_steps = 4
  config.sft.cache_dir = str(cache)
  config.reward_model.init = "policy_sft"
  rt.run(config, str(tmp_path / "rm"))
  [entry] = entries()
  policy = tiny_config()
  policy.sft.num_steps = 4
  policy.sft.cache_dir = str(cache)
  policy.rl.num_steps = 1
  policy.eval.every = 0
  train.run(policy, str(tmp_path / "policy"))
  assert entries() == [entry]
  config.reward_model.init = "sft"
  rt.run(config, str(tmp_path / "rm_own"))
  assert len(entries()) == 2


@pytest.fixture(scope="module")
def rm_and_policy(tmp_path_factory):
  """A tiny reward-model run and a tiny RL policy run of the same config."""
  from rljax import train  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("iterated")
  rm_dir = str(root / "rm")
  first = rt.run(_tiny(10), rm_dir)
  policy = tiny_config()
  policy.rl.num_steps = 1
  policy.sft.num_steps = 40
  policy.eval.every = 0
  train.run(policy, str(root / "policy"))
  return rm_dir, first, str(root / "policy")


@pytest.mark.slow
def test_iterated_rlhf_retrains_the_reward_model_on_the_policy_s_samples(
    rm_and_policy, tmp_path):
  """``reward_model.init_path`` continues a reward model (its held-out
  accuracy before is where the first run ended; no warm-up), and
  ``reward_model.policy_path`` labels the RL policy's samples (pairs of
  right over wrong answers by the verifier, kept in policy_pairs.jsonl)."""
  rm_dir, first, policy_dir = rm_and_policy
  config = _tiny(10)
  config.reward_model.init_path = rm_dir
  config.reward_model.policy_path = policy_dir
  config.reward_model.policy_prompts = 32
  config.reward_model.policy_samples = 4
  summary = rt.run(config, str(tmp_path))
  assert summary["heldout_accuracy_before"] == pytest.approx(
      first["heldout_accuracy"])
  rows = metrics.read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert not any("sft/sft_loss" in r for r in rows)
  [count] = [r["rm/policy_pairs"] for r in rows if "rm/policy_pairs" in r]
  path = os.path.join(str(tmp_path), "policy_pairs.jsonl")
  pairs = rt.read_pairs(path) if os.path.getsize(path) else []
  assert len(pairs) == count
  for p in pairs:
    answer = str(eval(p["prompt"].rstrip("=")))  # pylint: disable=eval-used
    assert re.findall(r"-?\d+", p["chosen"])[-1] == answer
  # The continued model differs from the one it started from.
  _, before = rm.load_hf_reward_model(os.path.join(rm_dir, "reward_model"))
  _, after = rm.load_hf_reward_model(os.path.join(str(tmp_path),
                                                  "reward_model"))
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.slow
def test_iterated_rlhf_paths_are_checked_before_training(rm_and_policy,
                                                         tmp_path):
  rm_dir, _, policy_dir = rm_and_policy
  cases = [
      ({"init_path": str(tmp_path / "nowhere")}, FileNotFoundError,
       "reward_model.init_path="),
      ({"policy_path": str(tmp_path), "policy_prompts": 8},
       FileNotFoundError, r"reward_model.policy_path=.*config.json does not "
       "exist"),
      ({"policy_path": policy_dir}, ValueError,
       "reward_model.policy_path=.* with reward_model.policy_prompts=0"),
  ]
  for fields, error, match in cases:
    config = _tiny(10)
    for k, v in fields.items():
      config.reward_model[k] = v
    with pytest.raises(error, match=match):
      rt.run(config, str(tmp_path / "run"))
  # Another tokenizer (a larger vocabulary): both refused, naming the field.
  other = _tiny(10)
  other.tokenizer.vocab_size = other.tokenizer.vocab_size + 16
  other.reward_model.init_path = rm_dir
  with pytest.raises(ValueError, match="reward_model.init_path=.*tokenizer"):
    rt.run(other, str(tmp_path / "other"))
  other = _tiny(10)
  other.tokenizer.vocab_size = other.tokenizer.vocab_size + 16
  other.reward_model.policy_path = policy_dir
  other.reward_model.policy_prompts = 8
  with pytest.raises(ValueError, match="reward_model.policy_path=.*tokenizer"):
    rt.run(other, str(tmp_path / "other2"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def _build():
  from rljax.train import build  # pylint: disable=g-import-not-at-top
  return build


def test_bad_reward_model_configs_are_refused_before_training(tmp_path):
  config = _tiny()
  config.reward_model.init = "policy"
  with pytest.raises(ValueError, match="reward_model.init='policy'"):
    rt.run(config, str(tmp_path))
  config = _tiny()
  config.model.lora.rank = 4
  with pytest.raises(ValueError, match="model.lora.rank > 0"):
    rt.run(config, str(tmp_path))
  config = _tiny()
  config.reward_model.max_length = 4
  with pytest.raises(ValueError, match="reward_model.max_length=4"):
    rt.run(config, str(tmp_path))
  assert not os.path.exists(os.path.join(str(tmp_path), "checkpoints"))


_RM_FLAGS = ("--config=configs/arithmetic_grpo.py:tiny",
             "--config.reward_model.num_steps=30",
             "--config.reward_model.eval_every=10",
             "--config.reward_model.checkpoint_every=10",
             "--config.reward_model.num_pairs=256",
             "--config.reward_model.num_heldout=64",
             "--config.reward_model.batch_size=16")


def _launch(workdir):
  env = subprocess_env.one_device_env()
  return subprocess.Popen(
      [sys.executable, "-m", "launch.train_reward_model",
       f"--workdir={workdir}", *_RM_FLAGS], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _exported(workdir):
  return rm.load_hf_reward_model(os.path.join(workdir, "reward_model"))[1]


def _rm_rows(workdir):
  return {r["step"]: {k: v for k, v in r.items()}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if "rm/loss" in r}


@pytest.mark.slow
def test_a_killed_reward_model_run_resumes_exactly(tmp_path):
  reference = str(tmp_path / "whole")
  assert _launch(reference).wait(timeout=600) == 0
  workdir = str(tmp_path / "killed")
  proc = _launch(workdir)
  _wait_for_step(workdir, 10, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(workdir, "reward_model"))
  out = _launch(workdir)
  assert out.wait(timeout=600) == 0, out.stdout.read()
  assert "resumed at step" in out.stdout.read()
  assert _rm_rows(workdir) == _rm_rows(reference)
  jax.tree.map(np.testing.assert_array_equal, _exported(workdir),
               _exported(reference))


@pytest.mark.slow
def test_bench_rlhf_quick_trains_a_reward_model_and_three_policies(
    tmp_path):
  """The near-miss reward model (the mixed one differs by a flag), a
  policy on it alone, one on the verifier, and iterated RLHF from it."""
  env = subprocess_env.one_device_env()
  result = subprocess.run(
      [sys.executable, "-m", "launch.bench_rlhf", "--quick", "--rms=near",
       "--iterated_rounds=2", f"--workdir={tmp_path}"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  [record] = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
  with open(tmp_path / record) as f:
    figures = json.load(f)["figures"]
  [run] = figures["runs"]
  assert "mixed" not in run
  for kind in ("near", "verifier", "iterated"):
    assert run[kind]["steps"] == [0, 2, 4]
    assert run[kind]["gain"] == pytest.approx(run[kind]["after"]
                                              - run[kind]["before"])
  assert 0.0 <= run["rm_near"]["heldout_accuracy"] <= 1.0
  for kind in ("near", "iterated"):
    assert set(run[kind]["rewards"]) == {"proxy", "numeric_match"}
    assert len(run[kind]["proxy"]) == 3
  assert "verifier_gain" in figures["summary"]
  # The over-optimisation curve: the KL to the SFT policy at each
  # evaluation (0 before RL, > 0 once RL moved the policy), its plot.
  for kind in ("near", "verifier", "iterated"):
    assert run[kind]["kl"][0] == 0.0 and run[kind]["kl"][-1] > 0, run[kind]
  # Iterated RLHF: 2 rounds of 2 steps from the 'near' reward model (the
  # first of --rms), retrained once on the policy's samples in between.
  it = run["iterated"]
  assert it["steps"] == [0, 2, 4]
  assert it["rm_accuracy"][0] == run["rm_near"]["heldout_accuracy"]
  assert len(it["rm_accuracy"]) == len(it["policy_pairs"]) == 2
  retrained = [json.loads(line) for line in open(
      tmp_path / "rm_iterated_seed0_round1" / "metrics.jsonl")]
  [before] = [r["rm/heldout_accuracy"] for r in retrained
              if r["step"] == 0 and "rm/heldout_accuracy" in r]
  assert before == pytest.approx(it["rm_accuracy"][0])  # continued
  # The policy's second round read the retrained model.
  import filecmp  # pylint: disable=import-outside-toplevel
  current = tmp_path / "rm_current_seed0"
  export = tmp_path / "rm_iterated_seed0_round1" / "reward_model"
  names = sorted(os.listdir(export))
  assert names and filecmp.cmpfiles(current, export, names,
                                    shallow=False)[0] == names
  assert os.path.getsize(tmp_path / (os.path.splitext(record)[0] + ".png"))
  # Each point's KL is the mean logged kl of the steps up to it.
  rows = [json.loads(line) for line in open(
      tmp_path / "policy_near_seed0" / "metrics.jsonl")]
  kl = [r["kl"] for r in rows if r["step"] > 0 and "kl" in r]
  assert len(kl) == 4
  assert run["near"]["kl"] == pytest.approx(
      [0.0, np.mean(kl[:2]), np.mean(kl[2:])])
