"""Training a reward model on preference pairs with the Bradley–Terry loss.

A pair is a prompt with a ``chosen`` and a ``rejected`` completion (and an
optional ``margin``). The reward model (``models.reward_model``) scores both;
the loss is the negative log-likelihood that the chosen one wins under the
Bradley–Terry model,

    loss = -mean_b log sigmoid(r_chosen_b - r_rejected_b - margin_b)
           + center_coef * mean_b (r_chosen_b + r_rejected_b)^2,

the second term (TRL's ``center_rewards_coefficient``, Eisenstein et al.
2023) pulling the rewards' mean to zero. References: Bradley & Terry, "Rank
Analysis of Incomplete Block Designs" (1952); Ouyang et al., "Training
language models to follow instructions with human feedback",
https://arxiv.org/abs/2203.02155 (the pairwise loss); Touvron et al.,
"Llama 2" (the margin), https://arxiv.org/abs/2307.09288; TRL's
``RewardTrainer``.

Pairs come from a JSONL file (``reward_model.pairs_path``: lines with
``prompt``, ``chosen``, ``rejected``, optionally ``margin``) or are built
from a built-in task (``builtin_pairs``: the reference answer preferred over
a near miss). Each pair is encoded as the policy's rollouts are
(``model_rewards.encode``), so a model trained here scores the policy's
tokens as they were sampled. The run (``run``; ``launch/train_reward_model.py``)
starts from the config's SFT warm-up (``reward_model.init="sft"``: the
reward model is the SFT model with a score head, as in InstructGPT), from
the policy's own warm-up (``"policy_sft"``: the initial parameters and SFT
that ``launch.train`` of the same config and seed starts from) or from
scratch, checkpoints and resumes, measures held-out pair accuracy, and
exports the model as a Hugging Face sequence-classification checkpoint with
the tokenizer in ``<workdir>/reward_model``, which ``"model:<workdir>"``
reads.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import checkpoint as ckpt_lib
from rljax import data as data_lib
from rljax import metrics as metrics_lib
from rljax import models, optim, sharding
from rljax import tokenizers as tok_lib
from rljax.models import reward_model as rm_lib
from rljax.train import model_rewards, rundir, sft

log = logging.getLogger("rljax")

INITS = ("sft", "policy_sft", "scratch")


def bradley_terry_loss(chosen_B: jax.Array, rejected_B: jax.Array,
                       margin_B: jax.Array | None = None,
                       center_coef: float = 0.0
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The pairwise loss of the module docstring and its metrics."""
  diff = chosen_B - rejected_B
  if margin_B is not None:
    diff = diff - margin_B
  loss = -jnp.mean(jax.nn.log_sigmoid(diff))
  if center_coef:
    loss = loss + center_coef * jnp.mean((chosen_B + rejected_B) ** 2)
  return loss, {"loss": loss,
                "accuracy": jnp.mean((chosen_B > rejected_B).astype(jnp.float32)),
                "reward_chosen": jnp.mean(chosen_B),
                "reward_rejected": jnp.mean(rejected_B),
                "reward_gap": jnp.mean(chosen_B - rejected_B)}


class Pairs(NamedTuple):
  """Encoded pairs: ``[P, L]`` right-padded ids and masks, ``[P]`` margins."""
  chosen: np.ndarray
  chosen_mask: np.ndarray
  rejected: np.ndarray
  rejected_mask: np.ndarray
  margin: np.ndarray


def _check_pair(pair: Any, where: str) -> None:
  if not isinstance(pair, dict):
    raise ValueError(f"{where}: a JSON object with 'prompt', 'chosen' and "
                     f"'rejected' is required, not {type(pair).__name__}.")
  for field in ("prompt", "chosen", "rejected"):
    if not isinstance(pair.get(field), str):
      raise ValueError(f"{where}: field {field!r} is "
                       f"{pair.get(field)!r}; a string is required.")
  margin = pair.get("margin", 0.0)
  if (isinstance(margin, bool) or not isinstance(margin, (int, float))
      or not math.isfinite(margin)):
    raise ValueError(f"{where}: field 'margin' is {margin!r}; a finite "
                     "number is required.")


