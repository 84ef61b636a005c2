"""The host loop: ``run(config, workdir)``.

One RL step (DESIGN.md section 3):

    prompts (grain) -> tokenize -> sample -> Rollout
    Rollout -> detokenize -> rewards (process pool)   -> rewards [N, R]
    rewards -> advantage chain (jit)                   -> advantages [N]
    Rollout + advantages -> rl_step (jit: epochs x minibatches x microbatches)
    metrics -> JSONL + TensorBoard; every k steps: evaluate, checkpoint

Before RL an optional short SFT warm-up teaches the format; held-out accuracy
is measured before and after RL at the training temperature. Everything is
checked before the first compile (``validate``).

With ``model.path`` the run starts from a Hugging Face checkpoint: its
config, weights and tokenizer (``models.load_hf_pretrained``), its EOS ids,
and, with ``tokenizer.chat_template``, its chat template around each prompt
(``batching.ChatPromptTokenizer``). Otherwise a sentencepiece tokenizer is
trained or read and ``model.preset`` is initialised from scratch.
"""

from __future__ import annotations

import functools
import importlib
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
import optax

from rljax import checkpoint as ckpt_lib
from rljax import data as data_lib
from rljax import metrics as metrics_lib
from rljax import models, sampling, sharding
from rljax import rewards as rewards_lib
from rljax import tokenizers as tok_lib
from rljax.advantages import advantage_metrics
from rljax.train import algorithms, batching, evaluation, policy
from rljax.train.steps import (RLStepConfig, TrainState, make_rl_step,
                               make_sft_step)

log = logging.getLogger("rljax")


def _positive(field: str, value: Any) -> None:
  if not isinstance(value, int) or value < 1:
    raise ValueError(f"{field}={value!r}: a positive integer is required.")


def validate(config: Any, mesh: jax.sharding.Mesh | None = None) -> None:
  """Checks the config before anything is compiled; errors name the field."""
  rl = config.rl
  for field in ("num_steps", "prompts_per_step", "group_size", "num_epochs",
                "num_minibatches", "num_microbatches"):
    _positive(f"rl.{field}", rl[field])
  algorithms.check_choice("rl.advantage", rl.advantage, algorithms.ADVANTAGES)
  algorithms.check_choice("rl.objective", rl.objective, algorithms.OBJECTIVES)
  algorithms.check_choice("rl.is_correction", rl.is_correction,
                          algorithms.IS_CORRECTIONS)
  from rljax.objectives import AGGREGATIONS
  algorithms.check_choice("rl.aggregation", rl.aggregation, AGGREGATIONS)
  if rl.group_size < 2 and rl.advantage in algorithms.GROUP_STATISTIC_ADVANTAGES:
    raise ValueError(
        f"rl.group_size={rl.group_size} with rl.advantage={rl.advantage!r}: "
        "a group baseline needs at least 2 samples per prompt; use "
        "rl.group_size >= 2, or rl.advantage='batch_std'.")
  n = rl.prompts_per_step * rl.group_size
  if n % (rl.num_minibatches * rl.num_microbatches):
    raise ValueError(
        f"rl.prompts_per_step x rl.group_size = {n} rows do not split into "
        f"rl.num_minibatches={rl.num_minibatches} x rl.num_microbatches="
        f"{rl.num_microbatches}: use counts whose product divides {n}.")
  if config.task.name not in data_lib.TASKS and not config.task.get("path"):
    raise ValueError(f"task.name={config.task.name!r} is unknown; accepted: "
                     f"{tuple(data_lib.TASKS)} (or set task.path to a JSONL file).")
  for name in config.rewards.names:
    _reward_fn(name)
  if config.model.get("path"):
    policy.hf_overrides(config)
    if config.tokenizer.get("path"):
      raise ValueError(
          f"tokenizer.path={config.tokenizer.path!r} is set with model.path="
          f"{config.model.path!r}: a Hugging Face run uses the checkpoint's "
          "tokenizer files; accepted: tokenizer.path=''.")
  if len(config.rewards.weights) != len(config.rewards.names):
    raise ValueError(
        f"rewards.weights has {len(config.rewards.weights)} entries for "
        f"{len(config.rewards.names)} rewards.names: give one weight each.")
  if mesh is not None:
    sharding.check_batch_divisible(rl.prompts_per_step, mesh,
                                   "rl.prompts_per_step")
    sharding.check_batch_divisible(config.eval.num_examples, mesh,
                                   "eval.num_examples")
    micro = n // (rl.num_minibatches * rl.num_microbatches)
    sharding.check_batch_divisible(micro, mesh, "rows per microbatch "
                                   "(rl.prompts_per_step x rl.group_size / "
                                   "(rl.num_minibatches x rl.num_microbatches))")


