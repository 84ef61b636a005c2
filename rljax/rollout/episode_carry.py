"""Partial rollouts of multi-turn episodes (APRIL on episodes): the episodes
a step does not finish, carried to the next step with their environment
state, and saved with checkpoints.

With ``rl.rollout="partial"`` and an environment, ``MultiTurnSampler.run``
plays the step's episodes on its slots after the episodes carried from
earlier steps, and stops as soon as ``B`` groups have ended (every episode
of the group over). Those are trained, the oldest first. The others are
carried: the host waits for the environment steps in flight and inserts
their observations (so a carried episode stops only where its model decodes
next), then keeps each episode's completion buffers (model and observation
tokens, sampler logprobs, the policy version of each token), its row key,
its environment state (gathered from the process that stepped it, so any
process can go on with it), its turns, rewards and spans. In a later step a
carried episode takes a slot in the first fill: its prompt and history are
prefilled again under the newer policy in one forward (``turns.restore``),
never re-sampled, and it decodes on from its last token with its own draws.
Groups that drew no token yet wait (no cap: they hold their reset's prompt
and state). A started group older than ``max_age`` steps, beyond
``max_carried`` groups, or with more unfinished episodes that have a
history than there are slots (they must all start in the first fill), is
dropped and counted (``rollout/dropped_groups``).

References:
  Zhou et al., "APRIL: Active Partial Rollouts in Reinforcement Learning to
  Tame Long-tail Generation", https://arxiv.org/abs/2509.18521.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

# Per-episode arrays of a carried group, each [G, ...]: the completion
# buffers ([G, T]), the row key data ([G, 2]) and the episode's figures.
ROW_FIELDS = ("tokens", "mask", "observed", "sampler_logp", "version", "keys",
              "turn_start", "over", "finished", "failed", "turns", "reward")


@dataclasses.dataclass
class CarriedGroup:
  """One example's ``G`` episodes between steps.

  Attributes:
    example: the data example (what the rewards and the batch read).
    prompt: the reset's prompt text.
    owner: the process block that steps its environments.
    born: the policy version that drew its first token; None: waiting.
    rows: ``ROW_FIELDS`` and ``policy_logp`` (with policy logprobs).
    states: each episode's environment state (JSON values).
    spans: each episode's ``(start, end, kind)`` column spans.
    rewards_at: each episode's ``(column, reward)`` step rewards.
  """

  example: dict[str, Any]
  prompt: str
  owner: int
  born: int | None
  rows: dict[str, np.ndarray]
  states: list[Any]
  spans: list[list[tuple[int, int, str]]]
  rewards_at: list[list[tuple[int, float]]]

  @property
  def history(self) -> np.ndarray:
    """``[G]``: the episodes that go on from tokens they have."""
    return ~self.rows["over"] & self.rows["mask"].any(1)


class Held:
  """One ``run``'s host records of its rows as the carry sees them: the
  carried rows' buffers (first ``n0`` rows), which rows have a history to
  restore, which are over, each row's turn start and the column where this
  run began it. ``MultiTurnSampler.run`` keeps them; ``finish`` makes the
  next carry."""

  def __init__(self, old: list[CarriedGroup], n: int, config: Any):
    g, t = config.num_samples, config.max_new_tokens
    self.old, self.n0, self.t = old, len(old) * g, t
    self.over = np.zeros(n, bool)
    self.history = np.zeros(n, bool)
    self.turn_start = np.zeros(n, np.int32)
    self.start_col = np.zeros(n, np.int32)
    self.versions = np.full((n, t), -1, np.int32)
    self.rows = ({name: np.concatenate([gr.rows[name] for gr in old])
                  for name in old[0].rows} if old else None)
    if old:
      k = self.n0
      self.over[:k] = self.rows["over"]
      self.history[:k] = np.concatenate([gr.history for gr in old])
      self.turn_start[:k] = self.rows["turn_start"]
      self.start_col[:k] = self.rows["mask"].sum(1)
      self.versions[:k] = self.rows["version"]
    self.keys: np.ndarray | None = None  # [n, 2] row key data (unpack)
    self.trained_examples: list[dict[str, Any]] = []
    self.trained_versions: np.ndarray | None = None
    self.generated = 0  # model tokens drawn in this run (finish)

  def ended(self, g: int) -> np.ndarray:
    """The groups every episode of which is over, in row order."""
    return np.flatnonzero(self.over.reshape(-1, g).all(1))

  def fill(self, out: Any) -> None:
    """The carried rows' buffers into ``out`` (``episodes.SlotOutputs``):
    those of episodes already over stay there; the others are copied again
    when they leave their slots."""
    if self.rows is None:
      return
    k, r = self.n0, self.rows
    for name in ("tokens", "mask", "observed", "sampler_logp", "finished"):
      getattr(out, name)[:k] = r[name]
    if out.policy_logp is not None:
      out.policy_logp[:k] = r["policy_logp"]

  def slots(self, slot_row: np.ndarray) -> tuple[np.ndarray, ...]:
    """``turns.restore``'s arrays for the slots ``slot_row`` play: the
    carried episodes with a history are restored, the others are not."""
    m, t, r = len(slot_row), self.t, self.rows
    at = np.where((slot_row >= 0) & (slot_row < self.n0), slot_row, 0)
    restore = (slot_row >= 0) & self.history[np.maximum(slot_row, 0)]
    pick = lambda name: r[name][at]  # noqa: E731
    zeros = np.zeros((m, t), np.float32)
    return (restore, pick("tokens"), pick("mask"),  # restore masks it
            pick("observed"), pick("sampler_logp"),
            pick("policy_logp") if "policy_logp" in r else zeros,
            pick("turn_start"))

  def finish(self, carry: "EpisodeCarry", out: Any, ep: Any,
             states: list[Any], prompts: list[str],
             new: list[tuple[int, dict[str, Any]]], own: set[int],
             group: Any, version: int, target: int) -> np.ndarray:
    """After a partial run: the first ``target`` groups that ended (the
    carried ones first, oldest first) are trained, the others are carried
    (``carry.keep``). ``new``: the run's new groups as ``(process block
    that plays it, example)``; ``own``: the rows this process stepped;
    ``group``: the processes (``distributed.ProcessGroup``). Sets
    ``trained_examples`` and ``trained_versions``; returns the trained
    groups' indices."""
    g = len(states) // len(prompts)
    k_old = len(self.old)
    examples = [gr.example for gr in self.old] + [x for _, x in new]
    cols = np.arange(self.t)[None]
    fresh = out.mask & (cols >= self.start_col[:, None])
    self.generated = int((fresh & ~out.observed).sum())
    versions = np.where(out.mask, np.where(fresh, version, self.versions), -1)
    trained = self.ended(g)[:target]
    rest = np.setdiff1d(np.arange(len(examples)), trained)
    # Every process's unfinished episodes' states, from the process that
    # stepped them (so any process can go on with them).
    mine = {str(r): states[r] for i in rest for r in range(i * g, (i + 1) * g)
            if r in own}
    for part in group.gather_json(mine):
      for r, state in part.items():
        states[int(r)] = state
    fields = {"tokens": out.tokens, "mask": out.mask, "observed": out.observed,
              "sampler_logp": out.sampler_logp, "version": versions,
              "turn_start": self.turn_start, "over": self.over,
              "finished": out.finished, "failed": ep.failed,
              "turns": ep.turns, "reward": ep.reward}
    if out.policy_logp is not None:
      fields["policy_logp"] = out.policy_logp
    keys = self.keys
    groups = []
    for i in map(int, rest):
      at = slice(i * g, (i + 1) * g)
      before = self.old[i] if i < k_old else None
      born = before.born if before is not None else None
      if born is None and fresh[at].any():
        born = version
      rows = {name: np.array(x[at]) for name, x in fields.items()}
      rows["keys"] = keys[at].copy()
      groups.append(CarriedGroup(
          example=examples[i], prompt=prompts[i],
          owner=before.owner if before is not None else new[i - k_old][0],
          born=born, rows=rows, states=list(states[at]),
          spans=[list(x) for x in ep.spans[at]],
          rewards_at=[list(x) for x in ep.rewards_at[at]]))
    carry.keep(groups, version + 1)
    trained_rows = (trained[:, None] * g + np.arange(g)).ravel()
    self.trained_examples = [examples[i] for i in trained]
    self.trained_versions = versions[trained_rows]
    return trained


