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
