r"""RL train-step throughput, compile time, recompiles, and an RL step's time split.

Part 1 times the jitted ``rl_step`` (forward + backward through the chunked
logprobs, PPO-clip coefficients, AdamW) on the ``small`` preset and reports
training tokens/s and the achieved fraction of the machine's matmul FLOP/s
measured in the same run. It also checks that steps after the first compile
nothing (the jit cache holds one entry).

With ``--compare_torch`` it also runs, in the same process, the PyTorch +
transformers step that TRL's GRPO trainer runs (``_get_per_token_logps`` with
``logits_to_keep``, the PPO-clip token-mean loss, ``clip_grad_norm_``,
``torch.optim.AdamW``) on the issue-12 workload: a Llama model (vocab 2048,
width 256, 4 layers, 8/4 heads, MLP 1024, fp32) with the same weights as
rljax's (written by ``save_hf_checkpoint``, read by ``from_pretrained``), 64
sequences of 64 prompt + 128 completion tokens, both on 2 CPU threads. It
prints both tokens/s, the ratio and the agreement of the loss, the gradient
norm and the logprobs.

With ``--remat_sweep`` it times the chunked logprobs' forward + backward with
and without rematerialisation over vocabulary sizes (the crossover that
``rljax.logprobs.REMAT_ABOVE_BYTES`` encodes).

Findings (2-core CPU, XLA:CPU; ``jax.profiler`` traces and the
optimised HLO of the decoder's forward + backward on the workload above;
PyTorch measured the same way):

* Work the loss does not need. The output projection and log-softmax ran on
  all ``L - 1 = 191`` positions; only the 128 completion positions are
  trained (``RLStepConfig.completion_length``). The entropy was computed and
  carried through the backward pass when nothing but a metric read it
  (``entropy_metric``). The logprob chunks were always rematerialised.
* Transposing copies. The weight gradient of each 3-D projection einsum
  (``btd,dnh->btnh``: contracting batch and time) ran through a
  ``copy_bitcast_fusion`` that transposed the activations before the YNNPACK
  matmul: 1.15 s of a 4.6 s decoder forward + backward (torch: 2.5 s).
  Flattened to 2-D matmuls (``transformer._project``) they are gone: 3.2 s.
* Training attention. Masked dense attention (softmax over all ``T x S``)
  took 0.34 s per layer forward + backward, PyTorch's causal
  ``scaled_dot_product_attention`` 0.085 s: it skips the blocks above the
  diagonal. ``attend(causal=True)`` runs the queries in blocks against the
  keys up to each block's end: 0.16 s per layer; decoder 2.74 s. XLA:CPU has
  no fused flash kernel; on a GPU or TPU the ``attend`` seam is where a
  cuDNN / splash kernel goes.
* The logprobs' rematerialisation (``--remat_sweep``): on this CPU the
  chunked, rematerialised pass is as fast as the one-block pass at 16 MiB of
  logits and faster from 32 MiB on (the chunk stays in cache), at a quarter
  of the memory; ``logprobs.REMAT_ABOVE_BYTES`` = 16 MiB.
* What remains: the matmuls (``ynn_fusion``: 2.85 s of the 3.7 s of kernel
  time in the profile) at ~100 GFLOP/s, where PyTorch's oneDNN matmuls reach
  ~125; the attention's elementwise softmax work; the optimizer update
  (clip + AdamW over all leaves, one fused program) is printed on its own
  and is a few percent of the step.
* XLA:CPU's kernel choices, tried through ``XLA_FLAGS`` on part 1 (one run
  each): none ``5,039`` tok/s; ``--xla_cpu_use_onednn=true`` 4,936;
  ``--xla_cpu_experimental_onednn_custom_call=true`` 4,687;
  ``--xla_cpu_use_xnnpack=true`` 4,620; ``--xla_cpu_experimental_ynn_fusion_type=``
  (no YNNPACK fusions) 4,907. None is faster, so no launcher sets one; the
  remaining gap to PyTorch is the matmul kernels' speed.
* Page faults (a 2-core AMD EPYC of family 26, 2026-12-04). The step's
  matmul fusions ran at ~150-200 GFLOP/s where the same shapes alone reach
  ~460 (``[12288, 256] x [256, 1024]``): each execution allocates its large
  buffers afresh, glibc maps them as new 4 KiB pages, and the first touch
  of each page faults (573k minor faults, 2.2 GiB, per padding-free step;
  ``getrusage``). With glibc's malloc on transparent huge pages
  (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``) 1.4k remain and the step is
  1.36-1.47x faster (``--huge_pages_ab``, child processes, since glibc
  reads the variable at start); ``launch/__init__.py`` re-executes every
  launcher with it. Raising ``M_MMAP_THRESHOLD`` or ``M_TRIM_THRESHOLD``
  through ``mallopt`` in the running process removed none of the faults.
  Attention laid out head-major with an additive mask and the softmax
  normalised on the outputs was 5% faster per layer, and a hand-written
  SwiGLU backward no faster: neither changes the step, so neither is in.
* Attention's glue (2026-12-04, same host; ``jax.profiler`` time split
  between the kernels running at each instant). JAX's derivative of the
  blocked attention spent more on slices, transposes of logit-sized
  tensors, the pads of each block's key gradient and the softmax
  gradient than on the attention matmuls: ~135 ms of a ~345 ms step for
  7% of its FLOPs. ``attend`` now lays the queries out as the rows of a
  ``(B, K)``-batched matmul (one transpose per tensor), normalises the
  softmax on the outputs and has a hand-written backward
  (``jax.custom_vjp``, FlashAttention's ``rowsum(dO * O)``): the step
  fell to ~300-325 ms (A/B in one process; blocks of 32 or 64 query rows
  instead of 48 within the noise). A single block (rows up to 48: the main
  job's) keeps JAX's derivative of dense attention, ~6% faster there.
  Accumulating the key and value gradients block by block in place
  (``.at[].add``) instead of summing zero-padded full-size copies made the
  step another 2-4% faster (4ebeb93; ``launch/bench_attention.py``).
* What is left (same split): the dense matmuls at ~440 GFLOP/s, the rate
  they reach alone, except the weight gradients (``x^T dy``, contracting
  the 4,096 token rows), which XLA:CPU runs through Eigen's transposed-lhs
  dot at ~210-290 GFLOP/s instead of a YNNPACK fusion. Given a
  transposed copy of ``x`` (``optimization_barrier``) YNNPACK runs them at
  ~400, but the copies cost what that saves: the step is unchanged. Fusing
  q/k/v or gate/up into one matmul, and the flags
  ``--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce``,
  ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` and
  ``--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED`` gave
  no measurable change either.
* Tried on 2026-12-04 (same host, small preset, 16 x 256; in-process A/B
  unless noted), none faster: weight gradients through a transposed copy
  of the smaller operand (``x`` or ``dy``, ``jax.custom_vjp``): 380 vs
  354 ms; input gradients through a transposed copy of the weight: the
  same; glibc keeping freed memory (``arena_max=1``, ``mmap_max=0``, a
  large ``trim_threshold``: 0 page faults per step instead of ~800 huge
  ones; two processes each) 372-383 vs 345-352 ms (its system time: see
  the next item); XLA:CPU's older fusion emitters
  (``--xla_cpu_use_fusion_emitters=false``, which halves test compiles;
  one process each) 384 vs 355 ms, its elementwise kernels slower. Alone, each dense
  matmul shape of the step reaches 460-480 GFLOP/s; in the step the
  thunk executor runs independent ones (gate and up) side by side, one
  thread each, so per-kernel times in a trace double while the wall time
  does not.
* A later session (same host, ``perf`` over 15 steps and in-process A/B):
  attend's key and value gradients as plain matmuls of transposed queries
  and output gradients (``dK^T = Q^T dS``, ``dV^T = dO^T P``) instead of
  matmuls contracting ``P``'s and ``dS``'s leading axis (Eigen, ~80 against
  ~150 GFLOP/s): attention forward + backward 20.4 -> 17.7 ms per layer,
  the step 312.6 -> 303.0 ms (bdc91ed). The roofline: one 2048 matmul,
  best of 5, read 404-487 GFLOP/s in processes a minute apart, 1024 ones
  483-499; ``benchlib.matmul_flops_per_s`` now takes the best of both
  sizes, 10 calls each, before and after the steps. Where the CPU time
  goes now: YNNPACK's matmuls 43%, XLA's own fused kernels (elementwise,
  reductions, transposes) 28%, the kernel zeroing fresh pages 11-13%,
  Eigen packing the weight gradients' transposed operand 6%. The zeroing:
  each step's 560 MiB temporary buffer is a fresh ``mmap`` (glibc serves
  a thread arena's request over 64 MiB by ``mmap`` and unmaps it on free,
  whatever ``mmap_threshold`` or ``mmap_max``; ``arena_max=1`` with
  ``mmap_max=0`` keeps the memory but runs slower, 469-515 ms, with
  285-369 ms of system time per step). Ablations (wrong results, timing
  only): no attention core -80 ms; weight gradients zeroed -62 to -80 ms.
  Tried, none faster: weight gradients as YNNPACK plain matmuls on a
  transposed ``x`` (shared by q/k/v and by gate/up), even without paying
  for the transposes (318.7 vs 310.2 ms); the SwiGLU rematerialised
  (``jax.checkpoint``) or with a hand-written backward (temporaries 560 ->
  517 MiB, the same time); query blocks of 16-128 rows (32: attention
  alone 6% faster, the step the same, 323.5 vs 324.0 ms); ``dV`` from the
  unnormalised ``exp`` with ``dO`` scaled by ``1 / total``; the
  transposed keys and values materialised once before the blocks slice
  them; a hand-written RMSNorm backward (325.8 vs 325.4 ms); YNNPACK
  fusions of elementwise ops and reductions
  (``--xla_cpu_experimental_ynn_fusion_type=+eltwise`` or
  ``+eltwise,+reduce,+dot``; one process each, two rounds): the same or
  slower.
* Tried in a third session (same host), none reliably faster: attention
  run per batch chunk (``jax.lax.map`` over chunks of 1, 2, 4 or 8 rows,
  so each chunk's score matrices stay in cache): forward + backward 18.4-21.0
  vs 15.9 ms per layer; ``--xla_cpu_prefer_vector_width=512`` (this CPU
  has full-width AVX-512; two rounds, one process each): 337.1 / 342.1 vs
  341.3 / 337.9 ms; glibc serving the large buffers from the main arena
  and keeping them (``mmap_max=0``, a large ``trim_threshold``, with
  ``arena_max`` 1 or 2 or JAX's synchronous dispatch; one process each,
  five rounds): 0-370 page faults per step instead of ~750, but the step
  300.7-335.5 ms against 322.3-333.0 (one run 7% faster, the others the
  same or slower, system time moving to lock waits); a profile's idle
  gaps are the Eigen weight-gradient dots, which record no kernel event.
* A second CPU (2026-12-04, an AMD EPYC of family 25, Zen 4, whose
  AVX-512 runs on 256-bit units; the same code, 2345af3): the roofline
  measures 205-215 GFLOP/s (PyTorch's oneDNN: 185-197 on the same squares
  and on the step's ``[4096, 256] x [256, 768]`` shapes), the step 612-641
  ms, **63.9-65.4%** of the roofline where family 26 reads 54-58%; PyTorch
  1.12x slower there (1.89x on family 26). With its matmuls at the
  roofline the step's remainder would be ~230 ms there against ~130 ms on
  family 26: the memory-bound kernels slow less than the matmuls, so the
  share depends on the CPU's balance of compute and memory as much as on
  the step.

Padding-free (``--padding_free``, on by default): the packed step
(``rl.padding_free``, ``train/packing.py``) against the padded step on the
same rows of the issue-12 model, two workloads of 64 x (64 + 128) slots:
``fixed`` (every row full, EOS off) and ``long_tailed`` (prompts of 16..64
tokens, geometric completions of mean ~32 truncated at 128). Figures are
real (non-padding) tokens/s; the packed time includes the host's plan.
Each workload also runs packed with ``rl.packing_buckets`` = 64 (every
buffer count its own program): how full its buffers are and its step time
against the default 8 buckets'. Then, on the long-tailed workload, ``--microbatches`` microbatches of
consecutive rows against microbatches split by tokens
(``rl.microbatch_tokens``, the same count, tokens balanced): a microbatch
holding the longest rows sets every microbatch's buffers when split by rows.

Part 2 runs a few steps of a config (the main job by default) twice, with
``rl.old_logprobs="recompute"`` and ``="sampler"``, and prints where an RL
step's time goes (sample / reward / advantage / train) side by side: the
sampler's logprobs save the trainer's no-gradient forward pass.

  python -m launch.bench_train_step --batch=16 --length=256
  python -m launch.bench_train_step --config=configs/arithmetic_grpo.py --split_steps=8
  python -m launch.bench_train_step --compare_torch --remat_sweep --notime_split
  python -m launch.bench_train_step --padding_free --notime_split
  python -m launch.bench_train_step --huge_pages_ab --nopadding_free --notime_split
"""

