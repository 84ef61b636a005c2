"""Environments for the tests (module-level so that spawned environment
workers can import them): scripted ones with known observations, and ones
that misbehave the ways user code does."""

import dataclasses
import os
import sys
import time

from rljax.envs import Step


class CharTokenizer:
  """One id per character of ``ALPHABET`` (id 0 pad, 1 BOS, 2 EOS), a
  tokenizer double over the tiny model's vocabulary."""

  ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789<>/=;+-?!.,: _"
  vocab_size = 256
  bos_id, eos_id, pad_id = 1, 2, 0

  def encode(self, text):
    return [3 + self.ALPHABET.index(ch) for ch in text]

  def decode(self, ids):
    return "".join(self.ALPHABET[i - 3] if 3 <= i < 3 + len(self.ALPHABET)
                   else "" for i in ids)


@dataclasses.dataclass(frozen=True)
class Scripted:
  """Observation ``"<k>"`` after turn k; done after ``turns`` turns, each
  turn rewarded 0.5."""

  turns: int = 3
  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], {"k": 0}

  def step(self, state, action):
    k = state["k"] + 1
    return Step(observation=f"<{k}>", reward=0.5, done=k >= self.turns,
                state={"k": k}, info={"steps": 1.0})


@dataclasses.dataclass(frozen=True)
class Misbehaves:
  """Fails on the rows whose prompt names the way: ``raise``, ``hang``,
  ``not_a_step``, ``nan_reward``, ``not_json_state``, ``huge``; others
  end well after one turn (reward 1)."""

  stop_strings: tuple = ()

  def reset(self, example):
    if example["prompt"] == "bad_reset":
      raise ValueError("reset refuses this example")
    if example["prompt"] == "long_prompt":
      return "a" * 100, {"how": "fine"}
    return example["prompt"], {"how": example["prompt"]}

  def step(self, state, action):
    how = state["how"]
    if how == "raise":
      raise RuntimeError("the environment failed")
    if how == "hang":
      time.sleep(600)
    if how == "not_a_step":
      return {"observation": "x"}
    if how == "nan_reward":
      return Step(reward=float("nan"), done=True, state=state)
    if how == "not_json_state":
      return Step(observation="x", state={"f": object()})
    if how == "exit":
      os._exit(3)
    return Step(reward=1.0, done=True, state=state)


@dataclasses.dataclass(frozen=True)
class ReportsImports:
  """Its one step's observation says whether the process has imported JAX."""

  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], None

  def step(self, state, action):
    return Step(observation="jax" if "jax" in sys.modules else "no jax",
                done=True)


@dataclasses.dataclass(frozen=True)
class NoStep:
  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], None


@dataclasses.dataclass(frozen=True)
class FlakyGuess:
  """The guessing game, failing on some secrets: raises when it is a
  multiple of 3, hangs when it is 7 or 8, returns a malformed step when 5."""

  max_guesses: int = 5
  stop_strings: tuple = ()

  def reset(self, example):
    from rljax.envs import GuessNumberEnv  # pylint: disable=g-import-not-at-top
    return GuessNumberEnv(self.max_guesses).reset(example)

  def step(self, state, action):
    from rljax.envs import GuessNumberEnv  # pylint: disable=g-import-not-at-top
    secret = state["secret"]
    if secret % 3 == 0:
      raise RuntimeError(f"flaky environment on secret {secret}")
    if secret in (7, 8):
      time.sleep(600)
    if secret == 5:
      return "not a step"
    return GuessNumberEnv(self.max_guesses).step(state, action)


@dataclasses.dataclass(frozen=True)
class StartsDaemon:
  """``step`` starts a process in a session of its own (``setsid``) whose
  command line holds the action, so the test can find it; an action that
  starts with ``hang`` then sleeps past the runner's timeout."""

  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], {}

  def step(self, state, action):
    import subprocess  # pylint: disable=g-import-not-at-top
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                      action], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if action.startswith("hang"):
      time.sleep(120)
    return Step(done=True, state=state)


@dataclasses.dataclass(frozen=True)
class Graded:
  """Turn k's step gives ``rewards[k]`` (its prefix sums are distinct, so an
  episode's total tells how many steps it had); done after the last one.
  A NaN reward is malformed: its episode fails."""

  rewards: tuple = (1.0, -0.25, 2.0)
  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], {"k": 0}

  def step(self, state, action):
    k = state["k"]
    return Step(observation=f"<{k + 1}>", reward=self.rewards[k],
                done=k + 1 >= len(self.rewards), state={"k": k + 1})


@dataclasses.dataclass(frozen=True)
class Jittery(Graded):
  """``Graded`` whose steps take 0 to 30 ms, by the action's characters: in
  worker processes, the steps of one round end in another order than they
  started."""

  def step(self, state, action):
    time.sleep(0.005 * (sum(map(ord, action)) % 7))
    return super().step(state, action)


@dataclasses.dataclass(frozen=True)
class Recorder:
  """Keeps every action in its state, appended in place (an environment
  that mutates its state: episodes that share one object would see each
  other's actions). The observation after turn k is ``"<k:n>"``, ``n`` the
  letters of all actions so far (mod 10), rewarded k; done after ``turns``
  turns. With ``fail_at=k``, step k raises on an action whose characters'
  codes sum to an odd number."""

  turns: int = 3
  fail_at: int = 0
  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], {"seen": []}

  def step(self, state, action):
    k = len(state["seen"]) + 1
    if k == self.fail_at and sum(map(ord, action)) % 2:
      raise ValueError(f"step {k} refuses {action!r}")
    state["seen"].append(action)
    letters = sum(ch.isalpha() for a in state["seen"] for ch in a) % 10
    return Step(observation=f"<{k}:{letters}>", reward=float(k),
                done=k >= self.turns, state=state)


def assert_replays(episodes, sampler, env):
  """Each row of ``episodes`` (``MultiTurnSampler.run``'s, on the host)
  holds the observations ``env`` answers its own actions, replayed from
  ``env.reset`` (a row that stepped another's state, or stepped one
  twice, would show it), each encoded as the sampler inserts it."""
  tokens = episodes.rollout.completion_tokens
  eos = set(sampler.config.eos_ids)
  for r, spans in enumerate(episodes.turn_tokens):
    _, state = env.reset({"prompt": ""})
    model = [(s, e) for s, e, kind in spans if kind == "model"]
    observed = [(s, e) for s, e, kind in spans if kind == "observation"]
    assert len(observed) <= len(model), (r, spans)
    for (s, e), (os_, oe) in zip(model, observed):
      action = sampler.tokenizer.decode(
          [int(x) for x in tokens[r, s:e] if x not in eos])
      step = env.step(state, action)
      want = sampler.format.encode(step.observation,
                                   int(tokens[r, e - 1]) in eos)
      assert oe > os_ and [int(x) for x in tokens[r, os_:oe]] == want[
          :oe - os_], (r, spans)
      state = step.state
