"""The DPO family (``rljax/objectives/preference.py``,
``rljax/train/preference.py``): each loss against a float64 NumPy port of
TRL's formula on hand-built batches, every name of ``PREFERENCE_LOSSES``
trained from the config, exact resume, LoRA, the precomputed reference, and
hostile pair files and reference models."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import metrics, train
from rljax.objectives import preference as pref
from rljax.train import build
from rljax.train import preference as pref_train
from tests.test_loop import assert_stop_and_resume_matches, loop_config, rl_rows

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "preference.md")


# --- TRL's formulas, ported to NumPy float64 ----------------------------------
# trl/trainer/dpo_trainer.py (dpo_loss: "sigmoid", "robust", "ipo"),
# trl/trainer/cpo_trainer.py (cpo_loss: "simpo"), trl/trainer/orpo_trainer.py
# (odds_ratio_loss), trl/trainer/kto_trainer.py (kto_loss).

def _logsig(x):
  return -np.logaddexp(0.0, -x)


def _sig(x):
  return 1.0 / (1.0 + np.exp(-x))


def trl_dpo(pc, pr, rc, rr, beta, label_smoothing, loss_type):
  logits = (pc - pr) - (rc - rr)
  if loss_type == "sigmoid":
    losses = (-_logsig(beta * logits) * (1 - label_smoothing)
              - _logsig(-beta * logits) * label_smoothing)
  elif loss_type == "robust":
    losses = (-_logsig(beta * logits) * (1 - label_smoothing)
              + _logsig(-beta * logits) * label_smoothing) / (
                  1 - 2 * label_smoothing)
  else:  # ipo: TRL averages the logps over each completion's tokens first
    losses = (logits - 1 / (2 * beta)) ** 2
  return losses.mean(), beta * (pc - rc), beta * (pr - rr)


def trl_simpo(pc_avg, pr_avg, beta, gamma, label_smoothing):
  logits = pc_avg - pr_avg - gamma / beta
  losses = (-_logsig(beta * logits) * (1 - label_smoothing)
            - _logsig(-beta * logits) * label_smoothing)
  return losses.mean()


def trl_orpo(pc_avg, pr_avg, chosen_token_logps, beta):
  log_odds = (pc_avg - pr_avg) - (np.log1p(-np.exp(pc_avg))
                                  - np.log1p(-np.exp(pr_avg)))
  nll = -np.mean(chosen_token_logps)  # cross-entropy over every chosen token
  return nll - np.mean(beta * _logsig(log_odds))


def trl_kto(pol, ref, desirable, pol_kl, ref_kl, beta, dw, uw):
  kl = max(np.mean(pol_kl - ref_kl), 0.0)
  lr = pol - ref
  chosen = 1 - _sig(beta * (lr[desirable] - kl))
  rejected = 1 - _sig(beta * (kl - lr[~desirable]))
  return np.concatenate([dw * chosen, uw * rejected]).mean()


RNG = np.random.default_rng(0)
P = 6
# Per-token logps of each completion (lengths 1 to 5), so that summed and
# averaged logps are both known.
LENGTHS_C = np.array([1, 3, 5, 2, 4, 3])
LENGTHS_R = np.array([2, 2, 4, 5, 1, 3])
TOKENS_C = [RNG.uniform(-3.0, -0.05, n) for n in LENGTHS_C]
TOKENS_R = [RNG.uniform(-3.0, -0.05, n) for n in LENGTHS_R]
PC = np.array([t.sum() for t in TOKENS_C])
PR = np.array([t.sum() for t in TOKENS_R])
RC = PC + RNG.normal(0.0, 0.7, P)
RR = PR + RNG.normal(0.0, 0.7, P)


def _s(pc=PC, pr=PR, rc=RC, rr=RR):
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return pref.SequenceLogprobs(f(pc), f(pr), f(rc), f(rr), f(LENGTHS_C),
                               f(LENGTHS_R))


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2),
                                      (2.0, 0.35)])
def test_dpo_and_cdpo_are_trls_sigmoid_loss(beta, eps):
  want, chosen, rejected = trl_dpo(PC, PR, RC, RR, beta, eps, "sigmoid")
  loss, m = pref.dpo_loss(_s(), beta=beta, label_smoothing=eps)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(m["rewards/chosen"]) == pytest.approx(chosen.mean(), rel=1e-5)
  assert float(m["rewards/margin"]) == pytest.approx(
      (chosen - rejected).mean(), rel=1e-5)
  assert float(m["rewards/accuracy"]) == pytest.approx(
      np.mean(chosen > rejected))


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.3, 0.1), (1.0, 0.45)])
def test_robust_dpo_is_trls_robust_loss(beta, eps):
  want, _, _ = trl_dpo(PC, PR, RC, RR, beta, eps, "robust")
  loss, _ = pref.robust_dpo_loss(_s(), beta=beta, label_smoothing=eps)
  assert float(loss) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_is_trls_on_length_normalised_logps(beta):
  want, _, _ = trl_dpo(PC / LENGTHS_C, PR / LENGTHS_R, RC / LENGTHS_C,
                       RR / LENGTHS_R, beta, 0.0, "ipo")
  loss, _ = pref.ipo_loss(_s(), beta=beta)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  # Summed logps would give another loss: the normalisation is used.
  unnormalised, _, _ = trl_dpo(PC, PR, RC, RR, beta, 0.0, "ipo")
  assert not np.isclose(float(loss), unnormalised, rtol=1e-2)


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_is_trls_cpo_simpo_loss_without_a_reference(beta, gamma, eps):
  want = trl_simpo(PC / LENGTHS_C, PR / LENGTHS_R, beta, gamma, eps)
  loss, _ = pref.simpo_loss(_s(), beta=beta, gamma=gamma, label_smoothing=eps)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  moved, _ = pref.simpo_loss(_s(rc=RC + 3.0, rr=RR - 1.0), beta=beta,
                             gamma=gamma, label_smoothing=eps)
  assert float(moved) == float(loss)  # no reference is read


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_is_trls_odds_ratio_loss_plus_the_chosen_nll(beta):
  want = trl_orpo(PC / LENGTHS_C, PR / LENGTHS_R, np.concatenate(TOKENS_C),
                  beta)
  loss, m = pref.orpo_loss(_s(), beta=beta)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(m["orpo/nll"]) == pytest.approx(
      -np.mean(np.concatenate(TOKENS_C)), rel=1e-5)


@pytest.mark.parametrize("kl_shift", [0.8, -0.8])  # z0 > 0, and clamped to 0
def test_kto_is_trls_kto_loss(kl_shift):
  n = 8
  pol = RNG.normal(-8.0, 2.0, n)
  ref = pol + RNG.normal(0.0, 0.5, n)
  desirable = np.arange(n) < 5
  pol_kl = RNG.normal(-9.0, 1.0, n)
  ref_kl = pol_kl - kl_shift + RNG.normal(0.0, 0.05, n)
  want = trl_kto(pol, ref, desirable, pol_kl, ref_kl, 0.3, 1.0, 1.33)
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, m = pref.kto_loss(f(pol), f(ref), jnp.asarray(desirable), f(pol_kl),
                          f(ref_kl), beta=0.3, desirable_weight=1.0,
                          undesirable_weight=1.33)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(m["kto/kl"]) == pytest.approx(
      max(np.mean(pol_kl - ref_kl), 0.0), abs=1e-5)


def test_the_dpo_gradient_is_the_papers():
  """d loss / d pi_c = -beta sigma(-beta h) / P (the DPO paper's gradient),
  and the reference gets none through the loss."""
  beta = 0.2
  s = _s()
  grads = jax.grad(lambda s: pref.dpo_loss(s, beta=beta)[0])(s)
  h = (PC - RC) - (PR - RR)
  want = -beta * _sig(-beta * h) / P
  np.testing.assert_allclose(grads.policy_chosen, want, rtol=1e-5)
  np.testing.assert_allclose(grads.policy_rejected, -want, rtol=1e-5)


def test_the_nll_term_adds_the_chosen_token_mean_nll():
  base, _ = pref.dpo_loss(_s(), beta=0.1)
  with_nll, _ = pref.dpo_loss(_s(), beta=0.1, nll_coef=0.5)
  nll = -np.mean(np.concatenate(TOKENS_C))
  assert float(with_nll - base) == pytest.approx(0.5 * nll, rel=1e-5)


# --- pairs and their rows -----------------------------------------------------

def test_batch_rows_pair_sides_and_shift_kto_completions():
  pairs = pref_train.EncodedPairs([[5, 6], [7]], [[8, 2], [9, 2]],
                                  [[10, 2], [11, 12, 2]])
  tokens, inputs, loss = pref_train.batch_rows(pairs, np.array([1, 0]),
                                               False, 6, 0)
  np.testing.assert_array_equal(tokens[:, :4], [[7, 9, 2, 0], [5, 6, 8, 2],
                                                [7, 11, 12, 2],
                                                [5, 6, 10, 2]])
  np.testing.assert_array_equal(loss[1], [0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(inputs.sum(1), [3, 4, 4, 4])
  kto, _, kto_loss = pref_train.batch_rows(pairs, np.array([1, 0]), True,
                                           6, 0)
  assert kto.shape == (8, 6)
  # KL rows: each completion after the prompt of the row before it.
  np.testing.assert_array_equal(kto[4, :4], [7, 10, 2, 0])
  np.testing.assert_array_equal(kto[5, :4], [5, 6, 9, 2])
  np.testing.assert_array_equal(kto_loss[4], [0, 1, 1, 0, 0, 0])


def test_batch_rows_leave_untrained_tokens_out():
  """An episode's observation tokens are inputs, not trained."""
  pairs = pref_train.EncodedPairs(
      [[5], [6]], [[8, 9, 10, 2], [11, 2]], [[12, 2], [13, 14, 15, 2]],
      [[True, False, True, True], [True, True]],
      [[True, True], [True, False, False, True]])
  _, _, loss = pref_train.batch_rows(pairs, np.array([0, 1]), False, 6, 0)
  np.testing.assert_array_equal(loss, [[0, 1, 0, 1, 1, 0],
                                       [0, 1, 1, 0, 0, 0],
                                       [0, 1, 1, 0, 0, 0],
                                       [0, 1, 0, 0, 1, 0]])


def test_draws_depend_on_the_seed_and_step_alone():
  a = pref_train.draw(3, 7, 100, 16)
  np.testing.assert_array_equal(a, pref_train.draw(3, 7, 100, 16))
  assert not np.array_equal(a, pref_train.draw(3, 8, 100, 16))
  assert a.min() >= 0 and a.max() < 100


def test_identical_pairs_are_skipped_and_an_empty_chosen_is_an_error():
  pairs = [{"prompt": "1+1", "chosen": "2", "rejected": "3"},
           {"prompt": "1+2", "chosen": "3", "rejected": "3"}]
  kept, identical = pref_train.clean_pairs(pairs, "p.jsonl")
  assert kept == pairs[:1] and identical == 1
  with pytest.raises(ValueError, match="p.jsonl: pair 2: field 'chosen' is "
                     "empty"):
    pref_train.clean_pairs(pairs[:1] + [dict(pairs[0], chosen=" ")],
                           "p.jsonl")
  with pytest.raises(ValueError, match="every one of its 1 pairs"):
    pref_train.clean_pairs(pairs[1:], "p.jsonl")


def _pairs_file(path, lines):
  with open(path, "wb") as f:
    for line in lines:
      f.write(line if isinstance(line, bytes)
              else (json.dumps(line) + "\n").encode())
  return str(path)


def dpo_config(**overrides):
  return loop_config(**{"preference.loss": "dpo", "preference.batch_size": 8,
                        "optimizer.warmup_steps": 0,
                        "preference.num_pairs": 64,
                        "preference.num_heldout": 16, **overrides})


@pytest.mark.parametrize("overrides,match", [
    ({"preference.loss": "dpo_v2"}, "preference.loss='dpo_v2': accepted"),
    ({"preference.beta": 0.0}, "preference.beta"),
    ({"preference.label_smoothing": 0.5}, "preference.label_smoothing"),
    ({"preference.reference": "/nonexistent/run"},
     "preference.reference='/nonexistent/run' does not exist"),
    ({"preference.loss": "simpo", "preference.reference": "/tmp"},
     "reads no reference model"),
    ({"rl.max_staleness": 1}, "samples nothing while it trains"),
])
def test_bad_preference_settings_are_refused_before_compiling(overrides,
                                                              match):
  with pytest.raises(ValueError, match=match):
    build.validate(dpo_config(**overrides))


def test_a_non_utf8_pair_file_names_its_line(tmp_path):
  path = _pairs_file(tmp_path / "pairs.jsonl", [
      {"prompt": "1+1", "chosen": "2", "rejected": "3"},
      b'{"prompt": "\xff", "chosen": "1", "rejected": "2"}\n'])
  with pytest.raises(ValueError, match=r"pairs.jsonl:2: not valid UTF-8"):
    train.run(dpo_config(**{"preference.pairs_path": path}),
              str(tmp_path / "run"))


def test_an_empty_chosen_side_in_a_file_names_the_file_and_pair(tmp_path):
  path = _pairs_file(tmp_path / "pairs.jsonl", [
      {"prompt": "1+1", "chosen": "2", "rejected": "3"},
      {"prompt": "1+2", "chosen": "", "rejected": "4"}])
  with pytest.raises(ValueError, match=r"pairs.jsonl: pair 2: field "
                     "'chosen' is empty"):
    train.run(dpo_config(**{"preference.pairs_path": path}),
              str(tmp_path / "run"))


# --- from the config, in the loop -------------------------------------------

def _finite_rows(workdir, steps):
  rows = rl_rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  for r in rows:
    assert math.isfinite(r["pref/loss"]) and r["pref/grad_norm"] > 0
  return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", list(pref_train.PREFERENCE_LOSSES))
def test_every_preference_loss_trains_from_the_config(name, tmp_path):
  config = dpo_config(**{"preference.loss": name, "eval.every": 2,
                         "preference.beta": 2.0 if name == "simpo" else 0.1})
  summary = train.run(config, str(tmp_path))
  rows = _finite_rows(tmp_path, 2)
  assert "eval/accuracy" in rows[-1] and "eval/pair_accuracy" in rows[-1]
  assert 0 <= summary["preference"]["pair_accuracy_before"] <= 1
  # The first update moves the policy: step 2's implicit rewards differ
  # from step 1's (a reference-based loss starts at exactly 0).
  assert rows[1]["pref/rewards/margin"] != rows[0]["pref/rewards/margin"]
  if pref_train.PREFERENCE_LOSSES[name].reference:
    assert rows[0]["pref/rewards/margin"] == 0.0
  if name == "kto":
    assert rows[-1]["pref/kto/kl"] >= 0.0


@pytest.mark.slow
def test_a_stopped_dpo_run_resumes_exactly_and_skips_identical_pairs(
    tmp_path):
  pairs = [{"prompt": f"{a}+{b}", "chosen": str(a + b),
            "rejected": str(a + b + 1 + (a % 3))}
           for a in range(10) for b in range(4)]
  pairs[3]["rejected"] = pairs[3]["chosen"]  # no preference: skipped
  path = _pairs_file(tmp_path / "pairs.jsonl", pairs)
  config = dpo_config(**{"preference.pairs_path": path, "rl.num_steps": 4,
                         "checkpoint.every": 1})
  train.run(config, str(tmp_path / "whole"))
  rows = _finite_rows(tmp_path / "whole", 4)
  before = [r for r in metrics.read_jsonl(
      str(tmp_path / "whole" / "metrics.jsonl")) if r["step"] == 0]
  assert any(r.get("pref/identical_pairs") == 1.0 for r in before)
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 2)
  assert os.path.isdir(tmp_path / "resumed" / "reference")


