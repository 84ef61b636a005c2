"""The supervised warm-up before RL: teach the task's answer format.

A built-in task gives reference completions (``task.sft_examples``); the
warm-up trains token-mean cross-entropy on the completion tokens (and the
EOS after them) with AdamW and a warm-up + cosine schedule, in one jitted
step with explicit shardings.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from rljax import distributed
from rljax import metrics as metrics_lib
from rljax import models, optim, sharding
from rljax import tokenizers as tok_lib
from rljax import objectives as obj_lib
from rljax.train import sft_cache

log = logging.getLogger("rljax")


def make_sft_step(model_config: models.ModelConfig,
                  optimizer: optax.GradientTransformation,
                  chunk_size: int = 128):
  """``sft_step(params, opt_state, tokens, input_mask, loss_mask,
  packing=None)``: token-mean cross-entropy on the completion tokens only;
  with a ``models.Packing`` of the rows the forward runs padding-free (the
  same loss)."""

  def loss_fn(params, tokens, input_mask, loss_mask, packing):
    lp, _ = models.sequence_logprobs(params, model_config, tokens, input_mask,
                                     chunk_size=chunk_size, with_entropy=False,
                                     packing=packing)
    return obj_lib.aggregate_loss(-lp, loss_mask, "token_mean")

  def sft_step(params, opt_state, tokens, input_mask, loss_mask,
               packing=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, input_mask,
                                              loss_mask, packing)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "sft_loss": loss, "grad_norm": optax.tree.norm(grads)}

  return sft_step


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Settings of the warm-up (``sft.*`` of a config).

  Attributes:
    num_steps: optimizer steps; 0 skips the warm-up.
    batch_size: rows per step (drawn with replacement).
    learning_rate: peak learning rate.
    num_examples: demonstrations drawn from the task.
    max_length: padded row length (prompt + completion + EOS).
    label_noise: fraction of demonstrations given a near-miss answer.
    seed: data seed.
    padding_free: pack each batch's rows (``train/packing.py``'s buffers
      and buckets).
    cache_dir: a directory of finished warm-ups (``sft_cache.py``): a
      warm-up already trained there, on the same parameters, data, program
      and platform, is loaded instead of trained; "" reads
      ``$RLJAX_SFT_CACHE`` (unset: no cache).
  """

  num_steps: int = 0
  batch_size: int = 64
  learning_rate: float = 3e-3
  num_examples: int = 4000
  max_length: int = 16
  label_noise: float = 0.0
  seed: int = 0
  padding_free: bool = True
  cache_dir: str = ""


def noisy_completions(completions: Sequence[str], fraction: float,
                      rng: np.random.Generator, max_offset: int = 9
                      ) -> list[str]:
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
      c = near_miss(c, rng, max_offset)
    out.append(c)
  return out


def near_miss(answer: str, rng: np.random.Generator, max_offset: int = 9
              ) -> str:
  """A wrong integer within ``max_offset`` of integer ``answer`` (never
  negative unless ``answer`` is)."""
  offset = int(rng.integers(1, max_offset + 1)) * int(rng.choice([-1, 1]))
  wrong = int(answer) + offset
  return str(wrong if wrong >= 0 else int(answer) + abs(offset))


SEGMENT_KINDS = ("model", "eos", "observation")


def segment_ids(tokenizer: Any, segments: Sequence[Sequence[str]]
                ) -> tuple[list[int], list[bool]]:
  """``(ids, trained)`` of a multi-turn demonstration's ``[kind, text]``
  segments (``data.agent_tasks``): ``"model"`` text and the ``"eos"`` token
  are trained, ``"observation"`` text is not. Each segment is encoded on its
  own, the first as a completion (``tokenizer.encode``) and the others as
  continuations (``tokenizers.continuation_ids``), as the multi-turn
  rollout encodes them."""
  ids: list[int] = []
  trained: list[bool] = []
  for kind, text in segments:
    if kind not in SEGMENT_KINDS:
      raise ValueError(f"a demonstration segment of kind {kind!r}: accepted "
                       f"{SEGMENT_KINDS}.")
    if kind == "eos":
      new = [tokenizer.eos_id]
    elif not ids:
      new = tokenizer.encode(text) if text else []
    else:
      new = tok_lib.continuation_ids(tokenizer, text)
    ids += new
    trained += [kind != "observation"] * len(new)
  return ids, trained


def sft_arrays(tokenizer: Any, prompts: Sequence[str],
               completions: Sequence[str], width: int,
               segments: Sequence[Any] | None = None):
  """Right-padded ``(tokens, input_mask, loss_mask)``, each ``[N, width]``.

  The loss covers the completion tokens and the EOS after them. A row with
  ``segments`` (a multi-turn demonstration, ``segment_ids``) takes them
  instead of its completion: its observations are inputs, not trained.
  """
  n = len(prompts)
  tokens = np.full((n, width), tokenizer.pad_id, np.int32)
  input_mask = np.zeros((n, width), bool)
  loss_mask = np.zeros((n, width), bool)
  segments = segments if segments is not None else [None] * n
  for i, (p, c, seg) in enumerate(zip(
      tok_lib.encode_prompts(tokenizer, prompts), completions, segments)):
    if seg is None:
      ids, trained = tokenizer.encode(c) + [tokenizer.eos_id], None
    else:
      ids, trained = segment_ids(tokenizer, seg)
    row = (p + ids)[:width]
    tokens[i, :len(row)] = row
    input_mask[i, :len(row)] = True
    loss_mask[i, len(p):len(row)] = (True if trained is None
                                     else trained[:len(row) - len(p)])
  return tokens, input_mask, loss_mask


