r"""Rollouts that never wait: static batch vs continuous batching vs partial
rollouts on long-tailed lengths, and the RL loop synchronous vs asynchronous.

Part 1, the sampler (random weights, so the lengths are the workload's): one
token in ``--eos_every`` ends a row, so completion lengths are geometric
(mean ~``eos_every``) and a few rows reach ``--max_new_tokens``. For
``--steps`` batches of ``B`` prompts x ``G`` samples it runs

  * static: ``sampling.make_sampler``, every row until the longest ends;
  * shrinking (``--shrink_batch_to``, 8 by default; 0 skips it): the static
    sampler with ``sampler.shrink_batch_to``, the decode batch halving as
    rows end (its row-steps: the smallest level that holds the live rows);
  * continuous: ``rl.rollout="continuous"`` (``M`` slots refilled as rows
    end), every row to its end;
  * partial: ``rl.rollout="partial"`` (APRIL): stop once ``B`` groups have
    ended, carry the rest (params unchanged between steps, so only the
    schedule differs);
  * tree and tree shrinking (``--tree_segment_tokens``, 8 by default; 0
    skips them): ``rl.rollout="tree"`` (2 roots, forks after each segment
    doubling the rows up to ``G``), its last width decoding every leaf to
    the longest's end, and with ``sampler.shrink_batch_to`` halving as the
    leaves end; their leaves' tokens per second, and the ratio of the two;

Part 1b: SPEC-RL at lenience 0 with the previous epoch's rollouts as drafts
(params moved by ``--spec_noise`` stds): plain static sampling, the static
speculative sampler, continuous slots, and slots verifying the drafts.

Part 1c (``--prefix_prompt_len``, 512 by default; 0 skips it): continuous
slots on long prompts (``B`` prompts of that many tokens, ``G`` samples,
each of ``--prefix_new_tokens`` new tokens, 1 (the rollout is its
prefills) and 32): a group's prompt prefilled once and its KV copied to the
other slots (``SlotConfig.share_prompts``) against every slot prefilling
its own prompt. It prints the seconds per rollout (median of
``--spec_repeats`` after a compile), the rows run through the decoder in
prefills, and the ratio; the rows drawn are the same.

Part 1 also compiles one rollout of each sampler on part 1's shapes and
reads the compiler's buffer assignment: the peak of its temporaries (the
KV cache and the decode state, not the params) for the static batch, the
shrinking one and the slots, and the ratio to the static batch's.

Part 1 prints slot utilisation (kept tokens over decode row-steps: the static
batch runs ``N x max length`` row-steps), generated tokens/s, trained
tokens/s (tokens of the rows handed to the trainer per second of sampling)
and the ratios to static.

Part 2, the loop (``--loop``): the tiny arithmetic config for ``--loop_steps``
RL steps with ``rl.max_staleness`` 0 and 1 and each ``rl.rollout``: seconds
per RL step (median of steps 3 on: the first ones compile), sample and
train tokens/s, mean staleness.

  python -m launch.bench_rollout
  python -m launch.bench_rollout --loop=false --eos_every=64 --max_new_tokens=256
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from launch import benchlib
from rljax import models, sampling
from rljax.rollout import partial as partial_lib

_B = flags.DEFINE_integer("prompts", 8, "prompts per batch (B)")
_G = flags.DEFINE_integer("group_size", 8, "samples per prompt (G)")
_T = flags.DEFINE_integer("max_new_tokens", 128, "generation budget")
_EOS = flags.DEFINE_integer("eos_every", 32, "one token in this many ends a row")
_SLOTS = flags.DEFINE_integer("slots", 32, "continuous / partial slots (M)")
_REFILL = flags.DEFINE_integer("refill_rows", 8, "rows per refill (R)")
_SHRINK = flags.DEFINE_integer(
    "shrink_batch_to", 8, "part 1: also the static sampler with "
    "sampler.shrink_batch_to (0: not)")
_TREE_SEGMENT = flags.DEFINE_integer(
    "tree_segment_tokens", 8, "part 1: also tree rollouts with segments of "
    "this many tokens, plain and shrinking (0: not)")
_STEPS = flags.DEFINE_integer("steps", 8, "batches per variant (timed: all "
                              "but the first two, which compile)")
_SPEC_NOISE = flags.DEFINE_float("spec_noise", 0.02, "part 1b: the policy "
                                  "moves by this many parameter stds")
_SPEC_REPEATS = flags.DEFINE_integer("spec_repeats", 3, "part 1b: timed runs")
_PREFIX_LEN = flags.DEFINE_integer(
    "prefix_prompt_len", 512, "part 1c: prompt tokens of the shared-prompt "
    "comparison (0: skip it)")
_PREFIX_T = flags.DEFINE_list("prefix_new_tokens", ["1", "32"], "part 1c: "
                              "new tokens per row, each a comparison (1: the "
                              "rollout is its prefills)")
_LOOP = flags.DEFINE_bool("loop", True, "also time the RL loop (part 2)")
_LOOP_STEPS = flags.DEFINE_integer("loop_steps", 20, "RL steps per loop run "
                                   "(the median of steps 3 on is reported)")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")

MODEL = models.ModelConfig(
    vocab_size=1024, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=32, mlp_dim=512, rope_theta=10_000.0, tie_embeddings=False)


def _batches(b):
  """Batches of ``b`` random prompts of 8-15 tokens, the same every time."""
  rng = np.random.RandomState(0)
  while True:
    lists = [list(rng.randint(1, MODEL.vocab_size, rng.randint(8, 16)))
             for _ in range(b)]
    yield lists, {"prompt": [""] * b, "answer": [0] * b}


def _sampler_part(params, config) -> dict:
  b, g, m = _B.value, _G.value, _SLOTS.value
  static = sampling.make_sampler(MODEL, config)
  figures = {}

  # Static: every row until the longest has ended; "shrinking": the static
  # sampler with sampler.shrink_batch_to (the batch halves as rows end).
  variants = [("static", static)]
  if _SHRINK.value:
    variants.append(("shrinking", sampling.make_sampler(
        MODEL, config.replace(shrink_batch_to=_SHRINK.value))))
  for name, sampler in variants:
    levels = sampling.shrink_levels(
        b * g, _SHRINK.value if name == "shrinking" else None)
    gen = steps = 0
    seconds = 0.0
    source = _batches(b)
    for i in range(_STEPS.value):
      lists, _ = next(source)
      tokens, mask = sampling.pad_prompts(lists, config.prompt_buckets)
      t = time.perf_counter()
      out = jax.device_get(sampler(params, tokens, mask, jax.random.key(i)))
      if i >= 2:  # both programs compiled (partial: with carried rows)
        seconds += time.perf_counter() - t
        gen += int(out.lengths.sum())
        # Rows decoded per step: the smallest level that holds the live rows.
        for step in range(int(out.lengths.max())):
          live = int(np.sum(out.lengths > step))
          steps += min(n for n in levels if n >= live)
    figures[name] = {"slot_utilization": gen / steps,
                     "generated_tokens_per_s": gen / seconds,
                     "trained_tokens_per_s": gen / seconds}

  for mode in ("continuous", "partial"):
    partial = partial_lib.PartialConfig(
        mode, slots=m, refill_rows=_REFILL.value, max_age=2,
        max_carried=b if mode == "partial" else 0)
    rollouts = partial_lib.SlotRollouts(MODEL, config, partial, b)
    source = _batches(b)
    more = lambda: next(source)  # noqa: E731
    gen = trained = slot_steps = 0
    seconds, stale = 0.0, []
    for i in range(_STEPS.value):
      lists, examples = next(source)
      t = time.perf_counter()
      rollout, _, versions, stats = rollouts.sample(
          params, lists, examples, jax.random.key(i), i,
          config.prompt_buckets, more=more)
      if i >= 2:  # both programs compiled (partial: with carried rows)
        seconds += time.perf_counter() - t
        gen += stats["rollout/generated_tokens"]
        trained += int(np.sum(rollout.lengths))
        slot_steps += stats["rollout/decode_steps"] * m
        stale.extend((i - versions[versions >= 0]).tolist())
    figures[mode] = {
        "slot_utilization": gen / slot_steps,
        "generated_tokens_per_s": gen / seconds,
        "trained_tokens_per_s": trained / seconds,
        "mean_staleness": float(np.mean(stale)) if stale else 0.0,
        "dropped_groups": rollouts.dropped}
  base = figures["static"]
  for name, f in figures.items():
    for k in ("slot_utilization", "trained_tokens_per_s",
              "generated_tokens_per_s"):
      f[f"{k}_vs_static"] = f[k] / base[k]
    print(f"{name:10s} slot util {f['slot_utilization']:.3f} "
          f"({f['slot_utilization_vs_static']:.2f}x)  generated "
          f"{f['generated_tokens_per_s']:8.0f} tok/s "
          f"({f['generated_tokens_per_s_vs_static']:.2f}x)  trained "
          f"{f['trained_tokens_per_s']:8.0f} tok/s "
          f"({f['trained_tokens_per_s_vs_static']:.2f}x)  staleness "
          f"{f.get('mean_staleness', 0.0):.2f}")
  return figures


def _tree_part(params, config) -> dict:
  """Tree rollouts (``sampling.tree``) of part 1's batches, the last width
  decoding to the end and shrinking as its leaves end: the same leaves
  (draws are keyed by row and column), timed after a compile each."""
  from rljax.sampling import tree as tree_lib  # pylint: disable=import-outside-toplevel
  tree = tree_lib.TreeConfig(segment_tokens=_TREE_SEGMENT.value, branch=2,
                             roots=2)
  shrink = _SHRINK.value or 8
  figures = {}
  for name, c in (("tree", config),
                  ("tree_shrinking", config.replace(shrink_batch_to=shrink))):
    sampler = tree_lib.make_tree_sampler(MODEL, c, tree)
    leaf = 0
    seconds = 0.0
    source = _batches(_B.value)
    for i in range(_STEPS.value):
      lists, _ = next(source)
      tokens, mask = sampling.pad_prompts(lists, config.prompt_buckets)
      t = time.perf_counter()
      out = jax.device_get(sampler(params, tokens, mask, jax.random.key(i)))
      if i >= 2:
        seconds += time.perf_counter() - t
        leaf += int(out.lengths.sum())
    figures[f"{name}_leaf_tokens_per_s"] = leaf / seconds
  figures["shrinking_vs_plain"] = (figures["tree_shrinking_leaf_tokens_per_s"]
                                   / figures["tree_leaf_tokens_per_s"])
  print(f"tree (segments of {tree.segment_tokens}) {figures['tree_leaf_tokens_per_s']:8.0f} "
        f"leaf tok/s; its last width shrinking to {shrink} rows "
        f"{figures['tree_shrinking_leaf_tokens_per_s']:8.0f} leaf tok/s: "
        f"{figures['shrinking_vs_plain']:.2f}x")
  return figures


def _memory_part(params, config) -> dict:
  """Peak compiled temporaries of one rollout (bytes; the KV cache and the
  decode state): the static sampler, the shrinking one and the slots."""
  from rljax.sampling import continuous as cb  # pylint: disable=import-outside-toplevel
  b, m = _B.value, _SLOTS.value
  lists, _ = next(_batches(b))
  tokens, mask = sampling.pad_prompts(lists, config.prompt_buckets)
  key = jax.random.key(0)
  queue = cb.fresh_queue(tokens, mask, key, config)
  lowered = {
      "static": sampling.make_sampler(MODEL, config).lower(
          params, tokens, mask, key),
      "continuous": cb.make_continuous_sampler(
          MODEL, config, cb.SlotConfig(m, _REFILL.value)).lower(
              params, queue, b)}
  if _SHRINK.value:
    lowered["shrinking"] = sampling.make_sampler(
        MODEL, config.replace(shrink_batch_to=_SHRINK.value)).lower(
            params, tokens, mask, key)
  figures = {}
  for name, low in lowered.items():
    stats = low.compile().memory_analysis()
    figures[name] = {"temp_bytes": int(stats.temp_size_in_bytes)}
  for name, f in figures.items():
    f["vs_static"] = f["temp_bytes"] / figures["static"]["temp_bytes"]
    print(f"  {name:10s} peak temporaries {f['temp_bytes'] / 2**20:7.2f} MiB "
          f"({f['vs_static']:.2f}x static)")
  return figures


def _prefix_part(params, config) -> dict:
  """Part 1c: shared prompt prefills on slots against one per slot, for
  each ``--prefix_new_tokens``."""
  return {f"new_tokens_{t}": _prefix_case(params, config, int(t))
          for t in _PREFIX_T.value}


def _prefix_case(params, config, new_tokens: int) -> dict:
  from rljax.sampling import continuous as cb  # pylint: disable=import-outside-toplevel
  b, p = _B.value, _PREFIX_LEN.value
  config = config.replace(prompt_buckets=(p,), max_new_tokens=new_tokens)
  rng = np.random.RandomState(1)
  lists = [list(rng.randint(1, MODEL.vocab_size, p)) for _ in range(b)]
  tokens, mask = sampling.pad_prompts(lists, config.prompt_buckets)
  queue = cb.fresh_queue(tokens, mask, jax.random.key(0), config)
  figures, outs = {}, {}
  for name, share in (("per_slot", False), ("shared", True)):
    fn = cb.make_continuous_sampler(MODEL, config, cb.SlotConfig(
        _SLOTS.value, _REFILL.value, share_prompts=share))
    outs[name] = jax.device_get(fn(params, queue, b))  # compiles
    times = []
    for _ in range(_SPEC_REPEATS.value):
      t = time.perf_counter()
      jax.block_until_ready(fn(params, queue, b))
      times.append(time.perf_counter() - t)
    figures[name] = {"seconds": float(np.median(times)),
                     "prefilled_rows": int(outs[name].prefilled_rows),
                     "generated_tokens": int(outs[name].lengths.sum())}
  same = bool(np.array_equal(outs["shared"].completion_tokens,
                             outs["per_slot"].completion_tokens))
  figures["speedup"] = (figures["per_slot"]["seconds"]
                        / figures["shared"]["seconds"])
  figures["same_tokens"] = same
  print(f"  {new_tokens:3d} new tokens: per-slot prefill "
        f"{figures['per_slot']['seconds']:.3f} s "
        f"({figures['per_slot']['prefilled_rows']} rows prefilled), shared "
        f"{figures['shared']['seconds']:.3f} s "
        f"({figures['shared']['prefilled_rows']} rows): "
        f"{figures['speedup']:.2f}x; same tokens: {same}")
  return figures


def _spec_part(params, config) -> dict:
  """SPEC-RL at lenience 0: drafts from the previous epoch, verified by the
  static speculative sampler and in the continuous slots."""
  b, m = _B.value, _SLOTS.value
  moved = jax.tree.map(
      lambda x: x + _SPEC_NOISE.value * jnp.std(x) * jax.random.normal(
          jax.random.key(1), x.shape, x.dtype), params)
  lists, examples = next(_batches(b))
  tokens, mask = sampling.pad_prompts(lists, config.prompt_buckets)
  first = jax.device_get(sampling.make_sampler(MODEL, config)(
      params, tokens, mask, jax.random.key(0)))
  draft = sampling.Draft(first.completion_tokens, first.completion_mask,
                         first.sampler_logprobs)
  plain = sampling.make_sampler(MODEL, config)
  spec = sampling.make_speculative_sampler(MODEL, config, log_lenience=0.0)
  timings, accepted = {}, {}

  def timed(name, fn):
    fn()  # compile
    best = float("inf")
    for _ in range(_SPEC_REPEATS.value):
      t = time.perf_counter()
      out = fn()
      best = min(best, time.perf_counter() - t)
    timings[name] = best
    return out

  timed("static plain", lambda: jax.device_get(
      plain(moved, tokens, mask, jax.random.key(5))))
  _, acc = timed("static SPEC-RL", lambda: jax.device_get(
      spec(moved, tokens, mask, draft, jax.random.key(5))))
  accepted["static SPEC-RL"] = float(acc.sum() / first.lengths.sum())
  for drafts in (False, True):
    store = sampling.DraftStore(1024)
    rollouts = partial_lib.SlotRollouts(
        MODEL, config, partial_lib.PartialConfig("continuous", m,
                                                 _REFILL.value),
        b, drafts=store if drafts else None, log_lenience=0.0)
    name = "slots SPEC-RL" if drafts else "slots plain"

    def run(rollouts=rollouts, store=store, drafts=drafts):
      if drafts:  # the previous epoch's rollout of each prompt
        store.update(lists, first.completion_tokens, first.completion_mask,
                     first.sampler_logprobs)
      return rollouts.sample(moved, lists, examples, jax.random.key(5), 1,
                             config.prompt_buckets)
    out = timed(name, run)
    if drafts:
      accepted[name] = out[3]["spec/accept_rate"]
  base = timings["static plain"]
  figures = {}
  for name, seconds in timings.items():
    figures[name] = {"seconds": seconds, "speedup_vs_static_plain":
                     base / seconds, "accept_rate": accepted.get(name)}
    print(f"{name:16s} {seconds * 1e3:8.1f} ms  {base / seconds:.2f}x static "
          f"plain" + (f"  accepted {accepted[name]:.0%}" if name in accepted
                      else ""))
  return figures


def _loop_part() -> dict:
  from configs import arithmetic_grpo  # pylint: disable=g-import-not-at-top
  from rljax import metrics as metrics_lib
  from rljax.train import loop
  figures = {}
  for rollout, staleness in (("static", 0), ("static", 1),
                             ("continuous", 0), ("partial", 0),
                             ("partial", 1)):
    c = arithmetic_grpo.get_config("tiny")
    c.sft.num_steps = 0
    c.eval.every = 10_000
    c.eval.greedy = False
    c.checkpoint.every = 10_000
    c.rl.num_steps = _LOOP_STEPS.value
    c.rl.rollout, c.rl.max_staleness = rollout, staleness
    with tempfile.TemporaryDirectory() as workdir:
      loop.run(c, workdir)
      rows = [r for r in metrics_lib.read_jsonl(
          os.path.join(workdir, "metrics.jsonl")) if r["step"] > 2]
    name = f"{rollout}/staleness={staleness}"
    f = {"seconds_per_step": float(np.median([r["time/step"] for r in rows])),
         "sample_tokens_per_s": float(np.median(
             [r["tokens_per_s/sample"] for r in rows])),
         "trained_tokens_per_s": float(
             np.sum([r["num_train_tokens"] for r in rows])
             / np.sum([r["time/step"] for r in rows])),
         "mean_staleness": float(np.mean(
             [r["rollout/staleness/mean"] for r in rows]))}
    figures[name] = f
  base = figures["static/staleness=0"]
  for name, f in figures.items():
    f["step_speedup_vs_sync"] = base["seconds_per_step"] / f["seconds_per_step"]
    print(f"{name:28s} {f['seconds_per_step']*1e3:7.0f} ms/step "
          f"({f['step_speedup_vs_sync']:.2f}x)  trained "
          f"{f['trained_tokens_per_s']:7.0f} tok/s  staleness "
          f"{f['mean_staleness']:.2f}")
  return figures


def main(argv):
  del argv
  config = sampling.SamplerConfig(
      num_samples=_G.value, max_new_tokens=_T.value,
      eos_ids=tuple(range(1, 1 + MODEL.vocab_size // _EOS.value)),
      pad_id=0, cache_dtype="float32", prompt_buckets=(16,))
  params = models.init_params(MODEL, jax.random.key(0))
  print(f"part 1: {_B.value} prompts x G={_G.value}, T={_T.value}, one token "
        f"in {_EOS.value} ends a row; {_SLOTS.value} slots, refill "
        f"{_REFILL.value}; {jax.devices()[0].platform}")
  figures = {"sampler": _sampler_part(params, config)}
  if _TREE_SEGMENT.value:
    figures["tree"] = _tree_part(params, config)
  print("part 1, memory: one rollout compiled, its peak temporaries")
  figures["memory"] = _memory_part(params, config)
  if _PREFIX_LEN.value:
    print(f"part 1c: {_B.value} prompts of {_PREFIX_LEN.value} tokens x "
          f"G={_G.value}, {_SLOTS.value} slots, refill {_REFILL.value}: a "
          "group's prompt prefilled once vs in every slot")
    figures["shared_prompts"] = _prefix_part(params, config)
  print(f"part 1b: SPEC-RL, log lenience 0, drafts from the previous epoch, "
        f"params moved by {_SPEC_NOISE.value} std")
  figures["spec_rl"] = _spec_part(params, config)
  if _LOOP.value:
    print(f"part 2: the tiny arithmetic loop, {_LOOP_STEPS.value} RL steps")
    figures["loop"] = _loop_part()
  if _RECORD_DIR.value:
    print("record:", benchlib.write_record(
        "bench_rollout", figures, _RECORD_DIR.value,
        {"args": {"prompts": _B.value, "group_size": _G.value,
                  "max_new_tokens": _T.value, "eos_every": _EOS.value,
                  "slots": _SLOTS.value, "refill_rows": _REFILL.value,
                  "shrink_batch_to": _SHRINK.value,
                  "tree_segment_tokens": _TREE_SEGMENT.value,
                  "prefix_prompt_len": _PREFIX_LEN.value,
                  "prefix_new_tokens": _PREFIX_T.value,
                  "steps": _STEPS.value, "loop_steps": _LOOP_STEPS.value}}))


if __name__ == "__main__":
  app.run(main)
