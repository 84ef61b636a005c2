"""The host loop: ``run(config, workdir, algorithm=None)``.

One RL step (DESIGN.md section 3), made of the public parts:

    batch = next(iterator)                              # rljax.data
    collected = collector.collect(params, batch, key, adv_state)
        # prompts -> Rollout -> rewards [N, R] -> advantages -> RLBatch
    state, metrics = rl_step(state, collected.batch, ref_params)
        # epochs x minibatches x microbatches, one compiled program
    metrics -> JSONL + TensorBoard; every k steps: evaluate, checkpoint

``build.build(config)`` makes the components; ``sft.run_sft`` warms the
policy up; held-out accuracy is measured before and after RL at the
sampling temperature. A researcher who wants another schedule composes the
same parts (see ``colabs/compose_an_algorithm.ipynb``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import checkpoint as ckpt_lib
from rljax import data as data_lib
from rljax import metrics as metrics_lib
from rljax import models
from rljax.train import build as build_lib
from rljax.train import critic as critic_lib
from rljax.train import distill, evaluation, rundir, sft
from rljax.train.algorithm import Algorithm
from rljax.train.rollout import Collector
from rljax.train.steps import TrainState, jit_rl_step, make_rl_step

log = logging.getLogger("rljax")


def evaluate(c: build_lib.Components, params: Any, key: jax.Array,
             samplers: dict[str, Any]) -> dict[str, float]:
  """Held-out metrics at the sampling temperature (and greedy, if asked)."""
  kwargs = dict(buckets=c.buckets, eos_ids=c.eos_ids,
                correctness_reward=c.correctness)
  with jax.set_mesh(c.mesh):
    out = evaluation.evaluate(params, samplers["eval"], c.tokenizer, c.heldout,
                              c.evaluator, key,
                              num_samples=c.settings.eval_num_samples, **kwargs)
    if c.settings.eval_greedy:
      greedy = evaluation.evaluate(
          params, samplers["greedy"], c.tokenizer, c.heldout, c.evaluator,
          key, num_samples=1, prefix="eval/greedy_", **kwargs)
      out["eval/greedy_accuracy"] = greedy["eval/greedy_accuracy"]
  return out


def init_state(c: build_lib.Components, params: Any, key: jax.Array
               ) -> TrainState:
  """A fresh ``TrainState`` around ``params`` (jitted; shardings follow params)."""
  s, sc, alg = c.settings, c.step_config, c.algorithm
  rows = s.prompts_per_step * (s.group_size + alg.extra_samples)
  micro = s.prompts_per_step * s.group_size // (
      sc.num_minibatches * sc.num_microbatches)
  length = c.buckets[-1] + sc.max_length
  num_rewards = s.num_rewards

  def init(params, key):
    critic = None
    if sc.critic is not None:  # the value model starts from the policy
      critic_params = critic_lib.init_params(params, c.model_config)
      critic = critic_lib.CriticState(
          critic_params, c.critic_optimizer.init(critic_params))
    return TrainState(
        params, alg.optimizer.init(params),
        alg.advantage.init(jnp.zeros((rows, num_rewards), jnp.float32)),
        alg.coefficient.init(jnp.zeros((micro, length), jnp.float32)),
        jnp.zeros((), jnp.int32), jax.random.key_data(key), critic)

  with jax.set_mesh(c.mesh):  # unsharded leaves (counts, keys) replicate
    return jax.jit(init)(params, key)


class _StopSignal:
  """Records SIGTERM/SIGINT so the loop can checkpoint at a step boundary."""

  def __init__(self):
    self.received = None
    self._previous = {}
    if threading.current_thread() is not threading.main_thread():
      return  # signal handlers can only be set from the main thread
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    # A second signal takes the default action (the process ends at once),
    # never a KeyboardInterrupt raised inside a running XLA computation.
    # Checkpoints are atomic, so nothing saved is lost.
    for sig in self._previous:
      signal.signal(sig, signal.SIG_DFL)

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


class _Guards:
  """Stops a run whose updates keep being non-finite or whose rewards fail."""

  def __init__(self, settings: build_lib.LoopSettings):
    self.s = settings
    self.skipped_total = 0
    self.failing_steps = 0

  def check(self, step: int, last: dict[str, float],
            manager: ckpt_lib.CheckpointManager,
            writer: metrics_lib.MetricWriter) -> None:
    """Warns on skipped updates; closes up and raises past a limit."""
    s = self.s
    if last.get("nonfinite_skipped_total", 0) > self.skipped_total:
      self.skipped_total = int(last["nonfinite_skipped_total"])
      log.warning("step %d: non-finite loss or gradient; the update was "
                  "skipped (%d updates skipped so far).", step,
                  self.skipped_total)
    bad = int(last.get("nonfinite_consecutive", 0))
    if s.max_consecutive_nonfinite and bad >= s.max_consecutive_nonfinite:
      writer.close()
      manager.wait()  # a save in flight completes before the message names it
      latest = manager.latest_step()
      where = (f"the newest complete checkpoint is step {latest} in "
               f"{os.path.join(manager.directory, str(latest))}"
               if latest is not None else
               f"no checkpoint was saved yet in {manager.directory}")
      manager.close()
      raise FloatingPointError(
          f"{bad} consecutive optimizer updates up to RL step {step} had a "
          "non-finite loss or gradient (optimizer.max_consecutive_nonfinite="
          f"{s.max_consecutive_nonfinite}): stopping; {where}.")
    failing = last["reward/failure_fraction"] > s.max_reward_failure_fraction
    self.failing_steps = self.failing_steps + 1 if failing else 0
    if self.failing_steps >= s.reward_failure_patience:
      writer.close()
      manager.close()  # a save in flight completes
      raise RuntimeError(
          f"reward/failure_fraction > rewards.max_failure_fraction="
          f"{s.max_reward_failure_fraction} for {self.failing_steps} RL steps "
          f"in a row (rewards.failure_patience={s.reward_failure_patience}, "
          f"last step {step}): the reward functions are failing, see the "
          "warnings above. Fix them, or raise either setting to keep training.")


def run(config: Any, workdir: str, *, algorithm: Algorithm | None = None
        ) -> dict[str, Any]:
  """Trains as ``config`` says, writing everything under ``workdir``.

  The run holds an exclusive lock on ``workdir`` (a second run on it fails,
  naming the holder). A directory with checkpoints is resumed from its newest
  readable one, after checking that the config can continue it (the fields
  of ``rundir.RESUME_FIELDS``) and before anything is written; rows of
  ``metrics.jsonl`` after the restored step are dropped. A checkpoint holds
  the train state, the reference params (with a KL term), the data
  iterator's position, the before-RL figures and, with SPEC-RL, the draft
  store. A full disk ends the run with one error naming the path.

  Args:
    config: an ml_collections config (``configs/*.py``).
    workdir: where config, tokenizer, metrics, plots and checkpoints go.
    algorithm: a user-built ``Algorithm`` to train instead of the one the
      config names (``rl.advantage``, ``rl.objective``, ``optimizer``).

  Returns:
    A summary: held-out metrics before and after RL, the final metrics, this
    process's wall clock by phase (``seconds_by_phase``: sft, sample, reward,
    advantage, train, evaluation, checkpoint), tokens and tokens/s of
    sampling and training, and the paths written.
  """
  lock = rundir.WorkdirLock(workdir)
  # From here on SIGTERM/SIGINT only set a flag, checked at step boundaries
  # (a first signal during set-up or SFT stops at the first one).
  stop_signal = _StopSignal()
  try:
    return _run(config, workdir, algorithm, stop_signal)
  except Exception as e:  # pylint: disable=broad-exception-caught
    full = rundir.disk_full(e)
    if full is None:
      raise
    raise OSError(
        errno.ENOSPC, f"no space left on the device while writing "
        f"{full.filename or workdir}: free some space, then run the same "
        "command to resume from the newest complete checkpoint in "
        f"{os.path.join(workdir, 'checkpoints')}.") from None
  finally:
    stop_signal.restore()
    lock.release()


def _run(config: Any, workdir: str, algorithm: Algorithm | None,
         stop_signal: _StopSignal) -> dict[str, Any]:
  t0 = time.time()
  config_json = json.loads(config.to_json_best_effort())
  checkpoints = os.path.join(workdir, "checkpoints")
  saved = rundir.saved_config(workdir)
  if saved is not None and os.path.isdir(checkpoints) and os.listdir(checkpoints):
    rundir.check_resumable(saved, config_json, workdir)
  c = build_lib.build(config, algorithm_override=algorithm)
  try:
    return _train(c, config, config_json, workdir, t0, stop_signal)
  finally:
    c.evaluator.close()


def _train(c: build_lib.Components, config: Any, config_json: dict[str, Any],
           workdir: str, t0: float, stop_signal: _StopSignal
           ) -> dict[str, Any]:
  s, alg = c.settings, c.algorithm
  kl = bool(c.step_config.kl_coef)
  teacher_config = teacher_params = None
  if c.step_config.distill_coef:  # loaded before anything is compiled
    teacher = config.teacher
    teacher_config, teacher_params = distill.load_teacher(
        teacher.path, c.mesh, c.model_config.vocab_size, step=teacher.get("step"))
    log.info("teacher for on-policy distillation: %s (%s params)",
             teacher.path, f"{models.count_params(teacher_params):,}")
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  if c.hf_path:  # what load_policy needs to rebuild tokenizer and model
    build_lib.save_hf_files(c.hf_path, workdir)
  else:
    c.tokenizer.save(os.path.join(workdir, "tokenizer.model"))
  # Four keys, the second unused (it was the SFT's, which draws its data
  # from the seed): a seed keeps the initial params and keys it always had.
  init_key, _, eval_key, state_key = jax.random.split(jax.random.key(s.seed), 4)
  params = (c.initial_params if c.initial_params is not None
            else models.init_params(c.model_config, init_key, c.mesh))
  c.initial_params = None
  devices = jax.devices()
  log.info("model: %s params, vocab %d; %d %s device(s), mesh %s; "
           "algorithm %s", f"{models.count_params(params):,}",
           c.model_config.vocab_size, len(devices), devices[0].platform,
           dict(c.mesh.shape), alg.name)
  log.info("task %s: %d training prompts, %d held-out; RL: %d steps x %d "
           "prompts x %d samples; SFT: %d steps", s.task_name,
           len(c.train_examples), len(c.heldout), s.num_steps,
           s.prompts_per_step, s.group_size, c.sft.num_steps)
  sampler_old = c.step_config.old_logprobs == "sampler"
  samplers = {"eval": c.sampler(s.eval_num_samples,
                                record_policy_logprobs=False),
              "greedy": c.sampler(1, greedy=True)}
  collector = Collector(
      sampler=c.sampler(s.group_size + alg.extra_samples,
                        record_policy_logprobs=sampler_old),
      tokenizer=c.tokenizer, evaluator=c.evaluator, algorithm=alg,
      group_size=s.group_size, buckets=c.buckets, eos_ids=c.eos_ids,
      correctness=c.correctness, mesh=c.mesh,
      speculation=c.speculation(record_policy_logprobs=sampler_old))
  manager = ckpt_lib.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      **build_lib.checkpoint_options(config))
  iterator = data_lib.make_prompt_iterator(
      c.train_examples, s.prompts_per_step, s.seed)
  summary: dict[str, Any] = {"workdir": workdir, "preempted": False}
  # Wall-clock seconds of this process's phases (a resumed run's only).
  seconds = dict.fromkeys(("sft", "sample", "reward", "advantage", "train",
                           "evaluation", "checkpoint"), 0.0)
  tokens = {"generated": 0.0, "train": 0.0}
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if not manager.all_steps():
    if os.path.exists(metrics_path):  # rows of a run that saved nothing
      rundir.trim_metrics(metrics_path, -10**9)
    writer = metrics_lib.MetricWriter(workdir)
    t = time.time()
    params = sft.run_sft(params, c.sft, task=c.task, tokenizer=c.tokenizer,
                         model_config=c.model_config, mesh=c.mesh,
                         param_shardings=c.param_shardings, writer=writer)
    seconds["sft"] = time.time() - t
    t = time.time()
    summary["before"] = evaluate(c, params, eval_key, samplers)
    seconds["evaluation"] += time.time() - t
    writer.write(0, summary["before"])
    log.info("held-out before RL: %s", _fmt(summary["before"]))
    state = init_state(c, params, state_key)
    ref_params = params if kl else None
  else:
    # The restore target: shapes, dtypes and shardings of a fresh state.
    target = {"state": init_state(c, params, state_key)}
    if kl:
      target["ref_params"] = params
    resumed, tree, meta = manager.restore_latest_valid(target)
    state, ref_params = tree["state"], tree.get("ref_params")
    del target
    iterator.set_state(meta["data_iterator"])
    if collector.speculation is not None:
      drafts = manager.restore_host_arrays(resumed, "drafts")
      if drafts is not None:
        collector.speculation.store.load_arrays(drafts)
    summary["before"] = meta.get("before", {})
    dropped = rundir.trim_metrics(metrics_path, resumed)
    writer = metrics_lib.MetricWriter(workdir)
    log.info("resumed from step %d in %s (%d metric rows after it dropped)",
             resumed, manager.directory, dropped)
  del params  # the state holds them (and ref_params, with a KL term)

  def save(step, metrics=None):
    t = time.time()
    tree = {"state": state}
    if kl:
      tree["ref_params"] = ref_params
    best = s.best_metric
    manager.save(step, tree, {"data_iterator": iterator.get_state(),
                              "before": summary["before"],
                              "config": config_json},
                 metrics=({best: metrics[best]} if best and metrics
                          and best in metrics else None),
                 host_arrays={"drafts": (collector.speculation.store.arrays()
                                         if collector.speculation else None)})
    seconds["checkpoint"] += time.time() - t

  rl_step = jit_rl_step(
      make_rl_step(c.model_config, c.step_config, alg.optimizer,
                   alg.coefficient, critic_optimizer=c.critic_optimizer,
                   teacher_config=teacher_config),
      c.mesh, jax.tree.map(lambda x: x.sharding, state),
      c.param_shardings if kl else None, old_logprobs=sampler_old,
      teacher_shardings=(None if teacher_params is None else jax.tree.map(
          lambda x: x.sharding, teacher_params)))
  # The teacher is an extra argument only when there is one.
  teacher_args = () if teacher_params is None else (teacher_params,)
  last: dict[str, float] = {}
  step = int(state.step)
  progress = metrics_lib.ProgressBar(
      s.num_steps, {"reward": "reward/total/mean", "accuracy": "accuracy",
                    "held-out": "eval/accuracy",
                    "tokens/s": "tokens_per_s/sample"}, initial=step)
  guards = _Guards(s)
  while step < s.num_steps:
    if stop_signal.received:
      save(step)
      manager.wait()
      log.warning("%s received: saved a checkpoint at step %d in %s; run the "
                  "same command (same --workdir) to resume.",
                  stop_signal.received, step, manager.directory)
      summary["preempted"] = True
      break
    t_start = time.time()
    # The key data comes to the host (8 bytes): an uncommitted key gives one
    # fold_in program whatever the state's sharding.
    sample_key = jax.random.fold_in(
        jax.random.wrap_key_data(np.asarray(jax.device_get(state.key))), 1)
    collected = collector.collect(state.params, next(iterator), sample_key,
                                  state.adv_state)
    state = state._replace(adv_state=collected.adv_state)
    t_collect = time.time()
    with jax.set_mesh(c.mesh):
      state, train_metrics = rl_step(state, collected.batch, ref_params,
                                     *teacher_args)
      train_metrics = jax.device_get(train_metrics)
    t_train = time.time()
    step = int(state.step)
    m: dict[str, Any] = {**collected.metrics, **train_metrics}
    m.update({
        "time/train": t_train - t_collect, "time/step": t_train - t_start,
        "tokens_per_s/sample": m["num_generated_tokens"]
                               / max(m["time/sample"], 1e-9),
        "tokens_per_s/train": m["num_train_tokens"] * c.step_config.num_epochs
                              / max(t_train - t_collect, 1e-9),
    })
    for phase in ("sample", "reward", "advantage", "train"):
      seconds[phase] += m[f"time/{phase}"]
    tokens["generated"] += m["num_generated_tokens"]
    tokens["train"] += m["num_train_tokens"] * c.step_config.num_epochs
    if step % s.eval_every == 0 or step == s.num_steps:
      t = time.time()
      m.update(evaluate(c, state.params, jax.random.fold_in(eval_key, step),
                        samplers))
      seconds["evaluation"] += time.time() - t
    writer.write(step, m)
    progress.update(step, m)
    last = metrics_lib.to_floats(m)
    guards.check(step, last, manager, writer)
    if step % s.checkpoint_every == 0 or step == s.num_steps:
      save(step, last)
  progress.close()
  t = time.time()
  manager.close()  # waits for the saves in flight
  seconds["checkpoint"] += time.time() - t
  writer.close()
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  plot = os.path.join(workdir, "curves.png")
  metrics_lib.plot_curves(
      [row for row in rows if row["step"] >= 0], plot,
      ["reward/total/mean", "eval/accuracy", "eval/greedy_accuracy",
       "completion_length/mean"], title=f"rljax: {s.task_name}")
  summary.update({
      "after": {k: v for k, v in last.items() if k.startswith("eval/")},
      "final": last, "plot": plot, "seconds": time.time() - t0,
      "seconds_by_phase": seconds, "tokens": tokens,
      "tokens_per_s": {
          "sample": tokens["generated"] / max(seconds["sample"], 1e-9),
          "train": tokens["train"] / max(seconds["train"], 1e-9)},
      "checkpoints": manager.directory, "metrics": metrics_path,
      "tensorboard": os.path.join(workdir, "tensorboard"),
      "sampling_temperature": s.sampling_temperature})
  if "eval/accuracy" in summary["after"]:
    log.info("held-out after RL: %s", _fmt(summary["after"]))
  return summary


def _fmt(metrics):
  return ", ".join(f"{k.removeprefix('eval/')} {v:.3f}"
                   for k, v in metrics.items())
