r"""Multi-turn rollouts: environment latency behind the decode, or not.

A model with random weights plays ``SlowTool`` (``launch/envs_fixtures.py``):
every step takes ``--delay_ms`` (a tool call) in one of ``--workers``
processes, up to ``--turns`` turns; one token in ``--eos_every`` ends a turn,
so turn lengths are geometric and uneven. The same episodes (same key) run

  * turn by turn (``env.step_rows=None``): every row's turn ends, then the
    environments step, then the observations are inserted: the devices idle
    while the environments run, and rows idle until the slowest turn ends;
  * in rounds of ``--step_rows`` (``env.step_rows``): a decode returns as
    soon as that many rows wait; their environments step while the next
    decode runs for the other rows.

It checks that both give the same tokens (the draws are keyed by row and
column) and prints the rollout seconds, the environment seconds, and the
ratio. ``--record_dir`` writes a record.

  python -m launch.bench_envs
  python -m launch.bench_envs --delay_ms=0   # no latency: what the rounds cost

``--mode=schedules`` trains the calculator demo (``configs/calculator_grpo.py``)
with ``--delay_ms`` added to every tool call
(``launch.envs_fixtures.SlowCalculator``, in ``--workers`` processes) under
two schedules, for each of ``--seeds`` seeds:

  * ``sync_static``: the static batch, turn by turn, synchronous
    (``rl.rollout=static``, ``rl.max_staleness=0``): the demo as the README
    gives it;
  * ``async_continuous``: episodes on continuous slots (``--slots``; None:
    the default ``rl.rollout_slots``, ``N / 2``), sampled one update ahead
    (``rl.rollout=continuous``, ``rl.max_staleness=1``; ``--step_rows``
    sets ``env.step_rows``): the update is dispatched once the first turns'
    decode is, so it runs while the host waits for the first environment
    steps; the slots' episodes go on turn by turn each, the environments'
    latency overlapping the other slots' decoding.

It prints the episodes per second of the RL steps (after the first
``--warmup_steps``, which compile; the last step, which samples nothing
ahead, left out), their ratio, and each seed's held-out success before and
after RL, and checks that the asynchronous runs' accuracy after RL lies in
the synchronous runs' seed range.

  python -m launch.bench_envs --mode=schedules

``--mode=paged`` plays the same episodes (``--delay_ms`` per step, turn by
turn) on a dense KV cache, ``P + T + O`` slots per row for the whole
rollout, and on a paged one of ``--block_size``-slot blocks
(``rljax/rollout/turn_pages.py``): it checks the tokens are the same and
prints the KV slots each holds (the paged pool's peak in use), a pool of
that peak (which cuts no episode), and the seconds per rollout of each.

  python -m launch.bench_envs --mode=paged
"""

from __future__ import annotations

import time

import os
import tempfile

from absl import app, flags
import jax
import numpy as np

from configs import calculator_grpo
from launch import benchlib
from launch import envs_fixtures
from rljax import envs, metrics, models, sampling, train
from rljax.rollout import multi_turn as mt

_MODE = flags.DEFINE_enum("mode", "rounds", ["rounds", "schedules", "paged"],
                          "rounds: one rollout, environments stepped in "
                          "rounds vs turn by turn; schedules: the calculator "
                          "demo trained sync-static vs async-continuous")
_SEEDS = flags.DEFINE_integer("seeds", 3, "schedules: seeds 0..n-1 each")
_RL_STEPS = flags.DEFINE_integer("rl_steps", None, "schedules: RL steps "
                                 "(None: the demo's)")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", None, "schedules: SFT steps "
                                  "(None: the demo's)")
_WARMUP = flags.DEFINE_integer("warmup_steps", 6, "schedules: first RL steps "
                               "left out of the episodes per second")
_EVAL = flags.DEFINE_integer("eval_examples", None, "schedules: held-out "
                             "examples (None: the demo's)")
_B = flags.DEFINE_integer("prompts", 8, "prompts per batch (B)")
_G = flags.DEFINE_integer("group_size", 8, "episodes per prompt (G)")
_T = flags.DEFINE_integer("max_new_tokens", 96, "episode budget (T)")
_TURNS = flags.DEFINE_integer("turns", 4, "environment steps per episode")
_EOS = flags.DEFINE_integer("eos_every", 12, "one token in this many ends a "
                            "turn")