def read_pairs(path: str) -> list[dict[str, Any]]:
  """The pairs of a JSONL file, each checked (errors name the line)."""
  pairs = list(data_lib.read_jsonl(path, required_fields=("prompt", "chosen",
                                                          "rejected")))
  for i, pair in enumerate(pairs):
    _check_pair(pair, f"{path}: pair {i + 1}")
  if not pairs:
    raise ValueError(f"{path} holds no pairs.")
  return pairs


NEGATIVES = ("mixed", "near")


def wrong_answer(answer: str, rng: np.random.Generator, kind: str) -> str:
  """A wrong non-negative integer for integer ``answer``.

  ``"near"``: within 9 of it (``sft.near_miss``); ``"random"``: uniform with
  one digit more or fewer at most; ``"digits"``: one digit changed, dropped,
  or repeated, or the digits reversed.
  """
  value = int(answer)
  for _ in range(100):
    if kind == "near":
      wrong = sft.near_miss(answer, rng)
    elif kind == "random":
      digits = max(1, len(answer.lstrip("-")) + int(rng.integers(-1, 2)))
      wrong = str(int(rng.integers(0, 10 ** digits)))
    else:
      d = list(str(abs(value)))
      i = int(rng.integers(len(d)))
      edit = int(rng.integers(4))
      if edit == 0:
        d[i] = str(int(rng.integers(10)))
      elif edit == 1 and len(d) > 1:
        del d[i]
      elif edit == 2:
        d.insert(i, d[i])
      else:
        d.reverse()
      wrong = str(int("".join(d)))
    if wrong != answer and int(wrong) >= 0:
      return wrong
  return str(value + 1)


def builtin_pairs(task: Any, split: str, num_pairs: int, seed: int,
                  negatives: str = "mixed") -> list[dict[str, Any]]:
  """Pairs from a built-in task: its reference completion preferred over a
  wrong integer (``wrong_answer``).

  ``negatives="near"``: near misses only. ``"mixed"`` (default): half near
  misses, a quarter random integers of about the answer's length, a quarter
  digit edits. A reward model that has only seen near misses is not asked
  about far-off answers, and a policy can find them: on the main job, RL on
  such a model drove held-out accuracy down (docs/guides/model_rewards.md).
  """
  if negatives not in NEGATIVES:
    raise ValueError(f"reward_model.negatives={negatives!r}: accepted "
                     f"{NEGATIVES}.")
  rng = np.random.default_rng((seed, 7))
  pairs = []
  for e in task.sft_examples(split, num_pairs, seed):
    chosen = e["completion"]
    if not chosen.strip().lstrip("-").isdigit():
      raise ValueError(f"task {task.name!r}: completion {chosen!r} is not an "
                       "integer; built-in pairs need one (give a pairs "
                       "file: reward_model.pairs_path or "
                       "preference.pairs_path).")
    kind = "near"
    if negatives == "mixed":
      kind = ("near", "near", "random", "digits")[int(rng.integers(4))]
    pairs.append({"prompt": e["prompt"], "chosen": chosen,
                  "rejected": wrong_answer(chosen, rng, kind)})
  return pairs


