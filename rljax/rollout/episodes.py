"""What a multi-turn rollout returns, and the host's records while it runs
(``rljax.rollout.multi_turn``): each episode's rewards, turns and failures, and
with slots the episodes that left them."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sampling.sampler import Rollout, SamplerConfig


class Episodes(NamedTuple):
  """What ``MultiTurnSampler.run`` returns.

  Attributes:
    rollout: the ``Rollout`` (``observation_mask`` and ``turn_rewards``
      set), on the devices.
    prompts: each example's prompt (``Environment.reset``), ``B``.
    env_reward: ``[N]`` float, the sum of each episode's step rewards (0 if
      none gave one); NaN for a failed episode.
    failed: ``[N]`` bool, the environment raised, hung or answered malformed
      output (or its reset did).
    metrics: ``env/*`` host floats, and ``time/env`` (seconds the host
      spent in the environments' resets and waiting for their steps: a
      step's latency hidden behind decoding is not counted).
    turn_tokens: each row's turns as ``(start, end, kind)`` column spans,
      ``kind`` ``"model"`` or ``"observation"`` (tests and debugging).
    examples: partial rollouts: the trained groups' examples, in row order
      (carried groups of earlier steps among them); None: the run's own.
    token_versions: partial rollouts: ``[N, T]`` int32, the policy version
      that drew or inserted each token (-1 outside the completion).
  """

  rollout: Rollout
  prompts: list[str]
  env_reward: np.ndarray
  failed: np.ndarray
  metrics: dict[str, float]
  turn_tokens: list[list[tuple[int, int, str]]]
  examples: list[dict[str, Any]] | None = None
  token_versions: np.ndarray | None = None


class SlotOutputs:
  """The episodes that left their slots, by episode row (host arrays)."""

  def __init__(self, n: int, config: SamplerConfig):
    t = config.max_new_tokens
    self.tokens = np.full((n, t), config.pad_id, np.int32)
    self.mask = np.zeros((n, t), bool)
    self.observed = np.zeros((n, t), bool)
    self.sampler_logp = np.zeros((n, t), np.float32)
    self.policy_logp = (np.zeros((n, t), np.float32)
                        if config.record_policy_logprobs else None)
    self.finished = np.zeros(n, bool)
    self.prefills = 0
    self.prefilled_rows = 0  # prompts run through the decoder (padded)

  def retire(self, state: Any, slots_M, slot_row,
             to_host: Any = jax.device_get) -> None:
    """Copies the ``slots_M`` slots' buffers (``rollout._Turns``) to their
    episodes' rows ``slot_row`` (``to_host``: device arrays to the host,
    whole; with several processes, gathered)."""
    slots = np.flatnonzero(slots_M)
    if not len(slots):
      return
    fields = ("tokens", "mask", "observed", "sampler_logp", "policy_logp",
              "finished")
    host = to_host({f: getattr(state, f) for f in fields
                    if getattr(state, f) is not None})
    rows = slot_row[slots]
    for f, x in host.items():
      getattr(self, f)[rows] = np.asarray(x)[slots]

  def rollout(self, tokens_NxP, mask_NxP, turn_rewards_NxT, *,
              xp: Any = jnp, rows: np.ndarray | None = None) -> Rollout:
    """The episodes' ``Rollout``: device arrays, or with ``xp=np`` host
    arrays (several processes place them split by process blocks);
    ``rows``: those episode rows only (partial rollouts' trained groups),
    None: every one."""
    at = slice(None) if rows is None else rows
    mask, observed = self.mask[at], self.observed[at]
    return Rollout(
        prompt_tokens=xp.asarray(tokens_NxP[at]),
        prompt_mask=xp.asarray(mask_NxP[at]),
        completion_tokens=xp.asarray(self.tokens[at]),
        completion_mask=xp.asarray(mask),
        lengths=xp.asarray((mask & ~observed).sum(1), xp.int32),
        finished=xp.asarray(self.finished[at]),
        policy_logprobs=(None if self.policy_logp is None
                         else xp.asarray(self.policy_logp[at])),
        sampler_logprobs=xp.asarray(self.sampler_logp[at]),
        observation_mask=xp.asarray(observed),
        turn_rewards=xp.asarray(turn_rewards_NxT[at]))

  def metrics(self, decode_steps: int, slots: int,
              model_tokens: int | None = None) -> dict[str, float]:
    """``model_tokens``: those decoded in the run (None: every one held;
    partial rollouts hold carried ones decoded before)."""
    if model_tokens is None:
      model_tokens = float((self.mask & ~self.observed).sum())
    return {"rollout/slots": float(slots),
            "rollout/decode_steps": float(decode_steps),
            "rollout/prefills": float(self.prefills + slots),
            "rollout/prefilled_rows": float(self.prefilled_rows),
            "rollout/slot_utilization": model_tokens / max(
                decode_steps * slots, 1)}


class EpisodeLog:
  """The host's figures of one ``run``: rewards, failures, turns, spans."""

  def __init__(self, n: int):
    self.failed = np.zeros(n, bool)
    self.reward = np.zeros(n, np.float64)
    self.rewards_at: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    self.turns = np.zeros(n, np.int32)
    self.spans: list[list[tuple[int, int, str]]] = [[] for _ in range(n)]
    self.info: dict[str, float] = {}
    self.counts = {"errors": 0, "timeouts": 0}
    self.obs_tokens = self.truncated_obs = self.turn_limit = 0
    self.env_seconds = 0.0
    self.slot_metrics: dict[str, float] = {}

  def timed(self, fn):
    t = time.monotonic()
    try:
      return fn()
    finally:
      self.env_seconds += time.monotonic() - t

  def fail(self, r: int, outcome) -> None:
    self.failed[r] = True
    self.counts["errors" if outcome.status == "error" else "timeouts"] += 1
    logging.getLogger("rljax").warning("environment %s: %s", outcome.status,
                                       outcome.message)

  def copy_rows(self, rows, sources, states: list) -> None:
    """Episode rows ``rows`` take the records of rows ``sources`` (all read
    before any is written) and a copy of their environment's state (tree
    episodes' forks, LATR's branches)."""
    rows, sources = np.asarray(rows), np.asarray(sources)
    for name in ("failed", "reward", "turns"):
      getattr(self, name)[rows] = getattr(self, name)[sources]
    got = [(list(self.rewards_at[s]), list(self.spans[s]),
            None if states[s] is None else state_copy(states[s]))
           for s in sources]
    for i, (rewards_at, spans, state) in zip(rows, got):
      self.rewards_at[i], self.spans[i], states[i] = rewards_at, spans, state

  def clear_row(self, i: int, states: list) -> None:
    """Row ``i`` holds no episode (LATR's pruned branch)."""
    self.failed[i], self.reward[i], self.turns[i] = False, 0.0, 0
    self.rewards_at[i], self.spans[i], states[i] = [], [], None

  def turn_rewards(self, t: int) -> np.ndarray:
    """``[N, T]`` float32: each step's reward on its turn's last model
    token; a failed episode's row is 0 (its ``env`` reward is NaN)."""
    out = np.zeros((len(self.failed), t), np.float32)
    for r, pairs in enumerate(self.rewards_at):
      if not self.failed[r]:
        for column, reward in pairs:
          out[r, column] += reward
    return out

  def episodes(self, rollout, prompts, restarts: int,
               rows: np.ndarray | None = None) -> Episodes:
    """``rows``: the episodes returned (partial rollouts' trained groups);
    None: every one."""
    at = slice(None) if rows is None else rows
    turns, failed = self.turns[at], self.failed[at]
    metrics = {
        "env/turns/mean": float(turns.mean()),
        "env/turns/max": float(turns.max()),
        "env/observation_tokens": float(self.obs_tokens),
        "env/observation_truncated": float(self.truncated_obs),
        "env/turn_limit": float(self.turn_limit),
        "env/failed_episodes": float(failed.sum()),
        "env/errors": float(self.counts["errors"]),
        "env/timeouts": float(self.counts["timeouts"]),
        "env/worker_restarts": float(restarts),
        "time/env": self.env_seconds,  # within time/sample
    }
    metrics.update({f"env/{k}": float(v) for k, v in self.info.items()})
    metrics.update(self.slot_metrics)
    spans = (self.spans if rows is None
             else [self.spans[r] for r in rows])
    return Episodes(rollout, prompts,
                    np.where(failed, np.nan, self.reward[at]), failed,
                    metrics, spans)


def state_copy(state: Any) -> Any:
  """An environment's state (a JSON value) copied: each episode that plays
  from it steps its own."""
  return json.loads(json.dumps(state))


def distinct_prompts(rows_N: np.ndarray, g: int, tokens_NxP: np.ndarray,
                      mask_NxP: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(tokens [U, P], mask [U, P], source [N])``: the prompts of the
  episode rows ``rows_N`` (the ``G`` rows of an example share its prompt),
  each example once, and the index of each row's. ``U`` is the count of
  distinct examples rounded up to a power of two (repeats of the last
  pad it), so a run compiles at most ``log2(M) + 1`` prefills."""
  examples, source = np.unique(np.asarray(rows_N) // g, return_inverse=True)
  u = 1 << (len(examples) - 1).bit_length()
  lead = np.concatenate([examples, np.repeat(examples[-1:],
                                             u - len(examples))]) * g
  return tokens_NxP[lead], mask_NxP[lead], source.astype(np.int32)


__all__ = ["EpisodeLog", "Episodes", "SlotOutputs", "distinct_prompts",
           "state_copy"]
