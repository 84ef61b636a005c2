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
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import numpy as np

from launch import benchlib
from launch import envs_fixtures
from rljax import envs, models, sampling
from rljax.rollout import multi_turn as mt

_B = flags.DEFINE_integer("prompts", 8, "prompts per batch (B)")
_G = flags.DEFINE_integer("group_size", 8, "episodes per prompt (G)")
_T = flags.DEFINE_integer("max_new_tokens", 96, "episode budget (T)")
_TURNS = flags.DEFINE_integer("turns", 4, "environment steps per episode")
_EOS = flags.DEFINE_integer("eos_every", 12, "one token in this many ends a "
                            "turn")
_DELAY = flags.DEFINE_integer("delay_ms", 40, "latency of one step call")
_WORKERS = flags.DEFINE_integer("workers", 4, "environment processes")
_STEP_ROWS = flags.DEFINE_integer("step_rows", 16, "rows per round")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs (best of)")
_RECORD = flags.DEFINE_string("record_dir", "benchmarks/results",
                              "where the JSON record goes ('' for none)")


class _Tokens:
  """Ids as text (one character per id): the environment sees numbers."""
  vocab_size, bos_id, eos_id, pad_id = 256, 1, 2, 0

  def encode(self, text):
    return [3 + (ord(c) % 200) for c in text]

  def decode(self, ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def main(_):
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
  runner = envs.EnvRunner(env, num_workers=_WORKERS.value, timeout_s=60)
  figures = {}
  outs = {}
  try:
    for name, step_rows in (("turn_by_turn", None),
                            ("rounds", _STEP_ROWS.value)):
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
  print(f"same episodes: {same}; rounds of {_STEP_ROWS.value} rows: "
        f"{ratio:.2f}x turn by turn")
  if _RECORD.value:
    print("record:", benchlib.write_record(
        "bench_envs", figures, _RECORD.value,
        {k: v.value for k, v in flags.FLAGS.__flags.items()
         if k in ("prompts", "group_size", "max_new_tokens", "turns",
                  "eos_every", "delay_ms", "workers", "step_rows",
                  "repeats")}))
  if not same:
    raise SystemExit("the rounds changed the episodes")


if __name__ == "__main__":
  app.run(main)
