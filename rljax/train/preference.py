"""Offline preference optimisation from the launcher: the DPO family.

``python -m launch.train --config=configs/arithmetic_dpo.py`` trains the
policy on preference pairs instead of RL rollouts when
``preference.loss`` names an entry of ``PREFERENCE_LOSSES`` (the losses are
``rljax/objectives/preference.py``'s, with their papers). Everything else
is the RL run's: the run directory (config, tokenizer, ``metrics.jsonl``,
TensorBoard and the other writers), the SFT warm-up, the held-out task
evaluation before and after (``eval/accuracy``: the verifier's), the
checkpoints (``TrainState``; a killed run resumes exactly: the step's pairs
are drawn from ``(seed, step)``), LoRA (adapters trained, the frozen base is
the reference), ``launch.export`` and ``load_policy``. A step trains
``preference.batch_size`` pairs; ``rl.num_steps`` steps with the run's
optimizer (``optimizer.*``).

Pairs: a JSONL file (``preference.pairs_path``: ``prompt``, ``chosen``,
``rejected``), or built from the built-in task as the reward model's are
(``reward_training.builtin_pairs``: the reference answer over a wrong
integer). A pair whose chosen side is empty is an error naming the file and
the pair; a pair whose two sides are equal carries no preference and is
skipped, counted (``pref/identical_pairs``) and logged. KTO reads each pair
as a desirable and an undesirable completion, and pairs each prompt with
another example's completion for its KL estimate.

The reference: the policy as the run starts (after the warm-up), written
once to ``<workdir>/reference`` and read back on resume; with LoRA the
frozen base itself; or ``preference.reference``, another run directory or
Hugging Face checkpoint with the same tokenizer. With
``preference.precompute_reference`` its log-probabilities of every pair are
computed once at the start (and again on resume), so the reference is not
held in device memory while training.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import checkpoint as ckpt_lib
from rljax import metrics as metrics_lib
from rljax import models
from rljax import optim as optim_lib
from rljax import sharding
from rljax.models import lora as lora_lib
from rljax.objectives import preference as pref_lib
from rljax.train import guards, reward_training, session
from rljax.train.preference_pairs import (  # noqa: F401  (re-exported)
    EncodedPairs, batch_rows, clean_pairs, draw, encode, online_batch,
    pairs_from_groups, rows, to_host)
from rljax.train.preference_losses import (PREFERENCE_LOSSES, PreferenceEntry,
                                          entry, loss_settings, validate)
from rljax.train import policy as policy_lib
from rljax.train import steps as steps_lib

log = logging.getLogger("rljax")

REFERENCE_DIR = "reference"


# ----------------------------------------------------------------------------
# The step.


def _sequence_logprobs(params, model_config, tokens, input_mask, loss_mask,
                       packing):
  lp, _ = models.sequence_logprobs(params, model_config, tokens, input_mask,
                                   with_entropy=False, packing=packing)
  return (jnp.sum(jnp.where(loss_mask, lp, 0.0), -1),
          jnp.sum(loss_mask, -1).astype(jnp.float32))


def batch_loss(name: str, settings: dict[str, float], policy_R, ref_R,
               tokens_R) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss of one batch's rows (``batch_rows``'s layout) from their
  summed log-probabilities and token counts."""
  e = entry(name)
  if e.unpaired:
    half = policy_R.shape[0] // 2
    desirable = jnp.arange(half) < half // 2
    return e.loss(policy_R[:half], ref_R[:half], desirable, policy_R[half:],
                  ref_R[half:], **settings)
  p = policy_R.shape[0] // 2
  s = pref_lib.SequenceLogprobs(policy_R[:p], policy_R[p:], ref_R[:p],
                                ref_R[p:], tokens_R[:p], tokens_R[p:])
  return e.loss(s, **settings)


def make_step(model_config: models.ModelConfig, optimizer: Any, name: str,
              settings: dict[str, float]):
  """``step(state, tokens, input_mask, loss_mask, ref_R, packing) ->
  (state, metrics)``: one optimizer update on a batch of rows. With LoRA the
  adapters are trained and the frozen base stays as it is."""

  def loss_fn(own, base, tokens, input_mask, loss_mask, ref_R, packing):
    params = own if base is None else lora_lib.merge(base, own)
    policy_R, tokens_R = _sequence_logprobs(params, model_config, tokens,
                                            input_mask, loss_mask, packing)
    loss, m = batch_loss(name, settings, policy_R, ref_R, tokens_R)
    p = tokens.shape[0] // (4 if entry(name).unpaired else 2)
    m.update({"loss": loss,
              "logps/chosen": jnp.mean(jax.lax.stop_gradient(policy_R[:p])),
              "logps/rejected": jnp.mean(jax.lax.stop_gradient(
                  policy_R[p:2 * p]))})
    return loss, m

  def step(state: steps_lib.TrainState, tokens, input_mask, loss_mask, ref_R,
           packing=None):
    own = steps_lib.trainable(model_config, state.params)
    base = steps_lib.frozen_base(model_config, state.params)
    (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        own, base, tokens, input_mask, loss_mask, ref_R, packing)
    updates, opt_state = optimizer.update(grads, state.opt_state, own,
                                          ess=jnp.ones((), jnp.float32))
    own = optax.apply_updates(own, updates)
    m["grad_norm"] = optax.tree.norm(grads)
    m.update(optim_lib.optimizer_metrics(opt_state))
    params = own if base is None else lora_lib.merge(base, own)
    return state._replace(params=params, opt_state=opt_state,
                          step=state.step + 1), m

  return step


