"""A run's set-up, start or resume, checkpoints and summary (around ``loop.py``).

``start`` writes what a run directory needs besides checkpoints (config,
tokenizer files), makes the samplers, the ``Collector``, the checkpoint
manager and the prompt iterator; ``initial_state`` either warms the policy
up (SFT), evaluates it and builds a fresh ``TrainState``, or restores the
newest readable checkpoint (state, reference params, data position, SPEC-RL
drafts) and drops the metric rows written after it; ``Session.save``
checkpoints all of that; ``summary`` closes up and reports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import checkpoint as ckpt_lib
from rljax import data as data_lib
from rljax import metrics as metrics_lib
from rljax import models
from rljax import tokenizers as tok_lib
from rljax.data import allocation as allocation_lib
from rljax.models import lora as lora_lib
from rljax.train import build as build_lib
from rljax.train import evaluation, rundir, schema, sft
from rljax.train.batch_layout import Postprocessor
from rljax.train import policy as policy_lib
from rljax.train import steps as steps_lib
from rljax.rollout.collector import Collector
from rljax.train.steps import TrainState

log = logging.getLogger("rljax")

# A LoRA run's frozen base, saved once when the RL stage starts (unless it
# is model.path's weights as they are); its checkpoints hold the adapters.
LORA_BASE_DIR = policy_lib.LORA_BASE_DIR

PHASES = ("sft", "sample", "reward", "advantage", "train", "evaluation",
          "checkpoint")


@dataclasses.dataclass
class Session:
  """The host-side parts of one run (built by ``start``).

  Attributes:
    c: the run's components.
    workdir: the run directory.
    collector: samples, scores and batches a step's prompts.
    samplers: ``{"eval": ..., "greedy": ... or None}`` for held-out metrics.
    manager: the checkpoint manager.
    iterator: the training prompts (its position is checkpointed).
    eval_key, state_key, init_key: the run's keys, split from its seed.
    writer: the metric writer (set by ``initial_state``).
    before: held-out metrics before RL.
    seconds: this process's wall clock by phase (``PHASES``).
    tokens: generated and trained tokens of this process.
  """

  c: build_lib.Components
  workdir: str
  collector: Collector
  samplers: dict[str, Any]
  manager: ckpt_lib.CheckpointManager
  iterator: Any
  eval_key: jax.Array
  state_key: jax.Array
  init_key: jax.Array
  writer: metrics_lib.MetricWriter | None = None
  before: dict[str, float] = dataclasses.field(default_factory=dict)
  seconds: dict[str, float] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(PHASES, 0.0))
  tokens: dict[str, float] = dataclasses.field(
      default_factory=lambda: {"generated": 0.0, "train": 0.0})
  steps: int = 0
  first_step: dict[str, Any] | None = None
  kl_coef: float | None = None  # an adaptive KL controller's (kl_control)

  @property
  def metrics_path(self) -> str:
    return os.path.join(self.workdir, "metrics.jsonl")

  def evaluate(self, params: Any, key: jax.Array) -> dict[str, float]:
    """Held-out metrics (``evaluation.heldout_metrics``), timed."""
    c, s, t = self.c, self.c.settings, time.time()
    out = evaluation.heldout_metrics(
        params, key, sampler=self.samplers["eval"],
        greedy_sampler=self.samplers["greedy"], tokenizer=c.tokenizer,
        examples=c.heldout, evaluator=c.evaluator,
        num_samples=s.eval_num_samples, buckets=c.buckets, eos_ids=c.eos_ids,
        correctness_reward=c.correctness, mesh=c.mesh, group=c.group,
        episodes=c.env is not None)
    self.seconds["evaluation"] += time.time() - t
    return out

  def save(self, step: int, state: TrainState, ref_params: Any,
           metrics: dict[str, float] | None = None, *,
           extras: tuple[Any, Any] | None = None) -> None:
    """Checkpoints the state, the reference params (with a KL term), the
    data position, the before-RL figures, the SPEC-RL drafts and the carried
    partial rows. ``extras``: ``(data position, carried rows)`` to save
    instead of the current ones (``schedules.Schedule.checkpoint_extras``)."""
    t = time.time()
    data_state, carried = extras or (self.iterator.get_state(),
                                     self.collector.carried_arrays())
    c = self.c
    tree = {"state": state}
    meta = {"data_iterator": data_state, "before": self.before,
            "config": c.config_json}
    if self.kl_coef is not None:
      meta["kl_coef"] = self.kl_coef
    if c.lora:  # the adapters, and where the frozen base is
      tree["state"] = state._replace(
          params=steps_lib.trainable(c.model_config, state.params))
      meta["lora_base"] = lora_base_reference(c)
    if ref_params is not None:
      tree["ref_params"] = ref_params
    best = self.c.settings.best_metric
    spec = self.collector.speculation
    self.manager.save(
        step, tree, meta,
        metrics=({best: metrics[best]} if best and metrics and best in metrics
                 else None),
        host_arrays={"drafts": spec.store.arrays() if spec else None,
                     "partial": carried, "selection": _greso_arrays(self),
                     "replay": (self.collector.replay.arrays()
                                if self.collector.replay else None),
                     "allocation": (self.collector.allocation.arrays()
                                    if isinstance(self.collector.allocation,
                                                  allocation_lib.Sgpo)
                                    else None)})
    self.seconds["checkpoint"] += time.time() - t


def saved_on_signal(run: Session, stop_signal: Any, step: int, state: TrainState,
                    ref_params: Any = None, extras: Any = None) -> bool:
  """Whether a stop signal reached any process (``guards.StopSignal``):
  then the run is checkpointed at ``step`` (``extras``: a callable giving
  ``Session.save``'s extras) and the user is told how to resume. Every
  process decides alike, so all stop at the same step."""
  if not run.c.group.any(bool(stop_signal.received)):
    return False
  run.save(step, state, ref_params, extras=extras() if extras else None)
  run.manager.wait()
  log.warning("%s received: saved a checkpoint at step %d in %s; run the "
              "same command (same --workdir) to resume.",
              stop_signal.received or "a stop signal (another process)",
              step, run.manager.directory)
  return True


def _greso(run: Session) -> Any:
  """The run's GRESO filter or DOTS queue (the checkpoint's ``selection``
  item), or None."""
  selection = run.collector.selection
  return None if selection is None else (selection.greso or selection.dots)


def _greso_arrays(run: Session) -> dict[str, Any] | None:
  greso = _greso(run)
  return None if greso is None else greso.arrays()


def run_keys(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A run's ``(init, eval, state)`` keys, split from its seed: the initial
  params, held-out sampling, the training state's draws. Four are split, the
  second unused (it was the SFT's, which draws its data from the seed): a
  seed keeps the initial params and keys it always had. A reward model on
  the policy's warm-up (``reward_model.init="policy_sft"``) draws its
  decoder from the same ``init`` key."""
  init_key, _, eval_key, state_key = jax.random.split(jax.random.key(seed), 4)
  return init_key, eval_key, state_key


