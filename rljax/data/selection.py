"""Which prompts are rolled out, and which sampled groups are trained.

In group-relative RL a group whose ``G`` rewards are all equal has zero
advantage for every row: its samples cost as much as any other and teach
nothing. Two ways to spend the rollouts better, built from ``rl.selection``
by ``rljax.train.build`` and used by ``rljax.rollout.collector.Collector``:

* **Dynamic sampling** (``rl.selection.name="dapo"``; Yu et al., "DAPO: An
  Open-Source LLM Reinforcement Learning System at Scale",
  https://arxiv.org/abs/2503.14476, section 3.2): after a batch is sampled
  and scored, its zero-variance groups are dropped and more prompts are
  sampled to refill the batch, for at most ``max_rounds`` rounds in all
  (verl's ``max_num_gen_batches``). The informative groups fill the batch in
  the order they were drawn (extra ones are dropped, as verl truncates);
  when the rounds run out first, the remaining slots keep zero-variance
  groups with their loss mask cleared, so, as in DAPO, only informative
  groups reach the loss and its token count (``select/masked_groups``
  counts them). Shapes stay static: one train program whatever was kept.
* **GRESO** (``rl.selection.name="greso"``; Zheng et al., "Act Only When It
  Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
  Rollouts", https://arxiv.org/abs/2506.02177): before sampling, a prompt
  whose last ``z`` rollouts were all zero-variance groups is skipped with
  probability ``1 - p**z``, ``p`` the exploration probability of its kind
  (*easy*: every row correct; *hard*: the rest). Each ``p`` adapts after
  every step: down by ``step_size`` when that kind's share of the step's
  groups exceeds its target, up otherwise (within ``[min_explore, 1]``).
  Skipped prompts are replaced by the iterator's next ones; dynamic sampling
  then runs as above.

``GresoState`` is plain arrays (the per-prompt history, keyed by a hash of
the prompt text, and the two probabilities): it is saved with every
checkpoint and restored on resume. GRESO's draws come from
``np.random.default_rng((seed, step, round, draw))``, a function of the
config's seed and the step, so a resumed run skips exactly what the uninterrupted one
would have (no hidden generator state).

Default targets: easy and hard groups each at most an eighth of a batch
(GRESO's target zero-variance share of 25%, split evenly), step 0.01 (the
paper's), exploration starting at 1 (nothing skipped until a history
exists) with a floor of 0.05 so every prompt is retried eventually.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from rljax.data.dots import Dots

NAMES = ("none", "dapo", "greso", "dots")
"""The values ``rl.selection.name`` accepts."""

EASY, HARD, INFORMATIVE = 1, 2, 0
"""A group's kind: every row correct, zero variance otherwise, or neither."""


def group_kinds(total_N: np.ndarray, valid_N: np.ndarray,
                correct_N: np.ndarray, group_size: int) -> np.ndarray:
  """``[B]`` int8: ``EASY``, ``HARD`` or ``INFORMATIVE`` per group.

  A group is informative when its scored rows' totals are not all equal (a
  nonzero group standard deviation: DAPO's ``std > 0``, which is ``0 <
  #correct < G`` for a binary reward). A group with fewer than two scored
  rows has zero variance. Zero-variance groups whose rows are all correct
  are easy, the others hard.
  """
  total = np.asarray(total_N, np.float64).reshape(-1, group_size)
  valid = np.asarray(valid_N, bool).reshape(-1, group_size)
  hi = np.where(valid, total, -np.inf).max(1)
  lo = np.where(valid, total, np.inf).min(1)
  informative = (valid.sum(1) >= 2) & (hi > lo)
  all_correct = np.asarray(correct_N, bool).reshape(-1, group_size).all(1)
  kinds = np.where(all_correct, EASY, HARD).astype(np.int8)
  return np.where(informative, INFORMATIVE, kinds).astype(np.int8)


class Plan(NamedTuple):
  """Which sampled groups form the trained batch (``plan_batch``).

  Attributes:
    rounds: ``[K]`` per round, the indices of its groups taken, in batch
      order (round by round).
    trained: ``[B]`` bool, the batch's groups whose loss counts (False: a
      zero-variance filler, loss mask cleared).
  """

  rounds: tuple[np.ndarray, ...]
  trained: np.ndarray


