"""Multi-turn environments: the rollout's tokens and logprobs, the runner's
failure handling, the built-in environments and the config checks.

References are independent: the static sampler (``sampling.sample``) for
the first turn's draws, a full forward pass without a cache for logprobs,
the tokenizer's own encoding of each observation, hand-derived episodes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import envs, models, sampling
from rljax import rollout as rollout_lib
from rljax.rollout import multi_turn as mt
from rljax.train import sft
from tests import env_fixtures
# log softmax(logits)[token] from one forward pass without a cache.
from tests.test_continuous import _logprobs as full_forward_logprobs

MC = models.get_preset("tiny")
TOK = env_fixtures.CharTokenizer()
T, O = 24, 4
B, G = 2, 3
# EOS (2) and a few more ids end a turn: turns of a few tokens.
EOS = (2, 40, 41, 42, 43, 44, 45)
SC = sampling.SamplerConfig(num_samples=G, max_new_tokens=T, eos_ids=EOS,
                            pad_id=0, cache_dtype="float32",
                            prompt_buckets=(8,), segment_slots=None,
                            record_policy_logprobs=True)
EXAMPLES = {"prompt": ["ab+c", "xyz"]}


EPISODE_FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens",
                  "completion_mask", "observation_mask", "lengths",
                  "finished", "turn_rewards")


def assert_same_episodes(got, want, fields=()):
  """Two runs' episodes (on the host) alike: every buffer and figure of
  ``EPISODE_FIELDS`` and ``fields`` exactly, logprobs to float rounding
  (a paged cache against a dense one, a pool at its peak)."""
  for field in EPISODE_FIELDS + tuple(fields):
    np.testing.assert_array_equal(getattr(got.rollout, field),
                                  getattr(want.rollout, field), err_msg=field)
  for field in ("sampler_logprobs", "policy_logprobs"):
    np.testing.assert_allclose(getattr(got.rollout, field),
                               getattr(want.rollout, field), atol=2e-5,
                               rtol=0, err_msg=field)
  assert got.turn_tokens == want.turn_tokens
  np.testing.assert_array_equal(got.env_reward, want.env_reward)


@pytest.fixture(scope="module")
def params():
  return models.init_params(MC, jax.random.key(0))


def _sampler(env, turns=mt.TurnConfig(max_turns=4, max_observation_tokens=O),
             config=SC, workers=0):
  return mt.MultiTurnSampler(MC, config, turns,
                             envs.EnvRunner(env, num_workers=workers),
                             TOK, (8,))


def play(params, env, config, turns, *, key=3, **sampler_kwargs):
  """``(sampler, its episodes of EXAMPLES on the host)``: one run of a
  ``MultiTurnSampler`` (``sampler_kwargs``: its plan) with ``env`` in
  process."""
  runner = envs.EnvRunner(env, num_workers=0)
  try:
    sampler = mt.MultiTurnSampler(MC, config, turns, runner, TOK, (8,),
                                  **sampler_kwargs)
    return sampler, jax.device_get(sampler.run(params, EXAMPLES,
                                               jax.random.key(key)))
  finally:
    runner.close()


@pytest.fixture(scope="module")
def scripted(params):
  sampler = _sampler(env_fixtures.Scripted(turns=3))
  return jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(3)))


def test_observations_are_the_tokenizers_ids_and_carry_no_loss(scripted):
  r = scripted.rollout
  assert sum("observation" in [k for _, _, k in spans]
             for spans in scripted.turn_tokens) >= 3
  for row, spans in enumerate(scripted.turn_tokens):
    assert spans[0][2] == "model"
    k = 0
    for start, end, kind in spans:
      inserted = r.observation_mask[row, start:end]
      if kind == "observation":
        k += 1
        np.testing.assert_array_equal(r.completion_tokens[row, start:end],
                                      TOK.encode(f"<{k}>"))
        assert inserted.all()
        np.testing.assert_array_equal(r.sampler_logprobs[row, start:end], 0)
      else:
        assert not inserted.any()
    # Nothing outside the spans is a token; spans tile the completion.
    assert spans[-1][1] == r.completion_mask[row].sum()
  np.testing.assert_array_equal(
      r.lengths, (r.completion_mask & ~r.observation_mask).sum(1))


def test_first_turn_is_the_static_samplers_row(params, scripted):
  prompts = [TOK.encode(p) for p in EXAMPLES["prompt"]]
  tokens, mask = sampling.pad_prompts([[TOK.bos_id] + p for p in prompts],
                                      (8,))
  static = jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(3), model_config=MC,
      config=SC.replace(stop_sequences=())))
  for row, spans in enumerate(scripted.turn_tokens):
    start, end, kind = spans[0]
    assert kind == "model" and start == 0
    np.testing.assert_array_equal(
        scripted.rollout.completion_tokens[row, :end],
        static.completion_tokens[row, :end])
    np.testing.assert_allclose(scripted.rollout.sampler_logprobs[row, :end],
                               static.sampler_logprobs[row, :end], atol=1e-5)


def test_kv_continuation_matches_a_full_forward_pass(params, scripted):
  r = scripted.rollout
  want = full_forward_logprobs(params, r.prompt_tokens, r.prompt_mask,
                               r.completion_tokens, r.completion_mask)
  model = r.completion_mask & ~r.observation_mask
  assert model.sum() > 20 and r.observation_mask.sum() > 5
  np.testing.assert_allclose(np.where(model, r.policy_logprobs, 0),
                             np.where(model, want, 0), atol=1e-5)


def test_episode_rewards_sum_the_steps_and_metrics_count_turns(scripted):
  turns = np.asarray([sum(k == "model" for _, _, k in s)
                      for s in scripted.turn_tokens])
  # Every step gives 0.5; episodes that end by the budget or the turn limit
  # have fewer steps than turns.
  assert np.all(scripted.env_reward <= 0.5 * turns + 1e-9)
  assert scripted.metrics["env/turns/mean"] == pytest.approx(turns.mean())
  assert scripted.metrics["env/steps"] == pytest.approx(
      scripted.env_reward.sum() / 0.5)
  assert not scripted.failed.any()


def test_the_trainer_gets_the_rollouts_ids_and_loss_only_on_model_tokens(
    scripted):
  from rljax.train import build  # pylint: disable=g-import-not-at-top
  from rljax.train import batch_layout  # pylint: disable=g-import-not-at-top
  from tests.test_train import tiny_config  # pylint: disable=g-import-not-at-top
  r = jax.tree.map(jnp.asarray, scripted.rollout)
  alg = build.algorithm(tiny_config())
  n = r.lengths.shape[0]
  rewards = jnp.asarray(np.arange(n, dtype=np.float32)[:, None] % 2)
  batch, _, _ = batch_layout.postprocess(
      r, rewards, jnp.ones(n, bool), jnp.ones(1), alg.advantage.init(rewards),
      algorithm=alg, group_size=G)
  p = r.prompt_tokens.shape[1]
  np.testing.assert_array_equal(batch.tokens_NxL[:, p:],
                                scripted.rollout.completion_tokens)
  want_loss = (scripted.rollout.completion_mask
               & ~scripted.rollout.observation_mask)
  np.testing.assert_array_equal(batch.loss_mask_NxL[:, p:], want_loss)
  np.testing.assert_array_equal(batch.input_mask_NxL[:, p:],
                                scripted.rollout.completion_mask)


def test_an_environment_that_ends_at_once_gives_the_static_rollout(params):
  sampler = _sampler(env_fixtures.Scripted(turns=1))
  out = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(5)))
  prompts = [[TOK.bos_id] + TOK.encode(p) for p in EXAMPLES["prompt"]]
  tokens, mask = sampling.pad_prompts(prompts, (8,))
  static = jax.device_get(sampling.sample(params, tokens, mask,
                                          jax.random.key(5), model_config=MC,
                                          config=SC))
  np.testing.assert_array_equal(out.rollout.completion_mask,
                                static.completion_mask)
  np.testing.assert_array_equal(
      np.where(static.completion_mask, out.rollout.completion_tokens, 0),
      np.where(static.completion_mask, static.completion_tokens, 0))
  assert not out.rollout.observation_mask.any()


@pytest.mark.parametrize("step_rows", [pytest.param(1, marks=pytest.mark.slow),
                                       4])
def test_rounds_do_not_change_the_episodes(params, step_rows):
  """With step_rows, environments are stepped as soon as a few rows wait
  (the others go on decoding): the same tokens, logprobs and rewards as
  turn by turn, since each draw is keyed by its row and column."""
  turns = mt.TurnConfig(max_turns=4, max_observation_tokens=O,
                        max_turn_tokens=5)
  examples = {"prompt": ["ab+c", "xyz", "q", "0123"]}
  want = jax.device_get(_sampler(env_fixtures.Scripted(turns=3), turns).run(
      params, examples, jax.random.key(7)))
  got = jax.device_get(_sampler(env_fixtures.Scripted(turns=3),
                                dataclasses.replace(turns, step_rows=step_rows)
                                ).run(params, examples, jax.random.key(7)))
  assert got.turn_tokens == want.turn_tokens
  for name in ("completion_tokens", "completion_mask", "observation_mask"):
    np.testing.assert_array_equal(getattr(got.rollout, name),
                                  getattr(want.rollout, name))
  np.testing.assert_allclose(got.rollout.sampler_logprobs,
                             want.rollout.sampler_logprobs, atol=1e-5)
  np.testing.assert_array_equal(got.env_reward, want.env_reward)


def test_turn_limit_observation_truncation_and_budget(params):
  long_obs = dataclasses.replace(env_fixtures.Scripted(turns=99))
  sampler = _sampler(long_obs, turns=mt.TurnConfig(
      max_turns=2, max_observation_tokens=2))
  out = jax.device_get(sampler.run(params, EXAMPLES, jax.random.key(3)))
  turns = [sum(k == "model" for _, _, k in s) for s in out.turn_tokens]
  assert max(turns) <= 2
  # "<1>" is 3 tokens, cut to 2, counted.
  assert out.metrics["env/observation_truncated"] >= 1
  for row, spans in enumerate(out.turn_tokens):
    for start, end, kind in spans:
      if kind == "observation":
        assert end - start == 2
        np.testing.assert_array_equal(
            out.rollout.completion_tokens[row, start:end], TOK.encode("<1"))
  assert out.metrics["env/turn_limit"] >= 1


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_failing_environments_fail_their_episodes_only(params, workers):
  ways = ["raise", "not_a_step", "nan_reward", "not_json_state", "fine",
          "bad_reset", "long_prompt"]
  if workers:
    ways += ["hang", "exit"]
  runner = envs.EnvRunner(env_fixtures.Misbehaves(), num_workers=workers,
                          timeout_s=3.0)
  sampler = mt.MultiTurnSampler(MC, SC.replace(num_samples=1),
                                mt.TurnConfig(max_turns=2, max_turn_tokens=3),
                                runner, TOK,
                                (8, 16))
  try:
    out = jax.device_get(sampler.run(params, {"prompt": ways},
                                     jax.random.key(1)))
  finally:
    runner.close()
  fine = ways.index("fine")
  assert out.failed.tolist() == [w != "fine" for w in ways]
  assert out.env_reward[fine] == 1.0
  assert np.isnan(np.delete(out.env_reward, fine)).all()
  assert out.metrics["env/failed_episodes"] == len(ways) - 1
  if workers:
    assert out.metrics["env/timeouts"] == 1
  # A failed reset's rows never decode, nor do those of a prompt longer
  # than the largest bucket.
  for way in ("bad_reset", "long_prompt"):
    assert out.rollout.completion_mask[ways.index(way)].sum() == 0


def test_an_environment_worker_never_imports_jax():
  """A worker unpickles its calls by importing the environment's module and
  ``rljax.envs``: neither pulls in JAX (the multi-turn rollout is
  ``rljax.rollout``'s), so a worker replaced after a timeout starts in a
  fraction of the time."""
  runner = envs.EnvRunner(env_fixtures.ReportsImports(), num_workers=1,
                          timeout_s=60.0)
  try:
    [out] = runner.step([None], ["guess"])
  finally:
    runner.close()
  assert out.status == "ok", out.message
  assert out.value["observation"] == "no jax", out.value
  # The rollout is the engine's (rljax.rollout), not the environments'.
  assert not hasattr(envs, "MultiTurnSampler") and "rollout" not in dir(envs)
  assert rollout_lib.TurnConfig is mt.TurnConfig


def test_runner_refuses_what_is_not_an_environment():
  with pytest.raises(TypeError, match="step"):
    envs.EnvRunner(env_fixtures.NoStep(), num_workers=0)
  with pytest.raises(ValueError, match="env.num_workers"):
    envs.EnvRunner(env_fixtures.Scripted(), num_workers=-1)
  with pytest.raises(ValueError, match="env.name='nope'"):
    envs.get_env("nope")
  with pytest.raises(ValueError, match="env.kwargs"):
    envs.get_env("calculator", colour="red")


def test_turn_config_rejects_bad_values():
  with pytest.raises(ValueError, match="env.max_turns"):
    mt.TurnConfig(max_turns=0)
  with pytest.raises(ValueError, match="env.max_turn_tokens"):
    mt.TurnConfig(max_turn_tokens=0)


# --- built-in environments, by hand -----------------------------------------


def test_calculator_answers_tool_calls_and_scores_the_answer():
  env = envs.CalculatorEnv()
  _, state = env.reset({"prompt": "q", "answer": "161"})
  step = env.step(state, "<calc>12*13+5</calc>")
  assert (step.observation, step.done, step.info["tool_errors"]) == (
      "=161;", False, 0.0)
  bad = env.step(step.state, "<calc>__import__('os')</calc>")
  assert bad.observation == "=error;" and bad.info["tool_errors"] == 1.0
  assert env.step(step.state, "161").reward == 1.0
  assert env.step(step.state, "160").reward == 0.0


def test_guess_number_hints_and_limit():
  env = envs.GuessNumberEnv(max_guesses=3)
  _, s = env.reset({"prompt": "1-20?", "secret": 13})
  a = env.step(s, "10")
  assert (a.observation, a.done) == ("+", False)
  b = env.step(a.state, "15")
  assert (b.observation, b.done) == ("-", False)
  assert env.step(b.state, "13").reward == 1.0
  c = env.step(b.state, "14")
  assert c.done and c.reward == 0.0
  assert env.step(s, "ten").observation == "?"


def test_sft_segments_train_model_tokens_and_eos_only():
  segments = [["model", "ab"], ["observation", "<1>"], ["model", "c"],
              ["eos", ""]]
  ids, trained = sft.segment_ids(TOK, segments)
  assert ids == TOK.encode("ab") + TOK.encode("<1>") + TOK.encode("c") + [2]
  assert trained == [True, True, False, False, False, True, True]
  tokens, _, loss = sft.sft_arrays(TOK, ["x"], ["unused"], 16,
                                   segments=[segments])
  p = 2  # BOS + "x"
  np.testing.assert_array_equal(tokens[0, p:p + len(ids)], ids)
  np.testing.assert_array_equal(loss[0, p:p + len(ids)], trained)
  with pytest.raises(ValueError, match="kind"):
    sft.segment_ids(TOK, [["tool", "x"]])


# --- observations through a chat template ------------------------------------

from tests.test_tokenizers import bpe_dir  # noqa: E402,F401  pylint: disable=wrong-import-position,unused-import
from tests.hf_extra import requires_hf  # noqa: E402  pylint: disable=wrong-import-position


@requires_hf("tokenizers", "jinja2")
def test_chat_observations_continue_the_conversation_as_the_template_does(
    bpe_dir):  # noqa: F811  pylint: disable=redefined-outer-name
  from rljax import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.prompt_tokenizer(tokenizers.load_hf_tokenizer(bpe_dir),
                                    True)
  fmt = mt.ObservationFormat(tok, role="user", eos_ids=tok.eos_ids)
  # By hand from the template: a message is "<|role|>\n{content}</s>\n".
  assert fmt.encode("36", True) == tok.encode(
      "\n<|user|>\n36</s>\n<|assistant|>\n")
  assert fmt.encode("36", False) == tok.encode(
      "</s>\n<|user|>\n36</s>\n<|assistant|>\n")
  # Prompt + the model's turn (ended by EOS) + the observation are the ids
  # of the template's rendering of the whole conversation.
  prompt = tokenizers.encode_prompts(tok, ["What is 7 * 6?"])[0]
  turn = tok.encode("42") + [tok.eos_id]
  ids = prompt + turn + fmt.encode("Sure?", True)
  want = tok.tokenizer.apply_chat_template(
      [{"role": "user", "content": "What is 7 * 6?"},
       {"role": "assistant", "content": "42"},
       {"role": "user", "content": "Sure?"}], add_generation_prompt=True)
  assert ids == tok.encode(want)


@pytest.mark.parametrize("workers", [0, 2])
def test_steps_started_without_waiting_come_back_once_each(workers):
  """``submit_steps`` starts the calls and returns at once;
  ``poll_steps(wait=True)`` gives back at least one ended call per poll and
  each exactly once, a hang as a timeout and a worker's death as an error;
  the same outcomes as ``step``'s."""
  ways = ["fine", "raise", "fine", "nan_reward"]
  if workers:
    ways += ["hang", "exit", "fine"]
  states = [{"how": w} for w in ways]
  with envs.EnvRunner(env_fixtures.Misbehaves(), num_workers=workers,
                      timeout_s=2.0) as runner:
    tickets = runner.submit_steps(states, ["a"] * len(ways))
    assert len(set(tickets)) == len(ways)
    got = {}
    while len(got) < len(ways):
      ended = runner.poll_steps(tickets, wait=True)
      assert ended and not set(ended) & set(got), (ended, got)
      got.update(ended)
    assert runner.poll_steps(tickets, wait=True) == {}  # nothing left: no wait
    want = runner.step(states[:4], ["a"] * 4)  # the blocking call's answers
  status = [got[t].status for t in tickets]
  assert status[:4] == [o.status for o in want] == ["ok", "error", "ok",
                                                    "error"]
  if workers:
    assert status[4:] == ["timeout", "error", "ok"], status
    assert got[tickets[5]].message.startswith("the worker died")
  assert got[tickets[0]].value == want[0].value
