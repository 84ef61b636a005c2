"""The samplers and rollout plans of a run, built from its config (part of
``build``, split off for length; ``build`` re-exports ``sampler_config``).

``Samplers`` is mixed into ``build.Components``: the static sampler, its
SPEC-RL twin, continuous-batching or partial slots, rollout allocation's
plan, multi-turn episodes, the prompt feeders, and where the training
rollouts sample (the trainer's devices or ``rl.sampler_devices`` of their
own).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rljax import rollout as rollout_lib
from rljax import sampling
from rljax.rollout import episode_carry
from rljax.rollout import partial as partial_lib
from rljax.train._build_inputs import eos_ids
from rljax.sampling import latr as latr_lib
from rljax.sampling import paged as paged_lib
from rljax.sampling import tree as tree_lib
from rljax.train._build_rollouts import (allocation, latr_config,
                                         partial_config, replay_buffer,
                                         selection, tree_config)


def sampler_config(config: Any, tokenizer: Any, num_samples: int, *,
                   greedy: bool = False,
                   record_policy_logprobs: bool = False,
                   greedy_every: int = 0) -> sampling.SamplerConfig:
  """The ``SamplerConfig`` of ``sampler.*`` for ``num_samples`` per prompt
  (``greedy_every``: ReMax's greedy row, ``SamplingMethod.greedy_every``)."""
  s = config.sampler
  method = (sampling.SamplingMethod(greedy=True) if greedy else
            sampling.SamplingMethod(temperature=s.temperature,
                                    top_k=s.top_k, top_p=s.top_p,
                                    min_p=s.min_p,
                                    greedy_every=greedy_every))
  return sampling.SamplerConfig(
      num_samples=num_samples, max_new_tokens=s.max_new_tokens, method=method,
      training_temperature=config.rl.training_temperature,
      eos_ids=eos_ids(tokenizer), pad_id=tokenizer.pad_id,
      cache_dtype=s.cache_dtype, prompt_buckets=tuple(s.prompt_buckets),
      share_prefix=s.share_prefix, segment_slots=s.segment_slots,
      shrink_batch_to=s.shrink_batch_to, record_policy_logprobs=record_policy_logprobs)


class Samplers:
  """Mixed into ``build.Components`` (its ``config``, ``tokenizer``,
  ``model_config``, ``algorithm``, ``settings``, ``step_config``, ``mesh``,
  ``param_shardings``, ``sample_mesh``, ``sample_param_shardings``,
  ``env``, ``turns``, ``buckets``, ``group`` and ``train_examples``)."""

  def episodes(self, num_samples: int, *, greedy: bool = False,
               record_policy_logprobs: bool = False, training: bool = False,
               drafts: sampling.DraftStore | None = None
               ) -> rollout_lib.MultiTurnSampler | None:
    """The multi-turn rollout of ``num_samples`` episodes per example
    (``env.name``), sampled as ``sampler``'s rows; None without an
    environment. ``training``: on the sampler's devices
    (``rl.sampler_devices``), and with ``rl.rollout="continuous"`` on
    ``rl.rollout_slots`` slots refilled as episodes end. ``drafts``:
    SPEC-RL's store (``speculation().store``), each turn drafted from the
    prompt's last episode."""
    if self.env is None:
      return None
    alg = self.algorithm
    greedy_every = num_samples if (
        alg.greedy_baseline and not greedy
        and num_samples == self.settings.group_size + alg.extra_samples) else 0
    mesh, param_shardings = self._where(training)
    partial = partial_config(self.config) if training else None
    return rollout_lib.MultiTurnSampler(
        self.model_config,
        sampler_config(self.config, self.tokenizer, num_samples, greedy=greedy,
                       record_policy_logprobs=record_policy_logprobs,
                       greedy_every=greedy_every),
        self.turns, self.env, self.tokenizer, self.buckets, mesh=mesh,
        param_shardings=param_shardings,
        observation_role=self.config.env.observation_role,
        slots=None if partial is None else partial.slots,
        refill_rows=1 if partial is None else partial.refill_rows,
        group=self.group, drafts=drafts,
        log_lenience=float(self.config.sampler.spec_log_lenience),
        carry=(episode_carry.EpisodeCarry(partial.slots, partial.max_age,
                                          partial.max_carried)
               if partial is not None and partial.mode == "partial"
               else None), paged=self._paged(),
        tree=tree_config(self.config) if training else None,
        latr=latr_config(self.config) if training else None)

  @property
  def split(self) -> bool:
    """Whether the training rollouts are sampled on devices of their own
    (``rl.sampler_devices``)."""
    return self.sample_mesh is not None and self.sample_mesh is not self.mesh

  def publish(self, params: Any) -> Any:
    """The params where the training sampler reads them: a copy on the
    sampler's devices with a split mesh (``jax.device_put``), else
    ``params`` themselves."""
    if not self.split:
      return params
    if self.group.single:
      return jax.device_put(params, self.sample_param_shardings)
    # Several processes: jax.device_put cannot move arrays between device
    # sets that span processes. Each process gathers the params whole on
    # its trainer devices (one all-gather over the trainer's mesh), then
    # puts its sampler devices' shards from its own copy.
    whole = jax.jit(lambda p: p, out_shardings=jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec()))(params)

    def put(x, where):
      local = x.addressable_data(0)
      return jax.make_array_from_single_device_arrays(x.shape, where, [
          jax.device_put(local[index], device) for device, index in
          where.addressable_devices_indices_map(x.shape).items()])

    return jax.tree.map(put, whole, self.sample_param_shardings)

  def sampler(self, num_samples: int, *, greedy: bool = False,
              record_policy_logprobs: bool | None = None,
              training: bool = False):
    """A jitted sampler with explicit shardings (``sampling.make_sampler``).

    ``record_policy_logprobs`` None (the default) records them when the step
    takes ``pi_old`` from the sampler (``rl.old_logprobs="sampler"``), so a
    Collector built from this sampler feeds ``rl_step`` what it needs.
    With a ReMax algorithm (``greedy_baseline``), the sampler of the
    training rows (``group_size + 1`` per prompt) decodes the last row of
    each prompt greedily; ``validate`` keeps ``eval.num_samples`` off that
    count. ``training``: on the sampler's devices (``rl.sampler_devices``),
    and with ``rl.rollout="tree"`` the training rows are sampled as trees
    (``sampling.tree``; with rollout allocation its prompt entries are the
    trees, ``allocation_rollouts``, and the collector's sampler of whole
    groups, which its rounds never call, is not one); with
    ``rl.rollout="latr"`` with LATR's branching (``sampling.latr``).
    ``sampler.kv_cache="paged"``: the static batch
    decodes on a paged KV cache (``sampling.paged``), as the slots do
    (``slot_rollouts``).
    """
    alg = self.algorithm
    if record_policy_logprobs is None:
      record_policy_logprobs = (not greedy
                                and self.step_config.old_logprobs == "sampler")
    greedy_every = num_samples if (
        alg.greedy_baseline and not greedy
        and num_samples == self.settings.group_size + alg.extra_samples) else 0
    config = sampler_config(self.config, self.tokenizer, num_samples,
                            greedy=greedy,
                            record_policy_logprobs=record_policy_logprobs,
                            greedy_every=greedy_every)
    paged = self._paged()
    trees = training and not greedy and self._trees(num_samples)
    tree = tree_config(self.config) if trees else None
    if tree is not None:
      return tree_lib.make_tree_sampler(self.model_config, config, tree,
                                        *self._where(training), paged=paged)
    latr = latr_config(self.config) if trees else None
    if latr is not None:
      return latr_lib.make_latr_sampler(self.model_config, config, latr,
                                        *self._where(training), paged=paged)
    if paged is not None:
      return paged_lib.make_paged_sampler(self.model_config, config, paged,
                                          *self._where(training))
    return sampling.make_sampler(self.model_config, config,
                                 *self._where(training))

  def _trees(self, num_samples: int) -> bool:
    """Whether training rows of ``num_samples`` per prompt grow as trees
    (TreePO's or LATR's, with ``rl.rollout``): all of them, or with rollout
    allocation only its prompt entries'."""
    return (self.config.rl.allocation.name == "none"
            or num_samples == allocation(self.config).sampler_samples)

  def _paged(self) -> paged_lib.PagedConfig | None:
    """``sampler.kv_cache="paged"``'s pool, or None (a dense cache)."""
    s = self.config.sampler
    return (paged_lib.PagedConfig(s.kv_block_size, s.kv_blocks)
            if s.kv_cache == "paged" else None)

  def _where(self, training: bool) -> tuple[jax.sharding.Mesh, Any]:
    if training and self.split:
      return self.sample_mesh, self.sample_param_shardings
    return self.mesh, self.param_shardings

  def _training_sampler_config(self, record_policy_logprobs: bool | None,
                               num_samples: int | None = None
                               ) -> sampling.SamplerConfig:
    """The training rows' ``SamplerConfig`` (``group_size + extra_samples``
    per prompt, ReMax's greedy row; or ``num_samples`` per prompt entry)
    for the slots and SPEC-RL."""
    alg = self.algorithm
    if record_policy_logprobs is None:
      record_policy_logprobs = self.step_config.old_logprobs == "sampler"
    greedy = num_samples is None and alg.greedy_baseline
    if num_samples is None:
      num_samples = self.settings.group_size + alg.extra_samples
    return sampler_config(
        self.config, self.tokenizer, num_samples,
        record_policy_logprobs=record_policy_logprobs,
        greedy_every=num_samples if greedy else 0)

  def slot_rollouts(self, *, record_policy_logprobs: bool | None = None,
                    drafts: sampling.DraftStore | None = None,
                    num_samples: int | None = None,
                    num_prompts: int | None = None
                    ) -> partial_lib.SlotRollouts | None:
    """Continuous batching or partial rollouts of the training rows
    (``rl.rollout``); None for the static sampler. ``record_policy_logprobs``
    as ``sampler``'s; ``drafts``: SPEC-RL's store (``speculation().store``),
    whose drafts are verified in the slots' prefills. ``num_samples`` rows
    for each of at most ``num_prompts`` prompts a call (rollout
    allocation's rounds); default the training rows' of
    ``rl.prompts_per_step`` prompts."""
    partial = partial_config(self.config)
    if partial is None or self.env is not None:  # episodes have their own
      return None
    config = self._training_sampler_config(record_policy_logprobs,
                                           num_samples)
    return partial_lib.SlotRollouts(
        self.model_config, config, partial,
        num_prompts or self.settings.prompts_per_step,
        *self._where(True), drafts=drafts,
        log_lenience=float(self.config.sampler.spec_log_lenience),
        paged=self._paged())

  def allocation_rollouts(self, schedule: Any, *,
                          record_policy_logprobs: bool | None = None,
                          drafts: sampling.DraftStore | None = None) -> Any:
    """Rollout allocation's rounds (``rl.allocation``) on the training
    rows' plan: ``schedule.sampler_samples`` rows per prompt entry, as
    episodes (``env.name``), on continuous-batching slots
    (``rl.rollout='continuous'``; ``drafts``: SPEC-RL's store, verified in
    the slots) or on the static batch (whose speculative twin is
    ``speculation(num_samples=schedule.sampler_samples)``)."""
    samples = schedule.sampler_samples
    if self.env is not None:
      return self.episodes(samples, record_policy_logprobs=bool(
          record_policy_logprobs), training=True, drafts=drafts)
    slots = self.slot_rollouts(record_policy_logprobs=record_policy_logprobs,
                               num_samples=samples,
                               num_prompts=schedule.round_entries,
                               drafts=drafts)
    if slots is not None:
      return slots
    return self.sampler(samples, record_policy_logprobs=record_policy_logprobs,
                        training=True)

  def selection(self) -> Any:
    """``_build_rollouts.selection`` of the config (``rl.selection``)."""
    return selection(self.config, len(self.train_examples))

  def replay(self) -> Any:
    """``_build_rollouts.replay_buffer`` of the config (``rl.replay``)."""
    return replay_buffer(self.config)

  def speculation(self, *, record_policy_logprobs: bool | None = None,
                  num_samples: int | None = None,
                  store: sampling.DraftStore | None = None
                  ) -> sampling.Speculation | None:
    """SPEC-RL drafts for the training rollouts (``sampler.speculative``):
    the speculative twin of ``sampler(group_size + extra_samples)`` (of a
    tree rollout's sampler, its segments verified node by node:
    ``sampling.tree_drafts``; of LATR's, its rows sampled as usual), on
    the same devices (the sampler's with ``rl.sampler_devices``), and a
    draft store; None when off. ``record_policy_logprobs`` as ``sampler``'s;
    ``num_samples`` rows per prompt entry (rollout allocation's rounds)
    drafting from ``store`` (default a new one)."""
    s = self.config.sampler
    if not s.speculative:
      return None
    config = self._training_sampler_config(record_policy_logprobs,
                                           num_samples)
    trees = self._trees(config.num_samples)
    tree = tree_config(self.config) if trees else None
    latr = latr_config(self.config) if trees else None
    if tree is not None:  # each segment verified from the earlier tree's
      sampler = tree_lib.make_tree_sampler(
          self.model_config, config, tree, *self._where(True),
          paged=self._paged(), speculative=True,
          log_lenience=float(s.spec_log_lenience))
    elif latr is not None:  # the rows sampled as usual draft
      sampler = latr_lib.make_latr_sampler(
          self.model_config, config, latr, *self._where(True),
          paged=self._paged(), speculative=True,
          log_lenience=float(s.spec_log_lenience))
    else:
      sampler = sampling.make_speculative_sampler(
          self.model_config, config, *self._where(True),
          log_lenience=float(s.spec_log_lenience), paged=self._paged())
    return sampling.Speculation(
        sampler=sampler, draft_slots=(
            None if latr is None else
            np.arange(config.num_samples) >= latr.tree_rows(
                config.num_samples)),
        store=(store if store is not None
               else sampling.DraftStore(int(s.spec_store_prompts))),
        max_new_tokens=config.max_new_tokens)


__all__ = ["Samplers", "sampler_config"]
