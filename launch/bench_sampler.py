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
  a: 8 prompts x G=8, 64-token prompts, exactly 128 new tokens;
  b: the same with 512-token prompts and 32 new tokens.
Model: vocab 2048, width 256, 4 layers, 8 query / 4 kv heads, MLP 1024, fp32.

  python -m launch.bench_sampler --workloads=a,b
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


WORKLOADS = {"a": Workload(8, 8, 64, 128), "b": Workload(8, 8, 512, 32)}


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
    results = {}
    for label, share in (("rljax (shared prefix)", True),
                         ("rljax (no prefix sharing)", False)):
      config = sampling.SamplerConfig(
          num_samples=w.group, max_new_tokens=w.new_tokens, method=method,
          cache_dtype="float32", share_prefix=share,
          prompt_buckets=(w.prompt_len,))
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
    print("record:", write_record("bench_sampler", figures, _RECORD_DIR.value,
                                  {"workloads": list(_WORKLOADS.value),
                                   "repeats": _REPEATS.value}))


if __name__ == "__main__":
  app.run(main)
