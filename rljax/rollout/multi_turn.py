"""The multi-turn rollout: model turns decoded on the devices, environment
steps on the host, observations prefilled into each row's KV cache.

Layout. ``N = B * G`` rows, each with its own KV cache row of
``S = P + T + O`` slots (prompt bucket, the episode's token budget
``T = max_new_tokens``, and one observation's width ``O``) written at its own
index (``KVCache.index`` ``[N]``, as continuous batching's slots). The
completion buffer ``[N, T]`` holds a row's model tokens and the observation
tokens between them, in order; slot ``P + j`` holds completion column ``j``
and the position of column ``j`` is ``prompt length + j``, so a row is one
contiguous sequence and the trainer's forward over ``prompt + completion``
sees what the sampler saw.

A turn. ``turns.decode_turn`` (``rljax/rollout/turns.py``) runs decode steps (one ``lax.while_loop``) until
every live row has ended its turn: at an end-of-turn (EOS) token, at one of
the environment's stop sequences (a tool call such as ``</calc>``), at
``max_turn_tokens``, or at the budget ``T``. The host then decodes each
ended turn to text, steps the environments (``EnvRunner``, in worker
processes), encodes each observation (``ObservationFormat``) and
``turns.insert`` prefills it into the row's cache at the row's own index: the
row's history is never prefilled again, and only the ``O``-wide observation
is computed. The row then decodes its next turn. A prompt is prefilled once
for the rows that start with it together (``turns.start``: the ``G`` rows of
an example copy one forward's keys and values), at the start and at each
refill of the slots.

Token exactness. What the trainer gets is this buffer: the ids that were
sampled and the ids that were inserted, never a decode and re-encode of the
text. ``Rollout.observation_mask`` marks the inserted ids: they are inputs,
not trained (no loss, no sampler logprob, which is 0 there).

Draws. Row ``r``'s token at completion column ``j`` is drawn with
``fold_in(fold_in(key, r), j)`` (``sampling.row_keys``), so an episode that
ends after its first turn is exactly the static sampler's row.

SPEC-RL (``drafts``, ``sampler.speculative``). Every episode is stored as
the next draft of its prompt and sample (``sampling.DraftStore``, with its
observation mask). A turn drafts from the stored episode when the row's
history so far, model and observation tokens, is the stored one's to the
token: turn 1 always (the prompt is the history), a later turn when every
turn before was kept whole and the environment answered the same. The
draft is the stored turn; ``turns.verify`` keeps it up to the first token
the acceptance rule rejects, and the row decodes on from there. A turn
kept whole that ended the stored turn ends this one, and the environment
steps it without a decode.

References:
  The token-in, token-out contract of verl's agent loop
  (``verl/experimental/agent_loop``) and TRL's rollout-source RFC; the
  environment interface of Tunix's agentic RL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rljax import distributed
from rljax import tokenizers as tok_lib
from rljax.envs.base import EnvOutcome, EnvRunner
from rljax.rollout import (env_steps, episode_carry, episode_latr,
                           episode_tree, turn_rounds)
from rljax.rollout import turns as turns_lib
from rljax.rollout.env_steps import StepCall
from rljax.rollout.episode_drafts import Speculation
from rljax.rollout.episodes import (EpisodeLog, Episodes, SlotOutputs,
                                   distinct_prompts, state_copy)
from rljax.rollout.observations import ObservationFormat
from rljax.models import ModelConfig
from rljax.sampling.decode_cache import shrink_levels
from rljax.sampling.drafts import DraftStore
from rljax.sampling.paged import PagedConfig
from rljax.sampling.sampler import SamplerConfig, pad_prompts, row_keys


@dataclasses.dataclass(frozen=True)
class TurnConfig:
  """Static settings of the multi-turn rollout.

  Attributes:
    max_turns: model turns per episode; after the last one the episode ends
      (``env/turn_limit``) whatever the environment says.
    max_observation_tokens: ``O``; a longer observation is cut to ``O``
      tokens (``env/observation_truncated``).
    max_turn_tokens: tokens one model turn may have (None: the budget).
    stop_sequences: token sequences that end a turn (the environment's
      ``stop_strings``, encoded), besides the sampler's EOS ids.
    step_rows: a decode returns to the host once this many rows wait for
      their environment (``MultiTurnSampler.run``'s rounds); None: once every
      row's turn has ended (the batch moves turn by turn).
  """

  max_turns: int = 4
  max_observation_tokens: int = 16
  max_turn_tokens: int | None = None
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  step_rows: int | None = None

  def __post_init__(self):
    for name in ("max_turns", "max_observation_tokens"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"env.{name}={value!r}: a positive integer is "
                         "required.")
    for name in ("max_turn_tokens", "step_rows"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                            or v < 1):
        raise ValueError(f"env.{name}={v!r}: a positive integer or None is "
                         "required.")
    if any(not s for s in self.stop_sequences):
      raise ValueError("env.stop_strings: a stop string encodes to no "
                       "tokens.")


class MultiTurnSampler(env_steps.EnvSteps, turn_rounds.Rounds):
  """Runs episodes: ``run(params, examples, key) -> Episodes``.

  Args:
    model_config: the policy's config.
    config: the sampler's settings (``num_samples`` G, ``max_new_tokens`` is
      the episode's token budget T: model and observation tokens together).
    turns: the multi-turn settings (``TurnConfig``).
    runner: steps the environment (``EnvRunner``).
    tokenizer: encodes prompts and observations, decodes turns.
    buckets: prompt length buckets.
    mesh, param_shardings: where the params live (rows are replicated: the
      rollout's arrays are laid out by the compiler).
    observation_role: the chat role of observations (``ObservationFormat``).
    slots: ``M``: the episodes play on ``M`` slots, each a cache row,
      refilled as episodes end (continuous batching: ``rl.rollout=
      "continuous"``); None: every episode has its own row from the start
      (the static batch).
    refill_rows: with slots, queued episodes take free slots once this many
      are free (or the queue's last ones are).
    group: the run's processes (``distributed.ProcessGroup``). With
      several, ``run`` takes this process's block of the examples: each
      process resets and steps the environments of its own episodes (in
      its own workers), the resets' prompts and every ended step's outcome
      (less the environment's state, which stays with its process) are
      gathered each round, so every process runs the same host loop over
      all episodes in lockstep (on slots too: a slot plays any process's
      episode, and the process that reset it steps it); the rollout comes
      back split by process blocks as the static sampler's.
    drafts: SPEC-RL's store (module docstring): each turn drafts from the
      prompt's last episode where its history matches; None: no drafts.
    log_lenience: the acceptance rule's ``log l >= 0``
      (``sampling.speculative``).
    carry: partial rollouts of episodes (``rl.rollout="partial"``,
      ``episode_carry.EpisodeCarry``, needs ``slots``): ``run`` stops once
      its step's ``B`` groups have ended and carries the others; None:
      every episode is played to its end.
    paged: the rows' KV cache is a pool of blocks
      (``sampling.PagedConfig``; ``rljax/rollout/turn_pages.py``): a
      prompt's blocks are shared by the rows that start with it, and an
      episode's blocks are released when it ends; None: a dense cache of
      ``P + T + O`` slots per row.
    tree: tree episodes (``rl.rollout="tree"``, ``episode_tree``): a
      group's episodes fork between turns; None: each plays on its own.
    latr: LATR episodes (``rl.rollout="latr"``, ``episode_latr``): part of
      a group's episodes branch at uncertain tokens; None: no branches.
  """

  def __init__(self, model_config: ModelConfig, config: SamplerConfig,
               turns: TurnConfig, runner: EnvRunner, tokenizer: Any,
               buckets: Sequence[int], *,
               mesh: jax.sharding.Mesh | None = None,
               param_shardings: Any = None, observation_role: str = "user",
               slots: int | None = None, refill_rows: int = 1,
               group: distributed.ProcessGroup | None = None,
               drafts: DraftStore | None = None, log_lenience: float = 0.0,
               carry: episode_carry.EpisodeCarry | None = None,
               paged: PagedConfig | None = None, tree: Any = None,
               latr: Any = None):
    for name, value in (("rl.rollout_slots", slots),
                        ("rl.rollout_refill_rows", refill_rows)):
      if value is not None and (isinstance(value, bool)
                                or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r}: a positive integer is "
                         "required.")
    self.slots, self.refill_rows = slots, refill_rows
    if carry is not None and slots is None:
      raise ValueError("partial rollouts of episodes play on slots: pass "
                       "slots with carry.")
    self.carry = carry
    if tree is not None:
      episode_tree.check(tree, config.num_samples, turns.max_turns,
                         plain=slots is None)
    if latr is not None:
      episode_latr.check(latr, config.num_samples, plain=slots is None)
    self.tree, self.latr = tree, latr
    self.group = group or distributed.ProcessGroup()
    if not self.group.single and mesh is None:
      raise ValueError("MultiTurnSampler with several processes needs the "
                       "mesh.")
    self.model_config, self.config, self.turns = model_config, config, turns
    self.runner, self.tokenizer = runner, tokenizer
    self.buckets = tuple(buckets)
    self.mesh = mesh
    self.format = ObservationFormat(tokenizer, role=observation_role,
                                    eos_ids=config.eos_ids)
    kw = dict(mc=model_config, sc=config)
    if not log_lenience >= 0:
      raise ValueError(f"sampler.spec_log_lenience={log_lenience!r}: a "
                       "number >= 0 is required.")
    self.drafts = drafts
    # A draft is at most a turn; its forward writes that many cache slots
    # past each row's index, so the cache has room for the wider of it and
    # an observation.
    t = config.max_new_tokens
    self._draft_width = min(turns.max_turn_tokens or t, t)
    extra = turns.max_observation_tokens if drafts is None else max(
        turns.max_observation_tokens, self._draft_width)
    self.paged = paged
    # The state comes back whole on each device from every program, so each
    # compiles once (a layout of the compiler's choosing varied by program).
    jit = functools.partial(jax.jit, out_shardings=None if mesh is None else
                            jax.sharding.NamedSharding(mesh, P()))
    self._start = jit(functools.partial(
        turns_lib.start, obs_width=extra, paged=paged, **kw))
    self._refill = jit(functools.partial(
        turns_lib.refill, obs_width=extra, paged=paged, **kw))
    self._verify = jit(functools.partial(
        turns_lib.verify, turns=turns, log_lenience=float(log_lenience), **kw),
                       static_argnames=("prompt_width",))
    self._decode = jit(functools.partial(turns_lib.decode_turn, turns=turns,
                                         latr=latr, **kw),
                       static_argnames=("prompt_width",))
    self._insert = jit(functools.partial(turns_lib.insert, **kw),
                       static_argnames=("prompt_width",))
    self._fork = jit(turns_lib.fork)
    self._restore = jit(functools.partial(turns_lib.restore, **kw),
                        static_argnames=("prompt_width",))
    self._decode_rows = jit(
        functools.partial(turns_lib.decode_rows, turns=turns, **kw),
        static_argnames=("prompt_width",))
    if slots is not None and config.shrink_batch_to is not None:
      raise ValueError(
          f"sampler.shrink_batch_to={config.shrink_batch_to!r} with "
          f"rl.rollout_slots={slots!r}: slots refill as episodes end, so "
          "there is no batch to shrink; accepted: one or the other.")

  def _mesh(self):
    return (jax.set_mesh(self.mesh) if self.mesh is not None
            else contextlib.nullcontext())

  def run(self, params: Any, examples: Mapping[str, Sequence[Any]],
          key: jax.Array, *, version: int = 0, more: Any = None,
          on_dispatch: Any = None) -> Episodes:
    """Runs ``G`` episodes of each of the ``B`` examples.

    Rounds: a decode (until every live row has ended its turn, or until
    ``TurnConfig.step_rows`` rows wait) is dispatched to the devices; while
    it runs, the host starts the environment steps of the rows that ended a
    turn in the previous round (``EnvRunner.submit_steps``: in the workers,
    without waiting) and takes back those that have ended
    (``poll_steps``), whose observations are inserted after the decode.
    The host waits only when no row decodes, and then for every step in
    flight. So an environment's latency overlaps the other rows' decoding
    and the other steps, and with ``step_rows`` a row waiting on its
    environment does not wait for the batch's slowest turn. The draws do not depend on the rounds (each
    token's key is its row's and column's), nor on when a step ends, so
    every ``step_rows`` and every timing gives the same episodes; with
    workers the number of rounds (``rollout/decode_steps``) depends on
    when the steps end.

    Args:
      params: the policy params.
      examples: ``{field: list of B values}`` (every field reaches
        ``Environment.reset`` as the example dict).
      key: PRNG key of the draws.
      version: the policy version of ``params`` (partial rollouts: each
        token's version, ``Episodes.token_versions``).
      more: ``fn() -> examples``, another batch of this process's examples
        (partial rollouts over-provision: ``B + max_carried`` groups).
      on_dispatch: called once the first turns' decode is dispatched
        (asynchronous sampling dispatches the update there: on the same
        devices it runs after that decode, while the host waits for the
        first environment steps, not before every turn).
    """
    g, carry = self.config.num_samples, self.carry
    old = carry.groups if carry is not None else []
    n0 = len(old) * g  # carried episodes' rows come first
    names = list(examples)
    b_local = len(examples[names[0]])
    block, blocks = self.group.block(self.mesh)
    target = b_local * blocks if carry is not None else None
    sizes = [b_local]  # this process's examples of each batch
    while (more is not None and target is not None
           and len(old) + sum(sizes) * blocks < target + carry.max_carried):
      extra = more()
      examples = {k: list(examples[k]) + list(extra[k]) for k in names}
      sizes.append(len(extra[names[0]]))
    b_local = len(examples[names[0]])
    rows = [{k: examples[k][i] for k in names} for i in range(b_local)]
    # Every process's examples, batch by batch and within a batch block by
    # block (one process: these): (process block, its example index).
    placed = [(q, sum(sizes[:k]) + i) for k, size in enumerate(sizes)
              for q in range(blocks) for i in range(size)]
    b = len(placed)
    n = n0 + b * g
    # The episode rows this process plays (its environments and states).
    group_of = {i: u for u, (q, i) in enumerate(placed) if q == block}
    self._own = {n0 + u * g + j for u in group_of.values()
                 for j in range(g)} | {i * g + j for i, gr in enumerate(old)
                                       if gr.owner == block for j in range(g)}
    ep = EpisodeLog(n)
    resets = ep.timed(lambda: self.runner.reset(rows))
    states = [None] * n
    for i, outcome in enumerate(resets):
      if outcome.status == "ok":
        for j in range(g):
          states[n0 + group_of[i] * g + j] = state_copy(
              outcome.value["state"])
    # Every example's prompt (a failed reset's: the example's own stands in,
    # and its rows end at once), gathered from the processes' blocks.
    # Partial rollouts carry examples: every process's, gathered with them.
    shared = [(o.status, o.value["prompt"] if o.status == "ok"
               else str(row.get("prompt", "")) or " ", o.message,
               row if carry is not None else None)
              for o, row in zip(resets, rows)]
    parts = self.group.gather_blocks(shared, self.mesh)
    shared = [parts[q][i] for q, i in placed]
    prompts = [gr.prompt for gr in old] + [x for _, x, _, _ in shared]
    for i, (status, _, message, _) in enumerate(shared):
      if status != "ok":
        for r in range(n0 + i * g, n0 + (i + 1) * g):
          ep.fail(r, EnvOutcome(status, None, message))
    keys_N = np.array(jax.random.key_data(row_keys(key, n)))
    held = episode_carry.unpack(old, ep, states, keys_N, self.config)
    encoded = tok_lib.encode_prompts(self.tokenizer, prompts)
    longest = max(self.buckets)
    for i, ids in enumerate(encoded):
      if len(ids) > longest or not ids:  # fails its episodes, not the run
        for r in range(i * g, (i + 1) * g):
          ep.fail(r, EnvOutcome(
              "error", None, f"reset's prompt has {len(ids)} tokens; "
              f"accepted 1 to {longest} (sampler.prompt_buckets)"))
        encoded[i] = [self.tokenizer.pad_id]
    tokens_BxP, mask_BxP = pad_prompts(encoded, self.buckets,
                                       self.tokenizer.pad_id)
    p = tokens_BxP.shape[1]
    spec = (Speculation(self, encoded, g, ep) if self.drafts is not None
            else None)
    tokens_NxP = np.repeat(tokens_BxP, g, 0)
    mask_NxP = np.repeat(mask_BxP, g, 0)
    m = min(self.slots or n, n)
    min_waiting = np.int32(self.turns.step_rows or m)
    # Carried episodes with a history take the first slots (turns.restore),
    # then the rows waiting for a slot, in order (episodes already over
    # take none).
    order = np.concatenate([np.flatnonzero(held.history),
                            np.flatnonzero(~held.history & ~held.over)])
    slot_row = np.full(m, -1)  # the episode row each slot plays (-1: free)
    slot_row[:min(m, len(order))] = order[:m]
    queue = [int(r) for r in order[m:]]
    out = (SlotOutputs(n, self.config) if m < n or carry is not None
           else None)
    if out is not None:
      held.fill(out)
    # The static batch decodes its live rows only, in the smallest of these
    # batch sizes that holds them (sampler.shrink_batch_to).
    levels = (shrink_levels(n, self.config.shrink_batch_to) if out is None
              else (m,))
    steps_before, row_steps = 0, 0
    with self._mesh():
      rows_M = np.maximum(slot_row, 0).astype(np.int32)
      distinct = distinct_prompts(rows_M, g, tokens_NxP, mask_NxP)
      state = self._start(params, *distinct, keys_N[rows_M], rows_M)
      if out is not None:
        out.prefilled_rows += len(distinct[0])
      if held.history.any():
        state = self._restore(params, state, *held.slots(slot_row),
                              prompt_width=p)
      # The slots live in the decode dispatched next.
      decoding = (slot_row >= 0) & ~ep.failed[rows_M]
      forest = self.tree and episode_tree.EpisodeTree(self.tree, g, n)
      if forest is not None:  # the rows that wait for a fork
        decoding &= ~forest.dormant()
      branching = self.latr and episode_latr.EpisodeLatr(self.latr, g, n)
      if branching is not None:  # its empty slots
        decoding &= ~branching.dormant()
        state = state._replace(latr=branching.rows())
      if not decoding.all():  # rows whose reset failed never decode
        state = state._replace(live=state.live & decoding,
                               done=state.done | ~decoding)
      if spec is not None:
        state = spec.verify(params, state, decoding, slot_row, p)
      taken = np.zeros(0, np.int64)  # slots whose turn waits for its env
      taken_turns = None
      calls: dict[int, StepCall] = {}  # environment calls in flight, by ticket
      stopped_early = False
      while (decoding.any() or len(taken) or queue
             or self.group.any(bool(calls))):
        if len(levels) == 1 or (branching and branching.growing):
          state, size = self._decode(params, state, _mask(m, taken),
                                     min_waiting, prompt_width=p), m
        else:
          state, size = self._decode_shrinking(
              params, state, _mask(m, taken), min_waiting, decoding, levels,
              p)
        if on_dispatch is not None:
          on_dispatch()
          on_dispatch = None
        resumed = np.zeros(m, bool)
        if len(taken):  # overlaps the decode just dispatched
          self._submit(taken, slot_row, taken_turns, states, calls, ep)
        # Steps that have ended go back in now. When nothing decodes
        # meanwhile the host waits for every step in flight, so the rows
        # resume together (one decode for them, not one per step).
        arrived = ep.timed(lambda: self._collect(calls,
                                                 wait=not decoding.any()))
        ended = self._exchange([(calls.pop(t), o)
                                for t, o in sorted(arrived.items())])
        if ended:
          inserts, resumed = self._apply(ended, states, ep, m)
          state = self._insert(params, state, *inserts, prompt_width=p)
          if spec is not None and forest is None:  # a tree's: after forks
            state = spec.verify(params, state, resumed, slot_row, p)
        host = self._host((state.column, state.turn_start,
                           state.ended_turn, state.done))
        column, start, ended, done = (np.asarray(x) for x in host)
        if branching is not None:
          decoding = branching.after_decode(self, state, decoding, ep, states)
        if len(levels) > 1:
          steps = int(self._host(state.steps))
          row_steps += size * (steps - steps_before)
          steps_before = steps
        stopped = decoding & (ended | done)  # their turn is over
        for s in np.flatnonzero(stopped):
          r = slot_row[s]
          ep.spans[r].append((int(start[s]), int(column[s]), "model"))
          ep.turns[r] += 1
        taken = np.flatnonzero(stopped & ended & ~done)
        taken_turns = (self._host(state.tokens), column, start)
        # (A resumed row whose observation found no block is over.)
        decoding = (decoding & ~stopped) | (resumed & ~done)
        if forest is not None:
          state, decoding, started = forest.step(
              self, state, decoding, resumed & ~done, done, ep, states)
          if spec is not None and started.any():
            state = spec.verify(params, state, started, slot_row, p)
        if out is not None:
          state, decoding = self._turnover(
              params, state, out, slot_row, queue, done & ~decoding,
              decoding, tokens_NxP, mask_NxP, keys_N, ep, spec, p, held)
        if target is not None and len(held.ended(g)) >= target:
          stopped_early = True
          break
      if on_dispatch is not None:  # nothing decoded (every reset failed)
        on_dispatch()
      if out is None:
        if self.group.single:
          tokens_NxP, mask_NxP = jnp.asarray(tokens_NxP), jnp.asarray(mask_NxP)
        if spec is not None:
          spec.store(self._host((state.tokens, state.mask,
                                 state.sampler_logp, state.observed)))
        if branching is not None:
          state = branching.fill(self, state, ep, states)
          ep.slot_metrics.update(branching.metrics(self, state))
        rollout = turns_lib.to_rollout(
            tokens_NxP, mask_NxP, state,
            ep.turn_rewards(self.config.max_new_tokens))
        if forest is not None:
          rollout = forest.annotate(rollout, self.group.single)
          ep.slot_metrics.update(forest.metrics(self._host(rollout.lengths)))
        rollout = self._split_by_blocks(rollout)
        if len(levels) > 1:
          ep.slot_metrics.update({
              "rollout/decode_steps": float(steps_before),
              "rollout/decode_rows": row_steps / max(steps_before, 1),
              # Model tokens decoded (tree episodes: less what forks copied).
              "rollout/decode_utilization": (ep.slot_metrics.get(
                  "rollout/generated_tokens") or self._model_tokens(state))
              / max(row_steps, 1)})
      else:
        if stopped_early:
          state = self._drain(params, state, taken, taken_turns, slot_row,
                              states, calls, ep, held, m, p)
        held.turn_start[slot_row[slot_row >= 0]] = np.asarray(self._host(
            state.turn_start))[slot_row >= 0]
        out.retire(state, slot_row >= 0, slot_row, self._host)
        trained = (np.arange(n // g) if carry is None
                   else held.finish(
                       carry, out, ep, states, prompts,
                       [(q, x[3]) for (q, _), x in zip(placed, shared)],
                       self._own, self.group, version, target))
        if spec is not None:
          spec.store((out.tokens, out.mask, out.sampler_logp, out.observed),
                     trained)
        trained_rows = (trained[:, None] * g + np.arange(g)).ravel()
        prompts = [prompts[i] for i in trained]
        rollout = self._split_by_blocks(out.rollout(
            tokens_NxP, mask_NxP, ep.turn_rewards(self.config.max_new_tokens),
            xp=jnp if self.group.single else np, rows=trained_rows))
        ep.slot_metrics = out.metrics(
            int(self._host(state.steps)), m,
            None if carry is None else held.generated)
        if carry is not None:
          ep.slot_metrics.update(carry.metrics(), **{
              "rollout/generated_tokens": float(held.generated)})
      if spec is not None:
        ep.slot_metrics.update(spec.metrics())
      if self.paged is not None:
        ep.slot_metrics.update(self._pool_metrics(state))
    episodes = ep.episodes(rollout, prompts,
                           sum(self.group.gather_json(self.runner.restarts)),
                           rows=None if carry is None else trained_rows)
    if carry is None:
      return episodes
    return episodes._replace(examples=held.trained_examples,
                             token_versions=held.trained_versions)

  def _drain(self, params, state, taken, taken_turns, slot_row, states,
             calls, ep, held, m, prompt_width):
    """Partial rollouts, once the step's groups have ended: the environment
    steps in flight and those of the turns just ended end, and their
    observations go in, so every unfinished episode stops where its model
    decodes next (``episode_carry``)."""
    if len(taken):
      self._submit(taken, slot_row, taken_turns, states, calls, ep)
    arrived = ep.timed(lambda: self._collect(calls, wait=True))
    ended = self._exchange([(calls.pop(t), o)
                            for t, o in sorted(arrived.items())])
    if ended:
      inserts, _ = self._apply(ended, states, ep, m)
      state = self._insert(params, state, *inserts, prompt_width=prompt_width)
    done = np.asarray(self._host(state.done))
    held.over[slot_row[(slot_row >= 0) & done]] = True
    return state

  def _turnover(self, params, state, out: "SlotOutputs", slot_row, queue,
                over, decoding, tokens_NxP, mask_NxP, keys_N, ep, spec,
                prompt_width, held):
    """Slots: the episodes that are over leave their slots (``out`` keeps
    them), and queued episodes take the free slots once
    ``refill_rows`` are free (or the queue's last ones). Updates
    ``slot_row`` and ``queue`` in place; returns the state and the slots
    that decode next."""
    over = over & (slot_row >= 0)
    if over.any():
      out.retire(state, over, slot_row, self._host)
      held.over[slot_row[over]] = True
      slot_row[over] = -1
    free = np.flatnonzero(slot_row < 0)
    if not queue or len(free) < min(self.refill_rows, len(queue),
                                    len(slot_row)):
      return state, decoding
    slots = free[:len(queue)]
    rows = np.asarray([queue.pop(0) for _ in slots])
    slot_row[slots] = rows
    refill = _mask(len(slot_row), slots)
    # Slots not refilled take a valid row's prompt and are discarded.
    rows_M = np.where(refill, slot_row, rows[0]).astype(np.int32)
    distinct = distinct_prompts(rows_M, self.config.num_samples,
                                 tokens_NxP, mask_NxP)
    state = self._refill(params, state, refill, *distinct, keys_N[rows_M],
                         rows_M)
    out.prefilled_rows += len(distinct[0])
    failed = refill & ep.failed[np.maximum(slot_row, 0)]
    if failed.any():  # their reset failed: over at once
      state = state._replace(live=state.live & ~failed,
                             done=state.done | failed)
    if spec is not None:
      state = spec.verify(params, state, refill & ~failed, slot_row,
                          prompt_width)
    out.prefills += len(slots)
    return state, decoding | (refill & ~failed)


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
  out = np.zeros(n, bool)
  out[rows] = True
  return out


__all__ = ["Episodes", "MultiTurnSampler", "ObservationFormat", "TurnConfig"]