def _reward_fn(name: str):
  """A built-in reward by name, or a user's ``"package.module:function"``."""
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"rewards.names contains {name!r}, which cannot be "
                       f"imported ({e}); accepted: a built-in name or "
                       "'package.module:function'.") from e
    return attr, fn
  if name not in rewards_lib.REWARD_FNS:
    raise ValueError(f"rewards.names contains {name!r}; accepted: "
                     f"{tuple(sorted(rewards_lib.REWARD_FNS))} or "
                     "'package.module:function'.")
  return name, rewards_lib.get_reward_fn(name)


def _model_config(config, vocab_size: int) -> models.ModelConfig:
  overrides = dict(config.model.get("overrides", {}) or {})
  overrides.setdefault("vocab_size", vocab_size)
  return models.get_preset(config.model.preset, **overrides)


def _eos_ids(tokenizer) -> tuple[int, ...]:
  """Every id that ends a completion: ``tokenizer.eos_ids`` if it has them."""
  return tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))


def _sampler_config(config, tokenizer, num_samples: int, *, greedy=False):
  s = config.sampler
  method = (sampling.SamplingMethod(greedy=True) if greedy else
            sampling.SamplingMethod(temperature=s.temperature,
                                    top_k=s.get("top_k"), top_p=s.get("top_p"),
                                    min_p=s.get("min_p")))
  return sampling.SamplerConfig(
      num_samples=num_samples, max_new_tokens=s.max_new_tokens, method=method,
      training_temperature=config.rl.training_temperature,
      eos_ids=_eos_ids(tokenizer), pad_id=tokenizer.pad_id,
      cache_dtype=s.cache_dtype, prompt_buckets=tuple(s.prompt_buckets),
      share_prefix=s.share_prefix)


def _load_task(config):
  t = config.task
  seed = config.seed
  if t.get("path"):
    train = list(data_lib.read_jsonl(t.path))
    heldout = (list(data_lib.read_jsonl(t.heldout_path)) if t.get("heldout_path")
               else train[:config.eval.num_examples])
    return None, train, heldout[:config.eval.num_examples]
  task = data_lib.get_task(t.name, **dict(t.get("kwargs", {}) or {}))
  train = task.examples("train", t.num_train, seed)
  heldout = task.examples("heldout", config.eval.num_examples, seed + 1)
  return task, train, heldout


def _tokenizer(config, task, train):
  if config.tokenizer.get("path"):
    return tok_lib.SentencePieceTokenizer(config.tokenizer.path)
  if task is not None:
    corpus = task.tokenizer_corpus(config.tokenizer.corpus_size, config.seed)
  else:
    corpus = [e["prompt"] for e in train]
  return tok_lib.train_sentencepiece(corpus, config.tokenizer.vocab_size)