import copy
import dataclasses
import json
import os
import resource
import subprocess
import sys
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ml_collections import config_flags

from launch.benchlib import matmul_flops_per_s, rl_step_inputs, write_record
from rljax import metrics, models, train

HUGE_PAGES = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "arithmetic_grpo.py"),
    "config of part 2 (the main job by default)")

_PRESET = flags.DEFINE_string("preset", "small", "model preset")
_BATCH = flags.DEFINE_integer("batch", 16, "rows per step")
_LENGTH = flags.DEFINE_integer("length", 256, "tokens per row")
_STEPS = flags.DEFINE_integer(
    "steps", 20, "timed steps of part 1 (the fastest counts: the first few after the compile are slower)")
_SPLIT = flags.DEFINE_bool("time_split", True, "run part 2 (main-job time split)")
_SPLIT_STEPS = flags.DEFINE_integer("split_steps", 8, "RL steps for part 2")
_TORCH = flags.DEFINE_bool("compare_torch", False,
                            "also time the PyTorch + transformers step")
_TORCH_STEPS = flags.DEFINE_integer("torch_steps", 3,
                                    "timed steps of each side of the comparison")
_PACKED = flags.DEFINE_bool("padding_free", True,
                             "time the packed step against the padded one "
                             "on fixed and long-tailed lengths")