def start(c: build_lib.Components, workdir: str) -> Session:
  """Writes the run's config and tokenizer files (process 0) and makes its
  host parts."""
  s, alg = c.settings, c.algorithm
  if c.group.primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(c.config_json, f, indent=2)
    if c.hf_path:  # what load_policy needs to rebuild tokenizer and model
      build_lib.save_hf_files(c.hf_path, workdir)
    else:
      c.tokenizer.save(os.path.join(workdir, "tokenizer.model"))
  init_key, eval_key, state_key = run_keys(s.seed)
  sampler_old = c.step_config.old_logprobs == "sampler"
  speculation = c.speculation(record_policy_logprobs=sampler_old)
  schedule = build_lib.allocation(c.config)  # rl.allocation's rounds
  selection = c.selection()
  if isinstance(schedule, allocation_lib.Sgpo) or (
      selection is not None and selection.dots is not None):
    longest = max(len(p) for p in tok_lib.encode_prompts(
        c.tokenizer, [e["prompt"] for e in c.train_examples]))
    if selection is not None and selection.dots is not None:
      selection.dots.attach(c.train_examples, longest, dots_embedder(c))
    else:  # sGPO profiles the whole pool
      schedule.attach(c.train_examples, longest)
  collector = Collector(
      sampler=c.sampler(s.group_size + alg.extra_samples,
                        record_policy_logprobs=sampler_old, training=True),
      tokenizer=c.tokenizer, evaluator=c.evaluator,
      postprocess=Postprocessor(alg),
      group_size=s.group_size, buckets=c.buckets, eos_ids=c.eos_ids,
      correctness=c.correctness, mesh=c.mesh,
      speculation=speculation, group=c.group,
      slots=c.slot_rollouts(
          record_policy_logprobs=sampler_old,
          drafts=speculation.store if speculation else None),
      sample_mesh=c.sample_mesh,
      episodes=c.episodes(s.group_size + alg.extra_samples,
                          record_policy_logprobs=sampler_old, training=True,
                          drafts=speculation.store if speculation else None),
      selection=selection, replay=c.replay(),
      allocation=schedule, allocation_sampler=None if schedule is None
      else c.allocation_rollouts(
          schedule, record_policy_logprobs=sampler_old,
          drafts=speculation.store if speculation else None),
      allocation_fresh=build_lib.fresh_allocation(c.config),
      allocation_speculation=None if schedule is None or not speculation
      else c.speculation(record_policy_logprobs=sampler_old,
                         num_samples=schedule.sampler_samples,
                         store=speculation.store))
  if c.env is not None:  # held-out episodes instead of single turns
    samplers = {"eval": c.episodes(s.eval_num_samples),
                "greedy": c.episodes(1, greedy=True) if s.eval_greedy
                          else None}
  else:
    samplers = {"eval": c.sampler(s.eval_num_samples,
                                  record_policy_logprobs=False),
                "greedy": c.sampler(1, greedy=True) if s.eval_greedy
                          else None}
  return Session(
      c=c, workdir=workdir, collector=collector,
      samplers=samplers,
      manager=ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                         **c.checkpoint_options),
      iterator=data_lib.make_prompt_iterator(
          c.train_examples, s.prompts_per_step, s.seed,
          block=c.group.block(c.mesh)),
      eval_key=eval_key, state_key=state_key, init_key=init_key)