def plan_batch(kinds: Sequence[np.ndarray], batch_size: int) -> Plan:
  """DAPO's batch from the groups of every round sampled this step.

  The informative groups, in the order drawn, fill the ``batch_size``
  slots; extra ones are dropped. Slots left once they run out take
  zero-variance groups, again in the order drawn, as masked fillers.
  """
  order = [(r, i) for r, k in enumerate(kinds) for i in np.flatnonzero(k == 0)]
  fillers = [(r, i) for r, k in enumerate(kinds)
             for i in np.flatnonzero(k != 0)]
  taken = order[:batch_size]
  trained = [True] * len(taken)
  if len(taken) < batch_size:
    taken += fillers[:batch_size - len(taken)]
    trained += [False] * (batch_size - len(trained))
  if len(taken) < batch_size:
    raise ValueError(f"{sum(len(k) for k in kinds)} groups sampled for a "
                     f"batch of {batch_size}.")
  rounds = tuple(np.asarray([i for r2, i in taken if r2 == r], np.int64)
                 for r in range(len(kinds)))
  # Batch order: round by round, each round's groups in ``taken``'s order.
  by_round = sorted(range(len(taken)), key=lambda j: taken[j][0])
  return Plan(rounds, np.asarray([trained[j] for j in by_round], bool))


def prompt_key(prompt: Any) -> int:
  """A stable 63-bit key of a prompt (its text or token list), the same in
  every process and every run (``hash`` of a str is salted per process)."""
  digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") >> 1


class GresoState(NamedTuple):
  """GRESO's history: what a checkpoint holds.

  Attributes:
    keys: ``[M]`` int64 ``prompt_key`` of every prompt seen, sorted.
    zero_runs: ``[M]`` int32, the prompt's latest consecutive zero-variance
      rollouts (0: its last group was informative).
    kinds: ``[M]`` int8, the kind of its last group.
    explore: ``[2]`` float64, the exploration probability of easy and of
      hard prompts.
  """

  keys: np.ndarray
  zero_runs: np.ndarray
  kinds: np.ndarray
  explore: np.ndarray