def _score(model_config, params, tokens, input_mask, loss_mask, packing):
  return _sequence_logprobs(params, model_config, tokens, input_mask,
                            loss_mask, packing)


def make_reference_fn(model_config: models.ModelConfig):
  """``fn(params, tokens, input_mask, loss_mask, packing) -> [R]`` summed
  log-probabilities, without gradient (jitted by the caller)."""
  def fn(params, tokens, input_mask, loss_mask, packing=None):
    return jax.lax.stop_gradient(_sequence_logprobs(
        params, model_config, tokens, input_mask, loss_mask, packing)[0])
  return fn


# ----------------------------------------------------------------------------
# The run.


class _Data(NamedTuple):
  train: EncodedPairs
  heldout: EncodedPairs
  identical: int


def _load(c: Any) -> _Data:
  p = c.config.preference
  train, heldout = reward_training.load_pairs(c.config, c.task, "preference")
  train, identical = clean_pairs(train, p.pairs_path or "built-in pairs")
  heldout, held_identical = clean_pairs(
      heldout, p.heldout_path or p.pairs_path or "built-in held-out pairs")
  if identical or held_identical:
    log.warning("preference pairs: %d training and %d held-out pairs have "
                "equal chosen and rejected sides: skipped "
                "(pref/identical_pairs)", identical, held_identical)
  width = p.max_length
  return _Data(
      encode(c.tokenizer, train, width, p.pairs_path or "built-in pairs"),
      encode(c.tokenizer, heldout, width,
             p.heldout_path or p.pairs_path or "built-in held-out pairs"),
      identical)


class _Reference:
  """The reference model's log-probabilities (module docstring)."""

  def __init__(self, c: Any, run: session.Session, params: Any,
               fresh: bool):
    p, self.c = c.config.preference, c
    self.needed = entry(p.loss).reference
    self.config, self.params = c.model_config, None
    if not self.needed:
      return
    if c.lora:  # the frozen base: the same params without their adapters
      self.config = c.model_config.base_config()
    elif p.reference:
      self.config, self.params = policy_lib.load_teacher(
          p.reference, c.mesh, c.model_config.vocab_size,
          tokenizer=getattr(c.tokenizer, "tokenizer", c.tokenizer),
          field="preference.reference")
    else:
      self.params = _initial_reference(run, params, fresh)
    self._fn = jax.jit(make_reference_fn(self.config))

  def __call__(self, policy_params, tokens, input_mask, loss_mask, packing):
    if not self.needed:
      return jnp.zeros((tokens.shape[0],), jnp.float32)
    params = policy_params if self.params is None else self.params
    return self._fn(params, tokens, input_mask, loss_mask, packing)


def _reference_manager(workdir: str) -> ckpt_lib.CheckpointManager:
  return ckpt_lib.CheckpointManager(os.path.join(workdir, REFERENCE_DIR),
                                    max_to_keep=1, async_save=False)


def _initial_reference(run: session.Session, params: Any, fresh: bool) -> Any:
  """The policy as the run started: written once at a fresh start (a copy
  of ``params``), read back on resume."""
  directory = os.path.join(run.workdir, REFERENCE_DIR)
  manager = _reference_manager(run.workdir)
  try:
    if fresh:
      reference = jax.tree.map(jnp.copy, params)
      manager.save(0, reference, {"model": "preference reference"})
      manager.wait()
      return reference
    if manager.latest_step() is None:
      raise FileNotFoundError(
          f"{directory}: the reference model of this preference run is "
          "missing; its checkpoints hold the policy only. Start the run "
          f"fresh (delete {run.manager.directory} or use another --workdir).")
    restored, _ = manager.restore(0, params)
    return restored
  finally:
    manager.close()