class _Run:
  """State of one ``run`` call: compiled functions and host objects.

  With ``model.path`` the model config, initial params and tokenizer are the
  Hugging Face checkpoint's (``initial_params``); otherwise the tokenizer is
  sentencepiece and the params are initialised in ``run``.
  """

  def __init__(self, config, workdir):
    self.config, self.workdir = config, workdir
    self.mesh = sharding.mesh_from_config(config.mesh)
    validate(config, self.mesh)
    self.task, self.train_examples, self.heldout = _load_task(config)
    self.hf_path = config.model.get("path") or ""
    self.initial_params = None
    if self.hf_path:
      overrides = policy.hf_overrides(config)
      model_config, self.initial_params, tokenizer = models.load_hf_pretrained(
          self.hf_path, self.mesh, param_dtype=overrides.get("param_dtype"),
          dtype=overrides.get("dtype"))
      if overrides.get("remat"):
        model_config = model_config.replace(remat=overrides["remat"])
      chat = bool(config.tokenizer.get("chat_template"))
      if chat and getattr(tokenizer, "chat_template", None) is None:
        log.warning("tokenizer.chat_template=True, but %s has no chat "
                    "template: prompts are encoded as plain text.", self.hf_path)
      self.tokenizer = batching.prompt_tokenizer(tokenizer, chat)
    else:
      self.tokenizer = _tokenizer(config, self.task, self.train_examples)
    self.buckets = tuple(config.sampler.prompt_buckets)
    batching.check_prompt_lengths(
        self.tokenizer, [e["prompt"] for e in self.train_examples + self.heldout],
        self.buckets)
    if self.hf_path:
      self.model_config = model_config  # its vocab_size may exceed the tokenizer's
    else:
      self.model_config = _model_config(config, self.tokenizer.vocab_size)
    self.param_shardings = models.param_shardings(self.model_config, self.mesh)
    rl = config.rl
    self.group_size = rl.group_size
    self.eos_ids = _eos_ids(self.tokenizer)
    specs = [rewards_lib.RewardSpec(*_reward_fn(n), weight=float(w))
             for n, w in zip(config.rewards.names, config.rewards.weights)]
    self.evaluator = rewards_lib.RewardEvaluator(
        specs, num_workers=config.rewards.num_workers,
        timeout_s=config.rewards.timeout_s)
    self.correctness = (config.eval.get("reward")
                        or _reward_fn(config.rewards.names[0])[0])

  def make_sampler(self, num_samples, greedy=False):
    return sampling.make_sampler(
        self.model_config,
        _sampler_config(self.config, self.tokenizer, num_samples, greedy=greedy),
        self.mesh, self.param_shardings)


def _evaluate(run: _Run, params, key, samplers) -> dict[str, float]:
  cfg = run.config.eval
  out = evaluation.evaluate(
      params, samplers["eval"], run.tokenizer, run.heldout, run.evaluator, key,
      num_samples=cfg.num_samples, buckets=run.buckets, eos_ids=run.eos_ids,
      correctness_reward=run.correctness)
  if cfg.get("greedy", True):
    greedy = evaluation.evaluate(
        params, samplers["greedy"], run.tokenizer, run.heldout, run.evaluator,
        key, num_samples=1, buckets=run.buckets, eos_ids=run.eos_ids,
        correctness_reward=run.correctness, prefix="eval/greedy_")
    out["eval/greedy_accuracy"] = greedy["eval/greedy_accuracy"]
  return out


def noisy_completions(completions, fraction: float, rng: np.random.Generator,
                      max_offset: int = 9) -> list[str]:
  """Replaces ``fraction`` of integer answers by a nearby wrong integer.

  Imitates an imperfect base model: after SFT on such demonstrations the
  policy puts roughly ``1 - fraction`` of its mass on the right answer and
  spreads the rest over near misses, which is what RL with a verifiable
  reward then sharpens. Non-integer completions are left as they are.
  """
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"sft.label_noise={fraction!r}: a number in [0, 1).")
  out = []
  for c in completions:
    if fraction and c.strip().lstrip("-").isdigit() and rng.random() < fraction:
      offset = int(rng.integers(1, max_offset + 1)) * int(rng.choice([-1, 1]))
      wrong = int(c) + offset
      c = str(wrong if wrong >= 0 else int(c) + abs(offset))
    out.append(c)
  return out


