"""Rollouts on continuous-batching slots, and partial rollouts (APRIL).

``SlotRollouts.sample`` is what ``Collector`` calls instead of the static
sampler when ``rl.rollout`` is ``"continuous"`` or ``"partial"``: it queues
the step's groups on the slots of ``sampling.continuous`` and returns the
``Rollout`` of ``B`` whole groups, in the order the trainer expects (rows
group-contiguous), whatever slots their rows were decoded in.

* ``continuous``: every row of the step is decoded to its end, on ``M``
  slots refilled as rows end. With the static sampler's row keys, every row
  is the row the static sampler gives (``tests/test_continuous.py``).
* ``partial`` (APRIL): the step's new groups are queued after the groups
  carried from earlier steps, and decoding stops as soon as ``B`` groups have
  ended. Those are trained (the oldest first); the rest are carried: their
  tokens, per-token sampler logprobs and the policy version that drew each
  token are kept, and in a later step they go on under the newer policy from
  where they stopped (their prompt and tokens are prefilled again, never
  re-sampled). A group older than ``max_age`` steps, or beyond
  ``max_carried`` groups, is dropped and counted (``rollout/dropped_groups``).

The trainer sees each token's sampler logprob (the exact behaviour policy of
that token, whichever version drew it), so TIS/MIS, the rejection rules,
ESS and SAT correct mixed-version rows exactly; ``Collected.token_versions``
gives the loop each token's version for the staleness metrics.

Checkpoints store the carried groups (``arrays``/``load_arrays``), so a run
resumed from a checkpoint continues exactly as the uninterrupted run.

References:
  Zhou et al., "APRIL: Active Partial Rollouts in Reinforcement Learning to
  Tame Long-tail Generation", https://arxiv.org/abs/2509.18521.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rljax import sampling
from rljax.sampling import continuous as cb
from rljax.sampling.sampler import row_keys

MODES = ("static", "continuous", "partial")


@dataclasses.dataclass
class _Group:
  """One prompt's ``G`` rows on the host (carried between steps)."""

  example: dict[str, Any]
  prompt: list[int]
  tokens: np.ndarray      # [G, T] int32
  length: np.ndarray      # [G] int32
  sampler_lp: np.ndarray  # [G, T] float32
  policy_lp: np.ndarray | None
  version: np.ndarray     # [G, T] int32, the policy version of each token
  keys: np.ndarray        # [G, 2] uint32
  done: np.ndarray        # [G] bool
  finished: np.ndarray    # [G] bool
  born: int | None        # the version that drew its first token (None:
                          # not started, a waiting group)
  verify: np.ndarray | None = None  # [G] bool: tokens are a SPEC-RL draft

  @property
  def complete(self) -> bool:
    return bool(self.done.all())


@dataclasses.dataclass(frozen=True)
class PartialConfig:
  """``rl.rollout*`` and ``rl.partial_*``, checked.

  Attributes:
    mode: ``"continuous"`` or ``"partial"``.
    slots: ``M`` decode slots (``rl.rollout_slots``).
    refill_rows: rows prefilled per refill (``rl.rollout_refill_rows``).
    max_age: a carried group older than this many steps is dropped.
    max_carried: at most this many groups are carried to the next step.
  """

  mode: str
  slots: int
  refill_rows: int
  max_age: int = 2
  max_carried: int = 0

  def __post_init__(self):
    if self.mode not in ("continuous", "partial"):
      raise ValueError(f"rl.rollout={self.mode!r}: accepted {MODES}.")
    cb.SlotConfig(self.slots, self.refill_rows)  # checks both
    for name in ("max_age", "max_carried"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"rl.partial_{name}={value!r}: an integer >= 0 is "
                         "required.")