def pairs_from_samples(prompts: Sequence[str],
                       completions: Sequence[Sequence[str]],
                       rewards: Sequence[Sequence[float]],
                       threshold: float = 1.0) -> list[dict[str, Any]]:
  """Pairs of a policy's own samples labelled by a verifier: for each prompt,
  its ``k``-th distinct correct completion (reward ``>= threshold``) over its
  ``k``-th distinct wrong one, as many as the smaller side has (InstructGPT's
  comparisons are of the SFT model's samples; here the labeller is the
  verifier)."""
  pairs = []
  for prompt, texts, values in zip(prompts, completions, rewards):
    right = list(dict.fromkeys(t for t, v in zip(texts, values)
                               if v >= threshold))
    wrong = list(dict.fromkeys(t for t, v in zip(texts, values)
                               if not v >= threshold))
    pairs += [{"prompt": prompt, "chosen": c, "rejected": w}
              for c, w in zip(right, wrong)]
  return pairs


def policy_pairs(config: Any, task: Any, params: Any, model_config: Any,
                 tokenizer: Any, mesh: jax.sharding.Mesh
                 ) -> list[dict[str, Any]]:
  """``pairs_from_samples`` of ``reward_model.policy_prompts`` training
  prompts, ``reward_model.policy_samples`` samples each from ``params`` (the
  SFT model) with the config's sampler, labelled by
  ``reward_model.labeller``."""
  from rljax import rewards as rewards_lib  # pylint: disable=g-import-not-at-top
  from rljax import sampling  # pylint: disable=g-import-not-at-top
  from rljax.train import build  # pylint: disable=g-import-not-at-top
  r = config.reward_model
  examples = task.examples("train", r.policy_prompts, config.seed + 2)
  k = r.policy_samples
  sc = build.sampler_config(config, tokenizer, k)
  fn = sampling.make_sampler(model_config, sc, mesh,
                             models.param_shardings(model_config, mesh))
  label, labeller = build.reward_fn(r.labeller)
  completions: list[list[str]] = []
  scores: list[list[float]] = []
  key = jax.random.key(config.seed + 3)
  with rewards_lib.RewardEvaluator(
      [rewards_lib.RewardSpec(label, labeller, in_process=True)],
      num_workers=0) as evaluator:
    for lo in range(0, len(examples), 64):
      chunk = examples[lo:lo + 64]
      ids = tok_lib.encode_prompts(tokenizer, [e["prompt"] for e in chunk])
      tokens, mask = sampling.pad_prompts(ids, sc.prompt_buckets,
                                          tokenizer.pad_id)
      rollout = jax.device_get(fn(params, tokens, mask,
                                  jax.random.fold_in(key, lo)))
      texts = tok_lib.decode_completions(tokenizer, rollout.completion_tokens,
                                         rollout.completion_mask, sc.eos_ids)
      fields = data_lib.repeat_each(
          {name: [e[name] for e in chunk] for name in chunk[0]}, k)
      values = np.nan_to_num(evaluator.evaluate(
          fields["prompt"], texts, fields).rewards_NxR[:, 0], nan=0.0)
      completions += [texts[i * k:(i + 1) * k] for i in range(len(chunk))]
      scores += [values[i * k:(i + 1) * k].tolist() for i in range(len(chunk))]
  return pairs_from_samples([e["prompt"] for e in examples], completions,
                            scores)


def encode_pairs(tokenizer: Any, pairs: Sequence[dict[str, Any]], width: int,
                 chat_template: bool = False) -> Pairs:
  """Right-padded ids of each side (``model_rewards.encode``).

  Raises:
    ValueError: if a side is longer than ``width`` (``reward_model.max_length``).
  """
  n = len(pairs)
  out = {k: np.full((n, width), tokenizer.pad_id, np.int32)
         for k in ("chosen", "rejected")}
  masks = {k: np.zeros((n, width), bool) for k in out}
  for i, pair in enumerate(pairs):
    for side in out:
      ids = model_rewards.encode(tokenizer, pair["prompt"], pair[side],
                                 chat_template)
      if len(ids) > width:
        raise ValueError(f"pair {i + 1}'s {side} side is {len(ids)} tokens; "
                         f"reward_model.max_length={width} is shorter "
                         f"(accepted: >= {len(ids)}).")
      out[side][i, :len(ids)] = ids
      masks[side][i, :len(ids)] = True
  margin = np.asarray([float(p.get("margin", 0.0)) for p in pairs], np.float32)
  return Pairs(out["chosen"], masks["chosen"], out["rejected"],
               masks["rejected"], margin)