def _put(c: Any, arrays: Sequence[np.ndarray]) -> list[Any]:
  """Host rows of the global batch onto the mesh (this process's block)."""
  group = c.group
  n = arrays[0].shape[0]
  if group.single:
    rows_sharding = sharding.batch_sharding(c.mesh, 2)
    return [jax.device_put(x, rows_sharding if x.ndim == 2
                           else sharding.batch_sharding(c.mesh, 1))
            for x in arrays]
  block = group.rows(c.mesh, n)
  return [group.global_array(x[block], c.mesh) for x in arrays]


def _packing(c: Any, input_mask: np.ndarray):
  if not c.config.preference.padding_free:
    return None
  from rljax.train import sft  # pylint: disable=g-import-not-at-top
  return sft.pack_batch(input_mask, sharding.batch_ways(c.mesh))


def _precompute(c, data_pairs: EncodedPairs, reference: _Reference,
                policy_params, batch_size: int) -> np.ndarray:
  """``[num_pairs, 2]`` (chosen, rejected) reference log-probabilities of
  every pair, in batches of the step's shape."""
  p = c.config.preference
  n = len(data_pairs.prompts)
  out = np.zeros((n, 2), np.float32)
  for lo in range(0, n, batch_size):
    idx = np.arange(lo, lo + batch_size) % n
    arrays = batch_rows(data_pairs, idx, False, p.max_length,
                        c.tokenizer.pad_id)
    with jax.set_mesh(c.mesh):
      ref = to_host(c, reference(policy_params, *_put(c, arrays),
                                  _packing(c, arrays[1])))
    k = min(batch_size, n - lo)
    out[lo:lo + k, 0] = ref[:k]
    out[lo:lo + k, 1] = ref[batch_size:batch_size + k]
  return out


def heldout_accuracy(c, data_pairs: EncodedPairs, reference: _Reference,
                     score, params, batch_size: int) -> float:
  """The fraction of held-out pairs whose implicit reward ranks the chosen
  side first (``beta`` scales both sides: it does not change the order):
  the log-ratio to the reference, or for a reference-free loss the
  length-normalised log-probability. A tie counts one half."""
  p = c.config.preference
  n = len(data_pairs.prompts)
  wins = []
  for lo in range(0, n, batch_size):
    idx = np.arange(lo, lo + batch_size) % n
    arrays = batch_rows(data_pairs, idx, False, p.max_length,
                        c.tokenizer.pad_id)
    with jax.set_mesh(c.mesh):
      placed = _put(c, arrays)
      packing = _packing(c, arrays[1])
      policy, tokens = score(params, *placed, packing)
      ref = reference(params, *placed, packing)
    policy, tokens, ref = (to_host(c, x) for x in (policy, tokens, ref))
    if entry(p.loss).reference:
      value = policy - ref
    else:
      value = policy / np.maximum(tokens, 1.0)
    k = min(batch_size, n - lo)
    chosen, rejected = value[:batch_size][:k], value[batch_size:][:k]
    wins.append((chosen > rejected) + 0.5 * (chosen == rejected))
  return float(np.concatenate(wins).mean())


