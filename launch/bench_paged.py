r"""KV-cache memory that follows live tokens: the static sampler on a dense
cache against a paged one (``sampler.kv_cache="paged"``).

A model with random weights samples ``--steps`` batches of ``B`` prompts of
``--prompt_len`` tokens x ``G`` samples; one token in ``--eos_every`` ends a
row, so completion lengths are geometric and a few rows reach
``--max_new_tokens``. The dense cache holds each prompt once (the shared
prefix) and ``T`` slots per row for the whole rollout; the paged one holds
each prompt's blocks once and gives a row's blocks back when it ends.

It prints, in one run:

* the paged sampler's peak blocks in use per batch, and the same rows as
  the dense sampler's (tokens compared);
* the KV cache each needs: the dense cache's slots, and a pool of the
  largest peak seen (rounded up by ``--margin``), against the worst-case
  pool; the compiled peak temporaries of one rollout of each (the compiler's
  buffer assignment: the cache and the decode state);
* the rows that pool cut (none, when the peak held) and the seconds per
  rollout of each (median after a compile) and their ratio.

With ``--slots=M`` it also runs the same batches on ``M`` continuous-batching
slots (``rl.rollout="continuous"``), on a dense cache of ``P + T`` slots per
slot and on a paged one (``rljax/sampling/slot_pages.py``): the same tokens,
the paged slots' peak against the dense slots' cache and the static dense
batch's, compiled temporaries and seconds.

  python -m launch.bench_paged --slots=16 --record_dir=benchmarks/results
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import numpy as np

from launch import benchlib
from rljax import models, sampling
from rljax.sampling import paged as paged_lib

_B = flags.DEFINE_integer("prompts", 8, "prompts per batch (B)")
_G = flags.DEFINE_integer("group_size", 8, "samples per prompt (G)")
_P = flags.DEFINE_integer("prompt_len", 64, "prompt tokens")
_T = flags.DEFINE_integer("max_new_tokens", 128, "generation budget (T)")
_EOS = flags.DEFINE_integer("eos_every", 32, "one token in this many ends a "
                            "row")
_BLOCK = flags.DEFINE_integer("block_size", 16, "slots per block")
_STEPS = flags.DEFINE_integer("steps", 6, "batches")
_MARGIN = flags.DEFINE_float("margin", 1.25, "the sized pool: the largest "
                             "peak seen times this")
_SLOTS = flags.DEFINE_integer("slots", 0, "also compare continuous slots, "
                              "dense and paged, on this many slots (0: no)")
_RECORD_DIR = flags.DEFINE_string("record_dir", "", "where the JSON record "
                                  "goes (benchmarks/results to keep it)")

MODEL = models.get_preset("tiny").replace(
    vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=32, mlp_dim=384)


def _prompts(step: int):
  rng = np.random.RandomState(step)
  lists = [list(rng.randint(1, MODEL.vocab_size, _P.value))
           for _ in range(_B.value)]
  return sampling.pad_prompts(lists, (_P.value,))


def _seconds(fn, params, steps):
  out, times = None, []
  for i in range(steps):
    tokens, mask = _prompts(i)
    t = time.perf_counter()
    out = jax.block_until_ready(fn(params, tokens, mask, jax.random.key(i)))
    if i:
      times.append(time.perf_counter() - t)
  return float(np.median(times)), out


def _temporaries(fn, params) -> int:
  tokens, mask = _prompts(0)
  low = fn.lower(params, tokens, mask, jax.random.key(0))
  return int(low.compile().memory_analysis().temp_size_in_bytes)


def _slot_figures(params, config, dense_static_slots: int) -> dict:
  """The batches on ``--slots`` continuous slots, dense and paged."""
  from rljax.sampling import continuous as cb  # pylint: disable=import-outside-toplevel
  m, bs = _SLOTS.value, _BLOCK.value
  p, t, b = _P.value, _T.value, _B.value
  dense = cb.make_continuous_sampler(MODEL, config, cb.SlotConfig(m, 1))
  paged = cb.make_continuous_sampler(MODEL, config, cb.SlotConfig(
      m, 1, paged=paged_lib.PagedConfig(bs)))
  peaks, seconds = [], {"dense": [], "paged": []}
  for i in range(_STEPS.value):
    tokens, mask = _prompts(i)
    queue = cb.fresh_queue(tokens, mask, jax.random.key(i), config)
    outs = {}
    for name, fn in (("dense", dense), ("paged", paged)):
      start = time.perf_counter()
      outs[name] = jax.device_get(jax.block_until_ready(fn(params, queue, b)))
      if i:
        seconds[name].append(time.perf_counter() - start)
    np.testing.assert_array_equal(outs["paged"].completion_tokens,
                                  outs["dense"].completion_tokens)
    peaks.append(float(outs["paged"].kv_stats["rollout/kv_blocks_peak"]))
  queue = cb.fresh_queue(*_prompts(0), jax.random.key(0), config)
  temps = {name: int(fn.lower(params, queue, b).compile().memory_analysis()
                     .temp_size_in_bytes)
           for name, fn in (("dense", dense), ("paged", paged))}
  dense_slots = m * (p + t)
  peak_slots = int(max(peaks)) * bs
  out = {"slots": m, "peaks": peaks, "dense_slot_cache_slots": dense_slots,
         "paged_peak_slots": peak_slots,
         "peak_vs_dense_slots": peak_slots / dense_slots,
         "peak_vs_dense_static": peak_slots / dense_static_slots,
         "temporaries": temps,
         "temporaries_paged_vs_dense": temps["paged"] / temps["dense"],
         "seconds_dense": float(np.median(seconds["dense"])),
         "seconds_paged": float(np.median(seconds["paged"]))}
  out["speed_vs_dense"] = out["seconds_dense"] / out["seconds_paged"]
  print(f"  {m} continuous slots: the same tokens dense and paged in all "
        f"{_STEPS.value} batches; peak blocks {[int(x) for x in peaks]}")
  print(f"    KV slots: dense slots {dense_slots}; paged peak {peak_slots} "
        f"({out['peak_vs_dense_slots']:.2f}x the dense slots', "
        f"{out['peak_vs_dense_static']:.2f}x the static dense batch's)")
  print(f"    peak temporaries dense {temps['dense'] / 2**20:.2f} MiB, paged "
        f"{temps['paged'] / 2**20:.2f} MiB "
        f"({out['temporaries_paged_vs_dense']:.2f}x); seconds per rollout "
        f"dense {out['seconds_dense']:.3f}, paged {out['seconds_paged']:.3f} "
        f"({out['speed_vs_dense']:.2f}x the dense slots' speed)")
  return out


def main(argv):
  del argv
  b, g, p, t = _B.value, _G.value, _P.value, _T.value
  config = sampling.SamplerConfig(
      num_samples=g, max_new_tokens=t,
      eos_ids=tuple(range(1, 1 + MODEL.vocab_size // _EOS.value)), pad_id=0,
      cache_dtype="float32", prompt_buckets=(p,), segment_slots=None)
  params = models.init_params(MODEL, jax.random.key(0))
  worst = paged_lib.PagedConfig(_BLOCK.value)
  paged = paged_lib.make_paged_sampler(MODEL, config, worst)
  dense = sampling.make_sampler(MODEL, config)
  peaks, lengths = [], []
  for i in range(_STEPS.value):
    tokens, mask = _prompts(i)
    key = jax.random.key(i)
    got, stats = paged.with_metrics(params, tokens, mask, key)
    want = jax.device_get(dense(params, tokens, mask, key))
    np.testing.assert_array_equal(jax.device_get(got).completion_tokens,
                                  want.completion_tokens)
    peaks.append(stats["rollout/kv_blocks_peak"])
    lengths.append(want.lengths)
  pool_worst = int(stats["rollout/kv_blocks_pool"])
  sized = int(np.ceil(max(peaks) * _MARGIN.value))
  bs = _BLOCK.value
  slot_bytes = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 4
  dense_slots = b * p + b * g * t
  lens = np.concatenate(lengths)
  print(f"{b} prompts of {p} tokens x G={g}, T={t}, one token in "
        f"{_EOS.value} ends a row (mean length {lens.mean():.1f}, max "
        f"{lens.max()}); blocks of {bs}; {jax.devices()[0].platform}")
  print(f"  the same tokens as the dense sampler in all {_STEPS.value} "
        "batches")
  print(f"  peak blocks in use per batch: {[int(x) for x in peaks]} of a "
        f"worst-case pool of {pool_worst}")
  sized_sampler = paged_lib.make_paged_sampler(
      MODEL, config, paged_lib.PagedConfig(bs, sized))
  cut = 0
  for i in range(_STEPS.value):
    tokens, mask = _prompts(i)
    _, stats = sized_sampler.with_metrics(params, tokens, mask,
                                          jax.random.key(i))
    cut += int(stats["rollout/kv_cut_rows"])
  cache = {"dense_slots": dense_slots,
           "dense_bytes": dense_slots * slot_bytes,
           "paged_peak_slots": int(max(peaks)) * bs,
           "paged_sized_pool_slots": sized * bs,
           "paged_worst_pool_slots": pool_worst * bs}
  cache["sized_pool_vs_dense"] = cache["paged_sized_pool_slots"] / dense_slots
  cache["peak_vs_dense"] = cache["paged_peak_slots"] / dense_slots
  print(f"  KV slots: dense {dense_slots} ({cache['dense_bytes'] / 2**20:.2f}"
        f" MiB); paged peak {cache['paged_peak_slots']} "
        f"({cache['peak_vs_dense']:.2f}x), a pool of {sized} blocks "
        f"{cache['paged_sized_pool_slots']} ({cache['sized_pool_vs_dense']:.2f}"
        f"x dense), worst case {cache['paged_worst_pool_slots']}; rows cut by "
        f"that pool: {cut}")
  temps = {"dense": _temporaries(dense, params),
           "paged_sized": _temporaries(sized_sampler.jitted, params),
           "paged_worst": _temporaries(paged.jitted, params)}
  for name, v in temps.items():
    print(f"  peak temporaries {name:12s} {v / 2**20:7.2f} MiB "
          f"({v / temps['dense']:.2f}x dense)")
  s_dense, _ = _seconds(dense, params, _STEPS.value)
  s_paged, _ = _seconds(sized_sampler, params, _STEPS.value)
  print(f"  seconds per rollout: dense {s_dense:.3f}, paged {s_paged:.3f} "
        f"({s_dense / s_paged:.2f}x the dense speed)")
  figures = {"cache": cache, "temporaries": temps, "peaks": peaks,
             "cut_rows": cut, "seconds_dense": s_dense,
             "seconds_paged": s_paged, "speed_vs_dense": s_dense / s_paged,
             "mean_length": float(lens.mean())}
  if _SLOTS.value:
    figures["slots"] = _slot_figures(params, config, dense_slots)
  if _RECORD_DIR.value:
    print("record:", benchlib.write_record(
        "bench_paged", figures, _RECORD_DIR.value,
        {"args": {"prompts": b, "group_size": g, "prompt_len": p,
                  "max_new_tokens": t, "eos_every": _EOS.value,
                  "block_size": bs, "steps": _STEPS.value,
                  "slots": _SLOTS.value,
                  "margin": _MARGIN.value}}))


if __name__ == "__main__":
  app.run(main)