_MICRO = flags.DEFINE_integer(
    "microbatches", 4, "--padding_free: microbatches of the rows-vs-tokens "
    "split comparison (0 skips it)")
_SWEEP = flags.DEFINE_bool("remat_sweep", False,
                           "time the logprobs with and without remat")
_HUGE = flags.DEFINE_bool(
    "huge_pages_ab", False, "time the padding-free part (fixed and "
    "long-tailed rows) in child processes, glibc's malloc without and with "
    f"transparent huge pages ({HUGE_PAGES}), alternating, "
    "with the page faults per step")
_CHILD_OUT = flags.DEFINE_string(
    "child_out", "", "internal (--huge_pages_ab): write the padding-free "
    "figures as JSON here and exit")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")


def train_flops(config: models.ModelConfig, tokens: int, length: int,
                scored: int | None = None) -> float:
  """Matmul FLOPs of forward + backward (3x forward) for ``tokens`` tokens,
  of which ``scored`` (default all) go through the output projection: the
  work the step needs, not the work a step that scores prompts would do."""
  dense = (2 * config.d_model * config.num_heads * config.head_dim
           + 2 * config.d_model * config.num_kv_heads * config.head_dim
           + 3 * config.d_model * config.mlp_dim) * config.num_layers
  attn = 2 * config.num_layers * config.num_heads * config.head_dim * length
  head = config.d_model * config.vocab_size * (tokens if scored is None
                                                else scored)
  return 3 * (tokens * (2 * dense + attn) + 2 * head)