def _sft(run: _Run, params, key, writer):
  cfg = run.config.sft
  if not cfg.num_steps:
    return params
  if run.task is None:
    raise ValueError("sft.num_steps > 0 needs a built-in task with reference "
                     "completions; set sft.num_steps=0 for a JSONL task.")
  examples = run.task.sft_examples("train", cfg.num_examples, run.config.seed)
  completions = noisy_completions(
      [e["completion"] for e in examples], cfg.get("label_noise", 0.0),
      np.random.default_rng(run.config.seed + 1))
  width = cfg.max_length
  tokens, input_mask, loss_mask = batching.sft_arrays(
      run.tokenizer, [e["prompt"] for e in examples], completions, width)
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(1, cfg.num_steps // 10), cfg.num_steps,
      cfg.learning_rate * 0.1), weight_decay=0.0)
  step = make_sft_step(run.model_config, opt)
  batch_sharding = sharding.batch_sharding(run.mesh, 2)
  jitted = jax.jit(step, in_shardings=(run.param_shardings, None, batch_sharding,
                                       batch_sharding, batch_sharding),
                   donate_argnums=(0, 1))
  opt_state = jax.jit(opt.init)(params)
  rng = np.random.default_rng(run.config.seed)
  start = time.time()
  with jax.set_mesh(run.mesh):
    for i in range(cfg.num_steps):
      idx = rng.integers(0, len(examples), cfg.batch_size)
      params, opt_state, m = jitted(params, opt_state, tokens[idx],
                                    input_mask[idx], loss_mask[idx])
      if (i + 1) % max(1, cfg.num_steps // 5) == 0 or i + 1 == cfg.num_steps:
        m = metrics_lib.to_floats(m)
        log.info("sft step %d/%d loss %.4f (%.0fs)", i + 1, cfg.num_steps,
                 m["sft_loss"], time.time() - start)
        writer.write(-cfg.num_steps + i + 1, {"sft/" + k: v for k, v in m.items()})
  del key
  return params


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
    if self.received:  # a second signal: stop now
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


def run(config: Any, workdir: str) -> dict[str, Any]:
  """Trains as ``config`` says, writing everything under ``workdir``.

  Returns a summary: held-out accuracy before and after RL, the final
  metrics and the paths written.
  """
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  r = _Run(config, workdir)
  rl = config.rl
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  if r.hf_path:  # what load_policy needs to rebuild tokenizer and model
    policy.save_hf_files(r.hf_path, workdir)
  else:
    r.tokenizer.save(os.path.join(workdir, "tokenizer.model"))
  writer = metrics_lib.MetricWriter(workdir)
  key = jax.random.key(config.seed)
  init_key, sft_key, eval_key, state_key = jax.random.split(key, 4)

  if r.initial_params is not None:
    params, r.initial_params = r.initial_params, None
  else:
    params = models.init_params(r.model_config, init_key, r.mesh)
  log.info("model: %s params, vocab %d; mesh %s", f"{models.count_params(params):,}",
           r.model_config.vocab_size, dict(r.mesh.shape))
  samplers = {"train": r.make_sampler(rl.group_size),
              "eval": r.make_sampler(config.eval.num_samples),
              "greedy": r.make_sampler(1, greedy=True)}
  manager = ckpt_lib.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      max_to_keep=config.checkpoint.max_to_keep,
      best_metric=config.checkpoint.get("best_metric") or None,
      best_mode=config.checkpoint.get("best_mode", "max"))

  adv_tx = algorithms.advantage_transform(rl)
  coef_tx = algorithms.coefficient_transform(rl)
  optimizer = algorithms.optimizer(config.optimizer, rl.num_steps
                                   * rl.num_epochs * rl.num_minibatches)
  n = rl.prompts_per_step * rl.group_size
  micro = n // (rl.num_minibatches * rl.num_microbatches)
  length = r.buckets[-1] + config.sampler.max_new_tokens

  def init_state(params, key):
    coef_state = coef_tx.init(jnp.zeros((micro, length), jnp.float32))
    return TrainState(params, optimizer.init(params),
                      adv_tx.init(jnp.zeros((n,), jnp.float32)), coef_state,
                      jnp.zeros((), jnp.int32), jax.random.key_data(key))

  iterator = data_lib.make_prompt_iterator(
      r.train_examples, rl.prompts_per_step, config.seed)
  summary: dict[str, Any] = {"workdir": workdir, "preempted": False}
  if not manager.all_steps():
    params = _sft(r, params, sft_key, writer)
    with jax.set_mesh(r.mesh):
      before = _evaluate(r, params, eval_key, samplers)
    summary["before"] = before
    writer.write(0, before)
    log.info("held-out before RL: %s", _fmt(before))
    state = jax.jit(init_state)(params, state_key)
    ref_params = params if rl.kl_coef else None
  else:
    # The restore target: shapes, dtypes and shardings of a fresh state.
    fresh = jax.jit(init_state)(params, state_key)
    target = {"state": fresh}
    if rl.kl_coef:
      target["ref_params"] = params
    resumed, tree, meta = manager.restore_latest_valid(target)
    state, ref_params = tree["state"], tree.get("ref_params")
    del fresh, target
    iterator.set_state(meta["data_iterator"])
    summary["before"] = meta.get("before", {})
    log.info("resumed from step %d in %s", resumed, manager.directory)
  del params  # the state holds them (and ref_params, with a KL term)

  def save(step, metrics=None):
    tree = {"state": state}
    if rl.kl_coef:
      tree["ref_params"] = ref_params
    best = config.checkpoint.get("best_metric")
    manager.save(step, tree, {"data_iterator": iterator.get_state(),
                              "before": summary["before"],
                              "config": json.loads(config.to_json_best_effort())},
                 metrics=({best: metrics[best]} if best and metrics
                          and best in metrics else None))

  step_cfg = RLStepConfig(
      num_epochs=rl.num_epochs, num_minibatches=rl.num_minibatches,
      num_microbatches=rl.num_microbatches, aggregation=rl.aggregation,
      max_length=config.sampler.max_new_tokens, kl_coef=rl.kl_coef,
      entropy_coef=rl.entropy_coef, training_temperature=rl.training_temperature)
  rl_step = make_rl_step(r.model_config, step_cfg, optimizer, coef_tx)
  rl_step = jax.jit(rl_step, donate_argnums=(0,))
  advantage_fn = jax.jit(lambda rewards, adv_state, mask: (
      adv_tx.update(rewards, adv_state, group_size=rl.group_size, mask_N=mask)))
  adv_metrics_fn = jax.jit(functools.partial(advantage_metrics,
                                             group_size=rl.group_size))
  progress = metrics_lib.ProgressBar(
      rl.num_steps, keys=("reward/total/mean", "accuracy", "eval/accuracy"))
  last: dict[str, float] = {}
  step = int(state.step)
  stop_signal = _StopSignal()
  max_bad = config.optimizer.get("max_consecutive_nonfinite")
  skipped_total = 0
  while step < rl.num_steps:
    if stop_signal.received:
      save(step)
      manager.wait()
      log.warning("%s received: saved a checkpoint at step %d in %s; run the "
                  "same command (same --workdir) to resume.",
                  stop_signal.received, step, manager.directory)
      summary["preempted"] = True
      break
    t_start = time.time()
    batch = next(iterator)
    prompts = batching.encode_prompts(r.tokenizer, batch["prompt"])
    tokens, mask = sampling.pad_prompts(prompts, r.buckets, r.tokenizer.pad_id)
    key = jax.random.wrap_key_data(state.key)
    sample_key = jax.random.fold_in(key, 1)
    rollout = jax.device_get(samplers["train"](state.params, tokens, mask,
                                               sample_key))
    t_sample = time.time()
    completions = batching.decode_completions(
        r.tokenizer, rollout.completion_tokens, rollout.completion_mask,
        r.eos_ids)
    fields = data_lib.repeat_each(batch, rl.group_size)
    result = r.evaluator.evaluate(fields["prompt"], completions, fields)
    t_reward = time.time()
    valid = np.isfinite(result.total_N)
    rewards = np.nan_to_num(result.total_N, nan=0.0).astype(np.float32)
    advantages, adv_state = advantage_fn(rewards, state.adv_state, valid)
    state = state._replace(adv_state=adv_state)
    rl_batch = batching.rollout_to_batch(rollout, advantages)
    with jax.set_mesh(r.mesh):
      state, train_metrics = rl_step(state, rl_batch, ref_params)
      train_metrics = jax.device_get(train_metrics)
    t_train = time.time()
    step = int(state.step)
    correct = np.nan_to_num(result.rewards_NxR[:, list(result.names).index(
        r.correctness)], nan=0.0) >= 1.0
    num_gen = int(rollout.lengths.sum())
    m: dict[str, Any] = {**result.metrics, **train_metrics}
    m.update({f"adv/{k}": v for k, v in adv_metrics_fn(rewards, advantages,
                                                       mask_N=valid).items()})
    m.update({
        "accuracy": float(correct.mean()),
        "completion_length/mean": float(rollout.lengths.mean()),
        "completion_length/max": float(rollout.lengths.max()),
        "truncation_rate": float(1.0 - rollout.finished.mean()),
        "time/sample": t_sample - t_start, "time/reward": t_reward - t_sample,
        "time/train": t_train - t_reward,
        "tokens_per_s/sample": num_gen / max(t_sample - t_start, 1e-9),
        "tokens_per_s/train": float(rl_batch.input_mask.sum()) * rl.num_epochs
                              / max(t_train - t_reward, 1e-9),
    })
    if step % config.eval.every == 0 or step == rl.num_steps:
      with jax.set_mesh(r.mesh):
        m.update(_evaluate(r, state.params, jax.random.fold_in(eval_key, step),
                           samplers))
    writer.write(step, m)
    progress.update(step, m)
    last = metrics_lib.to_floats(m)
    if last.get("nonfinite_skipped_total", 0) > skipped_total:
      skipped_total = int(last["nonfinite_skipped_total"])
      log.warning("step %d: non-finite loss or gradient; the update was skipped "
                  "(%d updates skipped so far).", step, skipped_total)
    if max_bad and last.get("nonfinite_consecutive", 0) >= max_bad:
      writer.close()
      stop_signal.restore()
      raise FloatingPointError(
          f"{int(last['nonfinite_consecutive'])} consecutive optimizer updates "
          f"up to RL step {step} had a non-finite loss or gradient "
          f"(optimizer.max_consecutive_nonfinite={max_bad}): stopping. The last "
          f"good checkpoint is in {manager.directory}.")
    if step % config.checkpoint.every == 0 or step == rl.num_steps:
      save(step, last)
  stop_signal.restore()
  manager.close()
  writer.close()
  r.evaluator.close()
  rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  plot = os.path.join(workdir, "curves.png")
  metrics_lib.plot_curves(
      [row for row in rows if row["step"] >= 0], plot,
      ["reward/total/mean", "eval/accuracy", "eval/greedy_accuracy",
       "completion_length/mean"], title=f"rljax: {config.task.name}")
  summary.update({"after": {k: v for k, v in last.items() if k.startswith("eval/")},
                  "final": last, "plot": plot, "seconds": time.time() - t0,
                  "checkpoints": manager.directory})
  b = summary["before"].get("eval/accuracy")
  a = summary["after"].get("eval/accuracy")
  log.info("held-out accuracy (T=%.2f sampling): before RL %s, after RL %s",
           config.sampler.temperature, _pct(b), _pct(a))
  return summary


def _pct(x):
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _fmt(metrics):
  return ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())