@pytest.mark.slow
def test_a_precomputed_reference_trains_as_the_reference_model(tmp_path):
  config = dpo_config(**{"rl.num_steps": 2})
  train.run(config, str(tmp_path / "live"))
  config.preference.precompute_reference = True
  train.run(config, str(tmp_path / "pre"))
  for a, b in zip(rl_rows(tmp_path / "live"), rl_rows(tmp_path / "pre")):
    for k in ("pref/loss", "pref/rewards/margin", "pref/grad_norm"):
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


@pytest.mark.slow
def test_lora_dpo_uses_its_frozen_base_as_the_reference_and_exports(
    tmp_path):
  config = dpo_config(**{"model.lora.rank": 2, "rl.num_steps": 2,
                         "optimizer.learning_rate": 1e-2})
  train.run(config, str(tmp_path / "run"))
  rows = _finite_rows(tmp_path / "run", 2)
  assert rows[0]["pref/rewards/margin"] == 0.0  # adapters start at zero
  assert not os.path.isdir(tmp_path / "run" / "reference")  # no copy
  policy = train.load_policy(str(tmp_path / "run"))
  assert policy.model_config.lora is not None
  from rljax.train import export  # pylint: disable=import-outside-toplevel
  out = export.export_policy(policy, str(tmp_path / "run"), "hf")
  assert os.path.isfile(os.path.join(out.path, "config.json"))