def part1():
  mc = models.get_preset(_PRESET.value)
  b, t = _BATCH.value, _LENGTH.value
  step, state, batch = rl_step_inputs(mc, b, t)
  n_params, completion = models.count_params(state.params), t - t // 4
  peak_before = matmul_flops_per_s()
  start = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready(m)
  first = time.perf_counter() - start
  times = []
  for _ in range(_STEPS.value):
    start = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - start)
  best = min(times)
  # The roofline is measured before and after the steps (the better
  # counts): a host slowed for a moment reads a low peak, not a high share.
  peak = max(peak_before, matmul_flops_per_s())
  flops = train_flops(mc, b * t, t, b * completion) / best
  print(f"rl_step, preset={_PRESET.value} ({n_params:,} params), "
        f"batch {b} x {t} tokens")
  print(f"  compile + first step: {first:.2f}s; steady step: {best * 1e3:.1f} ms "
        f"(median {statistics.median(times) * 1e3:.1f} ms)")
  print(f"  training tokens/s: {b * t / best:,.0f}")
  print(f"  achieved {flops / 1e9:.1f} GFLOP/s = {100 * flops / peak:.1f}% of the "
        f"measured matmul {peak / 1e9:.1f} GFLOP/s")
  print(f"  compiled programs after {_STEPS.value + 1} steps: {step._cache_size()} "
        f"({'no recompiles' if step._cache_size() == 1 else 'RECOMPILED'})")
  return {"train_tokens_per_s": b * t / best, "fraction_of_matmul": flops / peak,
          "matmul_peak_flops_per_s": peak,
          "compiled_programs": step._cache_size(), "steady_step_s": best,
          "first_step_s": first}


# The issue-12 workload (TRL's GRPO step measured side by side).
TORCH_MODEL = dict(vocab_size=2048, d_model=256, num_layers=4, num_heads=8,
                   num_kv_heads=4, head_dim=32, mlp_dim=1024)
TORCH_ROWS, TORCH_PROMPT, TORCH_COMPLETION = 64, 64, 128
LEARNING_RATE, WEIGHT_DECAY, MAX_GRAD_NORM, CLIP_EPS = 1e-5, 0.01, 1.0, 0.2


