r"""Rollout sampler throughput against its baselines, in one run.

Compares, on the same model, weights and workload:
  1. the rljax sampler (shared group prefixes, KV cache);
  2. the same without prefix sharing (each prompt prefilled G times);
  3. a no-cache baseline that re-runs the full forward every step;
  4. Hugging Face ``generate`` on a PyTorch model with the same architecture
     and weights (only when the ``hf`` extra is installed).
and prints tokens/s, ratios, compile times, and the achieved FLOP/s next to
the machine's matmul FLOP/s measured in the same run.

Workloads (``--workloads=a,b``):
  a: 8 prompts x G=8, 64-token prompts, exactly 128 new tokens (this is also
     issue 14's workload (c): its table's 8 x 64 x 8 x 128);
  b: the same with 512-token prompts and 32 new tokens;
  d: 8 prompts x G=8, 64-token prompts, 1024 new tokens;
  w: 4 prompts x G=8 (32 rows), 64-token prompts, 512 new tokens;
  e: SPEC-RL (``sampling.make_speculative_sampler``): workload a sampled
     once (epoch 1), the policy moved by one Adam step of a GRPO-style loss
     on random +-1 rewards (``--spec_lr``), then epoch 2 sampled plainly and
     with epoch 1 as drafts: acceptance and speed-up against plain sampling.
Model: vocab 2048, width 256, 4 layers, 8 query / 4 kv heads, MLP 1024, fp32.

Findings (2-core CPU, XLA:CPU; per-step timings of the decode
loop and of its parts jitted alone):

* Decode attention was the long-generation cost: a batched ``dot_general``
  over a ``[B, S, K, H]`` cache runs ``B * K`` matrix-vector products too
  small for the matmul kernel, 38.8 ms per layer at 64 rows x 1,088 slots.
  With the cache laid out ``[B, K, S, H]`` and the scores and value sums as
  broadcast products reduced in one fusion each
  (``models.transformer.decode_attend``): 6.8 ms. At 128 slots 1.5 -> 1.0
  ms. A bfloat16 cache is slower on this CPU (17.5 ms at 1,088 slots).
* The token draw's cumulative sum over the vocabulary compiles to a window
  sum of ``O(V^2)`` adds: 0.60 ms of a 64-row step at V=2048. A two-level
  inverse CDF (``sampling.methods.inverse_cdf_sample``): 0.24 ms.
* A 64-row step at 128 slots: ~7.6 ms, of which ~4.4 ms are the dense
  matmuls (weights stream from memory every step) and ~2 ms attention; q/k/v
  and gate/up as one matmul each saved ~5%.
* SPEC-RL (e): accepted drafts cost one verification forward, which runs at
  ~55% of matmul FLOP/s against decode's ~34%: on this CPU the speed-up of a
  fully accepted draft is bounded near 1.6x; on accelerators, where decode
  is memory-bound, the gap is wider. Rejections early in any row keep the
  loop running all ``T`` steps (rows cannot leave a static batch).

  python -m launch.bench_sampler --workloads=a,b
  python -m launch.bench_sampler --workloads=d --repeats=1 --no_cache_baseline=false
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from launch.benchlib import matmul_flops_per_s, write_record
from rljax import models, sampling

_WORKLOADS = flags.DEFINE_list("workloads", ["a", "b"], "workloads to run")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per variant")
_NO_CACHE = flags.DEFINE_bool("no_cache_baseline", True,
                              "run the (slow) no-cache baseline")
_HF = flags.DEFINE_bool("hf", True, "compare with transformers generate if installed")
_SPEC_LR = flags.DEFINE_float("spec_lr", 1e-5,
                               "learning rate of the RL step of workload e")
_SPEC_LENIENCE = flags.DEFINE_list(
    "spec_log_lenience", ["0.0", "0.5"], "log lenience values of workload e")
_SEGMENT = flags.DEFINE_integer("segment_slots", 64,
                                "SamplerConfig.segment_slots of rljax")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")

MODEL = models.ModelConfig(
    vocab_size=2048, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
    head_dim=32, mlp_dim=1024, rope_theta=10_000.0, tie_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Workload:
  prompts: int
  group: int
  prompt_len: int
  new_tokens: int


WORKLOADS = {"a": Workload(8, 8, 64, 128), "b": Workload(8, 8, 512, 32),
             "d": Workload(8, 8, 64, 1024), "w": Workload(4, 8, 64, 512),
             "e": Workload(8, 8, 64, 128)}


def decode_flops(c: models.ModelConfig, w: Workload) -> float:
  """Matmul FLOPs to generate all tokens (prefill excluded)."""
  dense = (2 * c.d_model * c.num_heads * c.head_dim
           + 2 * c.d_model * c.num_kv_heads * c.head_dim
           + 3 * c.d_model * c.mlp_dim) * c.num_layers + c.d_model * c.vocab_size
  avg_ctx = w.prompt_len + w.new_tokens / 2
  attn = 4 * c.num_layers * c.num_heads * c.head_dim * avg_ctx
  return w.prompts * w.group * w.new_tokens * (2 * dense + attn)


def _no_cache_sampler(mc: models.ModelConfig, w: Workload,
                      method: sampling.SamplingMethod):
  """Baseline: the full forward over the whole buffer at every step."""
  model = models.Decoder(mc)

  @jax.jit
  def run(params, prompt_tokens, prompt_mask, key):
    tokens = jnp.repeat(prompt_tokens, w.group, 0)
    mask = jnp.repeat(prompt_mask, w.group, 0)
    n = tokens.shape[0]
    tokens = jnp.concatenate(
        [tokens, jnp.zeros((n, w.new_tokens), jnp.int32)], 1)
    mask = jnp.concatenate([mask, jnp.zeros((n, w.new_tokens), bool)], 1)

    def step(i, carry):
      tokens, mask = carry
      logits, _ = model.apply({"params": params}, tokens,
                              models.positions_from_mask(mask),
                              input_mask_BxT=mask, return_logits=True)
      last = jax.lax.dynamic_index_in_dim(logits, w.prompt_len + i - 1, 1,
                                          keepdims=False)
      nxt, _ = method.get_next_tokens(last, jax.random.fold_in(key, i))
      tokens = jax.lax.dynamic_update_index_in_dim(tokens, nxt, w.prompt_len + i, 1)
      mask = jax.lax.dynamic_update_index_in_dim(
          mask, jnp.ones((n,), bool), w.prompt_len + i, 1)
      return tokens, mask

    return jax.lax.fori_loop(0, w.new_tokens, step, (tokens, mask))[0]

  return run


def _timed(fn, *args, repeats):
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return first - best, best  # (compile time, run time)


def _hf_generate(params, mc, w, prompt_tokens, repeats):
  try:
    import torch
    import transformers
  except ImportError:
    return None
  cfg = transformers.LlamaConfig(
      vocab_size=mc.vocab_size, hidden_size=mc.d_model,
      intermediate_size=mc.mlp_dim, num_hidden_layers=mc.num_layers,
      num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
      head_dim=mc.head_dim, rope_theta=mc.rope_theta, rms_norm_eps=mc.norm_eps,
      tie_word_embeddings=mc.tie_embeddings, attention_bias=False)
  model = transformers.LlamaForCausalLM(cfg).eval()
  p = jax.tree.map(lambda x: torch.tensor(np.asarray(x, np.float32)), params)
  sd = {"model.embed_tokens.weight": p["embedding"],
        "model.norm.weight": p["final_norm"]["scale"],
        "lm_head.weight": p["lm_head"].T}
  d = mc.d_model
  for i in range(mc.num_layers):
    lp, pre = p[f"layers_{i}"], f"model.layers.{i}."
    a = lp["attn"]
    sd[pre + "self_attn.q_proj.weight"] = a["q_kernel"].reshape(d, -1).T
    sd[pre + "self_attn.k_proj.weight"] = a["k_kernel"].reshape(d, -1).T
    sd[pre + "self_attn.v_proj.weight"] = a["v_kernel"].reshape(d, -1).T
    sd[pre + "self_attn.o_proj.weight"] = a["o_kernel"].reshape(-1, d).T
    sd[pre + "mlp.gate_proj.weight"] = lp["mlp"]["gate_kernel"].T
    sd[pre + "mlp.up_proj.weight"] = lp["mlp"]["up_kernel"].T
    sd[pre + "mlp.down_proj.weight"] = lp["mlp"]["down_kernel"].T
    sd[pre + "input_layernorm.weight"] = lp["pre_attn_norm"]["scale"]
    sd[pre + "post_attention_layernorm.weight"] = lp["pre_mlp_norm"]["scale"]
  model.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=False)
  ids = torch.tensor(np.repeat(prompt_tokens, w.group, 0), dtype=torch.long)

  def run():
    with torch.no_grad():
      return model.generate(
          ids, attention_mask=torch.ones_like(ids), do_sample=True,
          temperature=1.0, top_k=0, max_new_tokens=w.new_tokens,
          min_new_tokens=w.new_tokens, pad_token_id=0)

  run()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - start)
  return best


def _one_rl_step(params, rollout, lr: float, key):
  """One Adam step on a GRPO-style loss with random +-1 rewards per row."""
  import optax  # pylint: disable=import-outside-toplevel
  tokens, mask = rollout.sequences()
  p = rollout.prompt_tokens.shape[1]
  g = rollout.completion_tokens.shape[0] // 8
  rewards = jnp.where(jax.random.bernoulli(key, 0.5, (tokens.shape[0],)),
                      1.0, -1.0).reshape(-1, g)
  adv = (rewards - rewards.mean(1, keepdims=True)).reshape(-1, 1)
  loss_mask = jnp.pad(rollout.completion_mask, ((0, 0), (p, 0)))

  def loss(params):
    lp, _ = models.sequence_logprobs(params, MODEL, tokens, mask,
                                     with_entropy=False)
    return -jnp.sum(adv * lp * loss_mask) / jnp.sum(loss_mask)

  opt = optax.adam(lr)
  updates, _ = opt.update(jax.grad(loss)(params), opt.init(params), params)
  return optax.apply_updates(params, updates)


def _spec_workload(params, w: Workload, method, prompt_tokens, prompt_mask,
                   figures):
  """Workload e: epoch 2 of the same prompts, plain vs SPEC-RL drafts."""
  config = sampling.SamplerConfig(
      num_samples=w.group, max_new_tokens=w.new_tokens, method=method,
      cache_dtype="float32", prompt_buckets=(w.prompt_len,),
      segment_slots=_SEGMENT.value)
  plain = sampling.make_sampler(MODEL, config)
  epoch1 = plain(params, prompt_tokens, prompt_mask, jax.random.key(1))
  params2 = _one_rl_step(params, epoch1, _SPEC_LR.value, jax.random.key(2))
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(params2)))
  draft = sampling.Draft(epoch1.completion_tokens, epoch1.completion_mask,
                         epoch1.sampler_logprobs)
  key = jax.random.key(3)
  n_tokens = w.prompts * w.group * w.new_tokens
  compile_s, plain_s = _timed(plain, params2, prompt_tokens, prompt_mask, key,
                              repeats=_REPEATS.value)
  print(f"  one RL step (Adam, lr {_SPEC_LR.value:g}) moved weights by at "
        f"most {moved:.2e}")
  print(f"  {'variant':<34} {'tokens/s':>10} {'x plain':>8} {'accept':>7} "
        f"{'min kept':>8} {'steps':>6}")
  print(f"  {'plain sampling':<34} {n_tokens / plain_s:>10,.0f} {1.0:>8.2f}")
  figures["e/plain"] = {"tokens_per_s": n_tokens / plain_s,
                        "compile_s": compile_s, "max_weight_change": moved}
  for lenience in _SPEC_LENIENCE.value:
    spec = sampling.make_speculative_sampler(MODEL, config,
                                             log_lenience=float(lenience))
    compile_s, spec_s = _timed(spec, params2, prompt_tokens, prompt_mask,
                               draft, key, repeats=_REPEATS.value)
    rollout, accepted = jax.device_get(
        spec(params2, prompt_tokens, prompt_mask, draft, key))
    assert int(rollout.lengths.min()) == w.new_tokens
    rate = float(accepted.mean() / w.new_tokens)
    steps = int((rollout.lengths - accepted).max())
    label = f"SPEC-RL, log lenience {lenience}"
    print(f"  {label:<34} {n_tokens / spec_s:>10,.0f} {plain_s / spec_s:>8.2f} "
          f"{rate:>7.3f} {int(accepted.min()):>8} {steps:>6}")
    figures[f"e/{label}"] = {
        "tokens_per_s": n_tokens / spec_s, "speedup_vs_plain": plain_s / spec_s,
        "accept_rate": rate, "min_accepted": int(accepted.min()),
        "decode_steps": steps, "compile_s": compile_s}


def main(argv):
  del argv
  params = models.init_params(MODEL, jax.random.key(0))
  peak = matmul_flops_per_s()
  print(f"devices={jax.device_count()} ({jax.devices()[0].platform}); "
        f"machine matmul {peak / 1e9:.1f} GFLOP/s; model "
        f"{models.count_params(params):,} params")
  method = sampling.SamplingMethod(temperature=1.0)
  figures = {"matmul_gflops": peak / 1e9}
  for name in _WORKLOADS.value:
    w = WORKLOADS[name]
    rng = np.random.RandomState(0)
    prompt_tokens = rng.randint(1, MODEL.vocab_size,
                                (w.prompts, w.prompt_len)).astype(np.int32)
    prompt_mask = np.ones_like(prompt_tokens, bool)
    key = jax.random.key(1)
    n_tokens = w.prompts * w.group * w.new_tokens
    print(f"\nworkload {name}: {w.prompts} prompts x G={w.group}, prompt "
          f"{w.prompt_len}, {w.new_tokens} new tokens ({n_tokens} tokens)")
    if name == "e":
      _spec_workload(params, w, method, prompt_tokens, prompt_mask, figures)
      continue
    results = {}
    for label, share in (("rljax (shared prefix)", True),
                         ("rljax (no prefix sharing)", False)):
      config = sampling.SamplerConfig(
          num_samples=w.group, max_new_tokens=w.new_tokens, method=method,
          cache_dtype="float32", share_prefix=share,
          prompt_buckets=(w.prompt_len,), segment_slots=_SEGMENT.value)
      fn = sampling.make_sampler(MODEL, config)
      results[label] = _timed(fn, params, prompt_tokens, prompt_mask, key,
                              repeats=_REPEATS.value)
      rollout = fn(params, prompt_tokens, prompt_mask, key)
      assert int(rollout.lengths.min()) == w.new_tokens
    if _NO_CACHE.value:
      fn = _no_cache_sampler(MODEL, w, method)
      results["no-cache baseline"] = _timed(fn, params, prompt_tokens,
                                            prompt_mask, key, repeats=1)
    if _HF.value:
      hf = _hf_generate(params, MODEL, w, prompt_tokens, _REPEATS.value)
      if hf is not None:
        results["transformers generate"] = (float("nan"), hf)
      else:
        print("  (transformers not installed: pip install -e '.[hf]' to compare)")
    ours = results["rljax (shared prefix)"][1]
    print(f"  {'variant':<28} {'tokens/s':>10} {'x vs ours':>10} "
          f"{'compile s':>10} {'GFLOP/s':>8} {'%matmul':>8}")
    for label, (compile_s, run_s) in results.items():
      flops = decode_flops(MODEL, w) / run_s
      print(f"  {label:<28} {n_tokens / run_s:>10,.0f} {ours / run_s:>10.2f} "
            f"{compile_s:>10.2f} {flops / 1e9:>8.1f} {100 * flops / peak:>7.1f}%")
      figures[f"{name}/{label}"] = {
          "tokens_per_s": n_tokens / run_s, "speedup_of_ours": ours / run_s,
          "compile_s": compile_s, "fraction_of_matmul": flops / peak}
  if _RECORD_DIR.value:
    print("record:", write_record(
        "bench_sampler_" + "".join(_WORKLOADS.value), figures,
        _RECORD_DIR.value,
        {"workloads": list(_WORKLOADS.value), "repeats": _REPEATS.value,
         "segment_slots": _SEGMENT.value, "spec_lr": _SPEC_LR.value}))


if __name__ == "__main__":
  app.run(main)