_DELAY = flags.DEFINE_integer("delay_ms", 40, "latency of one step call")
_WORKERS = flags.DEFINE_integer("workers", None, "environment processes "
                                 "(None: 4 for rounds, 32 for schedules)")
_STEP_ROWS = flags.DEFINE_integer("step_rows", None, "rows per round (None: "
                                  "16 for rounds; for schedules, "
                                  "async_continuous's env.step_rows)")
_SLOTS = flags.DEFINE_integer("slots", None, "schedules: async_continuous's "
                              "rl.rollout_slots (None: the config's, N / 2)")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs (best of)")
_BLOCK = flags.DEFINE_integer("block_size", 16, "paged: slots per block")
_RECORD = flags.DEFINE_string("record_dir", "benchmarks/results",
                              "where the JSON record goes ('' for none)")


class _Tokens:
  """Ids as text (one character per id): the environment sees numbers."""
  vocab_size, bos_id, eos_id, pad_id = 256, 1, 2, 0

  def encode(self, text):
    return [3 + (ord(c) % 200) for c in text]

  def decode(self, ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


SCHEDULES = {
    "sync_static": {"rl.rollout": "static", "rl.max_staleness": 0},
    "async_continuous": {"rl.rollout": "continuous", "rl.max_staleness": 1},
}


def calculator_config(schedule: str, seed: int, workers: int, step_rows: int,
                      delay_ms: float):
  """The calculator demo's config under ``schedule`` with a slow tool."""
  c = calculator_grpo.get_config()
  c.seed = seed
  c.env.name = "launch.envs_fixtures:SlowCalculator"
  c.env.kwargs = {"delay_s": delay_ms / 1000}
  c.env.num_workers = workers
  for field, value in SCHEDULES[schedule].items():
    section, name = field.split(".")
    c[section][name] = value
  if schedule != "sync_static" and step_rows:
    c.env.step_rows = step_rows
  if schedule != "sync_static" and _SLOTS.value:
    c.rl.rollout_slots = _SLOTS.value
  if _RL_STEPS.value is not None:
    c.rl.num_steps = _RL_STEPS.value
    c.eval.every = c.checkpoint.every = _RL_STEPS.value
  if _SFT_STEPS.value is not None:
    c.sft.num_steps = _SFT_STEPS.value
  if _EVAL.value is not None:
    c.eval.num_examples = _EVAL.value
  return c


def episodes_per_second(rows: list[dict], episodes: int, warmup: int
                        ) -> float:
  """Episodes per second of the RL steps after ``warmup`` (``time/step``
  is each step's wall time), the last step left out."""
  steps = [r for r in rows if warmup < r["step"] < rows[-1]["step"]]
  if not steps:
    raise SystemExit(f"--warmup_steps={warmup} leaves no step to time.")
  return episodes * len(steps) / sum(r["time/step"] for r in steps)


def schedules_main():
  workers = _WORKERS.value or 32
  step_rows = _STEP_ROWS.value  # None: the slots step as their turns end
  figures: dict = {name: {"episodes_per_s": [], "accuracy_before": [],
                          "accuracy_after": [], "seconds": []}
                   for name in SCHEDULES}
  for seed in range(_SEEDS.value):
    for name in SCHEDULES:
      c = calculator_config(name, seed, workers, step_rows, _DELAY.value)
      workdir = tempfile.mkdtemp(prefix=f"bench-envs-{name}-")
      start = time.perf_counter()
      summary = train.run(c, workdir)
      seconds = time.perf_counter() - start
      rows = [r for r in metrics.read_jsonl(
          os.path.join(workdir, "metrics.jsonl"))
              if r.get("step", 0) > 0 and "time/step" in r]
      eps = episodes_per_second(rows, c.rl.prompts_per_step * c.rl.group_size,
                                _WARMUP.value)
      f = figures[name]
      f["episodes_per_s"].append(eps)
      f["accuracy_before"].append(summary["before"]["eval/accuracy"])
      f["accuracy_after"].append(summary["after"]["eval/accuracy"])
      f["seconds"].append(seconds)
      print(f"seed {seed} {name:>16}: {eps:6.1f} episodes/s, held-out "
            f"{summary['before']['eval/accuracy']:.1%} -> "
            f"{summary['after']['eval/accuracy']:.1%} ({seconds:.0f} s)")
  sync, fast = figures["sync_static"], figures["async_continuous"]
  ratio = float(np.mean(fast["episodes_per_s"]) /
                np.mean(sync["episodes_per_s"]))
  low, high = min(sync["accuracy_after"]), max(sync["accuracy_after"])
  within = all(low <= a <= high for a in fast["accuracy_after"])
  figures.update({"speedup": ratio, "async_within_sync_range": within})
  for name, f in figures.items():
    if isinstance(f, dict):
      print(f"{name:>16}: {np.mean(f['episodes_per_s']):.1f} episodes/s "
            f"(seeds {', '.join(f'{x:.1f}' for x in f['episodes_per_s'])}); "
            f"after RL {', '.join(f'{a:.1%}' for a in f['accuracy_after'])}")
  print(f"async on continuous slots: {ratio:.2f}x the episodes per second of "
        f"sync on the static batch; its accuracy after RL "
        f"{'lies' if within else 'does NOT lie'} in the sync seeds' range "
        f"[{low:.1%}, {high:.1%}]")
  if _RECORD.value:
    print("record:", benchlib.write_record(
        "bench_envs_schedules", figures, _RECORD.value,
        {"seeds": _SEEDS.value, "delay_ms": _DELAY.value, "workers": workers,
         "slots": _SLOTS.value,
         "step_rows": step_rows, "rl_steps": _RL_STEPS.value,
         "sft_steps": _SFT_STEPS.value, "warmup_steps": _WARMUP.value,
         "eval_examples": _EVAL.value}))


def _episodes_setup():
  """``(model config, params, sampler config, env, examples)`` of the
  rounds' and the paged modes' episodes."""
  mc = models.get_preset("tiny").replace(num_layers=2, d_model=128,
                                         mlp_dim=256, head_dim=32)
  params = models.init_params(mc, jax.random.key(0))
  eos = tuple(range(3, 3 + max(1, mc.vocab_size // _EOS.value)))
  config = sampling.SamplerConfig(
      num_samples=_G.value, max_new_tokens=_T.value, eos_ids=eos,
      cache_dtype="float32", prompt_buckets=(8,), segment_slots=None)
  env = envs_fixtures.SlowTool(delay_s=_DELAY.value / 1000,
                               turns=_TURNS.value)
  examples = {"prompt": [f"p{i}" for i in range(_B.value)]}
  return mc, params, config, env, examples


def paged_main():
  """``--mode=paged`` (the module docstring)."""
  mc, params, config, env, examples = _episodes_setup()
  turns = mt.TurnConfig(max_turns=_TURNS.value + 1, max_observation_tokens=4)
  runner = envs.EnvRunner(env, num_workers=_WORKERS.value or 4, timeout_s=60)
  bs = _BLOCK.value
  figures, outs = {}, {}
  try:
    def timed(paged):
      sampler = mt.MultiTurnSampler(mc, config, turns, runner, _Tokens(),
                                    (8,), paged=paged)
      run = lambda: jax.device_get(sampler.run(params, examples,
                                               jax.random.key(1)))
      out = run()  # compiles
      best = float("inf")
      for _ in range(_REPEATS.value):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
      return out, best
    outs["dense"], dense_s = timed(None)
    outs["paged"], paged_s = timed(sampling.PagedConfig(bs))
    peak = int(outs["paged"].metrics["rollout/kv_blocks_peak"])
    outs["pool"], pool_s = timed(sampling.PagedConfig(bs, peak))
  finally:
    runner.close()
  n = _B.value * _G.value
  dense_slots = n * (8 + _T.value + 4)
  same = all(np.array_equal(outs[k].rollout.completion_tokens,
                            outs["dense"].rollout.completion_tokens)
             for k in ("paged", "pool"))
  m = outs["pool"].metrics
  figures = {
      "same_episodes": same, "dense_slots": dense_slots,
      "paged_peak_slots": peak * bs, "peak_vs_dense": peak * bs / dense_slots,
      "worst_pool_slots": int(outs["paged"].metrics["rollout/kv_blocks_pool"])
      * bs, "pool_cut_rows": int(m["rollout/kv_cut_rows"]),
      "pool_blocks_left": int(m["rollout/kv_blocks_left"]),
      "seconds_dense": dense_s, "seconds_paged": paged_s,
      "seconds_pool": pool_s, "speed_vs_dense": dense_s / pool_s,
      "tokens": int(np.asarray(outs["dense"].rollout.completion_mask).sum()),
      "turns_mean": outs["dense"].metrics["env/turns/mean"]}
  print(f"{n} episodes, T={_T.value}, turns/episode "
        f"{figures['turns_mean']:.2f}, {figures['tokens']} tokens; blocks "
        f"of {bs}; same episodes on every cache: {same}")
  print(f"  KV slots: dense {dense_slots}; paged peak {peak * bs} "
        f"({figures['peak_vs_dense']:.2f}x); a pool of {peak} blocks cut "
        f"{figures['pool_cut_rows']} episodes, {figures['pool_blocks_left']} "
        "blocks left")
  print(f"  seconds per rollout: dense {dense_s:.3f}, paged {paged_s:.3f}, "
        f"pool of the peak {pool_s:.3f} ({figures['speed_vs_dense']:.2f}x "
        "the dense speed)")
  if _RECORD.value:
    print("record:", benchlib.write_record(
        "bench_envs_paged", figures, _RECORD.value,
        {**{k: v.value for k, v in flags.FLAGS.__flags.items()
            if k in ("prompts", "group_size", "max_new_tokens", "turns",
                     "eos_every", "delay_ms", "repeats", "block_size")},
         "workers": _WORKERS.value or 4}))
  if not same:
    raise SystemExit("the paged cache changed the episodes")


def main(_):
  if _MODE.value == "schedules":
    schedules_main()
    return
  if _MODE.value == "paged":
    paged_main()
    return
  mc, params, config, env, examples = _episodes_setup()
  runner = envs.EnvRunner(env, num_workers=_WORKERS.value or 4, timeout_s=60)
  figures = {}
  outs = {}
  try:
    for name, step_rows in (("turn_by_turn", None),
                            ("rounds", _STEP_ROWS.value or 16)):
      turns = mt.TurnConfig(max_turns=_TURNS.value + 1,
                            max_observation_tokens=4, step_rows=step_rows)
      sampler = mt.MultiTurnSampler(mc, config, turns, runner, _Tokens(),
                                    (8,))
      run = lambda: jax.block_until_ready(sampler.run(
          params, examples, jax.random.key(1)))
      run()  # compiles
      best, out = float("inf"), None
      for _ in range(_REPEATS.value):
        t = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - t)
      outs[name] = jax.device_get(out)
      figures[name] = {"seconds": best,
                       "env_seconds": out.metrics["time/env"],
                       "turns_mean": out.metrics["env/turns/mean"],
                       "tokens": int(np.asarray(
                           out.rollout.completion_mask).sum())}
      print(f"{name:>12}: {best:.3f} s per rollout, environments "
            f"{out.metrics['time/env']:.3f} s, turns/episode "
            f"{out.metrics['env/turns/mean']:.2f}, tokens "
            f"{figures[name]['tokens']}")
  finally:
    runner.close()
  a, b = outs["turn_by_turn"].rollout, outs["rounds"].rollout
  same = bool(np.array_equal(a.completion_tokens, b.completion_tokens)
              and np.array_equal(a.observation_mask, b.observation_mask))
  ratio = figures["turn_by_turn"]["seconds"] / figures["rounds"]["seconds"]
  figures.update({"same_episodes": same, "speedup": ratio})
  print(f"same episodes: {same}; rounds of {_STEP_ROWS.value or 16} rows: "
        f"{ratio:.2f}x turn by turn")
  if _RECORD.value:
    print("record:", benchlib.write_record(
        "bench_envs", figures, _RECORD.value,
        {**{k: v.value for k, v in flags.FLAGS.__flags.items()
            if k in ("prompts", "group_size", "max_new_tokens", "turns",
                     "eos_every", "delay_ms", "repeats")},
         "workers": _WORKERS.value or 4, "step_rows": _STEP_ROWS.value or 16}))
  if not same:
    raise SystemExit("the rounds changed the episodes")


if __name__ == "__main__":
  app.run(main)