def make_step(config: rm_lib.RewardModelConfig,
              optimizer: optax.GradientTransformation, center_coef: float):
  """``step(params, opt_state, pairs) -> (params, opt_state, metrics)``:
  both sides in one forward (``[2P, L]``)."""

  def loss_fn(params, batch: Pairs):
    tokens = jnp.concatenate([batch.chosen, batch.rejected])
    mask = jnp.concatenate([batch.chosen_mask, batch.rejected_mask])
    r = rm_lib.scores(params, config, tokens, mask)[:, 0]
    p = batch.chosen.shape[0]
    return bradley_terry_loss(r[:p], r[p:], batch.margin, center_coef)

  def step(params, opt_state, batch: Pairs):
    (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    m["grad_norm"] = optax.tree.norm(grads)
    return optax.apply_updates(params, updates), opt_state, m

  return step, loss_fn


def pair_accuracy(params: Any, config: rm_lib.RewardModelConfig,
                  pairs: Pairs, batch_size: int, mesh: jax.sharding.Mesh
                  ) -> float:
  """The fraction of ``pairs`` whose chosen side scores higher (a tie
  counts one half)."""
  score = _scores_fn(config)
  wins = []
  rows = sharding.batch_sharding(mesh, 2)
  for lo in range(0, len(pairs.chosen), batch_size):
    idx = np.arange(lo, lo + batch_size) % len(pairs.chosen)  # full batches
    sides = [score(params, jax.device_put(t[idx], rows),
                   jax.device_put(m[idx], rows))
             for t, m in ((pairs.chosen, pairs.chosen_mask),
                          (pairs.rejected, pairs.rejected_mask))]
    c, r = np.asarray(sides[0][:, 0]), np.asarray(sides[1][:, 0])
    won = (c > r) + 0.5 * (c == r)  # a tie is half a win
    wins.append(won[:min(batch_size, len(pairs.chosen) - lo)])
  return float(np.concatenate(wins).mean())


def _write_pairs(path: str, pairs: Sequence[dict[str, Any]]) -> None:
  """JSONL, atomically (a temporary file, then a rename)."""
  with open(path + ".tmp", "w") as f:
    for pair in pairs:
      f.write(json.dumps(pair) + "\n")
  os.replace(path + ".tmp", path)


def _concat(a: Pairs, b: Pairs) -> Pairs:
  return Pairs(*(np.concatenate([x, y]) for x, y in zip(a, b)))


@functools.lru_cache(maxsize=None)
def _scores_fn(config: rm_lib.RewardModelConfig):
  return jax.jit(lambda params, tokens, mask: rm_lib.scores(params, config,
                                                            tokens, mask))


def load_pairs(config: Any, task: Any, section: str = "reward_model"
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """``(train pairs, held-out pairs)`` of ``reward_model.*`` (or of another
  config section with the same pair fields: ``preference``)."""
  r = config[section]
  if r.pairs_path:
    train = read_pairs(r.pairs_path)
    heldout = (read_pairs(r.heldout_path) if r.heldout_path
               else train[:r.num_heldout])
    return train, heldout[:r.num_heldout]
  if task is None:
    raise ValueError(f"{section}.pairs_path is empty and task.path is a "
                     "JSONL task: built-in pairs need a built-in task "
                     f"(task.name), or give {section}.pairs_path.")
  return (builtin_pairs(task, "train", r.num_pairs, config.seed, r.negatives),
          builtin_pairs(task, "heldout", r.num_heldout, config.seed + 1,
                        r.negatives))


def task_is_jsonl(config: Any) -> bool:
  return bool(config.task.path)


def _check_init(directory: str, path: str, tokenizer: Any
                ) -> rm_lib.RewardModelConfig:
  """The config of the reward model ``reward_model.init_path`` starts from;
  it must read this run's tokens (the same tokenizer).

  Raises:
    ValueError: naming the field, when its tokenizer is another.
  """
  config = model_rewards.check(model_rewards.PREFIX + directory)
  if not model_rewards.shares_tokenizer(tokenizer, directory):
    raise ValueError(
        f"reward_model.init_path={path!r}: its tokenizer ({directory}) is not "
        "this config's; accepted: a reward model trained from the same "
        "config (the same task and tokenizer settings).")
  return config


def _sampling_policy(path: str, tokenizer: Any) -> Any:
  """``reward_model.policy_path``'s latest policy (``train.load_policy``),
  with this run's tokenizer.

  Raises:
    ValueError: naming the field, when its tokenizer is another.
  """
  from rljax.train import policy as policy_lib  # pylint: disable=g-import-not-at-top
  policy = policy_lib.load_policy(path)
  theirs = getattr(getattr(policy.tokenizer, "tokenizer", policy.tokenizer),
                   "serialized", None)
  ours = getattr(getattr(tokenizer, "tokenizer", tokenizer), "serialized",
                 None)
  if theirs is None or theirs != ours:
    raise ValueError(
        f"reward_model.policy_path={path!r}: the run's tokenizer is not this "
        "config's; accepted: a policy trained from the same config (the same "
        "task and tokenizer settings).")
  return policy


def run(config: Any, workdir: str) -> dict[str, Any]:
  """Trains a reward model (``reward_model.*`` of an RL config) in ``workdir``.

  Uses the config's task, tokenizer, ``model.preset`` and ``sft.*`` (with
  ``reward_model.init="sft"``), so a policy trained from the same config and
  seed has the same tokenizer and ``"model:<workdir>"`` reads its tokens.
  Resumes from the newest checkpoint in ``workdir/checkpoints``.

  Returns:
    The summary (also ``workdir/summary.json``): held-out pair accuracy
    before and after, steps, seconds, the export's directory.
  """
  from rljax.train import build  # pylint: disable=g-import-not-at-top
  r = config.reward_model
  if r.init not in INITS:
    raise ValueError(f"reward_model.init={r.init!r}: accepted {INITS}.")
  build.validate(config)
  if r.policy_prompts and task_is_jsonl(config):
    raise ValueError(
        f"reward_model.policy_prompts={r.policy_prompts}: pairs from a "
        "policy's samples need a built-in task (its prompts and verifier); "
        "accepted: 0 with task.path.")
  if r.policy_prompts and not r.policy_path and (
      r.init == "scratch" or not config.sft.num_steps):
    raise ValueError(
        f"reward_model.policy_prompts={r.policy_prompts}: pairs from the SFT "
        "model's samples need reward_model.init 'sft' or 'policy_sft' and "
        "sft.num_steps > 0 (or reward_model.policy_path); accepted: 0 "
        "otherwise.")
  if r.policy_path and not r.policy_prompts:
    raise ValueError(
        f"reward_model.policy_path={r.policy_path!r} with "
        "reward_model.policy_prompts=0: the policy samples no pairs; "
        "accepted: policy_prompts > 0, or policy_path=''.")
  init_dir = ""
  if r.init_path:  # a FileNotFoundError names what was looked for
    try:
      init_dir = model_rewards.resolve(r.init_path)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"reward_model.init_path={r.init_path!r}: {e}"
                              ) from None
  if r.policy_path:
    for name in ("config.json", "checkpoints"):
      if not os.path.exists(os.path.join(r.policy_path, name)):
        raise FileNotFoundError(
            f"reward_model.policy_path={r.policy_path!r}: "
            f"{os.path.join(r.policy_path, name)} does not exist; accepted: "
            "an rljax training run directory.")
  if r.policy_prompts:
    build.reward_fn(r.labeller)
  if config.model.path:
    raise ValueError("model.path is set: launch.train_reward_model trains a "
                     "model.preset with the run's own tokenizer; accepted: "
                     "model.path=''.")
  t0 = time.time()
  whose = "the policy's " if r.init == "policy_sft" else "the "
  if init_dir:
    init = f"the reward model {init_dir}"
  elif r.init != "scratch" and config.sft.num_steps:
    init = f"{whose}SFT model ({config.sft.num_steps} warm-up steps)"
  else:
    init = ("the policy's initial decoder" if r.init == "policy_sft"
            else "a fresh decoder")
  log.info("building a Bradley-Terry reward model from %s: %s %d steps x "
           "%d pairs, learning rate %g", init, config.task.path
           or config.task.name, r.num_steps, r.batch_size, r.learning_rate)
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.mesh_from_config(config.mesh)
  task, train_examples, _ = build.load_task(config)
  tokenizer = build.make_tokenizer(config, task, train_examples)
  decoder = build.preset_model_config(config, tokenizer.vocab_size)
  if decoder.lora is not None:
    raise ValueError("model.lora.rank > 0: a reward model is trained in "
                     "full; accepted: model.lora.rank=0.")
  rm_config = rm_lib.RewardModelConfig(decoder)
  if init_dir:
    rm_config = _check_init(init_dir, r.init_path, tokenizer)
  policy = None
  if r.policy_path:
    policy = _sampling_policy(r.policy_path, tokenizer)
  train_pairs, heldout_pairs = load_pairs(config, task)
  chat = config.tokenizer.chat_template
  train = encode_pairs(tokenizer, train_pairs, r.max_length, chat)
  heldout = encode_pairs(tokenizer, heldout_pairs, r.max_length, chat)
  devices = jax.devices()
  log.info("reward model: %d layers, width %d, vocab %d; %d %s device(s), "
           "mesh %s; %d training pairs, %d held-out (%s negatives)",
           decoder.num_layers, decoder.d_model, decoder.vocab_size,
           len(devices), devices[0].platform,
           dict(mesh.shape), len(train.chosen), len(heldout.chosen),
           r.negatives)
  sharding.check_batch_divisible(r.batch_size, mesh, "reward_model.batch_size")
  opt = optax.adamw(optim.warmup_cosine(r.learning_rate, r.num_steps),
                    weight_decay=0.0)
  opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
  step_fn, _ = make_step(rm_config, opt, r.center_coef)
  manager = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=2, async_save=False)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  pairs_file = os.path.join(workdir, "policy_pairs.jsonl")
  latest = manager.latest_step()
  # Rows past the newest checkpoint (a killed run's) are written again.
  rundir.trim_metrics(metrics_path, latest if latest is not None else -10**9)
  writer = metrics_lib.from_config(
      json.loads(config.to_json_best_effort()), workdir)
  key = jax.random.key(config.seed)
  with jax.set_mesh(mesh):
    params = rm_lib.init_params(rm_config, key, mesh)
    opt_state = sharding.init_like_params(opt.init, params, mesh)
    start, before = 0, None
    if manager.latest_step() is not None:
      start, (params, opt_state), meta = manager.restore_latest_valid(
          (params, opt_state))
      before = meta.get("heldout_accuracy_before")
      log.info("reward model: resumed at step %d", start)
    else:
      sft_params = None
      if r.init == "policy_sft":
        # The policy's own initial params (session.run_keys), so the warm-up
        # below is the one launch.train of this config and seed runs.
        from rljax.train import session  # pylint: disable=g-import-not-at-top
        sft_params = models.init_params(
            decoder, session.run_keys(config.seed)[0], mesh)
      if r.init != "scratch" and config.sft.num_steps and not (
          init_dir and (policy is not None or not r.policy_prompts)):
        if sft_params is None:
          sft_params = models.init_params(decoder, key, mesh)
        sft_params = sft.run_sft(
            sft_params, build.sft_config(config),
            task=task, tokenizer=tokenizer, model_config=decoder, mesh=mesh,
            param_shardings=models.param_shardings(decoder, mesh),
            writer=writer)
      if r.policy_prompts:
        source = "the SFT model" if policy is None else r.policy_path
        sampled = (policy_pairs(config, task, sft_params, decoder, tokenizer,
                                mesh) if policy is None else policy_pairs(
                                    config, task, jax.device_put(
                                        policy.params, models.param_shardings(
                                            policy.model_config, mesh)),
                                    policy.model_config, tokenizer, mesh))
        log.info("reward model: %d pairs from %s's samples (%d prompts)",
                 len(sampled), source, r.policy_prompts)
        writer.write(0, {"rm/policy_pairs": float(len(sampled))})
        _write_pairs(pairs_file, sampled)
      if init_dir:
        _, params = rm_lib.load_hf_reward_model(init_dir, mesh)
        opt_state = sharding.init_like_params(opt.init, params, mesh)
      elif sft_params is not None:
        params = rm_lib.init_params(rm_config, key, mesh, decoder=sft_params)
        opt_state = sharding.init_like_params(opt.init, params, mesh)
      before = pair_accuracy(params, rm_config, heldout, r.batch_size, mesh)
      writer.write(0, {"rm/heldout_accuracy": before})
      log.info("reward model: held-out pair accuracy before %.3f", before)
    if r.policy_prompts and os.path.getsize(pairs_file):
      # Saved at the start: a resumed run trains on the same pairs.
      train = _concat(train, encode_pairs(tokenizer, read_pairs(pairs_file),
                                          r.max_length, chat))
    jitted = jax.jit(step_fn, donate_argnums=(0, 1))
    rows = sharding.batch_sharding(mesh, 2)
    rng = np.random.default_rng((config.seed, 11))
    for _ in range(start):  # the batches already trained on
      rng.integers(0, len(train.chosen), r.batch_size)
    accuracy = before
    for i in range(start, r.num_steps):
      idx = rng.integers(0, len(train.chosen), r.batch_size)
      batch = Pairs(*(jax.device_put(x[idx], rows) for x in train[:4]),
                    jax.device_put(train.margin[idx]))
      params, opt_state, m = jitted(params, opt_state, batch)
      step = i + 1
      if step % r.eval_every == 0 or step == r.num_steps:
        m = {f"rm/{k}": v for k, v in metrics_lib.to_floats(m).items()}
        accuracy = pair_accuracy(params, rm_config, heldout, r.batch_size, mesh)
        m["rm/heldout_accuracy"] = accuracy
        writer.write(step, m)
        log.info("reward model step %d/%d: loss %.4f, train pair accuracy "
                 "%.3f, held-out %.3f", step, r.num_steps, m["rm/loss"],
                 m["rm/accuracy"], accuracy)
      if step % r.checkpoint_every == 0 or step == r.num_steps:
        manager.save(step, (params, opt_state),
                     {"heldout_accuracy_before": before})
  manager.wait()
  writer.close()
  out = os.path.join(workdir, model_rewards.RUN_SUBDIR)
  rm_lib.save_hf_reward_model(out, rm_config, params, extra_config={
      "pad_token_id": tokenizer.pad_id, "eos_token_id": tokenizer.eos_id,
      "bos_token_id": tokenizer.bos_id})
  tok_lib.save_hf_tokenizer(tokenizer, out,
                            add_bos_token=tokenizer.bos_id is not None)
  summary = {"heldout_accuracy_before": before, "heldout_accuracy": accuracy,
             "steps": r.num_steps, "train_pairs": len(train_pairs),
             "heldout_pairs": len(heldout_pairs), "export": out,
             "seconds": time.time() - t0}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  manager.close()
  return summary