class SlotRollouts:
  """Samples a step's groups on continuous-batching slots (see module doc).

  Args:
    model_config: the policy's model config.
    config: the ``SamplerConfig`` of the training rollouts (``num_samples``
      rows per prompt).
    partial: the slots and the carrying rules.
    num_prompts: ``B``, groups trained per step.
    mesh, param_shardings: where the params live.
    drafts, log_lenience: SPEC-RL's store and acceptance rule: drafts are
      verified in the slots' prefills.
    paged: a ``sampling.PagedConfig``: the slots' KV cache in blocks
      (``SlotConfig.paged``; the pool's figures join the metrics).
  """

  def __init__(self, model_config, config: sampling.SamplerConfig,
               partial: PartialConfig, num_prompts: int, mesh=None,
               param_shardings=None, *,
               drafts: sampling.DraftStore | None = None,
               log_lenience: float = 0.0, paged: Any = None):
    self.config, self.partial, self.num_prompts = config, partial, num_prompts
    g = config.num_samples
    self.carried: list[_Group] = []
    self.dropped = 0  # groups dropped so far (age or cap)
    self.drafts = drafts
    # Queue rows, a fixed count: carried started groups (<= max_carried),
    # waiting ones (< B) and the batches drawn to reach B + max_carried.
    self.queue_rows = (2 * num_prompts + partial.max_carried) * g
    make = lambda slots: cb.make_continuous_sampler(  # noqa: E731
        model_config, config, slots, mesh, param_shardings)
    if drafts is not None:  # one program: every prefill verifies drafts
      one = make(cb.SlotConfig(partial.slots, partial.refill_rows, True,
                               log_lenience=float(log_lenience),
                               paged=paged))
      self._samplers = {False: one, True: one}
    else:
      self._samplers = {
          carried: make(cb.SlotConfig(partial.slots, partial.refill_rows,
                                      carried, paged=paged))
          for carried in (False, True)}

  # --- one step -------------------------------------------------------------

  def sample(self, params: Any, prompts: Sequence[Sequence[int]],
             examples: Mapping[str, Sequence[Any]], key: jax.Array,
             version: int, buckets: Sequence[int], on_dispatch=None,
             more: Any = None
             ) -> tuple[sampling.Rollout, dict[str, list[Any]], np.ndarray,
                        dict[str, float]]:
    """``(rollout, examples, token_versions, metrics)`` of ``B`` whole groups.

    ``examples``/``prompts``: the step's ``B`` new prompts; ``version``: the
    policy version of ``params`` (the number of updates that made them).
    The returned examples are those of the trained groups, in row order.
    ``on_dispatch``: called once the sampling is dispatched (``Collector``).
    ``more``: ``fn() -> (prompts, examples)``, another batch of new prompts
    (partial rollouts over-provision: the queue holds ``B + max_carried``
    groups; the prompts a step does not start wait for the next one).
    """
    # As many groups end as prompts are asked for (B, or fewer where replay
    # fills the rest of the batch).
    sc, p_cfg, b = self.config, self.partial, len(prompts)
    if not 1 <= b <= self.num_prompts:
      raise ValueError(f"{b} prompts for slots built for at most "
                       f"{self.num_prompts} (rl.prompts_per_step).")
    names = list(examples)
    groups = self.carried + self._new_groups(prompts, examples, key)
    draws = 0
    while (p_cfg.mode == "partial" and more is not None
           and len(groups) < b + p_cfg.max_carried):
      draws += 1
      extra_prompts, extra_examples = more()
      groups += self._new_groups(extra_prompts, extra_examples,
                                 jax.random.fold_in(key, draws))
    drafted = self._attach_drafts(groups)
    queue, where = self._queue(groups, buckets)
    carried_rows = any(gr.length.any() for gr in self.carried
                       if not gr.complete)
    target = b if p_cfg.mode == "partial" else len(groups)
    out = self._samplers[carried_rows](params, queue, target)
    if on_dispatch is not None:
      on_dispatch()
    out = jax.device_get(out)
    t = sc.max_new_tokens
    for i, gr in enumerate(groups):
      rows = where[i]
      # A verified draft's kept tokens count as drawn now (their sampler
      # logprobs are the current policy's, SPEC-RL's rule); a drafted row
      # that did not start drops its draft, unverified.
      old_length, unstarted = gr.length.copy(), np.zeros_like(gr.done)
      if gr.verify is not None:
        old_length = np.where(gr.verify, 0, gr.length)
        unstarted = gr.verify & ~np.asarray(out.started[rows])
      gr.verify = None
      gr.tokens = np.where(unstarted[:, None], sc.pad_id,
                           out.completion_tokens[rows]).astype(np.int32)
      gr.length = np.where(unstarted, 0, out.lengths[rows]).astype(np.int32)
      gr.sampler_lp = np.where(unstarted[:, None], 0.0,
                               out.sampler_logprobs[rows]).astype(np.float32)
      if gr.policy_lp is not None:
        gr.policy_lp = np.where(unstarted[:, None], 0.0,
                                out.policy_logprobs[rows]).astype(np.float32)
      gr.done = np.asarray(out.done[rows]) & ~unstarted
      gr.finished = np.asarray(out.finished[rows]) & ~unstarted
      cols = np.arange(t)[None]
      fresh = (cols >= old_length[:, None]) & (cols < gr.length[:, None])
      gr.version = np.where(fresh, version, gr.version).astype(np.int32)
      if gr.born is None and fresh.any():
        gr.born = version
    complete = [gr for gr in groups if gr.complete]
    trained = complete[:b]
    chosen = {id(gr) for gr in trained}
    rest = [gr for gr in groups if id(gr) not in chosen]
    if len(trained) < b:  # cannot happen: the loop runs until b have ended
      raise RuntimeError(f"{len(trained)} of {b} groups ended.")
    self.carried, dropped = self._carry(rest, version + 1)
    self.dropped += dropped
    rollout, versions = self._rollout(trained, buckets)
    if self.drafts is not None:  # every trained group drafts its next visit
      self.drafts.update([gr.prompt for gr in trained],
                         rollout.completion_tokens, rollout.completion_mask,
                         rollout.sampler_logprobs)
    steps, kept = int(out.decode_steps), int(out.kept_tokens)
    metrics = {
        "rollout/slot_utilization": kept / max(steps * p_cfg.slots, 1),
        "rollout/decode_steps": float(steps),
        "rollout/prefills": float(out.prefills),
        "rollout/prefilled_rows": float(out.prefilled_rows),
        "rollout/carried_groups": float(sum(
            gr.born is not None for gr in self.carried)),
        "rollout/waiting_groups": float(sum(
            gr.born is None for gr in self.carried)),
        "rollout/dropped_groups": float(self.dropped),
        "rollout/generated_tokens": float(kept),
    }
    if out.kv_stats is not None:  # the paged pool's figures
      metrics.update({k: float(v) for k, v in out.kv_stats.items()})
    if drafted is not None:
      lengths_in, rows_in = drafted
      index = [where[i][j] for i, j in rows_in]
      kept = np.asarray(out.accepted)[index]
      has = (lengths_in > 0) & np.asarray(out.started)[index]
      lengths_in = np.where(has, lengths_in, 0)
      metrics.update({
          "spec/drafted_rows": float(has.sum()),
          "spec/accepted_tokens/mean": float(kept[has].mean()) if has.any()
                                       else 0.0,
          "spec/accept_rate": float(kept.sum() / max(lengths_in.sum(), 1)),
          "spec/full_accept_fraction": float(
              (kept[has] == lengths_in[has]).mean()) if has.any() else 0.0})
    elif self.drafts is not None:
      metrics["spec/drafted_rows"] = 0.0
    trained_examples = {k: [gr.example[k] for gr in trained] for k in names}
    return rollout, trained_examples, versions, metrics

  def _attach_drafts(self, groups: list[_Group]):
    """SPEC-RL: a new group whose prompt has an earlier rollout takes it as
    its rows' tokens, to be verified when they are prefilled. Returns the
    drafts' lengths and the groups' indices, or None without drafts."""
    if self.drafts is None:
      return None
    sc = self.config
    g, t = sc.num_samples, sc.max_new_tokens
    fresh = [i for i, gr in enumerate(groups) if gr.born is None]
    if not fresh:
      return None
    draft = self.drafts.lookup([groups[i].prompt for i in fresh], g, t)
    if draft is None:
      return None
    for k, i in enumerate(fresh):
      gr, rows = groups[i], slice(k * g, (k + 1) * g)
      gr.length = draft.mask[rows].sum(1).astype(np.int32)
      gr.tokens = np.where(draft.mask[rows], draft.tokens[rows],
                           sc.pad_id).astype(np.int32)
      gr.sampler_lp = np.where(draft.mask[rows], draft.logprobs[rows],
                               0.0).astype(np.float32)
      gr.verify = gr.length > 0
    return (np.concatenate([groups[i].length for i in fresh]),
            [(i, j) for i in fresh for j in range(g)])

  def _new_groups(self, prompts, examples, key) -> list[_Group]:
    """Waiting groups of new prompts, with the static sampler's row keys."""
    sc = self.config
    g, t = sc.num_samples, sc.max_new_tokens
    keys = np.asarray(jax.random.key_data(row_keys(key, len(prompts) * g)))
    names = list(examples)
    return [
        _Group(example={k: examples[k][i] for k in names},
               prompt=[int(x) for x in prompts[i]],
               tokens=np.full((g, t), sc.pad_id, np.int32),
               length=np.zeros((g,), np.int32),
               sampler_lp=np.zeros((g, t), np.float32),
               policy_lp=(np.zeros((g, t), np.float32)
                          if sc.record_policy_logprobs else None),
               version=np.full((g, t), -1, np.int32),
               keys=keys[i * g:(i + 1) * g], done=np.zeros((g,), bool),
               finished=np.zeros((g,), bool), born=None)
        for i in range(len(prompts))]

  def _queue(self, groups: list[_Group], buckets) -> tuple[cb.Queue, list]:
    """The queue (pending carried rows, pending new rows, ended rows, then
    padding) and each group's queue rows."""
    sc = self.config
    g, t, q = sc.num_samples, sc.max_new_tokens, self.queue_rows
    if len(groups) * g > q:
      raise RuntimeError(f"{len(groups)} groups exceed the queue's {q} rows.")
    order = ([(i, j) for i, gr in enumerate(groups) if gr.length.any()
              for j in range(g) if not gr.done[j]]
             + [(i, j) for i, gr in enumerate(groups) if not gr.length.any()
                for j in range(g) if not gr.done[j]])
    pending = len(order)
    order += [(i, j) for i, gr in enumerate(groups) for j in range(g)
              if gr.done[j]]
    tokens_p, mask_p = sampling.pad_prompts([gr.prompt for gr in groups],
                                            buckets, sc.pad_id)
    p = tokens_p.shape[1]
    queue = {
        "prompt_tokens": np.zeros((q, p), np.int32),
        "prompt_mask": np.zeros((q, p), bool),
        "tokens": np.full((q, t), sc.pad_id, np.int32),
        "length": np.zeros((q,), np.int32),
        "sampler_logprobs": np.zeros((q, t), np.float32),
        "policy_logprobs": (np.zeros((q, t), np.float32)
                            if sc.record_policy_logprobs else None),
        "keys": np.zeros((q, 2), np.uint32),
        "sample": np.zeros((q,), np.int32),
        "group": np.full((q,), q, np.int32),
        "done": np.ones((q,), bool), "finished": np.zeros((q,), bool),
        "verify": np.zeros((q,), bool),
    }
    queue["prompt_mask"][:, -1] = True  # padding rows: a one-token prompt
    where = [np.zeros((g,), np.int64) for _ in groups]
    for r, (i, j) in enumerate(order):
      gr = groups[i]
      where[i][j] = r
      queue["prompt_tokens"][r] = tokens_p[i]
      queue["prompt_mask"][r] = mask_p[i]
      queue["tokens"][r] = gr.tokens[j]
      queue["length"][r] = gr.length[j]
      queue["sampler_logprobs"][r] = gr.sampler_lp[j]
      if gr.policy_lp is not None:
        queue["policy_logprobs"][r] = gr.policy_lp[j]
      queue["keys"][r] = gr.keys[j]
      queue["sample"][r] = j
      queue["group"][r] = i
      queue["done"][r] = gr.done[j]
      queue["finished"][r] = gr.finished[j]
      queue["verify"][r] = gr.verify is not None and gr.verify[j]
    if self.drafts is None:
      queue["verify"] = None
    return cb.Queue(**queue, num_pending=np.int32(pending)), where

  def _carry(self, rest: list[_Group], next_version: int
             ) -> tuple[list[_Group], int]:
    """The groups kept for the next step (oldest first) and how many were
    dropped: too old, beyond ``max_carried``, or more unfinished rows with
    tokens than slots (they must all start in the first fill)."""
    p_cfg, kept, dropped = self.partial, [], 0
    if p_cfg.mode != "partial":
      return [], 0
    started = [gr for gr in rest if gr.born is not None]
    rows_with_tokens = 0
    for gr in sorted(started, key=lambda x: x.born):  # stable: oldest first
      pending = int(np.sum(~gr.done & (gr.length > 0)))
      if (next_version - gr.born > p_cfg.max_age
          or len(kept) >= p_cfg.max_carried
          or rows_with_tokens + pending > p_cfg.slots):
        dropped += 1
        continue
      rows_with_tokens += pending
      kept.append(gr)
    # Groups that drew no token wait for the next step (no cap: they hold
    # nothing but their prompt).
    return kept + [gr for gr in rest if gr.born is None], dropped

  def _rollout(self, groups: list[_Group], buckets
               ) -> tuple[sampling.Rollout, np.ndarray]:
    """The trained groups as one ``Rollout`` (rows group-contiguous) and
    each token's policy version."""
    sc = self.config
    g = sc.num_samples
    tokens_p, mask_p = sampling.pad_prompts([gr.prompt for gr in groups],
                                            buckets, sc.pad_id)
    cat = lambda f: np.concatenate([f(gr) for gr in groups])  # noqa: E731
    tokens = cat(lambda gr: gr.tokens)
    lengths = cat(lambda gr: gr.length).astype(np.int32)
    mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
    rollout = sampling.Rollout(
        prompt_tokens=np.repeat(tokens_p, g, 0),
        prompt_mask=np.repeat(mask_p, g, 0),
        completion_tokens=np.where(mask, tokens, sc.pad_id).astype(np.int32),
        completion_mask=mask, lengths=lengths,
        finished=cat(lambda gr: gr.finished),
        policy_logprobs=(None if not sc.record_policy_logprobs else np.where(
            mask, cat(lambda gr: gr.policy_lp), 0.0).astype(np.float32)),
        sampler_logprobs=np.where(mask, cat(lambda gr: gr.sampler_lp),
                                  0.0).astype(np.float32))
    versions = np.where(mask, cat(lambda gr: gr.version), -1)
    return rollout, versions.astype(np.int32)

  # --- checkpoints ----------------------------------------------------------

  def arrays(self) -> dict[str, np.ndarray] | None:
    """The carried groups as host arrays (saved with a checkpoint)."""
    if not self.carried:
      return {"dropped": np.asarray([self.dropped], np.int64)}
    groups = self.carried
    width = max(len(gr.prompt) for gr in groups)
    prompts = np.full((len(groups), width), -1, np.int64)
    for i, gr in enumerate(groups):
      prompts[i, :len(gr.prompt)] = gr.prompt
    out = {
        "dropped": np.asarray([self.dropped], np.int64),
        "prompts": prompts,
        "examples": np.frombuffer(json.dumps(
            [gr.example for gr in groups]).encode(), np.uint8),
        "born": np.asarray([-1 if gr.born is None else gr.born
                            for gr in groups], np.int64),
    }
    for name in ("tokens", "length", "sampler_lp", "version", "keys", "done",
                 "finished"):
      out[name] = np.stack([getattr(gr, name) for gr in groups])
    if groups[0].policy_lp is not None:
      out["policy_lp"] = np.stack([gr.policy_lp for gr in groups])
    return out

  def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Restores what ``arrays`` saved, checking it against this sampler."""
    sc = self.config
    self.dropped = int(np.asarray(arrays["dropped"])[0])
    self.carried = []
    if "prompts" not in arrays:
      return
    examples = json.loads(bytes(np.asarray(arrays["examples"])).decode())
    k = len(examples)
    g, t = sc.num_samples, sc.max_new_tokens
    expect = {"tokens": (k, g, t), "length": (k, g), "sampler_lp": (k, g, t),
              "version": (k, g, t), "keys": (k, g, 2), "done": (k, g),
              "finished": (k, g), "born": (k,)}
    for name, shape in expect.items():
      if name not in arrays or tuple(np.shape(arrays[name])) != shape:
        raise ValueError(
            f"the checkpoint's carried partial rows: {name} has shape "
            f"{np.shape(arrays.get(name))}, expected {shape} (rl.group_size "
            f"and sampler.max_new_tokens must be the run's).")
    for i, example in enumerate(examples):
      prompt = [int(x) for x in arrays["prompts"][i] if x >= 0]
      self.carried.append(_Group(
          example=example, prompt=prompt,
          tokens=np.asarray(arrays["tokens"][i], np.int32),
          length=np.asarray(arrays["length"][i], np.int32),
          sampler_lp=np.asarray(arrays["sampler_lp"][i], np.float32),
          policy_lp=(np.asarray(arrays["policy_lp"][i], np.float32)
                     if "policy_lp" in arrays else (
                         np.zeros((g, t), np.float32)
                         if sc.record_policy_logprobs else None)),
          version=np.asarray(arrays["version"][i], np.int32),
          keys=np.asarray(arrays["keys"][i], np.uint32),
          done=np.asarray(arrays["done"][i], bool),
          finished=np.asarray(arrays["finished"][i], bool),
          born=(None if int(arrays["born"][i]) < 0
                else int(arrays["born"][i]))))


__all__ = ["MODES", "PartialConfig", "SlotRollouts"]