def train(c: Any, workdir: str, t0: float, stop_signal: guards.StopSignal
          ) -> dict[str, Any]:
  """Trains ``c`` (``build.build``'s components of a config with
  ``preference.loss``) in ``workdir``: the module docstring. Returns the
  run's summary (``session.summary``), with the held-out pair accuracy
  before and after (``eval/pair_accuracy``)."""
  p, s = c.config.preference, c.settings
  e = entry(p.loss)
  online = bool(p.online)
  data = None
  if not online or p.pairs_path:
    data = _load(c)
  elif c.task is not None:  # held-out pairs from the task, where it has them
    try:
      data = _load(c)
    except ValueError as err:
      log.info("no held-out pairs (%s): eval/pair_accuracy is not measured",
               err)
  if data is not None:
    log.info("preference pairs: %d training%s, %d held-out (%s), %d "
             "identical skipped; loss %s", len(data.train.prompts),
             " (unused: online)" if online else "",
             len(data.heldout.prompts), p.pairs_path or "built from the task",
             data.identical, p.loss)
  if online:
    log.info("online %s: each step %d prompts x %d samples from the policy, "
             "each group's best over its worst by %s", p.loss,
             s.prompts_per_step, s.group_size, "+".join(
                 c.config.rewards.names))
  pairs_per_step = s.prompts_per_step if online else p.batch_size
  rows_per_step = pairs_per_step * (4 if e.unpaired else 2)
  sharding.check_batch_divisible(rows_per_step, c.mesh,
                                 "rows per preference step (preference."
                                 "batch_size x 2, x 4 for KTO)")
  run = session.start(c, workdir)
  fresh = not run.manager.all_steps()
  state, _ = session.initial_state(run)
  reference = _Reference(c, run, state.params, fresh)
  settings = loss_settings(p.loss, p)
  # The state keeps its shardings across steps (a restored one has the
  # fresh one's), so every step runs one compiled program.
  step_fn = jax.jit(make_step(c.model_config, c.algorithm.optimizer, p.loss,
                              settings), donate_argnums=(0,),
                    out_shardings=(jax.tree.map(lambda x: x.sharding, state),
                                   jax.sharding.NamedSharding(
                                       c.mesh, jax.sharding.PartitionSpec())))
  score = jax.jit(functools.partial(_score, c.model_config))
  precomputed = None
  if p.precompute_reference and e.reference and not e.unpaired and not online:
    t = time.time()
    precomputed = _precompute(c, data.train, reference, state.params,
                              p.batch_size)
    log.info("reference log-probabilities of %d pairs precomputed in %.1f s",
             len(precomputed), time.time() - t)
    reference.params = None if not c.lora else reference.params
  step = int(state.step)
  if fresh and data is not None:
    row = {"pref/identical_pairs": float(data.identical)}
    if s.evaluates_at(0):  # eval.every=0: no held-out evaluation
      before = heldout_accuracy(c, data.heldout, reference, score,
                                state.params, pairs_per_step)
      run.before["eval/pair_accuracy"] = row["eval/pair_accuracy"] = before
      log.info("held-out pair accuracy before: %.3f", before)
    run.writer.write(0, row)
  last: dict[str, float] = {}
  preempted = False
  stop = guards.Guards(s)
  finished = step >= s.num_steps
  if finished:
    log.info("this run already finished: step %d of %d in %s.", step,
             s.num_steps, workdir)
  progress = metrics_lib.ProgressBar(
      s.num_steps, {"loss": "pref/loss", "accuracy": "pref/rewards/accuracy",
                    "held-out": "eval/accuracy"}, initial=step,
      active=c.group.primary)
  while step < s.num_steps:
    if session.saved_on_signal(run, stop_signal, step, state):
      preempted = True
      break
    t_start = time.time()
    extra: dict[str, float] = {}
    if online:
      pairs, extra = online_batch(c, run, state.params, step)
      idx = np.arange(pairs_per_step)
    else:
      pairs = data.train
      idx = draw(s.seed, step, len(data.train.prompts), p.batch_size)
    if pairs is None:  # every group tied: nothing to prefer
      log.warning("step %d: every sampled group scored alike; no pair, no "
                  "update (pref/online/tied_groups)", step + 1)
      state = state._replace(step=state.step + 1)
      m: dict[str, float] = {}
    else:
      arrays = batch_rows(pairs, idx, e.unpaired, p.max_length,
                          c.tokenizer.pad_id)
      packing = _packing(c, arrays[1])
      with jax.set_mesh(c.mesh):
        placed = _put(c, arrays)
        if precomputed is not None:
          ref_R = _put(c, [np.concatenate([precomputed[idx, 0],
                                           precomputed[idx, 1]])])[0]
        else:
          ref_R = reference(state.params, *placed, packing)
        state, m = step_fn(state, *placed, ref_R, packing)
      m = {f"pref/{k}" if not k.startswith(("learning_rate", "nonfinite"))
           else k: v for k, v in metrics_lib.to_floats(m).items()}
      m["num_train_tokens"] = float(arrays[2].sum())
    step = int(state.step)
    m.update(extra)
    m["time/step"] = time.time() - t_start
    run.steps += 1
    if s.evaluates_at(step):
      m.update(run.evaluate(state.params, jax.random.fold_in(run.eval_key,
                                                             step)))
      if data is not None:
        m["eval/pair_accuracy"] = heldout_accuracy(
            c, data.heldout, reference, score, state.params, pairs_per_step)
    run.writer.write(step, m)
    progress.update(step, m)
    last = m
    # The reward guard has nothing to watch here: no reward is computed.
    stop.check(step, {**last, "reward/failure_fraction": 0.0}, run.manager,
               run.writer)
    if step % s.checkpoint_every == 0 or step == s.num_steps:
      run.save(step, state, None, last)
  progress.close()
  if finished:
    last = {}
  out = session.summary(run, last, t0, preempted, finished=finished)
  out["preference"] = {"loss": p.loss,
                       "pair_accuracy_before": run.before.get(
                           "eval/pair_accuracy"),
                       "pair_accuracy": last.get("eval/pair_accuracy"),
                       "identical_pairs": (None if data is None
                                           else data.identical)}
  return out


__all__ = ["PREFERENCE_LOSSES", "PreferenceEntry", "batch_loss", "entry",
           "make_step", "train", "validate"]
