"""An environment for ``launch/bench_envs.py`` (module-level, so that its
worker processes can import it)."""

import dataclasses
import time

from rljax.envs import Step


@dataclasses.dataclass(frozen=True)
class SlowTool:
  """Every step takes ``delay_s`` (a tool call's latency) and answers with
  a fixed observation; the episode ends after ``turns`` steps."""

  delay_s: float = 0.05
  turns: int = 4
  stop_strings: tuple = ()

  def reset(self, example):
    return example["prompt"], {"k": 0}

  def step(self, state, action):
    time.sleep(self.delay_s)
    k = state["k"] + 1
    return Step(observation=" ok ", reward=float(len(action) % 2),
                done=k >= self.turns, state={"k": k})


@dataclasses.dataclass(frozen=True)
class SlowCalculator:
  """The calculator (``rljax/envs/calculator.py``) whose every step takes
  ``delay_s`` more, as a remote tool would: same observations, rewards and
  episodes. ``env.name='launch.envs_fixtures:SlowCalculator'``."""

  delay_s: float = 0.04
  max_calls: int = 4

  @property
  def _env(self):
    from rljax.envs import calculator  # pylint: disable=import-outside-toplevel
    return calculator.CalculatorEnv(max_calls=self.max_calls)

  @property
  def stop_strings(self):
    return self._env.stop_strings

  def reset(self, example):
    return self._env.reset(example)

  def step(self, state, action):
    time.sleep(self.delay_s)
    return self._env.step(state, action)
