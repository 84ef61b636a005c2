"""The environment's side of a multi-turn rollout (``multi_turn.py``).

Mixed into ``MultiTurnSampler``: the steps of the rows that ended a turn
start in the environment workers without waiting (``_submit``), come back
as they end (``_collect``; with several processes every process's ended
steps are gathered, ``_exchange``) and become the observations inserted
into the rows (``_apply``). Device arrays are read whole (``_host``) and
the rollout is split by process blocks (``_split_by_blocks``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from rljax import sharding
from rljax.envs.base import EnvOutcome
from rljax.rollout.episodes import EpisodeLog
from rljax.sampling.sampler import Rollout


class StepCall(NamedTuple):
  """An environment step in flight: the slot that waits for it, the episode
  row it plays, the column where the observation goes, and whether the
  turn ended on an EOS id."""
  slot: int
  row: int
  column: int
  ended_eos: bool


class EnvSteps:
  """Mixed into ``MultiTurnSampler`` (its ``runner``, ``tokenizer``,
  ``config``, ``turns``, ``format``, ``group``, ``mesh`` and ``_own``)."""

  def _host(self, x: Any) -> Any:
    """Device arrays on the host, whole (gathered from every process)."""
    if self.group.single:
      return jax.device_get(x)
    return jax.tree.map(lambda a: np.asarray(
        multihost_utils.process_allgather(a, tiled=True)), x)

  def _exchange(self, ended: list) -> list:
    """Every process's ended steps ``[(call, outcome)]``, in the order of
    their blocks (each process's own keep the environment's state; the
    others' come without it)."""
    if self.group.single:
      return ended
    shared = [(tuple(call), o.status, o.message, None if o.value is None
               else {k: v for k, v in o.value.items() if k != "state"})
              for call, o in ended]
    own = {call.row: o for call, o in ended}
    out = []
    for part in self.group.gather_blocks(shared, self.mesh):
      for call, status, message, value in part:
        call = StepCall(*call)
        out.append((call, own.get(call.row)
                    or EnvOutcome(status, value, message)))
    return out

  def _split_by_blocks(self, rollout: Rollout) -> Rollout:
    """With several processes, the rollout's arrays split by process
    blocks over the batch axes (the collector reads each process's rows
    from them); one process: as it is."""
    if self.group.single:
      return rollout

    def put(x):
      where = sharding.batch_sharding(self.mesh, np.ndim(x))
      if isinstance(x, np.ndarray):
        return sharding.put_global(x, where)
      return jax.jit(lambda y: y, out_shardings=where)(x)

    with self._mesh():
      return jax.tree.map(put, rollout)

  def _submit(self, taken, slot_row, turns, states, calls, ep) -> None:
    """Starts the environment steps of the ``taken`` slots' episodes
    (their actions decoded from ``turns``) that this process plays,
    recorded in ``calls``."""
    taken = [s for s in taken if slot_row[s] in self._own]
    if not taken:  # another process's episodes only
      return
    toks, column, start = turns
    eos = set(self.config.eos_ids)
    actions, pending = [], []
    for s in taken:
      ids = [int(x) for x in toks[s, start[s]:column[s]]]
      actions.append(self.tokenizer.decode([x for x in ids if x not in eos]))
      pending.append(StepCall(int(s), int(slot_row[s]), int(column[s]),
                           bool(ids) and ids[-1] in eos))
    tickets = ep.timed(lambda: self.runner.submit_steps(
        [states[c.row] for c in pending], actions))
    calls.update(zip(tickets, pending))

  def _collect(self, calls, *, wait: bool):
    """The steps in flight that have ended (all of them with ``wait``)."""
    got = self.runner.poll_steps(list(calls), wait=False)
    while wait and len(got) < len(calls):
      got.update(self.runner.poll_steps(
          [t for t in calls if t not in got], wait=True))
    return got

  def _apply(self, ended, states, ep: "EpisodeLog", m: int):
    """The ended steps ``[(call, outcome)]``: the arrays of ``_insert``
    (one row per slot) and the slots that go on."""
    o, t = self.turns.max_observation_tokens, self.config.max_new_tokens
    obs = np.full((m, o), self.config.pad_id, np.int32)
    obs_len = np.zeros(m, np.int32)
    resume, end, env_done = (np.zeros(m, bool) for _ in range(3))
    for call, outcome in ended:
      s, r, column = call.slot, call.row, call.column
      if outcome.status != "ok":
        ep.fail(r, outcome)
        end[s] = True
        continue
      value = outcome.value
      if "state" in value:  # this process's episode
        states[r] = value["state"]
      if value["reward"] is not None:
        ep.reward[r] += value["reward"]
        # The turn the step answered ends at column - 1.
        ep.rewards_at[r].append((column - 1, value["reward"]))
      for k, v in value["info"].items():
        ep.info[k] = ep.info.get(k, 0.0) + v
      if value["done"]:
        end[s] = env_done[s] = True
        continue
      if ep.turns[r] >= self.turns.max_turns:
        end[s] = True
        ep.turn_limit += 1
        continue
      ids = self.format.encode(value["observation"], call.ended_eos)
      room = min(o, t - column - 1)  # keep one model token
      if room < len(ids):
        ep.truncated_obs += 1
      if room <= 0 and ids:
        end[s] = True  # no room for the observation and a reply
        continue
      ids = ids[:max(room, 0)]
      obs[s, :len(ids)] = ids
      obs_len[s] = len(ids)
      ep.obs_tokens += len(ids)
      resume[s] = True
      if ids:
        ep.spans[r].append((column, column + len(ids), "observation"))
    return (obs, obs_len, resume, end, env_done), resume


__all__ = ["EnvSteps", "StepCall"]
