"""One rollout batch: prompts -> Rollout -> rewards ``[N, R]`` -> advantages -> RLBatch.

``Collector.collect`` is the sampling half of an RL step
(docs/architecture.md). The rollout stays on the devices; only the completion tokens cross to the
host (to be decoded and scored), and only the rewards ``[N, R]`` cross back.
The advantage chain, MC-GRPO's pivot drop (or ReMax's greedy-row drop) and
the trainer's ``[N, P + T]`` layout run in one jitted function whose outputs
are sharded as ``rl_step`` takes them: the trainer's, handed in as
``postprocess`` (``rljax/train/batch_layout.py``), so that this package
imports nothing of ``rljax.train``.
Several sampled batches (prompt selection's rounds, replayed groups) are
merged before it (``rounds.merge``).

Rewards. Each reward function is a column of ``rewards_NxR`` (NaN where it
gave no reward); the ``RewardSpec`` weights reach the advantage chain as
``reward_weights_R`` and are applied there, once. A row whose every reward
failed is outside ``mask_N``: no group statistic sees it and its advantage
is 0 (TRL's semantics; ``Algorithm.failed_rewards="zero"`` scores it 0 and
keeps it in); ``reward/all_failed`` counts such rows. The chain also
receives ``advantage_extra_args``: completion lengths and sequence
log-ratios, and the completions (KTAE's advantages are per completion
token). ``RLBatch.advantages_NxL`` is ``[N, P + T]``, 0 on the prompt; with a
critic (``Algorithm.critic``) the chain gives each row's reward, passed as
``RLBatch.rewards_N`` for the step's GAE.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from rljax import data as data_lib
from rljax.data import selection as selection_lib
from rljax import distributed
from rljax import rewards as rewards_lib
from rljax import sampling
from rljax import sharding as sharding_lib
from rljax import tokenizers as tok_lib
from rljax.sampling import tree as tree_lib
from rljax.rollout import allocated, feeding, process_blocks, speculated
from rljax.rollout import rounds as rounds_lib
from rljax.rollout.rounds import Sampled, distinct_completions, scored_rows

log = logging.getLogger("rljax")


class Collected(NamedTuple):
  """What ``Collector.collect`` returns.

  Attributes:
    batch: the ``RLBatch`` for ``rl_step`` (on the devices; ``N = B * G``).
    adv_state: the advantage chain's new state.
    metrics: host floats: the reward evaluator's metrics,
      ``reward/all_failed``, ``accuracy``, completion lengths, ``adv/*``
      and ``time/{sample,reward,advantage}`` (seconds; the advantage time
      includes the wait for the device).
    completions: the decoded completions (``B * (G + extra)``) of this
      process's rows.
    rewards_NxR: the rewards as scored (NaN: no reward), every row's.
    token_versions: ``[N, T]`` int32, the policy version that drew each
      completion token (-1 where masked); None: every token is of the
      ``version`` passed to ``collect``.
    rows: per-row figures of every row, for histograms (``rows/reward``,
      ``rows/completion_length``, ``rows/advantage`` and, where the rollout
      carries the policy's logprobs, ``rows/log_ratio``: log pi_old(y) /
      mu(y)); NaN: a row out of the loss.
  """

  batch: Any
  adv_state: Any
  metrics: dict[str, float]
  completions: list[str]
  rewards_NxR: np.ndarray
  token_versions: np.ndarray | None = None
  rows: dict[str, np.ndarray] | None = None


class Postprocess(Protocol):
  """What the trainer hands the collector (``rljax.train.Postprocessor``):
  its sampling needs and the jitted function that turns a scored rollout
  into its batch. This package imports nothing of ``rljax.train``.

  Attributes:
    extra_samples: rows sampled per prompt beyond the trained ``G`` (a
      pivot or a greedy row the batch drops).
    failed_rewards: ``"mask"`` or ``"zero"``: how a row whose every reward
      failed is scored (``rounds.scored_rows``).
  """

  extra_samples: int
  failed_rewards: str

  def __call__(self, *, group_size: int, mesh: jax.sharding.Mesh | None,
               has_old_logprobs: bool, groups: tuple[int, int] | None,
               env_column: int | None, episodes: bool) -> Callable:
    """``fn(rollout, rewards_NxR, valid_N, weights_R, adv_state, trained_N,
    group_ids_N) -> (batch, adv_state, metrics)``; ``metrics`` has
    ``nonfinite_rows``. ``groups``: ``(prompts, max_group)`` for groups of
    unequal size, else None; ``env_column``: the ``"env"`` reward's column."""
    ...


class Collector(process_blocks.ProcessBlocks, feeding.SelectionAndReplay,
                speculated.Speculated):
  """Samples, scores and turns one batch of prompts into an ``RLBatch``.

  Args:
    sampler: ``fn(params, tokens_BxP, mask_BxP, key) -> Rollout`` drawing
      ``group_size + postprocess.extra_samples`` samples per prompt
      (``sampling.make_sampler``).
    tokenizer: encodes prompts (through a chat template if it has one) and
      decodes completions.
    evaluator: the reward functions.
    postprocess: the trainer's sampling needs and batch
      (``Postprocess``; ``rljax.train.Postprocessor(algorithm)``).
    group_size: rows per prompt that are trained (``rl.group_size``, G).
    buckets: prompt length buckets.
    eos_ids: ids that end a completion (removed before decoding).
    correctness: the reward whose value >= 1 counts as correct (``accuracy``).
    mesh: the device mesh (outputs are sharded as ``rl_step`` takes them).
    speculation: SPEC-RL drafts (``sampling.Speculation``): a batch whose
      prompts have an earlier rollout in the store is sampled speculatively
      (``spec/*`` metrics); every rollout is stored as the next draft.
    group: the run's processes (``distributed.ProcessGroup``). With several,
      ``collect`` takes this process's block of the batch's examples, builds
      the global prompt arrays, decodes and scores its own rows, and gathers
      the rewards (and the per-row figures of the metrics) in row order, so
      the advantage chain and every metric see the whole batch. The draft
      store is the same on every process (each rollout is gathered into it),
      so a prompt finds its draft whichever process samples it next.
    slots: continuous batching or partial rollouts (``partial.SlotRollouts``)
      instead of ``sampler``: the step's groups are decoded on a fixed
      number of refilled slots, and with partial rollouts unfinished groups
      are carried to the next step (one process only).
    sample_mesh: the mesh ``sampler`` runs on, when it is not ``mesh``
      (``rl.sampler_devices``): the rollout is moved to ``mesh`` before the
      advantage chain.
    episodes: a multi-turn environment (``rollout.MultiTurnSampler``) instead
      of ``sampler``: each example is an episode (``Environment.reset`` gives
      its prompt), the rows are its ``G`` trajectories, the reward functions
      score their transcripts (model turns and observations, decoded) and
      the reward ``"env"`` reads each episode's environment reward (the
      batch field ``env_reward``). Observation tokens are not trained.
    selection: prompt selection (``rljax.data.selection``): GRESO skips
      prompts before sampling, and dynamic sampling refills the batch's
      zero-variance groups from ``more_examples`` (``select/*`` metrics;
      the sampled rounds use ``key`` folded with the round).
    replay: a buffer of recent informative groups
      (``selection.ReplayBuffer``): a step that finds enough young groups
      samples ``B - R`` fresh prompts (the first of the batch drawn) and
      trains the ``R`` replayed groups with them, each row with the policy
      version that drew it (``replay/*`` metrics, ``token_versions``).
    allocation: rollout allocation (``rljax.data.allocation.Schedule``):
      the ``B * G`` rows are sampled in rounds, more of them for the
      prompts whose rewards vary most (``rollout/allocated.py``); groups
      of unequal size reach the advantage chain with their group ids, so
      the algorithm's advantage must be ``advantages.by_group_ids``-wrapped
      (``build`` does it). Needs ``allocation_sampler``: the training
      rows' plan drawing ``allocation.sampler_samples`` per prompt entry
      (a sampler, or with ``slots`` a ``SlotRollouts`` of continuous
      batching, or with ``episodes`` a ``MultiTurnSampler``), for at least
      ``allocation.round_entries`` entries a round.
    allocation_fresh: with ``allocation`` and ``replay``, the rounds of a
      step that replays ``R`` groups: its ``B - R`` fresh prompts get
      ``(B - R) * G`` rows (``build.fresh_allocation``); the replayed
      groups, of ``G`` rows, follow them as groups of their own.
    allocation_speculation: with ``speculation`` and a static
      ``allocation_sampler``, SPEC-RL's speculative twin of it (the same
      draft store): each prompt entry's rows draft from the prompt's last
      entry (``allocation.sampler_samples`` rows).
  """

  def __init__(self, *, sampler, tokenizer, evaluator: rewards_lib.RewardEvaluator,
               postprocess: Postprocess, group_size: int,
               buckets: Sequence[int],
               eos_ids: Sequence[int], correctness: str,
               mesh: jax.sharding.Mesh | None = None,
               speculation: sampling.Speculation | None = None,
               group: distributed.ProcessGroup | None = None,
               slots: Any = None,
               sample_mesh: jax.sharding.Mesh | None = None,
               episodes: Any = None,
               selection: selection_lib.Selection | None = None,
               replay: selection_lib.ReplayBuffer | None = None,
               allocation: Any = None, allocation_sampler: Any = None,
               allocation_fresh: Any = None,
               allocation_speculation: sampling.Speculation | None = None):
    self.sampler, self.tokenizer, self.evaluator = sampler, tokenizer, evaluator
    # Which features combine is train/combinations.py's (build.validate
    # checks a config against it); these are the arguments' own contracts.
    self.episodes = episodes
    if episodes is not None and slots is not None:
      raise ValueError("episodes and slots are two rollout plans: pass one "
                       "(episodes play on slots of their own: "
                       "MultiTurnSampler(slots=...)).")
    self.group = group or distributed.ProcessGroup()
    self.slots = slots
    self.sample_mesh = sample_mesh if sample_mesh is not mesh else None
    if slots is not None and speculation is not None and (
        slots.drafts is not speculation.store):
      raise ValueError("with slots, SPEC-RL's draft store must be the slots' "
                       "(partial.SlotRollouts(drafts=speculation.store)).")
    if not self.group.single and mesh is None:
      raise ValueError("Collector with several processes needs the mesh.")
    self.selection, self.replay = selection, replay
    if allocation is not None and allocation_sampler is None:
      raise ValueError("rollout allocation (rl.allocation) samples its "
                       "rounds with allocation_sampler: pass it.")
    self.allocation, self.allocation_sampler = allocation, allocation_sampler
    if allocation_fresh is not None and (allocation is None or replay is None):
      raise ValueError("allocation_fresh is the rounds of a step that "
                       "replays groups: pass allocation and replay too.")
    self.allocation_fresh = allocation_fresh
    if allocation_speculation is not None and (
        speculation is None
        or allocation_speculation.store is not speculation.store):
      raise ValueError("allocation_speculation drafts from speculation's "
                       "store: pass both, with one store.")
    self.allocation_speculation = allocation_speculation
    self.postprocess, self.group_size = postprocess, group_size
    self.failed_rewards = postprocess.failed_rewards
    self.samples_per_prompt = group_size + postprocess.extra_samples
    self.buckets, self.eos_ids = tuple(buckets), tuple(eos_ids)
    names = list(evaluator.names)
    if correctness not in names:
      raise ValueError(f"eval.reward={correctness!r} is not one of the reward "
                       f"names {tuple(names)}.")
    self.correct_column = names.index(correctness)
    self._env_column = names.index("env") if "env" in names else None
    self._weights_R = np.asarray(evaluator.weights, np.float32)
    self.mesh = mesh
    self.speculation = speculation
    self._jitted = {}

  def _postprocess_fn(self, has_old_logprobs: bool):
    """The trainer's jitted postprocessing (``Postprocess``), one per
    kind of rollout."""
    if has_old_logprobs not in self._jitted:
      self._jitted[has_old_logprobs] = self.postprocess(
          group_size=self.group_size, mesh=self.mesh,
          has_old_logprobs=has_old_logprobs,
          groups=None if self.allocation is None else (
              self.allocation.prompts[0], max(
                  s.max_group for s in (self.allocation,
                                        self.allocation_fresh)
                  if s is not None)),
          env_column=self._env_column, episodes=self.episodes is not None)
    return self._jitted[has_old_logprobs]

  @property
  def _episode_carry(self):
    """Partial rollouts' carried episodes (``episode_carry.EpisodeCarry``),
    or None."""
    return None if self.episodes is None else self.episodes.carry

  def carried_arrays(self) -> dict[str, Any] | None:
    """What the slots carry to the next step (partial rollouts' groups, or
    with an environment their episodes), as host arrays: a checkpoint's
    ``partial`` item; None without slots."""
    if self.slots is not None:
      return self.slots.arrays()
    carry = self._episode_carry
    return None if carry is None else carry.arrays()

  def load_carried(self, arrays: Mapping[str, Any]) -> str | None:
    """Restores ``carried_arrays``' record; returns what was dropped (the
    run no longer carries that kind), or None."""
    carry = self._episode_carry
    if carry is not None and "episodes_dropped" in arrays:
      sc = self.episodes.config
      carry.load_arrays(arrays, group_size=sc.num_samples,
                        max_new_tokens=sc.max_new_tokens,
                        policy_logp=sc.record_policy_logprobs,
                        blocks=self.group.block(self.mesh)[1])
    elif self.slots is not None and "dropped" in arrays:
      self.slots.load_arrays(arrays)
    elif "prompts" in arrays or "episodes" in arrays:
      return (f"{len(arrays['born'])} partial groups" if "prompts" in arrays
              else "partial episodes")
    return None

  def _encoded(self, examples):
    return tok_lib.encode_prompts(self.tokenizer, examples["prompt"]), examples

  def collect(self, params: Any, examples: Mapping[str, Sequence[Any]],
              key: jax.Array, adv_state: Any, *, version: int = 0,
              on_dispatch: Any = None, more_examples: Any = None
              ) -> Collected:
    """Samples ``examples["prompt"]``, scores them and builds the batch.

    Args:
      params: the policy params (sharded as the sampler takes them).
      examples: a batch of ``B`` examples, ``{field: list of B values}``
        (``prompt`` and whatever the reward functions read).
      key: PRNG key of the sampler.
      adv_state: the advantage chain's state.
      version: the policy version of ``params`` (updates that made them);
        partial rollouts record it per token.
      on_dispatch: called once the sampling is dispatched to the devices,
        before the host waits for it (an asynchronous schedule dispatches
        the update there, so that the host's decoding and scoring overlap
        it).
      more_examples: ``fn() -> examples``, another batch (partial rollouts
        draw more prompts than they train, APRIL's over-provisioning; prompt
        selection refills with it).
    """
    dots_metrics, dots_tokens = {}, None
    feeding = (self.selection is not None or self.replay is not None
               or self.allocation is not None)
    # Prompt feeders decide on the global batch, the same on every process
    # (with one process it is this batch): each samples its block. The
    # batches drawn after it (refills, partial rollouts' over-provisioning)
    # are global too.
    if self.selection is not None and self.selection.dots is not None:
      examples, dots_metrics, dots_tokens = allocated.dots_examples(
          self, params, key, version)  # the global batch
    elif feeding:
      examples = self.gathered(examples)
    if feeding and more_examples is not None and not self.group.single:
      more_local = more_examples
      more_examples = lambda: self.gathered(more_local())  # noqa: E731
    replayed = None if self.replay is None else self.replay.take(version)
    if replayed is not None:  # the batch's first B - R prompts are sampled
      fresh = len(examples["prompt"]) - len(replayed[0])
      examples = {f: list(v)[:fresh] for f, v in examples.items()}
    trained_B, metrics, group_ids_N, trained_N = None, {}, None, None
    if self.allocation is not None:
      sampled, group_ids_N, metrics, trained_N = allocated.sample(
          self, params, examples, key, version, on_dispatch, more_examples)
    elif self.selection is not None and self.selection.dots is None:
      sampled, trained_B, metrics = self._sample_selected(
          params, examples, key, version, on_dispatch, more_examples)
    elif feeding and not self.group.single:
      sampled = self.sample_global(params, examples, key, version,
                                   on_dispatch, more_examples)
    else:
      sampled = self.sample_round(params, examples, key, version, on_dispatch,
                                  more_examples)
    if dots_tokens is not None:  # the reference rollouts' tokens count
      metrics.update(dots_metrics)
      metrics["num_generated_tokens"] = dots_tokens + float(
          np.sum(sampled.lengths))
    if self.replay is not None:
      # Generated this step: the fresh rows' tokens (every round's).
      metrics.setdefault("num_generated_tokens",
                         float(np.sum(sampled.lengths)))
      self._store(sampled, trained_B, version, group_ids_N)
      sampled, trained_B, replay_metrics = self._with_replay(
          sampled, trained_B, replayed, version)
      metrics.update(replay_metrics)
      if group_ids_N is not None and replayed is not None:
        # Replayed group j follows the fresh ones: group B - R + j.
        fresh = len(examples["prompt"])
        group_ids_N = np.concatenate([group_ids_N, np.repeat(
            np.arange(fresh, fresh + len(replayed[0]), dtype=np.int32),
            self.samples_per_prompt)])
        if trained_N is not None:  # the replayed rows train
          trained_N = np.concatenate([trained_N, np.ones(
              len(replayed[0]) * self.samples_per_prompt, bool)])
    if trained_N is None and trained_B is not None:
      trained_N = np.repeat(trained_B, self.samples_per_prompt)
    return self._finish(sampled, adv_state, trained_N=trained_N,
                        extra_metrics=metrics, group_ids_N=group_ids_N)

  def sample_round(self, params, examples, key, version, on_dispatch,
                   more_examples, *, sampler=None, samples: int | None = None,
                   longest: int | None = None, whole: bool = False,
                   real: int | None = None) -> Sampled:
    """Samples, decodes and scores one batch of prompts.

    ``examples``: this process's block of the batch, or with ``whole``
    (slots only) every process's, the same on each.

    ``sampler``: the plan of the training rows (``episodes``, ``slots`` or
    the static sampler) drawing ``samples`` per prompt instead of the
    training rows' ``samples_per_prompt`` (rollout allocation's rounds);
    ``longest``: pad the prompts as if one had this many tokens (the static
    batch; others pad to buckets); ``real``: ``Speculated._sample``'s."""
    g, group, mesh = samples or self.samples_per_prompt, self.group, self.mesh
    t_start = time.time()
    prompts = tok_lib.encode_prompts(self.tokenizer, examples["prompt"])
    token_versions = None
    env_reward = None
    scored_examples = examples
    if self.episodes is not None:
      if on_dispatch is not None and self.sample_mesh is None:
        # The update runs while the episodes play out: on a split mesh the
        # sampler's params are a copy on its own devices; on one mesh the
        # update donates the params, so the episodes decode with a copy
        # (one more set of params while they play). The update is
        # dispatched once the first turns' decode is: on the same devices
        # it runs while the host waits for the first environment steps.
        params = jax.tree.map(jnp.copy, params)
      episodes = (sampler or self.episodes).run(
          params, examples, key, version=version, more=more_examples,
          on_dispatch=on_dispatch)
      on_dispatch = None
      rollout, spec_metrics = episodes.rollout, episodes.metrics
      if episodes.examples is not None:  # partial: the trained groups'
        examples = self.block({k: [x[k] for x in episodes.examples]
                               for k in examples})
        token_versions = episodes.token_versions
      # The rewards read the episodes' prompts (Environment.reset's); the
      # batch keeps the data's examples, which selection and replay key by.
      # Several processes: every episode's figures, of which this process
      # scores its block.
      prompts_B, env_reward_N = episodes.prompts, episodes.env_reward
      if not group.single:
        prompts_B = prompts_B[group.rows(mesh, len(prompts_B))]
        env_reward_N = env_reward_N[group.rows(mesh, len(env_reward_N))]
      scored_examples = dict(examples, prompt=prompts_B)
      env_reward = [None if np.isnan(r) else float(r) for r in env_reward_N]
      mask = group.local_rows(rollout.prompt_mask)[::g]
      rollout = self._to_trainer(rollout)
    elif self.slots is not None:
      more = None if more_examples is None else (
          lambda: self._encoded(more_examples()))
      if not group.single and not whole:  # slots play every process's groups
        prompts, examples = self._gathered_prompts(prompts), self.gathered(
            examples)
        if more is not None:
          more_local = more

          def more():
            ps, ex = more_local()
            return self._gathered_prompts(ps), self.gathered(ex)
      rollout, examples, token_versions, spec_metrics = (
          sampler or self.slots).sample(
          params, prompts, examples, key, version, self.buckets,
          on_dispatch=on_dispatch, more=more)
      if not group.single:  # the trained groups, split by process blocks
        rollout = jax.tree.map(lambda x: sharding_lib.put_global(
            x, sharding_lib.batch_sharding(mesh, x.ndim)), rollout)
        examples = self.block(examples)
      # The trained groups' own examples (partial rollouts train carried
      # groups of earlier steps): the rewards read them.
      scored_examples = examples
      mask = group.local_rows(rollout.prompt_mask)[::g]
    else:
      tokens, mask = sampling.pad_prompts(
          prompts, self.buckets, self.tokenizer.pad_id,
          longest=longest or group.max_int(max(len(p) for p in prompts)))
      where = self.sample_mesh or mesh  # the sampler's devices
      rollout, spec_metrics = self._sample(
          params, prompts, group.global_array(tokens, where),
          group.global_array(mask, where), key, sampler, where, g, real)
      rollout = self._to_trainer(rollout)
      if on_dispatch is not None:
        on_dispatch()
    completion_tokens, completion_mask, lengths, finished = (
        distributed.local_rows_many(
            group, rollout.completion_tokens, rollout.completion_mask,
            rollout.lengths, rollout.finished))
    t_sample = time.time()
    completions = tok_lib.decode_completions(
        self.tokenizer, completion_tokens, completion_mask, self.eos_ids)
    # Distinct completions in each group of every process's rows: what a
    # batch's sampled tokens bought, a tree's shared segments or not.
    every = completions if group.single else [
        c for block in group.gather_blocks(completions, mesh) for c in block]
    spec_metrics = dict(spec_metrics, **{
        "rollout/distinct_completions": distinct_completions(every, g)})
    fields = data_lib.repeat_each(scored_examples, g)
    if env_reward is not None:
      fields["env_reward"] = env_reward
    result = self.evaluator.evaluate(  # a reward model reads the tokens
        fields["prompt"], completions, fields,
        tokens=rollout)
    # The chain's inputs: this process's rows, as blocks of global arrays.
    rewards_NxR = group.global_array(result.rewards_NxR, mesh)
    valid_N = group.global_array(
        scored_rows(result.valid_NxR, self.failed_rewards), mesh)
    # Each row's prompt (counted once per prompt below) and completion tokens.
    prompt_tokens_N = np.repeat(np.asarray(mask).sum(1), g)
    completion_tokens_N = completion_mask.sum(1)
    if not group.single:  # the metrics' inputs: every row's, in row order
      (rewards_all, valid_all, total_all, lengths, finished, prompt_tokens_N,
       completion_tokens_N) = distributed.gather_rows_many(
           group, mesh, result.rewards_NxR, result.valid_NxR, result.total_N,
           lengths, finished, prompt_tokens_N, completion_tokens_N)
      result = rewards_lib.merge_results(
          result.names, rewards_all, valid_all, total_all,
          group.gather_json(result.metrics))
    if rollout.tree_nodes is not None and self.episodes is None:  # trees
      nodes = group.gather_rows(group.local_rows(rollout.tree_nodes), mesh)
      spec_metrics = dict(spec_metrics, **self._tree_metrics(
          sampler, nodes, lengths, g))
    t_reward = time.time()
    return Sampled(rollout, examples, completions, result, rewards_NxR,
                    valid_N, lengths, finished, prompt_tokens_N,
                    completion_tokens_N, token_versions, spec_metrics,
                    t_sample - t_start, t_reward - t_sample)

  def _finish(self, sampled: Sampled, adv_state: Any, *,
              trained_N: np.ndarray | None = None,
              extra_metrics: Mapping[str, float] | None = None,
              group_ids_N: np.ndarray | None = None) -> Collected:
    """The advantage chain, the trainer's batch and the step's metrics.

    ``trained_N``: False for a row that stays in the batch with its loss
    mask cleared (prompt selection's zero-variance fillers).
    ``group_ids_N``: each row's group, for groups of unequal size (rollout
    allocation); None: groups of ``samples_per_prompt`` consecutive rows.
    """
    g = self.samples_per_prompt
    result, lengths = sampled.result, sampled.lengths
    t_reward = time.time()
    fn = self._postprocess_fn(sampled.rollout.policy_logprobs is not None)
    rows = self._device_rows
    with (jax.set_mesh(self.mesh) if self.mesh is not None
          else contextlib.nullcontext()):
      batch, adv_state, adv_metrics = fn(
          sampled.rollout, rows(sampled.rewards_NxR), rows(sampled.valid_N),
          self._weights_R, adv_state, rows(trained_N), rows(group_ids_N))
      adv_metrics = jax.device_get(adv_metrics)
    t_advantage = time.time()
    rows_out = {k: np.asarray(adv_metrics.pop(k)) for k in list(adv_metrics)
                if k.startswith("rows/")}
    rows_out["rows/reward"] = np.asarray(result.total_N, np.float64)
    rows_out["rows/completion_length"] = np.asarray(lengths, np.float64)
    if adv_metrics["nonfinite_rows"]:
      log.warning(
          "the advantage chain (Algorithm.advantage of %r) returned non-"
          "finite advantages for %d of %d rows: they are out of this step's "
          "loss (adv/nonfinite_rows).",
          getattr(self.postprocess, "name", "the trainer"),
          int(adv_metrics["nonfinite_rows"]), len(result.rewards_NxR))
    correct = np.nan_to_num(result.rewards_NxR[:, self.correct_column],
                            nan=0.0) >= 1.0
    prompt_tokens_N = sampled.prompt_tokens_N
    completion_tokens_N = sampled.completion_tokens_N
    if trained_N is not None:  # masked fillers train no token
      prompt_tokens_N = prompt_tokens_N * trained_N
      completion_tokens_N = completion_tokens_N * trained_N
    metrics = dict(result.metrics)
    metrics.update({f"adv/{k}": float(v)
                    for k, v in adv_metrics.items()})
    metrics.update({
        "reward/all_failed": float(np.sum(~result.valid_NxR.any(axis=1))),
        "reward/failure_fraction": float(1.0 - result.valid_NxR.mean()),
        "accuracy": float(correct.mean()),
        "completion_length/mean": float(lengths.mean()),
        "completion_length/max": float(lengths.max()),
        "truncation_rate": float(1.0 - sampled.finished.mean()),
        "num_generated_tokens": float(lengths.sum()),
        # Tokens of the trained rows (with a pivot drop, pro rata).
        "num_train_tokens": float(np.sum(prompt_tokens_N) + np.sum(
            completion_tokens_N)) * self.group_size / g,
        "time/sample": sampled.seconds_sample,
        "time/reward": sampled.seconds_reward,
        "time/advantage": t_advantage - t_reward, **sampled.spec_metrics,
        **(extra_metrics or {}),
    })
    if self.sample_mesh is not None:  # rl.sampler_devices
      metrics["rollout/sampler_devices"] = float(self.sample_mesh.devices.size)
    if "rollout/generated_tokens" in sampled.spec_metrics:  # not carried
      metrics["num_generated_tokens"] = sampled.spec_metrics[
          "rollout/generated_tokens"]
    completions = sampled.completions
    if not self.group.single and len(completions) == len(lengths):
      # Merged rounds hold every process's completions: this one's rows.
      completions = completions[self.group.rows(self.mesh, len(completions))]
    return Collected(batch, adv_state, metrics, completions,
                     result.rewards_NxR, sampled.token_versions, rows_out)

  def _tree_metrics(self, sampler, nodes_NxD, lengths_N, g: int
                    ) -> dict[str, float]:
    """A tree rollout's counts (``sampling.tree.tree_counts``) of every
    process's rows."""
    tree = (sampler or self.sampler).tree
    return tree_lib.tree_metrics([tree_lib.tree_counts(
        nodes_NxD, lengths_N, g, tree.segment_tokens)])

  def _scored(self, sampled: Sampled) -> np.ndarray:
    """Every row's ``valid_N`` on the host (``scored_rows`` of the gathered
    rewards; ``sampled.valid_N`` holds this process's block)."""
    return scored_rows(sampled.result.valid_NxR, self.failed_rewards)

  def merge_rounds(self, rounds: Sequence[Sampled], plan: selection_lib.Plan,
             group_rows: int | None = None,
             trees_apart: bool = False) -> Sampled:
    """``rounds.merge`` with this collector's group rows and pad id."""
    return rounds_lib.merge(rounds, plan,
                            group_rows=group_rows or self.samples_per_prompt,
                            pad_id=self.tokenizer.pad_id,
                            failed_rewards=self.failed_rewards,
                            trees_apart=trees_apart)




__all__ = ["Collected", "Collector", "Postprocess", "scored_rows"]