def _workload(vocab_size):
  """Tokens, loss mask (completions of random length) and advantages."""
  rng = np.random.RandomState(0)
  n, p, t = TORCH_ROWS, TORCH_PROMPT, TORCH_COMPLETION
  tokens = rng.randint(0, vocab_size, (n, p + t)).astype(np.int32)
  lengths = rng.randint(t // 2, t + 1, n)
  loss_mask = np.zeros((n, p + t), bool)
  for i, k in enumerate(lengths):
    loss_mask[i, p:p + k] = True
  return tokens, loss_mask, rng.randn(n).astype(np.float32)


def _timed(fn, steps, faults_out=None):
  """The fastest of ``steps`` calls after a warm-up; with ``faults_out`` (a
  dict) also the minor page faults per call (``faults_per_step``)."""
  fn()  # compile / warm-up
  times = []
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(steps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  if faults_out is not None:
    faults_out["faults_per_step"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
  return min(times)


def compare_torch():
  """rljax's ``rl_step`` and the PyTorch + transformers step, same work."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(2)
  mc = dataclasses.replace(models.get_preset("small"), **TORCH_MODEL)
  params = models.init_params(mc, jax.random.key(0))
  tokens, loss_mask, adv = _workload(mc.vocab_size)
  n, length = tokens.shape
  t = TORCH_COMPLETION
  n_tokens = n * length

  optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM),
                          optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
  coef_tx = train.coefficient_chain({"objective": "ppo_clip",
                                     "clip_eps_low": CLIP_EPS})
  cfg = train.RLStepConfig(completion_length=t, entropy_metric=False)
  step = jax.jit(train.make_rl_step(mc, cfg, optimizer, coef_tx))
  batch = train.RLBatch(tokens, np.ones_like(loss_mask), loss_mask, adv,
                        np.zeros(loss_mask.shape, np.float32))
  state0 = train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                            coef_tx.init(jnp.zeros((1, 1))),
                            jnp.zeros((), jnp.int32),
                            jax.random.key_data(jax.random.key(0)))
  jax_metrics = jax.device_get(step(state0, batch)[1])
  jax_lp = np.asarray(jax.jit(lambda p: models.sequence_logprobs(
      p, mc, tokens, np.ones_like(loss_mask), num_scored=t,
      with_entropy=False)[0])(params))
  holder = {"state": state0}

  def jax_step():
    holder["state"], m = step(holder["state"], batch)
    jax.block_until_ready(m)

  jax_time = _timed(jax_step, _TORCH_STEPS.value)
  # The optimizer update alone (clip + AdamW over every leaf): its share.
  update = jax.jit(lambda g, s, p: optimizer.update(g, s, p))
  opt_state = optimizer.init(params)
  opt_time = _timed(lambda: jax.block_until_ready(
      update(params, opt_state, params)), _TORCH_STEPS.value)

  with tempfile.TemporaryDirectory() as d:
    models.save_hf_checkpoint(d, mc, jax.device_get(params))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, torch_dtype=torch.float32, attn_implementation="sdpa")
  model.train()
  torch_opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE,
                                weight_decay=WEIGHT_DECAY)
  ids = torch.from_numpy(tokens.astype(np.int64))
  attention_mask = torch.ones_like(ids)
  mask = torch.from_numpy(loss_mask[:, -t:]).float()
  advantages = torch.from_numpy(adv)[:, None]

  def torch_logps():
    # TRL GRPOTrainer._get_per_token_logps: logits_to_keep = T + 1.
    logits = model(input_ids=ids, attention_mask=attention_mask,
                   logits_to_keep=t + 1).logits[:, :-1]
    return torch.gather(logits.log_softmax(-1), 2, ids[:, -t:, None])[..., 0]

  def torch_step():
    logp = torch_logps()
    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.min(ratio * advantages,
                           torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
                           * advantages)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    torch_opt.step()
    torch_opt.zero_grad()
    # rljax reports the coefficient form -sg(c) A logp (same gradient), with
    # c = ratio where the PPO clip is inactive, 0 where it is active.
    clipped = (((advantages > 0) & (ratio > 1 + CLIP_EPS))
               | ((advantages < 0) & (ratio < 1 - CLIP_EPS)))
    coef = torch.where(clipped, 0.0, ratio).detach()
    pg = -(coef * advantages * logp * mask).sum() / mask.sum()
    return float(pg), float(norm)

  with torch.no_grad():
    torch_lp = torch_logps().numpy()
  torch_loss, torch_norm = torch_step()
  torch_time = _timed(torch_step, _TORCH_STEPS.value)

  lp_diff = np.abs(np.where(loss_mask[:, -t:], jax_lp - torch_lp, 0.0)).max()
  loss_rel = abs(float(jax_metrics["pg_loss"]) - torch_loss) / abs(torch_loss)
  norm_rel = abs(float(jax_metrics["grad_norm"]) - torch_norm) / torch_norm
  ratio = torch_time / jax_time
  print(f"\nrljax vs PyTorch {torch.__version__} + transformers "
        f"{transformers.__version__} (2 threads), {n} x ({TORCH_PROMPT} + {t}) "
        f"tokens, {models.count_params(params):,} params:")
  print(f"  rljax rl_step: {n_tokens / jax_time:,.0f} tokens/s "
        f"({jax_time * 1e3:.0f} ms)")
  print(f"  PyTorch step:  {n_tokens / torch_time:,.0f} tokens/s "
        f"({torch_time * 1e3:.0f} ms)")
  print(f"  ratio rljax / PyTorch: {ratio:.2f}x (rljax's clip + AdamW update "
        f"alone: {opt_time * 1e3:.0f} ms)")
  print(f"  agreement: loss rel {loss_rel:.1e}, grad norm rel {norm_rel:.1e}, "
        f"max |logp diff| {lp_diff:.1e}")
  return {"rljax_tokens_per_s": n_tokens / jax_time,
          "torch_tokens_per_s": n_tokens / torch_time, "ratio": ratio,
          "optimizer_update_s": opt_time,
          "loss_rel_diff": loss_rel, "grad_norm_rel_diff": norm_rel,
          "max_abs_logp_diff": float(lp_diff), "torch": torch.__version__,
          "transformers": transformers.__version__}


def _lengths_workload(kind, vocab_size, seed=0):
  """Issue 24's workloads on TORCH_MODEL's rows (64 x (64 + 128)):
  ``fixed``: every prompt 64 and every completion 128 tokens (EOS off);
  ``long_tailed``: prompts of 16..64 tokens (left-padded) and geometric
  completions of mean about 128 / 4, truncated at 128 (some rows are)."""
  rng = np.random.RandomState(seed)
  n, p, t = TORCH_ROWS, TORCH_PROMPT, TORCH_COMPLETION
  tokens = rng.randint(1, vocab_size, (n, p + t)).astype(np.int32)
  if kind == "fixed":
    prompts, completions = np.full(n, p), np.full(n, t)
  else:
    prompts = rng.randint(16, p + 1, n)
    completions = np.minimum(rng.geometric(4.0 / t, n), t)
  input_mask = np.zeros((n, p + t), bool)
  loss_mask = np.zeros((n, p + t), bool)
  for i, (a, b) in enumerate(zip(prompts, completions)):
    input_mask[i, p - a:p + b] = True
    loss_mask[i, p:p + b] = True
  tokens = np.where(input_mask, tokens, 0).astype(np.int32)
  return train.RLBatch(tokens, input_mask, loss_mask,
                       rng.randn(n).astype(np.float32),
                       np.zeros((n, p + t), np.float32))


def padding_free():
  """The packed step against the padded step on the same rows, both
  workloads: real (non-padding) trained tokens/s, the ratio, and the
  agreement of their loss and gradient norm. The packed time includes the
  host's plan (``train/packing.py``)."""
  from rljax.train import packing  # pylint: disable=import-outside-toplevel
  mc = dataclasses.replace(models.get_preset("small"), **TORCH_MODEL)
  params = models.init_params(mc, jax.random.key(0))
  optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM),
                          optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  cfg = train.RLStepConfig(completion_length=TORCH_COMPLETION,
                           entropy_metric=False)
  state0 = train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                            coef_tx.init(jnp.zeros((1, 1))),
                            jnp.zeros((), jnp.int32),
                            jax.random.key_data(jax.random.key(0)))
  padded = jax.jit(train.make_rl_step(mc, cfg, optimizer, coef_tx))
  packed = packing.PaddingFree(padded, cfg)
  # rl.packing_buckets=TORCH_ROWS: every buffer count a bucket of its own.
  exact = packing.PaddingFree(padded, dataclasses.replace(
      cfg, packing_buckets=TORCH_ROWS))
  out = {}
  print(f"\npadding-free vs padded rl_step, {TORCH_ROWS} x ({TORCH_PROMPT} + "
        f"{TORCH_COMPLETION}) slots, {models.count_params(params):,} params "
        "(real tokens/s):")
  for kind in ("fixed", "long_tailed"):
    batch = _lengths_workload(kind, mc.vocab_size)
    real = int(batch.input_mask_NxL.sum())
    row = {"real_tokens": real, "slots": batch.tokens_NxL.size}
    metrics_of = {}
    for name, step in (("padded", padded), ("packed", packed)):
      metrics_of[name] = jax.device_get(step(state0, batch)[1])
      faults = {}
      seconds = _timed(lambda step=step: jax.block_until_ready(
          step(state0, batch)[1]), _TORCH_STEPS.value, faults)
      row[f"{name}_s"] = seconds
      row[f"{name}_page_faults_per_step"] = faults["faults_per_step"]
      row[f"{name}_real_tokens_per_s"] = real / seconds
    row["ratio"] = row["padded_s"] / row["packed_s"]
    row["fill"] = packed.last_fill
    row["exact_buckets_s"] = _timed(lambda: jax.block_until_ready(
        exact(state0, batch)[1]), _TORCH_STEPS.value, {})
    row["exact_buckets_fill"] = exact.last_fill
    row["exact_buckets_vs_8"] = row["packed_s"] / row["exact_buckets_s"]
    row["loss_rel_diff"] = abs(
        float(metrics_of["packed"]["pg_loss"] - metrics_of["padded"]["pg_loss"])
        ) / max(abs(float(metrics_of["padded"]["pg_loss"])), 1e-12)
    row["grad_norm_rel_diff"] = abs(
        float(metrics_of["packed"]["grad_norm"]
              - metrics_of["padded"]["grad_norm"])) / float(
                  metrics_of["padded"]["grad_norm"])
    print(f"  {kind:<12} real {real:>6} of {row['slots']} slots; padded "
          f"{row['padded_real_tokens_per_s']:>8,.0f}/s, packed "
          f"{row['packed_real_tokens_per_s']:>8,.0f}/s (buffers "
          f"{100 * row['fill']:.0f}% full): {row['ratio']:.2f}x; loss rel "
          f"{row['loss_rel_diff']:.1e}, grad norm rel "
          f"{row['grad_norm_rel_diff']:.1e}")
    print(f"  {'':<12} rl.packing_buckets={TORCH_ROWS}: buffers "
          f"{100 * row['exact_buckets_fill']:.1f}% full, "
          f"{row['exact_buckets_vs_8']:.2f}x the 8 buckets' step")
    out[kind] = row
  # Issue 48's bar: the packed update's time per real token on long-tailed
  # rows within 1.2x of its time on full rows.
  if {"fixed", "long_tailed"} <= set(out):
    out["long_tailed_time_per_real_token_vs_fixed"] = (
        out["fixed"]["packed_real_tokens_per_s"]
        / out["long_tailed"]["packed_real_tokens_per_s"])
    print(f"  packed, time per real token: long-tailed "
          f"{out['long_tailed_time_per_real_token_vs_fixed']:.2f}x full rows'")
  return out


def projection_layout(vocab_sizes=(2048, 32768), rounds=5):
  """Where padding-free scoring runs the output projection, on the
  long-tailed workload packed as a step's microbatch: forward + backward of
  ``sequence_logprobs`` (the completion's columns, no entropy) with the
  projection on the rows' scored columns against on the packed buffers
  (``projection="auto"`` picks the buffers here: fewer positions), at the
  workload's vocabulary and at a 32k one; the median of ``rounds``
  alternating calls each, and the largest logprob difference."""
  from rljax.train import packing  # pylint: disable=import-outside-toplevel
  out = {}
  print("\noutput projection on the rows' scored columns vs on the packed "
        "buffers, long-tailed, forward + backward of the logprobs:")
  for vocab in vocab_sizes:
    mc = dataclasses.replace(models.get_preset("small"),
                             **{**TORCH_MODEL, "vocab_size": vocab})
    params = models.init_params(mc, jax.random.key(0))
    batch = _lengths_workload("long_tailed", vocab)
    plan = jax.tree.map(jnp.asarray, packing.pack_microbatch(
        np.asarray(batch.input_mask_NxL)))
    tokens, mask = jnp.asarray(batch.tokens_NxL), jnp.asarray(
        batch.input_mask_NxL)

    def grad_fn(projection):
      def loss(p):
        lp, _ = models.sequence_logprobs(
            p, mc, tokens, mask, num_scored=TORCH_COMPLETION,
            with_entropy=False, packing=plan, projection=projection)
        return jnp.sum(lp), lp
      return jax.jit(jax.value_and_grad(loss, has_aux=True))

    fns = {name: grad_fn(name) for name in ("rows", "buffers")}
    logp = {name: np.asarray(fn(params)[0][1]) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
      for name, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(params))
        times[name].append(time.perf_counter() - start)
    row = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    row["ratio"] = row["rows_s"] / row["buffers_s"]
    row["positions"] = {"rows": int(tokens.shape[0] * TORCH_COMPLETION),
                        "buffers": int(np.prod(plan.segment_BpxLp.shape))}
    row["max_abs_logp_diff"] = float(np.abs(logp["rows"]
                                            - logp["buffers"]).max())
    print(f"  vocab {vocab:>6}: rows ({row['positions']['rows']} positions) "
          f"{row['rows_s']:.3f} s, buffers ({row['positions']['buffers']}) "
          f"{row['buffers_s']:.3f} s: {row['ratio']:.2f}x; max |logp diff| "
          f"{row['max_abs_logp_diff']:.1e}")
    out[str(vocab)] = row
  return out


def token_microbatches():
  """Microbatches by rows against microbatches by tokens
  (``rl.microbatch_tokens``, verl's dynamic batch size) on the long-tailed
  workload, both padding-free: ``--microbatches`` microbatches of
  consecutive rows, against a budget of 1.1x the real tokens over that
  count (the same number of microbatches, tokens balanced). Prints real
  tokens/s, the slots of a microbatch's buffers (its activation memory) and
  the loss agreement."""
  from rljax.train import packing  # pylint: disable=import-outside-toplevel
  mc = dataclasses.replace(models.get_preset("small"), **TORCH_MODEL)
  params = models.init_params(mc, jax.random.key(0))
  optimizer = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM),
                          optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
  coef_tx = train.coefficient_chain({"objective": "ppo_clip"})
  batch = _lengths_workload("long_tailed", mc.vocab_size)
  real = int(batch.input_mask_NxL.sum())
  k = _MICRO.value
  by_rows = train.RLStepConfig(completion_length=TORCH_COMPLETION,
                               entropy_metric=False, num_microbatches=k)
  by_tokens = dataclasses.replace(by_rows, num_microbatches=1,
                                  microbatch_tokens=-(-real * 11 // (10 * k)))
  state0 = train.TrainState(params, optimizer.init(params), optax.EmptyState(),
                            coef_tx.init(jnp.zeros((1, 1))),
                            jnp.zeros((), jnp.int32),
                            jax.random.key_data(jax.random.key(0)))
  out = {"real_tokens": real, "budget": by_tokens.microbatch_tokens}
  losses = {}
  print(f"\nmicrobatches by rows ({k}) vs by tokens (budget "
        f"{by_tokens.microbatch_tokens} = 1.1 x {real} real / {k}), "
        "long-tailed, padding-free:")
  for name, cfg in (("rows", by_rows), ("tokens", by_tokens)):
    step = packing.PaddingFree(
        jax.jit(train.make_rl_step(mc, cfg, optimizer, coef_tx)), cfg)
    losses[name] = float(jax.device_get(step(state0, batch)[1])["pg_loss"])
    seconds = _timed(lambda step=step: jax.block_until_ready(
        step(state0, batch)[1]), _TORCH_STEPS.value)
    plan = step.plan(state0, batch)
    slots = int(np.prod(plan.packing.segment_BpxLp.shape[-2:]))
    tokens = np.asarray(batch.input_mask_NxL.sum(-1))[plan.order_UxKxM]
    out[name] = {"s": seconds, "real_tokens_per_s": real / seconds,
                 "microbatches": int(plan.order_UxKxM.shape[1]),
                 "slots_per_microbatch": slots,
                 "max_microbatch_tokens": int(tokens.sum(-1).max()),
                 "fill": step.last_fill}
    print(f"  by {name:<7} {out[name]['microbatches']} microbatches of "
          f"{slots} slots (most real tokens in one: "
          f"{out[name]['max_microbatch_tokens']}), buffers "
          f"{100 * step.last_fill:.0f}% full: "
          f"{out[name]['real_tokens_per_s']:8,.0f} real tokens/s")
  out["ratio"] = out["rows"]["s"] / out["tokens"]["s"]
  out["slots_ratio"] = (out["tokens"]["slots_per_microbatch"]
                        / out["rows"]["slots_per_microbatch"])
  out["loss_rel_diff"] = abs(losses["tokens"] - losses["rows"]) / max(
      abs(losses["rows"]), 1e-12)
  print(f"  tokens / rows: {out['ratio']:.2f}x tokens/s, "
        f"{out['slots_ratio']:.2f}x slots per microbatch; loss rel "
        f"{out['loss_rel_diff']:.1e}")
  return out


def remat_sweep(batch=16, length=128, width=256,
                vocab_sizes=(512, 2048, 4096, 8192, 32768)):
  """Forward + backward of ``token_logprobs`` with and without remat."""
  from rljax import logprobs  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(0)
  h = jnp.asarray(rng.randn(batch, length, width).astype(np.float32))
  rows = []
  print(f"\nlogprobs forward + backward, {batch} x {length} positions, width "
        f"{width} (REMAT_ABOVE_BYTES = {logprobs.REMAT_ABOVE_BYTES / 2**20:.0f}"
        " MiB of logits):")
  print(f"  {'vocab':>7} {'logits MiB':>10} {'remat ms':>9} {'no remat ms':>11}"
        f" {'remat temp MiB':>14} {'no remat temp MiB':>17}  auto")
  for v in vocab_sizes:
    w = jnp.asarray(rng.randn(width, v).astype(np.float32) * 0.05)
    y = jnp.asarray(rng.randint(0, v, (batch, length)).astype(np.int32))
    row = {"vocab": v, "logits_mib": batch * length * v * 4 / 2**20}
    for remat in (True, False):
      loss = lambda h, w, remat=remat: jnp.sum(logprobs.token_logprobs(
          h, w, y, chunk_size=32, with_entropy=False, remat=remat)[0])
      fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
      temp = fn.lower(h, w).compile().memory_analysis().temp_size_in_bytes
      key = "remat" if remat else "no_remat"
      row[f"{key}_s"] = _timed(lambda: jax.block_until_ready(fn(h, w)), 3)
      row[f"{key}_temp_mib"] = temp / 2**20
    auto = logprobs.remat_by_size(batch, length, v)
    print(f"  {v:>7} {row['logits_mib']:>10.0f} {row['remat_s'] * 1e3:>9.1f} "
          f"{row['no_remat_s'] * 1e3:>11.1f} {row['remat_temp_mib']:>14.0f} "
          f"{row['no_remat_temp_mib']:>17.0f}  {'remat' if auto else 'keep'}")
    rows.append(row)
  return rows


STAGES = ("sample", "reward", "advantage", "train")


def _split(config, old_logprobs, padding_free=None):
  config = copy.deepcopy(config)
  config.rl.old_logprobs = old_logprobs
  if padding_free is not None:
    config.rl.padding_free = config.sft.padding_free = padding_free
  with tempfile.TemporaryDirectory() as workdir:
    train.run(config, workdir)
    rows = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r["step"] > 1]  # step 1 includes compiles
  return {k: statistics.mean(r[f"time/{k}"] for r in rows) for k in STAGES}


def part2():
  config = copy.deepcopy(_CONFIG.value)
  config.sft.num_steps = min(config.sft.num_steps, 20)
  config.rl.num_steps = _SPLIT_STEPS.value
  config.eval.every = 10_000
  config.eval.num_examples = 32
  config.checkpoint.every = 10_000
  split = {mode: _split(config, mode) for mode in train.OLD_LOGPROBS}
  print(f"\nRL step time split, mean of steps 2..{_SPLIT_STEPS.value} "
        f"({config.rl.num_epochs} epoch(s) x {config.rl.num_minibatches} "
        "minibatch(es)):")
  print(f"  {'stage':<10} {'recompute':>12} {'sampler':>12}   sampler/recompute")
  for k in STAGES + ("total",):
    a, b = ((sum(split[m].values()) if k == "total" else split[m][k])
            for m in train.OLD_LOGPROBS)
    print(f"  {k:<10} {a * 1e3:9.1f} ms {b * 1e3:9.1f} ms   {b / a:6.2f}x")
  slowest = max(split["recompute"], key=split["recompute"].get)
  print(f"  slowest stage (recompute): {slowest}")
  # Padding-free on the config's own rows (the main job's: short prompts
  # in buckets, short completions), old_logprobs as the config sets it.
  mode = config.rl.old_logprobs
  by_packing = {"padded": _split(config, mode, False),
                "packed": _split(config, mode, True)}
  print(f"\n  padding-free ({mode}):  {'padded':>9} {'packed':>9}   "
        "packed/padded")
  for k in STAGES + ("total",):
    a, b = ((sum(by_packing[m].values()) if k == "total"
             else by_packing[m][k]) for m in ("padded", "packed"))
    print(f"  {k:<10} {a * 1e3:9.1f} ms {b * 1e3:9.1f} ms   {b / a:6.2f}x")
  return {"time_split_s": split, "padding_free_split_s": by_packing}


def huge_pages_ab(rounds: int = 2) -> dict:
  """``padding_free()`` in child processes without and with glibc's malloc
  on transparent huge pages (``HUGE_PAGES``: a variable glibc reads when a
  process starts, hence the children), alternating ``rounds`` times; each
  side's fastest step per workload and row layout, and the ratio."""
  sides = {"default": {}, "huge_pages": {}}
  for _ in range(rounds):
    for side, figures in sides.items():
      env = dict(os.environ, RLJAX_HUGE_PAGES="0")  # as set here, no re-exec
      env.pop("GLIBC_TUNABLES", None)
      if side == "huge_pages":
        env["GLIBC_TUNABLES"] = HUGE_PAGES.split("=", 1)[1]
      with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "figures.json")
        subprocess.run([sys.executable, "-m", "launch.bench_train_step",
                        f"--child_out={out}",
                        f"--torch_steps={_TORCH_STEPS.value}"],
                       env=env, check=True, cwd=os.path.join(
                           os.path.dirname(__file__), ".."))
        with open(out) as f:
          child = json.load(f)
      for kind, row in child.items():
        for layout in ("padded", "packed"):
          best = figures.setdefault(f"{kind}/{layout}", {
              "s": float("inf"), "page_faults_per_step": None})
          if row[f"{layout}_s"] < best["s"]:
            best.update(s=row[f"{layout}_s"], page_faults_per_step=row[
                f"{layout}_page_faults_per_step"])
  print(f"\nglibc malloc, default vs {HUGE_PAGES} (child processes, "
        f"{rounds} rounds alternating; seconds per step, minor page faults "
        "per step):")
  ratios = {}
  for key in sides["default"]:
    a, b = sides["default"][key], sides["huge_pages"][key]
    ratios[key] = a["s"] / b["s"]
    print(f"  {key:<20} {a['s']:.3f} s ({a['page_faults_per_step']:,.0f} "
          f"faults) vs {b['s']:.3f} s ({b['page_faults_per_step']:,.0f}): "
          f"{ratios[key]:.2f}x")
  return {**sides, "ratio_default_over_huge_pages": ratios,
          "setting": HUGE_PAGES}