def dots_embedder(c: build_lib.Components) -> Any:
  """DOTS's ``embed(params, tokens_BxP, mask_BxP) -> [B, D]``: the policy's
  final hidden states averaged over each prompt's tokens (jitted)."""
  config = c.model_config

  def embed(params, tokens, mask):
    hidden, _ = models.Decoder(config).apply(
        {"params": params}, tokens, models.positions_from_mask(mask),
        input_mask_BxT=mask)
    weights = mask.astype(jnp.float32)[..., None]
    return (jnp.sum(hidden.astype(jnp.float32) * weights, 1)
            / jnp.maximum(jnp.sum(weights, 1), 1.0))

  # Several processes: every process reads the whole result (replicated).
  jitted = jax.jit(embed) if c.group.single else jax.jit(
      embed, out_shardings=jax.sharding.NamedSharding(
          c.mesh, jax.sharding.PartitionSpec()))

  def run(params, tokens, mask):
    with jax.set_mesh(c.mesh):
      return np.asarray(jax.device_get(jitted(params, tokens, mask)))
  return run


def describe(config: Any) -> str:
  """What a config builds, in one line (the launcher's first lines)."""
  c = schema.complete_config(config)
  model = (f"the Hugging Face checkpoint {c.model.path}" if c.model.path
           else f"a fresh {c.model.preset!r} model")
  if c.model.lora.rank:
    model += f" with LoRA rank {c.model.lora.rank}"
  task = c.task.path or c.task.name
  sft = f"SFT {c.sft.num_steps} steps, " if c.sft.num_steps else ""
  env = f", environment {c.env.name!r}" if c.env.name else ""
  if c.preference.loss:  # rljax/train/preference.py
    pairs = c.preference.pairs_path or "pairs built from the task"
    return (f"{model} on {task!r}: {sft}preference optimisation "
            f"{c.preference.loss!r} {c.rl.num_steps} steps x "
            f"{c.preference.batch_size} pairs ({pairs})")
  return (f"{model} on {task!r}{env}: {sft}RL {c.rl.num_steps} steps x "
          f"{c.rl.prompts_per_step} prompts x {c.rl.group_size} samples, "
          f"{c.rl.advantage}/{c.rl.objective}, rollout {c.rl.rollout!r}")


