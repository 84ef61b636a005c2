"""A Python tool in a sandbox (``envs.sandbox``).

The model calls the tool by writing ``<python>CODE</python>``: the turn ends
at ``</python>`` (a stop string), the code runs in ``sandbox.run_python``
(separate process, own namespaces, CPU / memory / process / file limits, a
wall-clock timeout, an unprivileged user, a private scratch directory) and
the observation is its output, cut to ``max_output_chars``:
``<output>...</output>``, with ``error: <last line of stderr>`` or
``error: timeout`` when it failed. A turn without a tool call is the answer,
rewarded 1 if its final number matches the example's ``answer``.

The tool's failures are observations, not environment failures: an
infinite loop, a fork storm or a 20 GB allocation is answered with an
error observation (``env/tool_errors``, ``env/tool_timeouts``) and the
episode goes on. Run it with ``env.num_workers >= 1`` and an
``env.timeout_s`` above ``timeout_s``: the worker process is then a second
wall around the sandbox.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.envs import sandbox
from rljax.envs.base import Step
from rljax.rewards import parsing


@dataclasses.dataclass(frozen=True)
class PythonToolEnv:
  """The sandboxed Python tool (see the module docstring).

  Attributes:
    timeout_s, cpu_s, memory_mb, max_processes: the sandbox's limits
      (``sandbox.SandboxLimits``).
    max_output_chars: characters of output in an observation.
    max_calls: tool calls per episode; later calls are refused (an error
      observation).
  """

  timeout_s: float = 5.0
  cpu_s: int = 3
  memory_mb: int = 512
  max_processes: int = 32
  max_output_chars: int = 200
  max_calls: int = 4
  open_tag: str = "<python>"
  close_tag: str = "</python>"

  @property
  def stop_strings(self) -> tuple[str, ...]:
    return (self.close_tag,)

  @property
  def limits(self) -> sandbox.SandboxLimits:
    return sandbox.SandboxLimits(
        timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
        max_processes=self.max_processes,
        max_output_chars=self.max_output_chars)

  def reset(self, example: dict[str, Any]) -> tuple[str, Any]:
    return example["prompt"], {"answer": str(example.get("answer", "")),
                               "calls": 0}

  def step(self, state: Any, action: str) -> Step:
    if not action.endswith(self.close_tag):
      answer = parsing.extract_final_answer(action)
      correct = parsing.answers_match(answer, state["answer"])
      return Step(reward=1.0 if correct else 0.0, done=True, state=state)
    calls = state["calls"] + 1
    state = dict(state, calls=calls)
    start = action.rfind(self.open_tag)
    code = (action[start + len(self.open_tag):-len(self.close_tag)]
            if start >= 0 else "")
    if calls > self.max_calls:
      return Step(observation="<output>error: too many calls</output>",
                  state=state, info={"tool_calls": 1.0, "tool_errors": 1.0,
                                     "tool_timeouts": 0.0})
    result = sandbox.run_python(code, self.limits)
    text = result.stdout
    if result.status == "timeout":
      text += f"error: timeout after {self.timeout_s:g}s"
    elif result.status != "ok":
      lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
      text += "error: " + (lines[-1] if lines else
                           f"exit code {result.returncode}")
    return Step(observation=f"<output>{text[:self.max_output_chars]}"
                            "</output>",
                state=state,
                info={"tool_calls": 1.0,
                      "tool_errors": float(result.status != "ok"),
                      "tool_timeouts": float(result.status == "timeout")})