def main(argv):
  del argv
  if _CHILD_OUT.value:
    with open(_CHILD_OUT.value, "w") as f:
      json.dump(padding_free(), f)
    return
  figures = {"rl_step": part1()}
  if _PACKED.value:
    figures["padding_free"] = padding_free()
    figures["projection_layout"] = projection_layout()
    if _MICRO.value:
      figures["token_microbatches"] = token_microbatches()
  if _HUGE.value:
    figures["huge_pages"] = huge_pages_ab()
  if _TORCH.value:
    figures["vs_torch"] = compare_torch()
  if _SWEEP.value:
    figures["remat_sweep"] = remat_sweep()
  if _SPLIT.value:
    figures["main_job_split"] = part2()
  if _RECORD_DIR.value:
    print("record:", write_record(
        "bench_train_step", figures, _RECORD_DIR.value,
        {"preset": _PRESET.value, "batch": _BATCH.value, "length": _LENGTH.value,
         "torch_workload": ({**TORCH_MODEL, "rows": TORCH_ROWS,
                             "prompt": TORCH_PROMPT,
                             "completion": TORCH_COMPLETION}
                            if _TORCH.value else None),
         "split_config": _CONFIG.value.to_dict() if _SPLIT.value else None}))


if __name__ == "__main__":
  app.run(main)