def initial_state(run: Session) -> tuple[TrainState, Any]:
  """``(state, ref_params)``: a fresh start (SFT, the before-RL evaluation)
  or the newest readable checkpoint's."""
  c, s = run.c, run.c.settings
  kl = bool(c.step_config.kl_coef or c.step_config.log_kl)
  params = c.init_params(run.init_key)
  devices = jax.devices()
  log.info("model: %s params, vocab %d; %d %s device(s), mesh %s; "
           "algorithm %s", f"{models.count_params(params):,}",
           c.model_config.vocab_size, len(devices), devices[0].platform,
           dict(c.mesh.shape), c.algorithm.name)
  log.info("task %s: %d training prompts, %d held-out; RL: %d steps x %d "
           "prompts x %d samples; SFT: %d steps", s.task_name,
           len(c.train_examples), len(c.heldout), s.num_steps,
           s.prompts_per_step, s.group_size, c.sft.num_steps)
  primary = c.group.primary
  if not run.manager.all_steps():
    if primary and os.path.exists(run.metrics_path):  # a run that saved nothing
      rundir.trim_metrics(run.metrics_path, -10**9)
    run.writer = metrics_lib.from_config(run.c.config_json, run.workdir,
                                         active=primary)
    t = time.time()
    params = sft.run_sft(params, c.sft, task=c.task, tokenizer=c.tokenizer,
                         model_config=c.model_config.without_lora(),
                         mesh=c.mesh, param_shardings=c.base_param_shardings,
                         writer=run.writer, group=c.group)
    run.seconds["sft"] = time.time() - t
    if c.lora:
      params = c.attach_adapters(params, _adapter_key(run))
      if not c.lora_base_from_hf:
        save_lora_base(run, params)
    if c.settings.evaluates_at(0):  # eval.every=0: no held-out evaluation
      t = time.time()
      log.info("held-out evaluation before RL (compiles the sampler once)")
      run.before = run.evaluate(params, run.eval_key)
      log.info("held-out evaluation took %.1f s", time.time() - t)
      run.writer.write(0, run.before)
      log.info("held-out before RL: %s", format_eval(run.before))
    # With LoRA the KL reference is the frozen base itself: no copy.
    return (c.init_state(params, run.state_key),
            params if kl and not c.lora else None)
  if c.lora:
    params = restore_lora_base(run, params)
  # The restore target: shapes, dtypes and shardings of a fresh state.
  fresh = c.init_state(params, run.state_key)
  target = {"state": fresh}
  if c.lora:
    target["state"] = fresh._replace(
        params=steps_lib.trainable(c.model_config, fresh.params))
  if kl and not c.lora:
    target["ref_params"] = params
  # The state, the metadata and the host arrays are verified together: a
  # damaged draft store falls back to the previous checkpoint like a
  # damaged state.
  resumed, tree, meta, extras = run.manager.restore_latest_valid_with(
      target, ("drafts", "partial", "selection", "replay", "allocation"))
  del target
  run.iterator.set_state(meta["data_iterator"])
  if run.collector.speculation is not None:
    drafts = extras["drafts"]
    if drafts is not None:
      run.collector.speculation.store.load_arrays(drafts)
  greso = _greso(run)
  if greso is not None and extras["selection"] is not None:
    greso.load_arrays(extras["selection"])
  if run.collector.replay is not None and extras["replay"] is not None:
    run.collector.replay.load_arrays(extras["replay"])
  if extras["allocation"] is not None:  # sGPO's profile and curriculum
    run.collector.allocation.load_arrays(extras["allocation"])
  lost = (None if extras["partial"] is None
           else run.collector.load_carried(extras["partial"]))
  if lost:
    log.warning("the checkpoint carries %s, dropped: rl.rollout is not "
                "'partial' now, or env.name changed.", lost)
  run.before = meta.get("before", {})
  run.kl_coef = meta.get("kl_coef")
  dropped = rundir.trim_metrics(run.metrics_path, resumed) if primary else 0
  run.writer = metrics_lib.from_config(run.c.config_json, run.workdir,
                                         active=primary)
  log.info("resumed from step %d in %s (%d metric rows after it dropped)",
           resumed, run.manager.directory, dropped)
  state = tree["state"]
  if c.lora:
    state = state._replace(params=lora_lib.merge(
        lora_lib.split(params)[1], state.params))
  return state, tree.get("ref_params")


def _adapter_key(run: Session) -> jax.Array:
  """The fresh adapters' key (as ``models.init_params`` draws them)."""
  return jax.random.fold_in(run.init_key, 1)


def lora_base_reference(c: build_lib.Components) -> dict[str, str]:
  """Where a LoRA run's frozen base is: ``{"source": "hf", "path":
  model.path}`` or ``{"source": "checkpoint", "path": LORA_BASE_DIR}``
  (relative to the run directory)."""
  if c.lora_base_from_hf:
    return {"source": "hf", "path": c.hf_path}
  return {"source": "checkpoint", "path": LORA_BASE_DIR}


def _base_manager(workdir: str) -> ckpt_lib.CheckpointManager:
  return ckpt_lib.CheckpointManager(os.path.join(workdir, LORA_BASE_DIR),
                                    max_to_keep=1, async_save=False)


