"""The host loop: ``run(config, workdir, algorithm=None)``.

One RL step (docs/architecture.md), made of the public parts:

    batch = next(iterator)                              # rljax.data
    collected = collector.collect(params, batch, key, adv_state)
        # prompts -> Rollout -> rewards [N, R] -> advantages -> RLBatch
    state, metrics = rl_step(state, collected.batch, ref_params)
        # epochs x minibatches x microbatches, one compiled program
    metrics -> JSONL + TensorBoard; every k steps: evaluate, checkpoint

``build.build(config)`` makes the components; ``session`` sets the run up
(SFT warm-up and the before-RL evaluation, or the resume), checkpoints it
and reports; ``guards`` stops it early. Held-out accuracy is measured before
and after RL at the sampling temperature. A researcher who wants another schedule composes the
same parts (see ``colabs/compose_an_algorithm.ipynb``).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import time
from typing import Any

import jax

from rljax import distributed
from rljax import metrics as metrics_lib
from rljax.train import build as build_lib
from rljax.rollout import schedules
from rljax.train import guards, kl_control, preference, rundir, schema, session
from rljax.train import packing as packing_lib
from rljax.train.algorithm import Algorithm
from rljax.train.steps import jit_rl_step, make_rl_step

log = logging.getLogger("rljax")


def run(config: Any, workdir: str, *, algorithm: Algorithm | None = None,
        schedule: Any = None) -> dict[str, Any]:
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
    schedule: a factory ``fn(collector, iterator, rl_step, mesh) ->
      schedules.Schedule`` to use instead of the one ``rl.max_staleness``
      names (``schedules.make_schedule``).

  Returns:
    A summary: held-out metrics before and after RL, the final metrics, this
    process's wall clock by phase (``seconds_by_phase``: sft, sample, reward,
    advantage, train, evaluation, checkpoint), tokens and tokens/s of
    sampling and training, and the paths written.
  """
  # A bad field is named as such (not as a difference from a saved run) and
  # a refused start leaves the run directory as it was: no lock file either.
  build_lib.validate(config)
  log.info("building %s", session.describe(config))
  group = distributed.ProcessGroup()
  lock, error = None, None
  if group.primary:  # one lock for the run (a shared filesystem's workdir)
    try:
      lock = rundir.WorkdirLock(workdir)
    except RuntimeError as e:
      error = str(e)
  group.raise_any(error)
  # From here on SIGTERM/SIGINT only set a flag, checked at step boundaries
  # (a first signal during set-up or SFT stops at the first one).
  stop_signal = guards.StopSignal()
  try:
    group.check_same_config(json.loads(config.to_json_best_effort()))
    return _run(config, workdir, algorithm, stop_signal, group, schedule)
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
    if lock is not None:
      lock.release()


def _run(config: Any, workdir: str, algorithm: Algorithm | None,
         stop_signal: guards.StopSignal,
         group: distributed.ProcessGroup, schedule: Any) -> dict[str, Any]:
  t0 = time.time()
  saved = rundir.saved_config(workdir)
  checkpoints = os.path.join(workdir, "checkpoints")
  if saved is not None and os.path.isdir(checkpoints) and os.listdir(checkpoints):
    # Both completed: a field added since the run started (model.lora)
    # compares at its default.
    rundir.check_resumable(
        json.loads(schema.complete_config(saved).to_json_best_effort()),
        json.loads(schema.complete_config(config).to_json_best_effort()),
        workdir)
  c = build_lib.build(config, algorithm_override=algorithm, group=group)
  try:
    if c.config.preference.loss:  # the DPO family instead of RL
      return preference.train(c, workdir, t0, stop_signal)
    return _train(c, workdir, t0, stop_signal, schedule)
  finally:
    c.close()