def unpack(old: list[CarriedGroup], ep: Any, states: list[Any],
           keys_N: np.ndarray, config: Any) -> Held:
  """Puts the carried groups ``old`` in a run's first rows: their episodes'
  figures in ``ep`` (``episodes.EpisodeLog``), environment states in
  ``states`` and row keys in ``keys_N``; returns the run's ``Held``."""
  held = Held(old, len(states), config)
  held.keys = keys_N
  if not old:
    return held
  g, k = config.num_samples, held.n0
  keys_N[:k] = held.rows["keys"]
  ep.failed[:k] = held.rows["failed"]
  ep.turns[:k] = held.rows["turns"]
  ep.reward[:k] = held.rows["reward"]
  for i, gr in enumerate(old):
    for j in range(g):
      r = i * g + j
      states[r] = gr.states[j]
      ep.spans[r] = [tuple(x) for x in gr.spans[j]]
      ep.rewards_at[r] = [tuple(x) for x in gr.rewards_at[j]]
  return held


class EpisodeCarry:
  """The carried groups of a partial multi-turn rollout (module docstring).

  Args:
    slots: ``M``, the sampler's slots.
    max_age: a started group older than this many steps is dropped.
    max_carried: at most this many started groups are carried.
  """

  def __init__(self, slots: int, max_age: int, max_carried: int):
    self.slots, self.max_age, self.max_carried = slots, max_age, max_carried
    self.groups: list[CarriedGroup] = []
    self.dropped = 0

  @property
  def started(self) -> int:
    return sum(gr.born is not None for gr in self.groups)

  def keep(self, rest: list[CarriedGroup], next_version: int) -> None:
    """Carries ``rest`` (the groups a step did not train) to the next step:
    the started ones oldest first, within the caps; the waiting ones."""
    kept, history = [], 0
    started = [gr for gr in rest if gr.born is not None]
    for gr in sorted(started, key=lambda x: x.born):  # stable: oldest first
      pending = int(gr.history.sum())
      if (next_version - gr.born > self.max_age
          or len(kept) >= self.max_carried
          or history + pending > self.slots):
        self.dropped += 1
        continue
      history += pending
      kept.append(gr)
    self.groups = kept + [gr for gr in rest if gr.born is None]

  def metrics(self) -> dict[str, float]:
    return {"rollout/carried_groups": float(self.started),
            "rollout/waiting_groups": float(len(self.groups) - self.started),
            "rollout/dropped_groups": float(self.dropped)}

  # --- checkpoints ----------------------------------------------------------

  def arrays(self) -> dict[str, np.ndarray]:
    """The carried groups as host arrays (saved with a checkpoint)."""
    out = {"episodes_dropped": np.asarray([self.dropped], np.int64)}
    if not self.groups:
      return out
    blob = [{"example": gr.example, "prompt": gr.prompt, "owner": gr.owner,
             "born": gr.born, "states": gr.states, "spans": gr.spans,
             "rewards_at": gr.rewards_at} for gr in self.groups]
    out["episodes"] = np.frombuffer(json.dumps(blob).encode(), np.uint8)
    for name in self.groups[0].rows:
      out[f"episode_{name}"] = np.stack([gr.rows[name] for gr in self.groups])
    return out

  def load_arrays(self, arrays: Mapping[str, np.ndarray], *, group_size: int,
                  max_new_tokens: int, policy_logp: bool, blocks: int
                  ) -> None:
    """Restores what ``arrays`` saved, checked against this run's
    ``rl.group_size`` (``group_size`` episodes per example) and
    ``sampler.max_new_tokens``; ``blocks``: the run's process blocks (a
    group whose process is gone is stepped by another: its states are
    every process's)."""
    self.dropped = int(np.asarray(arrays["episodes_dropped"])[0])
    self.groups = []
    if "episodes" not in arrays:
      return
    try:
      blob = json.loads(bytes(np.asarray(arrays["episodes"])).decode())
    except ValueError as e:  # a cut or corrupt record
      raise ValueError(f"the checkpoint's carried episodes: their record "
                       f"does not read as JSON ({e}).") from e
    k, g, t = len(blob), group_size, max_new_tokens
    fields = ROW_FIELDS + (("policy_logp",) if policy_logp else ())
    for name in fields:
      got = arrays.get(f"episode_{name}")
      want = (k, g, 2) if name == "keys" else (
          (k, g, t) if name in ("tokens", "mask", "observed", "sampler_logp",
                                "version", "policy_logp") else (k, g))
      if got is None or tuple(np.shape(got)) != want:
        raise ValueError(
            f"the checkpoint's carried episodes: {name} has shape "
            f"{None if got is None else np.shape(got)}, expected {want} "
            "(rl.group_size and sampler.max_new_tokens must be the run's).")
    for i, entry in enumerate(blob):
      if len(entry["states"]) != g:
        raise ValueError(f"the checkpoint's carried episodes: group {i} "
                         f"has {len(entry['states'])} states, expected {g}.")
      self.groups.append(CarriedGroup(
          example=entry["example"], prompt=entry["prompt"],
          owner=int(entry["owner"]) % blocks, born=entry["born"],
          rows={name: np.asarray(arrays[f"episode_{name}"][i])
                for name in fields},
          states=entry["states"],
          spans=[[tuple(s) for s in row] for row in entry["spans"]],
          rewards_at=[[(int(c), float(r)) for c, r in row]
                      for row in entry["rewards_at"]]))


__all__ = ["CarriedGroup", "EpisodeCarry", "Held", "ROW_FIELDS", "unpack"]