def save_lora_base(run: Session, params: Any) -> None:
  """Writes the frozen base of ``params`` (no adapters) to
  ``<workdir>/lora_base`` as step 0, replacing what a run that saved no RL
  checkpoint left there. Synchronous: it is written before any checkpoint
  that needs it."""
  directory = os.path.join(run.workdir, LORA_BASE_DIR)
  if run.c.group.primary and os.path.isdir(directory):
    shutil.rmtree(directory)
  run.c.group.barrier("lora_base_cleared")
  manager = _base_manager(run.workdir)
  try:
    manager.save(0, lora_lib.split(params)[1],
                 {"config": run.c.config_json, "model": "frozen LoRA base"})
    manager.wait()
  finally:
    manager.close()


def restore_lora_base(run: Session, base: Any) -> Any:
  """A resumed LoRA run's params with the frozen base and fresh adapters
  (the checkpoint's adapters replace them): ``model.path``'s weights
  (``base``, as ``init_params`` read them) or ``<workdir>/lora_base``.

  Raises:
    FileNotFoundError: ``lora_base`` is missing or unreadable, naming it.
  """
  c = run.c
  params = c.attach_adapters(base, _adapter_key(run))
  if c.lora_base_from_hf:
    return params
  directory = os.path.join(run.workdir, LORA_BASE_DIR)
  frozen = lora_lib.split(params)[1]
  manager = _base_manager(run.workdir)
  try:
    if manager.latest_step() is None:
      raise FileNotFoundError("no checkpoint there")
    restored, _ = manager.restore(0, frozen)
  except Exception as e:  # pylint: disable=broad-exception-caught
    # orbax / tensorstore raise many kinds for a damaged directory.
    raise FileNotFoundError(
        f"{directory}: the frozen LoRA base of this run is missing or "
        f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
        "the checkpoints hold the adapters only. Start the run fresh (delete "
        f"{run.manager.directory} or use another --workdir).") from e
  finally:
    manager.close()
  return lora_lib.merge(restored, lora_lib.adapters_of(params))


def summary(run: Session, last: dict[str, float], t0: float,
            preempted: bool, *, finished: bool = False) -> dict[str, Any]:
  """Closes the checkpoint manager and the writer, plots, and reports.

  ``finished``: the run had already finished when this process started
  (``already_finished`` in the summary; ``last`` then holds the final
  step's metrics as ``metrics.jsonl`` recorded them).
  """
  c, seconds, tokens = run.c, run.seconds, run.tokens
  t = time.time()
  run.manager.close()  # waits for the saves in flight
  seconds["checkpoint"] += time.time() - t
  run.writer.close()
  plot = os.path.join(run.workdir, "curves.png")
  if c.group.primary and not finished:
    rows = metrics_lib.read_jsonl(run.metrics_path)
    metrics_lib.plot_curves(
        [row for row in rows if row["step"] >= 0], plot,
        ["reward/total/mean", "eval/accuracy", "eval/greedy_accuracy",
         "completion_length/mean"], title=f"rljax: {c.settings.task_name}")
  after = {k: v for k, v in last.items() if k.startswith("eval/")}
  if "eval/accuracy" in after and not finished:
    log.info("held-out after RL: %s", format_eval(after))
  return {
      "workdir": run.workdir, "preempted": preempted,
      "already_finished": finished, "before": run.before,
      "after": after, "final": last, "plot": plot,
      "seconds": time.time() - t0, "seconds_by_phase": seconds,
      "tokens": tokens, "steps": run.steps,
      "first_step": run.first_step,
      "tokens_per_s": _rates(run),
      "process": {"index": c.group.index, "count": c.group.count,
                  "collectives": dict(c.group.collectives)},
      "checkpoints": run.manager.directory, "metrics": run.metrics_path,
      "tensorboard": os.path.join(run.workdir, "tensorboard"),
      "sampling_temperature": c.settings.sampling_temperature}


def _rates(run: Session) -> dict[str, float]:
  """Tokens/s of sampling and training, over the steps after this process's
  first (which compiles) when there are such steps."""
  seconds, tokens = dict(run.seconds), dict(run.tokens)
  if run.first_step is not None and run.steps > 1:
    for phase, key in (("sample", "generated"), ("train", "train")):
      seconds[phase] -= run.first_step["seconds"][phase]
      tokens[key] -= run.first_step["tokens"][key]
  return {"sample": tokens["generated"] / max(seconds["sample"], 1e-9),
          "train": tokens["train"] / max(seconds["train"], 1e-9)}


def format_eval(metrics: dict[str, float]) -> str:
  return ", ".join(f"{k.removeprefix('eval/')} {v:.3f}"
                   for k, v in metrics.items())