@pytest.mark.slow
def test_a_mismatched_reference_model_is_refused_naming_it(tmp_path):
  """A reference trained with another tokenizer (another vocabulary)."""
  other = dpo_config(**{"tokenizer.vocab_size": 40, "rl.num_steps": 1})
  train.run(other, str(tmp_path / "other"))
  config = dpo_config(**{"preference.reference": str(tmp_path / "other")})
  with pytest.raises(ValueError, match="preference.reference="):
    train.run(config, str(tmp_path / "run"))


def test_the_docs_list_every_loss():
  with open(DOCS) as f:
    text = f.read()
  for name, e in pref_train.PREFERENCE_LOSSES.items():
    assert f"| `{name}` |" in text, name
    assert e.paper.split(",")[0] in text, name


@pytest.mark.slow
def test_bench_quick_trains_a_loss_and_writes_its_record(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..")
  out = subprocess.run(
      [sys.executable, "-m", "launch.bench_preference", "--quick",
       "--losses=ipo", f"--workdir={tmp_path}"], cwd=root,
      capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  [record] = [f for f in os.listdir(tmp_path)
              if f.startswith("bench_preference_quick-")]
  with open(tmp_path / record) as f:
    figures = json.load(f)["figures"]
  [run] = figures["runs"]["ipo"]
  assert 0 <= run["before"] <= 1 and 0 <= run["pair_accuracy"] <= 1
  assert figures["summary"]["ipo_gain"]["mean"] == pytest.approx(
      run["after"] - run["before"])


# --- online pairs ---------------------------------------------------------------

def test_online_pairs_are_each_groups_best_over_its_worst():
  totals = np.array([0.0, 1.0, 0.5, 1.0,    # best row 1 (first of equals)
                     0.3, 0.3, 0.3, 0.3,    # tied: no pair
                     2.0, -1.0, 5.0, 0.0,   # row 10 over row 9
                     1.0, 0.0, 9.0, 9.0])   # invalid 14, 15: row 12 over 13
  valid = np.ones(16, bool)
  valid[[10, 14, 15]] = [True, False, False]
  pairs, tied = pref_train.pairs_from_groups(totals, valid, 4)
  assert pairs == [(1, 0), (10, 9), (12, 13)] and tied == 1
  one_valid = valid.copy()
  one_valid[13] = False  # a group with one valid row gives no pair
  pairs, tied = pref_train.pairs_from_groups(totals, one_valid, 4)
  assert pairs == [(1, 0), (10, 9)] and tied == 2


def test_online_top_fraction_keeps_the_pairs_with_the_largest_gaps():
  """Gaps by hand: group 0 1.0 (row 1 over 0), group 2 6.0 (10 over 9),
  group 3 1.0 (12 over 13); the kept count is ceil(fraction x 3), on both
  sides of 2/3; equal gaps keep the earlier group; order stays by group."""
  totals = np.array([0.0, 1.0, 0.5, 1.0, 0.3, 0.3, 0.3, 0.3,
                     2.0, -1.0, 5.0, 0.0, 1.0, 0.0, 9.0, 9.0])
  valid = np.ones(16, bool)
  valid[[14, 15]] = False
  want = {1.0: [(1, 0), (10, 9), (12, 13)], 0.67: [(1, 0), (10, 9), (12, 13)],
          2 / 3: [(1, 0), (10, 9)], 0.5: [(1, 0), (10, 9)],
          1 / 3: [(10, 9)], 0.01: [(10, 9)]}
  for fraction, pairs in want.items():
    got, tied = pref_train.pairs_from_groups(totals, valid, 4, fraction)
    assert (got, tied) == (pairs, 1), fraction


@pytest.mark.parametrize("value,online,match", [
    (0.0, True, r"preference.online_top_fraction=0.0: a number in \(0, 1\]"),
    (1.01, True, r"preference.online_top_fraction=1.01: a number in \(0, 1\]"),
    (0.5, False, r"preference.online_top_fraction=0.5 with "
     r"preference.online=False: .* accepted: 1.0"),
])
def test_online_top_fraction_is_checked_before_compiling(value, online, match):
  c = online_config(**{"preference.online_top_fraction": value})
  c.preference.online = online
  with pytest.raises(ValueError, match=match):
    build.validate(c)
  c.preference.online, c.preference.online_top_fraction = True, 1.0
  build.validate(c)


def online_config(**overrides):
  c = dpo_config(**{"preference.online": True, **overrides})
  c.preference.max_length = (max(c.sampler.prompt_buckets)
                             + c.sampler.max_new_tokens)
  return c


def test_online_rows_must_fit_the_sampled_length():
  c = online_config()
  c.preference.max_length -= 1
  with pytest.raises(ValueError, match=r"preference.max_length=21 with "
                     r"preference.online=True: .* accepted: >= 22"):
    build.validate(c)
  with pytest.raises(ValueError, match="nothing to compute ahead"):
    build.validate(online_config(**{"preference.precompute_reference": True}))


@pytest.mark.slow
def test_online_dpo_samples_labels_trains_and_resumes_exactly(tmp_path):
  config = online_config(**{"rl.num_steps": 3, "checkpoint.every": 1,
                             "preference.online_top_fraction": 0.5})
  train.run(config, str(tmp_path / "whole"))
  rows = _finite_rows(tmp_path / "whole", 3)
  for r in rows:  # the verifier and the parity reward label the pairs
    assert r["pref/online/reward_chosen"] > r["pref/online/reward_rejected"]
    assert 0 <= r["pref/online/tied_groups"] < 1
    # Half of the groups' pairs at most (those with the largest gaps).
    assert 0 < r["pref/online/kept_pairs"] <= 0.5
    assert r["pref/online/reward_gap"] > 0
    assert r["num_generated_tokens"] > 0
  assert_stop_and_resume_matches(config, rows, tmp_path / "resumed", 1)


@pytest.mark.slow
def test_online_kto_on_episodes_leaves_observations_out_of_the_loss(
    tmp_path):
  """Pairs of multi-turn calculator episodes, labelled by the
  environment's reward: KTO trains on them (the rows' loss masks leave the
  observations out: test_batch_rows_leave_untrained_tokens_out)."""
  from tests.test_env_loop import env_config  # pylint: disable=import-outside-toplevel
  config = env_config("calculator", **{"preference.loss": "kto",
                                       "preference.online": True,
                                       "rl.num_steps": 2, "eval.every": 0,
                                       "optimizer.warmup_steps": 0,
                                       "preference.num_pairs": 64,
                                       "preference.num_heldout": 16})
  config.preference.max_length = (max(config.sampler.prompt_buckets)
                                  + config.sampler.max_new_tokens)
  train.run(config, str(tmp_path))
  rows = _finite_rows(tmp_path, 2)
  assert all(r["env/turns/mean"] >= 1 for r in rows)
  assert all("pref/kto/kl" in r for r in rows)


@pytest.mark.slow
def test_the_rlhf_recipe_config_trains_on_an_ensemble(tmp_path):
  """configs/arithmetic_rlhf.py (tiny), its two reward models stood in by
  random-headed ones with the policy's tokenizer."""
  from configs import arithmetic_rlhf  # pylint: disable=import-outside-toplevel
  from tests import reward_models  # pylint: disable=import-outside-toplevel
  config = arithmetic_rlhf.get_config("tiny")
  config.rl.num_steps, config.sft.num_steps, config.eval.every = 2, 0, 2
  config.preference.num_pairs, config.preference.num_heldout = 64, 16
  config.eval.num_examples = 8
  task, examples, _ = build.load_task(config)
  tokenizer = build.make_tokenizer(config, task, examples)
  dirs = [reward_models.tiny_reward_model(tmp_path / f"rm{seed}", tokenizer,
                                          seed) for seed in (0, 1)]
  assert config.rewards.names[0].startswith("ensemble:")
  config.rewards.names = ("ensemble:" + ",".join(dirs), "numeric_match")
  train.run(config, str(tmp_path / "run"))
  rows = _finite_rows(tmp_path / "run", 2)
  assert all(r["reward/ensemble/valid_frac"] == 1.0 for r in rows)
  assert all("pref/online/reward_chosen" in r for r in rows)