def pack_batch(input_mask: np.ndarray, row_multiple: int = 1
               ) -> models.Packing:
  """A warm-up batch's ``models.Packing``, planned as an RL step's
  microbatch (``train/packing.py``: buffers of one or two rows' length, their
  count bucketed)."""
  from rljax.train import packing as packing_lib  # pylint: disable=g-import-not-at-top
  return packing_lib.pack_microbatch(input_mask, row_multiple)


def run_sft(params: Any, cfg: SFTConfig, *, task: Any, tokenizer: Any,
            model_config: models.ModelConfig, mesh: jax.sharding.Mesh,
            param_shardings: Any, writer: metrics_lib.MetricWriter | None = None,
            group: distributed.ProcessGroup | None = None) -> Any:
  """Runs the warm-up and returns the new params (``params`` is donated).

  Metrics go to ``writer`` at steps ``-num_steps + i`` (before RL's step 0).
  With several processes (``group``) every process draws the same batch
  indices and feeds its block of the rows.

  Raises:
    ValueError: with ``num_steps > 0`` and no built-in task.
  """
  if not cfg.num_steps:
    return params
  if task is None:
    raise ValueError("sft.num_steps > 0 needs a built-in task with reference "
                     "completions; set sft.num_steps=0 for a JSONL task.")
  examples = task.sft_examples("train", cfg.num_examples, cfg.seed)
  completions = noisy_completions(
      [e["completion"] for e in examples], cfg.label_noise,
      np.random.default_rng(cfg.seed + 1))
  tokens, input_mask, loss_mask = sft_arrays(
      tokenizer, [e["prompt"] for e in examples], completions, cfg.max_length,
      segments=[e.get("segments") for e in examples])
  opt = optax.adamw(optim.warmup_cosine(cfg.learning_rate, cfg.num_steps),
                    weight_decay=0.0)
  step = make_sft_step(model_config, opt)
  rows = sharding.batch_sharding(mesh, 2)
  opt_state = sharding.init_like_params(opt.init, params, mesh)
  opt_shardings = jax.tree.map(lambda x: x.sharding, opt_state)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  group = group or distributed.ProcessGroup()
  packed = cfg.padding_free
  jitted = jax.jit(step,
                   in_shardings=(param_shardings, opt_shardings, rows, rows,
                                 rows) + ((models.Packing(*[replicated] * 4),)
                                          if packed else ()),
                   out_shardings=(param_shardings, opt_shardings, replicated),
                   donate_argnums=(0, 1))
  if not group.single:
    sharding.check_batch_divisible(cfg.batch_size, mesh, "sft.batch_size")

  def batch(rng):
    idx = rng.integers(0, len(examples), cfg.batch_size)
    # Every process draws the same rows: the packing of the global batch.
    extra = (pack_batch(input_mask[idx], sharding.batch_ways(mesh)),
             ) if packed else ()
    if not group.single:
      idx = idx[group.rows(mesh, cfg.batch_size)]
    return (*(group.global_array(x[idx], mesh)
              for x in (tokens, input_mask, loss_mask)), *extra)

  directory = sft_cache.cache_dir(cfg.cache_dir)
  if directory:
    with jax.set_mesh(mesh):
      program = jitted.lower(params, opt_state, *batch(
          np.random.default_rng(cfg.seed))).as_text()
    entry = sft_cache.key(params, cfg, program,
                          (tokens, input_mask, loss_mask), mesh, group)
    cached = sft_cache.load(directory, entry, params, group)
    if cached is not None:
      params, logged = cached
      if writer is not None:
        for row in logged:
          writer.write(row["step"], row["metrics"])
      return params
  logged = []
  rng = np.random.default_rng(cfg.seed)
  start = time.time()
  every = max(1, cfg.num_steps // 5)
  log.info("sft: %d warm-up steps x %d rows; compiling the step (once)",
           cfg.num_steps, cfg.batch_size)
  with jax.set_mesh(mesh):
    for i in range(cfg.num_steps):
      params, opt_state, m = jitted(params, opt_state, *batch(rng))
      if i == 0:
        jax.block_until_ready(m)
        log.info("sft: step 1 compiled and ran in %.1f s",
                 time.time() - start)
      if (i + 1) % every == 0 or i + 1 == cfg.num_steps:
        m = metrics_lib.to_floats(m)
        log.info("sft step %d/%d loss %.4f (%.0fs)", i + 1, cfg.num_steps,
                 m["sft_loss"], time.time() - start)
        logged.append({"step": -cfg.num_steps + i + 1,
                       "metrics": {"sft/" + k: v for k, v in m.items()}})
        if writer is not None:
          writer.write(logged[-1]["step"], logged[-1]["metrics"])
  if directory:
    sft_cache.save(directory, entry, params, logged, group)
  return params