def _train(c: build_lib.Components, workdir: str, t0: float,
           stop_signal: guards.StopSignal, schedule: Any) -> dict[str, Any]:
  s, sc = c.settings, c.step_config
  run = session.start(c, workdir)
  state, ref_params = session.initial_state(run)
  teacher_config, teacher_params = c.teacher or (None, None)
  rl_step = jit_rl_step(
      make_rl_step(c.model_config, sc, c.algorithm.optimizer,
                   c.algorithm.coefficient,
                   critic_optimizer=c.critic_optimizer,
                   teacher_config=teacher_config),
      c.mesh, jax.tree.map(lambda x: x.sharding, state),
      c.param_shardings if ref_params is not None else None,
      old_logprobs=sc.old_logprobs == "sampler",
      teacher_shardings=(None if teacher_params is None else jax.tree.map(
          lambda x: x.sharding, teacher_params)),
      rewards=sc.critic is not None,
      packed=bool(c.config.rl.padding_free),
      token_rewards=sc.critic is not None and c.env is not None,
      kl_coef=c.config.rl.kl_target is not None)
  if c.config.rl.padding_free:  # the host plans each step's packing
    rl_step = packing_lib.PaddingFree(rl_step, sc, c.mesh)
  rl_step, controller = kl_control.attach(c.config, c.mesh, run, rl_step)
  # The teacher is an extra argument only when there is one.
  teacher_args = () if teacher_params is None else (teacher_params,)
  if schedule is None:
    schedule = functools.partial(schedules.make_schedule,
                                 max_staleness=c.config.rl.max_staleness,
                                 num_steps=s.num_steps, publish=c.publish)
  plan = schedule(run.collector, run.iterator, rl_step, c.mesh)
  last: dict[str, float] = {}
  preempted = False
  step = int(state.step)
  finished = step >= s.num_steps
  if finished:  # a rerun of a finished run trains and writes nothing
    last = _metrics_at(run, step)
    log.info("this run already finished: step %d of %d in %s; nothing to "
             "train (raise rl.num_steps to train on).", step, s.num_steps,
             workdir)
  progress = metrics_lib.ProgressBar(
      s.num_steps, {"reward": "reward/total/mean", "accuracy": "accuracy",
                    "held-out": "eval/accuracy",
                    "tokens/s": "tokens_per_s/sample"}, initial=step,
      active=c.group.primary)
  stop = guards.Guards(s)
  if not finished:
    log.info("RL step %d: compiling the sampler and the update (once; the "
             "first step takes longer)", step + 1)
  while step < s.num_steps:
    # A signal to any process stops them all at the same step.
    if session.saved_on_signal(run, stop_signal, step, state, ref_params,
                               plan.checkpoint_extras):
      preempted = True
      break
    t_start = time.time()
    # A checkpoint follows this update: nothing is sampled ahead across it.
    barrier = (step + 1) % s.checkpoint_every == 0 or step + 1 == s.num_steps
    out = plan.step(state, ref_params, teacher_args, barrier=barrier)
    state, collected = out.state, out.collected
    step = int(state.step)
    m: dict[str, Any] = {**collected.metrics, **out.train_metrics,
                         **out.metrics}
    if isinstance(rl_step, packing_lib.PaddingFree):
      m["packing/fill"] = rl_step.last_fill  # real tokens / buffer slots
      m["packing/microbatches"] = rl_step.last_microbatches  # per update
    trained_tokens = m["num_train_tokens"] * sc.num_epochs
    m.update({
        "time/step": time.time() - t_start,
        "tokens_per_s/sample": m["num_generated_tokens"]
                               / max(m["time/sample"], 1e-9),
        "tokens_per_s/train": trained_tokens / max(m["time/train"], 1e-9),
    })
    for phase in ("sample", "reward", "advantage", "train"):
      run.seconds[phase] += m[f"time/{phase}"]
    run.tokens["generated"] += m["num_generated_tokens"]
    run.tokens["train"] += trained_tokens
    run.steps += 1
    if run.steps == 1:  # compiles included: kept out of ETA and tokens/s
      run.first_step = {"seconds": {k: m[f"time/{k}"] for k in
                                    ("sample", "train")},
                        "tokens": {"generated": m["num_generated_tokens"],
                                   "train": trained_tokens}}
      log.info("RL step %d took %.0f s, compiles included; the progress "
               "estimate and the closing tokens/s count from here.", step,
               m["time/step"])
      progress.restart_clock(step)
    if s.evaluates_at(step):
      m.update(run.evaluate(state.params, jax.random.fold_in(run.eval_key,
                                                             step)))
    rows = {**(collected.rows or {}), **{k: m.pop(k) for k in list(m)
                                         if k.startswith("rows/")}}
    every = s.histogram_every
    run.writer.write(step, m, rows if every and (
        step % every == 0 or step == s.num_steps) else None)
    progress.update(step, m)
    last = metrics_lib.to_floats(m)
    if last.get("coef/nonfinite_tokens"):
      log.warning("step %d: the coefficient chain of %r returned NaN/inf for "
                  "%d trained tokens; they weighed 0 in the update "
                  "(coef/nonfinite_tokens).", step,
                  run.collector.algorithm.name,
                  int(last["coef/nonfinite_tokens"]))
    kl_control.observe(controller, run, last, s.prompts_per_step * s.group_size)
    stop.check(step, last, run.manager, run.writer)
    if step % s.checkpoint_every == 0 or step == s.num_steps:
      run.save(step, state, ref_params, last,
               extras=plan.checkpoint_extras())
  progress.close()
  return session.summary(run, last, t0, preempted, finished=finished)


def _metrics_at(run: session.Session, step: int) -> dict[str, float]:
  """The metrics ``metrics.jsonl`` holds for ``step`` (process 0 reads)."""
  if not (run.c.group.primary and os.path.exists(run.metrics_path)):
    return {}
  merged: dict[str, float] = {}
  for row in metrics_lib.read_jsonl(run.metrics_path):
    if row.get("step") == step:
      merged.update({k: v for k, v in row.items() if k != "step"})
  return merged