class Greso:
  """GRESO's pre-rollout filter (see the module docstring).

  Args:
    seed: the run's seed (``seed``); draws are ``default_rng((seed, step,
      draw))``.
    target: each kind's target share of a step's groups.
    step_size: how much an exploration probability moves per step.
    min_explore: the probabilities' floor.
    max_draws: batches drawn from the iterator per step at most (the first
      included) before the batch is completed with skipped prompts, those
      least likely skipped first.
  """

  def __init__(self, *, seed: int, target: float = 0.125,
               step_size: float = 0.01, min_explore: float = 0.05,
               max_draws: int = 4):
    for name, value, ok in (("target", target, 0 < target < 1),
                            ("step_size", step_size, 0 < step_size <= 1),
                            ("min_explore", min_explore, 0 < min_explore <= 1),
                            ("max_draws", max_draws, max_draws >= 1)):
      if not ok:
        raise ValueError(f"rl.selection.greso_{name}={value!r} is out of "
                         "range: see rljax.data.selection.Greso.")
    self.seed, self.target, self.step_size = int(seed), target, step_size
    self.min_explore, self.max_draws = min_explore, max_draws
    self.state = GresoState(np.zeros(0, np.int64), np.zeros(0, np.int32),
                            np.zeros(0, np.int8), np.ones(2, np.float64))

  def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(zero_runs, kinds)`` of ``keys`` (0 and INFORMATIVE when unseen)."""
    s = self.state
    at = np.searchsorted(s.keys, keys)
    at_c = np.minimum(at, max(len(s.keys) - 1, 0))
    seen = (at < len(s.keys)) & (s.keys[at_c] == keys) if len(s.keys) else (
        np.zeros(len(keys), bool))
    runs = np.where(seen, s.zero_runs[at_c] if len(s.keys) else 0, 0)
    kinds = np.where(seen, s.kinds[at_c] if len(s.keys) else 0, INFORMATIVE)
    return runs.astype(np.int32), kinds.astype(np.int8)

  def skip_probabilities(self, prompts: Sequence[Any]) -> np.ndarray:
    """``[n]``: ``1 - p_kind ** zero_runs`` of each prompt."""
    runs, kinds = self._lookup(np.asarray([prompt_key(p) for p in prompts],
                                          np.int64))
    p = np.where(kinds == EASY, self.state.explore[0], self.state.explore[1])
    return np.where(runs > 0, 1.0 - p ** runs, 0.0)

  def select(self, examples: Mapping[str, list],
             more: Callable[[], Mapping] | None, stream: Sequence[int]
             ) -> tuple[dict[str, list], dict[str, float]]:
    """``batch_size`` examples to roll out, and ``select/*`` metrics.

    Draws ``u ~ U[0, 1)`` per candidate (``default_rng((seed, *stream,
    draw))``: ``stream`` is the step and the sampling round) and keeps
    those with ``u >=`` their skip probability, drawing further batches
    (``more()``) while fewer than ``batch_size`` are kept, ``max_draws``
    batches at most.
    """
    batch_size = len(examples["prompt"])
    fields = list(examples)
    kept: list[dict] = []
    skipped: list[tuple[float, int, dict]] = []
    batch, draw = examples, 0
    while True:
      rows = [{f: batch[f][i] for f in fields} for i in range(batch_size)]
      probs = self.skip_probabilities([r["prompt"] for r in rows])
      u = np.random.default_rng((self.seed, *stream, draw)).random(batch_size)
      for row, prob, ui in zip(rows, probs, u):
        if ui >= prob:
          kept.append(row)
        else:
          skipped.append((float(prob), len(skipped), row))
      draw += 1
      if len(kept) >= batch_size or draw >= self.max_draws or more is None:
        break
      batch = more()
    n_skipped = len(skipped)
    if len(kept) < batch_size:  # the least likely skipped complete it
      kept += [row for _, _, row in sorted(skipped)[:batch_size - len(kept)]]
    kept = kept[:batch_size]
    out = {f: [row[f] for row in kept] for f in fields}
    return out, {"select/skipped_prompts": float(n_skipped),
                 "select/prompt_draws": float(draw),
                 "select/explore_easy": float(self.state.explore[0]),
                 "select/explore_hard": float(self.state.explore[1])}

  def update(self, prompts: Sequence[Any], kinds: np.ndarray) -> None:
    """Records each sampled group's kind and adapts the probabilities.

    Args:
      prompts: every group's prompt sampled this step (all rounds).
      kinds: ``[n]`` their ``group_kinds``.
    """
    kinds = np.asarray(kinds, np.int8)
    keys = np.asarray([prompt_key(p) for p in prompts], np.int64)
    runs, _ = self._lookup(keys)
    new_runs = np.where(kinds == INFORMATIVE, 0, runs + 1).astype(np.int32)
    s = self.state
    # A prompt sampled twice in a step keeps its last group's record.
    merged = dict(zip(s.keys.tolist(), zip(s.zero_runs.tolist(),
                                           s.kinds.tolist())))
    merged.update(zip(keys.tolist(), zip(new_runs.tolist(), kinds.tolist())))
    order = sorted(merged)
    explore = s.explore.copy()
    for j, kind in enumerate((EASY, HARD)):
      share = float(np.mean(kinds == kind)) if len(kinds) else 0.0
      delta = -self.step_size if share > self.target else self.step_size
      explore[j] = min(1.0, max(self.min_explore, explore[j] + delta))
    self.state = GresoState(
        np.asarray(order, np.int64),
        np.asarray([merged[k][0] for k in order], np.int32),
        np.asarray([merged[k][1] for k in order], np.int8), explore)

  def arrays(self) -> dict[str, np.ndarray]:
    """The state as named host arrays (a checkpoint item)."""
    return dict(self.state._asdict())

  def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Restores ``arrays()``; a missing or malformed field is named."""
    fields = GresoState._fields
    missing = [f for f in fields if f not in arrays]
    if missing:
      raise ValueError(f"the checkpoint's GRESO state lacks {missing}.")
    state = GresoState(*(np.asarray(arrays[f]) for f in fields))
    m = len(state.keys)
    if (len(state.zero_runs) != m or len(state.kinds) != m
        or state.explore.shape != (2,)):
      raise ValueError("the checkpoint's GRESO state has inconsistent "
                       f"shapes: {[np.shape(x) for x in state]}.")
    self.state = GresoState(state.keys.astype(np.int64),
                            state.zero_runs.astype(np.int32),
                            state.kinds.astype(np.int8),
                            state.explore.astype(np.float64))


class Selection(NamedTuple):
  """``rl.selection`` as the Collector uses it.

  Attributes:
    name: one of ``NAMES`` (not "none": no ``Selection`` is built then).
    max_rounds: sampling rounds per step at most (the first included).
    greso: the pre-rollout filter, or None.
    dots: DOTS's difficulty-targeted selection (``rljax/data/dots.py``),
      or None; it picks each step's prompts itself (no refill rounds).
  """

  name: str
  max_rounds: int
  greso: Greso | None = None
  dots: Dots | None = None


def make_selection(name: str, *, seed: int, max_rounds: int = 3,
                   greso_target: float = 0.125, greso_step_size: float = 0.01,
                   greso_min_explore: float = 0.05, greso_max_draws: int = 4,
                   batch_size: int = 1, pool_size: int | None = None,
                   dots_every: int = 8, dots_reference: int = 64,
                   dots_target: float = 0.5, dots_temperature: float = 0.1,
                   dots_attention_temperature: float = 0.05
                   ) -> Selection | None:
  """The ``Selection`` that ``rl.selection`` names; None for "none".
  ``dots`` needs ``batch_size`` and ``pool_size`` (the training prompts)."""
  if name not in NAMES:
    raise ValueError(f"rl.selection.name={name!r} is not one of {NAMES}.")
  if max_rounds < 1:
    raise ValueError(f"rl.selection.max_rounds={max_rounds!r}: at least 1 "
                     "(1: no refill).")
  if name == "none":
    return None
  greso = None if name != "greso" else Greso(
      seed=seed, target=greso_target, step_size=greso_step_size,
      min_explore=greso_min_explore, max_draws=greso_max_draws)
  dots = None
  if name == "dots":
    if pool_size is None:
      raise ValueError("make_selection('dots'): pass pool_size, the number "
                       "of training prompts.")
    dots = Dots(batch_size=batch_size, pool_size=pool_size, every=dots_every,
                reference=dots_reference, target=dots_target,
                temperature=dots_temperature,
                attention_temperature=dots_attention_temperature, seed=seed)
  return Selection(name, 1 if dots else max_rounds, greso, dots)




_REPLAY_ROW_FIELDS = ("prompt_tokens", "prompt_mask", "completion_tokens",
                      "completion_mask", "lengths", "finished",
                      "policy_logprobs", "sampler_logprobs", "rewards_NxR",
                      "valid_NxR", "total_N", "prompt_tokens_N",
                      "completion_tokens_N")
"""What the replay buffer keeps of each row (``policy_logprobs`` only when
the sampler records them)."""


class ReplayBuffer:
  """Recent informative groups, replayed in place of fresh samples.

  Rollout replay (Sun et al., "Improving Data Efficiency for LLM
  Reinforcement Fine-tuning Through Difficulty-targeted Online Data
  Selection and Rollout Replay", https://arxiv.org/abs/2506.05316): each
  step samples ``B - R`` fresh groups and takes ``R = round(fraction * B)``
  groups from this buffer, the newest first, each replayed once; a group
  older than ``max_age`` updates is dropped. Only informative groups are
  kept (a zero-variance group teaches nothing), at most ``capacity`` (the
  oldest go first). A replayed row carries its own tokens, rewards, sampler
  logprobs and the policy version that drew it: the trainer's corrections
  (PPO's clip against ``rl.old_logprobs='sampler'``, TIS/MIS, ESS) see its
  exact behaviour logprobs, and ``rollout/staleness/*`` its age. When fewer
  than ``R`` eligible groups are stored, the step samples all ``B`` fresh
  (two sampler shapes at most).

  Args:
    fraction: replayed share of the step's groups, in ``[0, 1)``.
    max_age: updates after which a stored group is too old to replay.
    capacity: groups stored at most.
    batch_size: ``B``, the step's groups.
  """

  def __init__(self, *, fraction: float, max_age: int, capacity: int,
               batch_size: int):
    if not 0 <= fraction < 1:
      raise ValueError(f"rl.replay.fraction={fraction!r}: a number in "
                       "[0, 1) is required.")
    if max_age < 1 or capacity < 1:
      raise ValueError(f"rl.replay.max_age={max_age!r} and rl.replay."
                       f"capacity={capacity!r} must be >= 1.")
    self.fraction, self.max_age, self.capacity = fraction, max_age, capacity
    self.count = int(round(fraction * batch_size))
    if self.count >= batch_size:
      raise ValueError(f"rl.replay.fraction={fraction!r} replays all "
                       f"{batch_size} groups: at least one must be fresh.")
    self.groups: list[dict[str, np.ndarray]] = []  # oldest first
    self.versions: list[int] = []

  def __len__(self) -> int:
    return len(self.groups)

  def push(self, groups: Sequence[Mapping[str, np.ndarray]],
           version: int) -> None:
    """Stores groups (each ``{field: [G, ...] array}``) drawn by ``version``."""
    for g in groups:
      self.groups.append({k: np.asarray(v) for k, v in g.items()})
      self.versions.append(int(version))
    excess = len(self.groups) - self.capacity
    if excess > 0:
      del self.groups[:excess], self.versions[:excess]

  def take(self, version: int) -> tuple[list[dict], list[int]] | None:
    """``R`` groups for the step that trains ``version`` (removed from the
    buffer, newest first) and the versions that drew them; None when fewer
    than ``R`` are young enough. Too old groups are dropped either way."""
    keep = [i for i, v in enumerate(self.versions)
            if version - v <= self.max_age]
    self.groups = [self.groups[i] for i in keep]
    self.versions = [self.versions[i] for i in keep]
    if self.count == 0 or len(self.groups) < self.count:
      return None
    taken = list(range(len(self.groups) - self.count, len(self.groups)))[::-1]
    out = [self.groups[i] for i in taken], [self.versions[i] for i in taken]
    del self.groups[-self.count:], self.versions[-self.count:]
    return out

  def arrays(self) -> dict[str, np.ndarray]:
    """The buffer as named host arrays (a checkpoint item): each field
    stacked over the groups, prompts left-padded to the widest."""
    out: dict[str, np.ndarray] = {"versions": np.asarray(self.versions,
                                                         np.int64)}
    if not self.groups:
      return out
    # Each group's own prompt width, restored exactly on load.
    out["prompt_width"] = np.asarray(
        [g["prompt_tokens"].shape[1] for g in self.groups], np.int64)
    width = int(out["prompt_width"].max())
    for name in self.groups[0]:
      parts = []
      for g in self.groups:
        x = g[name]
        if name.startswith("prompt_") and x.ndim == 2:
          x = np.pad(x, ((0, 0), (width - x.shape[1], 0)))
        parts.append(x)
      out[name] = np.stack(parts)
    return out

  def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Restores ``arrays()``; a malformed item is refused, naming it."""
    if "versions" not in arrays:
      raise ValueError("the checkpoint's replay buffer lacks 'versions'.")
    versions = np.asarray(arrays["versions"]).tolist()
    names = [k for k in arrays if k not in ("versions", "prompt_width")]
    needed = {"prompt_tokens", "prompt_mask", "total_N", "prompt_width"}
    if versions and not needed <= set(arrays):
      raise ValueError("the checkpoint's replay buffer lacks "
                       f"{sorted(needed - set(arrays))}.")
    for k in names + (["prompt_width"] if versions else []):
      if np.shape(arrays[k])[0] != len(versions):
        raise ValueError(f"the checkpoint's replay buffer field {k!r} has "
                         f"{np.shape(arrays[k])[0]} groups; 'versions' has "
                         f"{len(versions)}.")
    widths = np.asarray(arrays.get("prompt_width", []), np.int64)
    self.groups = []
    for i in range(len(versions)):
      group = {k: np.asarray(arrays[k][i]) for k in names}
      for k in ("prompt_tokens", "prompt_mask"):
        group[k] = group[k][:, group[k].shape[1] - int(widths[i]):]
      self.groups.append(group)
    self.versions = [int(v) for v in versions]


__all__ = ["EASY", "HARD", "INFORMATIVE", "NAMES", "Greso", "GresoState",
           "Plan", "ReplayBuffer", "Selection", "group_kinds",
           "make_selection", "plan_batch", "prompt_key"]
