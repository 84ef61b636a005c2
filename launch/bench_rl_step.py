r"""A whole GRPO RL step: rljax's ``train.run`` against TRL's ``GRPOTrainer``.

Both sides train the same Hugging Face checkpoint directory, written once per
workload in a temporary directory: the issue-12 Llama (vocab 2048, width 256,
4 layers, 8/4 heads, MLP 1024, tied embeddings, fp32) with random weights from
``models.init_params`` saved by ``models.save_hf_checkpoint``, and a
character-level ``tokenizers`` WordLevel tokenizer of exactly 2048 ids
(``<pad>``, ``<s>``, ``</s>``, the 94 printable ASCII characters and CJK
filler characters). rljax reads it with ``model.path``, TRL with
``GRPOTrainer(model=<dir>)`` (``AutoModelForCausalLM.from_pretrained``, sdpa
attention, fp32) and its tokenizer (``AutoProcessor``). The same
``--prompts`` prompts (random characters, 16..64 tokens with the BOS; plain
text, no chat template: rljax writes BOS itself, TRL's tokenizer adds it with
its post-processor, so both see the same ids) form every step's batch,
``--group_size`` samples each, at most ``--max_new_tokens`` new tokens at
temperature 1 (no top-k / top-p), rewarded by the same Python function
(``digit_fraction``: the fraction of digits in the completion text).

What each side computes per step (``--loss_type=dapo``, TRL's default):

* rljax (``train.run``, one RL step of its loop): sample the ``B x G`` rows
  (KV-cached decoding, each group's prompt prefilled once, fp32 cache, the
  decode cache sized to the live length segment), decode and score them
  (the reward function in-process, ``rewards.num_workers=0``), group
  advantages (``rl.advantage=grpo``, ``rl.std_eps=1e-4`` as TRL), then one
  jitted update: forward + backward over the rows packed padding-free
  (``rl.padding_free``, the default; the completion positions' logprobs and,
  as a metric, their entropy), the PPO-clip coefficient (eps 0.2 both
  ways, ``rl.clip_eps_high=0.2`` as TRL's ``epsilon_high=None``),
  ``rl.aggregation=token_mean`` (TRL ``dapo``; ``--loss_type=grpo`` uses
  ``sequence_mean_token_mean`` with ``rl.count_empty_sequences=True``),
  global-norm clip 1.0 and AdamW. With one update per step ``pi_old`` is
  the same forward pass (``rl.old_logprobs=recompute`` reuses it: no extra
  pass), as TRL's ``old_per_token_logps = per_token_logps.detach()``.
  ``time/step`` of ``metrics.jsonl``: sample + reward + advantage + train.
* TRL (``Trainer.train``, one optimizer step): ``transformers.generate``
  (``do_sample``, dynamic KV cache, every row of the ``B x G`` batch
  prefilled with its prompt, left-padded to the longest prompt), the EOS
  mask, decode, the reward function, group advantages (``scale_rewards=
  group``, std + 1e-4), then ``_compute_loss``: one forward over the padded
  prompt + completion rows scoring the completion positions
  (``fused_lm_head`` logprobs and the entropy, which TRL always computes),
  the clipped surrogate, ``dapo`` aggregation,
  backward, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``. No reference
  model (``beta=0``), no old-logprob pass (``num_iterations=1``,
  ``steps_per_generation=1``), ``gradient_checkpointing=False`` (TRL's
  default is True, which would add a forward pass), ``bf16=False``, no vLLM.
  Timed by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``.

Both use AdamW (lr ``--learning_rate``, constant, betas 0.9 / 0.999, eps
1e-8, weight decay 0), clip 1.0, no KL, no entropy bonus, on 2 CPU threads
(``torch.set_num_threads(2)``; the machine's 2 cores for XLA).

Lengths, from the weights (identical on both sides, so both sides sample
the same distribution). Residual dimension 0 carries a constant: every
embedding row has ``C = 16`` there, no layer writes it (``o_proj`` and
``down_proj`` have a zero output column 0) and no layer reads it (the
pre-attention and pre-MLP norms have scale 0 there); everything else is
``init_params``'s. ``C`` dominates every RMS norm (the other 255
dimensions hold ~0.1 each), so after the final norm that dimension is
``C / rms(x) ~ 16`` at every position (15.93..15.97 measured), and the EOS
row's entry there, ``C + shift``, adds ``~16 * shift`` to the EOS logit
alone (every other token gets the same constant ``~16 C``, which the
softmax ignores; the other dimensions' normalised activations are ~1/16 of
a plain random model's, so the policy is close to uniform over the
vocabulary). ``shift`` is solved on the rljax forward pass of random rows:

* ``fixed``: EOS can never be emitted: the shift puts the EOS logit more
  than 300 below the others' log-sum-exp, where its fp32 probability is
  exactly 0, so neither sampler draws it (both still check for it); every
  row is ``max_new_tokens`` long. No generation option is changed on
  either side.
* ``long_tailed``: P(EOS) per step = ``4 / max_new_tokens`` on average, so
  lengths are geometric with mean ~``max_new_tokens / 4`` (31.4 for 128,
  with the EOS token), ~1.7% of rows truncated at the budget. The mean
  length and truncated fraction each side actually sampled are printed.

Timing: each run is ``--warmup`` untimed steps (rljax's first compiles the
sampler and the update; TRL's first warms PyTorch up) then ``--steps`` timed
steps; per workload the sides alternate, rljax run, TRL run, ``--rounds``
times, in one process. Each side's per-step seconds are the mean (and the
median) of all its timed steps; the ratio is TRL / rljax. The split: rljax's
``time/sample``, ``time/reward``, ``time/advantage``, ``time/train``; TRL's
``_generate_single_turn`` (sample), the rest of
``_generate_and_score_completions`` (score: tokenize, decode, reward,
advantages) and the rest of the step (train). Other processes on the 2
cores slow both sides, PyTorch's 2 OpenMP threads far more (its per-token
generation went from ~30 ms to ~300 ms next to a test run), so each run
records the cores other processes kept busy meanwhile (``/proc/stat``
less this process's CPU time): only figures with ~0 there compare the
libraries.

With ``--shrink_batch_to=m`` each round runs rljax a second time with
``sampler.shrink_batch_to=m`` (the decode batch halves as rows end, down to
``m`` rows; ``docs/rollouts.md``), printed as ``rljax_shrink`` with its own
ratio.

Measured (a quiet 2-core AMD EPYC, family 26; XLA:CPU against PyTorch
2.13, transformers 5.25 and TRL 1.16, 2 threads each; other processes
0.01..0.04 cores; the defaults: 2 rounds x 3 timed steps per side, 64 rows
x 128 new tokens, ``dapo``; ``--shrink_batch_to=8``), at aaa9b5e
(``benchmarks/results/bench_rl_step-aaa9b5efcd41.json``), both processes on
glibc's huge pages (``launch/__init__.py``):

* fixed: rljax 2.24 s per step (sample 0.68, train 1.53), TRL 6.00 s
  (sample 2.13, train 3.85): 2.68x (2.80x with the shrinking batch, which
  has nothing to shrink here: every row runs to 128 tokens).
* long_tailed: rljax 1.09 s (sample 0.51, train 0.55; mean completion
  29.3 tokens, 0.5% truncated), TRL 5.43 s (sample 1.87, train 3.56; 33.1
  tokens, 2.1% truncated): 5.00x; with the shrinking batch the sample
  takes 0.28 s and the step 1.07 s mean, 0.90 s median (5.06x, 6.00x of
  the medians). TRL's sampler decodes every row until the longest ends.
* The same host without huge pages (at 6936855,
  ``bench_rl_step-69368557da53.json``): 1.95x fixed (rljax 2.73 s, TRL
  5.32 s) and 3.99x long-tailed (1.39 s against 5.54 s; 4.96x with the
  shrinking batch). On an earlier host (at dee766a, its CPU not recorded,
  ``bench_rl_step-dee766a0fceb.json``): 1.19x and 1.87x, rljax sampling
  the fixed workload in 2.98 s (0.68 s here) and TRL in 4.30 s.

  python -m launch.bench_rl_step --compare_trl
  python -m launch.bench_rl_step --compare_trl --prompts=2 --group_size=2 \
      --max_new_tokens=8 --steps=2 --record_dir=
  python -m launch.bench_rl_step  # the rljax side only (no TRL needed)

TRL and its dependencies come with the ``bench`` extra
(``pip install -e '.[hf,bench]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

from absl import app, flags, logging
import jax
import numpy as np

from launch.benchlib import write_record
from rljax import metrics, models, train

_COMPARE = flags.DEFINE_bool("compare_trl", False,
                             "also run TRL's GRPOTrainer (the bench extra)")
_WORKLOADS = flags.DEFINE_list("workloads", ["fixed", "long_tailed"],
                               "fixed and/or long_tailed")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps per run")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed steps first in each run")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "runs per side and workload, "
                               "alternating rljax and TRL")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "prompts per step (B)")
_GROUP = flags.DEFINE_integer("group_size", 4, "samples per prompt (G)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "generation budget")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 16, "shortest prompt, tokens")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 64, "longest prompt, tokens")
_LOSS = flags.DEFINE_enum("loss_type", "dapo", ["dapo", "grpo"],
                          "TRL's loss_type (rljax's matching aggregation)")
_LR = flags.DEFINE_float("learning_rate", 1e-5, "AdamW learning rate")
_THREADS = flags.DEFINE_integer("threads", 2, "torch threads")
_SHRINK = flags.DEFINE_integer(
    "shrink_batch_to", None, "rljax's sampler.shrink_batch_to (None: every "
    "row decodes until the last one ends, the default of both sides)")
_RECORD_DIR = flags.DEFINE_string(
    "record_dir", "benchmarks/results",
    "where the JSON record of the figures goes ('' for none)")

# The issue-12 model (launch/bench_train_step.py's TORCH_MODEL).
MODEL = dict(vocab_size=2048, d_model=256, num_layers=4, num_heads=8,
             num_kv_heads=4, head_dim=32, mlp_dim=1024)
SPECIALS = ("<pad>", "<s>", "</s>")
PAD, BOS, EOS = range(3)
CONSTANT = 16.0  # the residual's constant dimension 0 (see the docstring)
FIXED_MARGIN = 300.0  # EOS logit below the others' log-sum-exp (fixed)
CLIP_EPS, MAX_GRAD_NORM, STD_EPS = 0.2, 1.0, 1e-4


def digit_fraction(prompts, completions, **unused_fields):
  """The reward of both sides: the fraction of digits in each completion."""
  del prompts, unused_fields
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


# ----------------------------------------------------------------------------
# The checkpoint: tokenizer, weights and lengths.


def vocabulary(size: int) -> list[str]:
  """``size`` tokens: the specials, printable ASCII, then CJK fillers."""
  chars = [chr(i) for i in range(33, 127)]
  chars += [chr(0x4E00 + i) for i in range(size - len(SPECIALS) - len(chars))]
  return list(SPECIALS) + chars


def write_tokenizer(path: str, vocab: list[str]) -> None:
  """A character-level tokenizer.json (BOS added by its post-processor, as
  TRL encodes plain prompts) and tokenizer_config.json."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(".|\n"), "isolated")  # one token per character
  tok.decoder = tokenizers.decoders.Fuse()
  tok.add_special_tokens(list(SPECIALS))
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", special_tokens=[("<s>", BOS)])
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
               "tokenizer_class": "PreTrainedTokenizerFast",
               "model_max_length": 4096}, f)


def model_config() -> models.ModelConfig:
  return dataclasses.replace(models.get_preset("small"), **MODEL)


def constant_feature_params(mc: models.ModelConfig, seed: int = 0) -> dict:
  """``init_params`` with residual dimension 0 held at ``CONSTANT``."""
  params = jax.tree.map(np.array, jax.device_get(
      models.init_params(mc, jax.random.key(seed))))
  params["embedding"][:, 0] = CONSTANT
  for i in range(mc.num_layers):
    layer = params[f"layers_{i}"]
    layer["attn"]["o_kernel"][..., 0] = 0.0
    layer["mlp"]["down_kernel"][:, 0] = 0.0
    for norm in ("pre_attn_norm", "pre_mlp_norm"):
      layer[norm]["scale"][0] = 0.0
  return params


def eos_shift(mc: models.ModelConfig, params: dict, kind: str,
              max_new_tokens: int, seed: int = 0) -> tuple[float, dict]:
  """The shift of the EOS row's dimension 0 for ``kind``, solved on the
  forward pass of random rows (EOS never in them): per position, the EOS
  logit moves by ``hidden[0] * shift`` and nothing else does."""
  rng = np.random.RandomState(seed)
  rows, length = 32, _PROMPT_MAX.value + max_new_tokens
  tokens = rng.randint(len(SPECIALS), mc.vocab_size, (rows, length))
  positions = np.broadcast_to(np.arange(length), tokens.shape)
  hidden = jax.jit(lambda p, x, i: models.Decoder(mc).apply(
      {"params": p}, x, i)[0])(params, tokens, positions)
  logits = np.asarray(models.compute_logits(hidden, params["embedding"].T),
                      np.float64)[:, -max_new_tokens:]
  k = np.asarray(hidden, np.float64)[:, -max_new_tokens:, 0]
  others = np.delete(logits, EOS, axis=-1)
  top = others.max(-1)
  gap = logits[..., EOS] - (top + np.log(np.exp(others - top[..., None]).sum(-1)))
  if kind == "fixed":
    shift = float(-(FIXED_MARGIN + gap.max()) / k.min())
  else:
    target = 4.0 / max_new_tokens
    p = lambda s: float(np.mean(1.0 / (1.0 + np.exp(-(gap + k * s)))))
    lo, hi = -50.0, 50.0
    for _ in range(100):
      mid = (lo + hi) / 2
      lo, hi = (mid, hi) if p(mid) < target else (lo, mid)
    shift = (lo + hi) / 2
  new_gap = gap + k * shift
  return shift, {"eos_shift": shift, "k_min": float(k.min()),
                 "k_max": float(k.max()),
                 "p_eos_mean": float(np.mean(1 / (1 + np.exp(-new_gap)))),
                 "eos_logit_gap_max": float(new_gap.max())}


def write_checkpoint(path: str, kind: str, max_new_tokens: int) -> dict:
  """The checkpoint directory of a workload; returns how EOS was shaped."""
  mc = model_config()
  params = constant_feature_params(mc)
  shift, info = eos_shift(mc, params, kind, max_new_tokens)
  params["embedding"][EOS, 0] = CONSTANT + shift
  models.save_hf_checkpoint(path, mc, params, extra_config={
      "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})
  write_tokenizer(path, vocabulary(mc.vocab_size))
  return info


def write_prompts(path: str, n: int, vocab: list[str], seed: int = 0) -> list[str]:
  """``n`` prompts of random characters (``prompt_min..prompt_max`` tokens
  with the BOS) as a JSONL task."""
  rng = np.random.RandomState(seed)
  # No '<' or '>': no prompt can spell a special token's text.
  chars = [c for c in vocab[len(SPECIALS):] if c not in "<>"]
  prompts = ["".join(rng.choice(chars, rng.randint(_PROMPT_MIN.value,
                                                   _PROMPT_MAX.value + 1) - 1))
             for _ in range(n)]
  with open(path, "w") as f:
    for p in prompts:
      f.write(json.dumps({"prompt": p, "answer": "0"}) + "\n")
  return prompts


# ----------------------------------------------------------------------------
# rljax.


def rljax_config(checkpoint: str, task: str, num_steps: int,
                 shrink_batch_to: int | None = None):
  from configs import common  # pylint: disable=import-outside-toplevel
  c = common.base()
  c.task.path = c.task.heldout_path = task
  c.model.path = checkpoint
  c.tokenizer.chat_template = False
  c.sampler.max_new_tokens = _MAX_NEW.value
  c.sampler.temperature = 1.0
  c.sampler.prompt_buckets = (_PROMPT_MAX.value,)
  c.sampler.cache_dtype = "float32"
  c.sampler.shrink_batch_to = shrink_batch_to
  c.sft.num_steps = 0
  c.rl.num_steps = num_steps
  c.rl.prompts_per_step = _PROMPTS.value
  c.rl.group_size = _GROUP.value
  c.rl.advantage = "grpo"
  c.rl.std_eps = STD_EPS
  c.rl.objective = "ppo_clip"
  c.rl.clip_eps_low = c.rl.clip_eps_high = CLIP_EPS
  if _LOSS.value == "dapo":
    c.rl.aggregation = "token_mean"
  else:
    c.rl.aggregation = "sequence_mean_token_mean"
    c.rl.count_empty_sequences = True
  c.rl.kl_coef = 0.0
  c.rl.old_logprobs = "recompute"
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = _LR.value
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = MAX_GRAD_NORM
  c.rewards.names = (f"{digit_fraction.__module__}:digit_fraction",)
  c.rewards.weights = (1.0,)
  c.rewards.num_workers = 0
  c.eval.every = 10 ** 6
  c.eval.num_examples = min(_PROMPTS.value, 4)
  c.eval.greedy = False
  c.checkpoint.every = 10 ** 6
  return c


def run_rljax(checkpoint: str, task: str,
              shrink_batch_to: int | None = None) -> dict:
  """One ``train.run``; the timed steps' figures from ``metrics.jsonl``."""
  warm, steps = _WARMUP.value, _STEPS.value
  with tempfile.TemporaryDirectory() as workdir:
    train.run(rljax_config(checkpoint, task, warm + steps, shrink_batch_to),
              workdir)
    rows = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r["step"] > warm]
  out = {"step_s": [r["time/step"] for r in rows]}
  for k in ("sample", "reward", "advantage", "train"):
    out[f"{k}_s"] = [r[f"time/{k}"] for r in rows]
  out["completion_length"] = [r["completion_length/mean"] for r in rows]
  out["truncated"] = [r["truncation_rate"] for r in rows]
  out["generated_tokens"] = [r["num_generated_tokens"] for r in rows]
  return out


# ----------------------------------------------------------------------------
# TRL.


def run_trl(checkpoint: str, prompts: list[str]) -> dict:
  """One ``GRPOTrainer.train``; the timed steps' figures."""
  import datasets  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(_THREADS.value)
  warm, steps, t = _WARMUP.value, _STEPS.value, _MAX_NEW.value
  record = {"step_s": [], "sample_s": [], "score_s": [],
            "completion_length": [], "truncated": [], "generated_tokens": []}
  current = {}

  class Timer(transformers.TrainerCallback):

    def on_step_begin(self, args, state, control, **kwargs):
      current.clear()
      current["start"] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      if state.global_step > warm:
        record["step_s"].append(time.perf_counter() - current["start"])
        record["sample_s"].append(current["sample"])
        record["score_s"].append(current["score"] - current["sample"])
        lengths = np.asarray(current["lengths"])
        record["completion_length"].append(float(lengths.mean()))
        record["truncated"].append(float(np.mean(current["truncated"])))
        record["generated_tokens"].append(float(lengths.sum()))

  with tempfile.TemporaryDirectory() as out:
    args = trl.GRPOConfig(
        output_dir=out, max_steps=warm + steps, seed=0,
        per_device_train_batch_size=_PROMPTS.value * _GROUP.value,
        gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=_GROUP.value, num_iterations=1,
        max_completion_length=t, temperature=1.0, top_p=1.0, top_k=0,
        loss_type=_LOSS.value, beta=0.0, epsilon=CLIP_EPS,
        scale_rewards="group", mask_truncated_completions=False,
        learning_rate=_LR.value, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True,
        model_init_kwargs={"dtype": torch.float32,
                           "attn_implementation": "sdpa"},
        report_to=[], save_strategy="no", logging_steps=10 ** 6,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    trainer = trl.GRPOTrainer(
        model=checkpoint, reward_funcs=digit_fraction, args=args,
        train_dataset=datasets.Dataset.from_list(
            [{"prompt": p} for p in prompts]),
        callbacks=[Timer()])
    generate_one = trainer._generate_single_turn
    generate_score = trainer._generate_and_score_completions
    eos = set(trainer.eos_token_ids)

    def timed_generate(*a, **kw):
      start = time.perf_counter()
      completion_ids, logprobs = generate_one(*a, **kw)
      current["sample"] = time.perf_counter() - start
      current["lengths"] = [len(c) for c in completion_ids]
      current["truncated"] = [len(c) == t and c[-1] not in eos
                              for c in completion_ids]
      return completion_ids, logprobs

    def timed_score(*a, **kw):
      start = time.perf_counter()
      result = generate_score(*a, **kw)
      current["score"] = time.perf_counter() - start
      return result

    trainer._generate_single_turn = timed_generate
    trainer._generate_and_score_completions = timed_score
    trainer.train()
  record["train_s"] = [s - a - b for s, a, b in zip(
      record["step_s"], record["sample_s"], record["score_s"])]
  record["versions"] = {"trl": trl.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__}
  return record


def logits_agreement(checkpoint: str) -> float:
  """Max |log-softmax difference| of the two sides' models on random rows."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(_THREADS.value)
  mc, params = models.load_hf_checkpoint(checkpoint)
  rng = np.random.RandomState(1)
  tokens = rng.randint(len(SPECIALS), mc.vocab_size, (4, 96))
  positions = np.broadcast_to(np.arange(96), tokens.shape)
  jax_logits = np.asarray(models.Decoder(mc).apply(
      {"params": params}, tokens, positions, return_logits=True)[0])
  model = transformers.AutoModelForCausalLM.from_pretrained(
      checkpoint, dtype=torch.float32, attn_implementation="sdpa")
  with torch.no_grad():
    torch_logits = model(torch.from_numpy(tokens)).logits.numpy()
  lsm = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
      -1, keepdims=True)) - x.max(-1, keepdims=True)
  return float(np.abs(lsm(jax_logits.astype(np.float64))
                      - lsm(torch_logits.astype(np.float64))).max())


# ----------------------------------------------------------------------------


def _cpu_seconds() -> tuple[float, float] | None:
  """Busy CPU seconds so far of the whole machine and of this process."""
  try:
    with open("/proc/stat") as f:
      ticks = [int(x) for x in f.readline().split()[1:9]]
  except (OSError, ValueError):
    return None
  busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
  return busy / os.sysconf("SC_CLK_TCK"), sum(os.times()[:4])


def _with_others(fn, *args) -> dict:
  """``fn(*args)`` (a run's figures) with ``others_cores``: the cores that
  other processes kept busy meanwhile, on average (0: a quiet machine)."""
  start, t0 = _cpu_seconds(), time.perf_counter()
  figures = fn(*args)
  end, wall = _cpu_seconds(), time.perf_counter() - t0
  if start and end:
    figures["others_cores"] = max(
        0.0, (end[0] - start[0] - (end[1] - start[1])) / wall)
  return figures


def _summary(values: list[float]) -> dict:
  return {"mean": statistics.mean(values), "median": statistics.median(values)}


def workload(kind: str) -> dict:
  t = _MAX_NEW.value
  with tempfile.TemporaryDirectory() as d:
    checkpoint = os.path.join(d, "model")
    os.makedirs(checkpoint)
    shaping = write_checkpoint(checkpoint, kind, t)
    task = os.path.join(d, "prompts.jsonl")
    prompts = write_prompts(task, _PROMPTS.value,
                            vocabulary(MODEL["vocab_size"]))
    out = {"eos": shaping, "rljax": [], "rljax_shrink": [], "trl": []}
    if _COMPARE.value:
      out["max_abs_logp_diff"] = logits_agreement(checkpoint)
    for _ in range(_ROUNDS.value):
      out["rljax"].append(_with_others(run_rljax, checkpoint, task))
      if _SHRINK.value:
        out["rljax_shrink"].append(_with_others(run_rljax, checkpoint, task,
                                                _SHRINK.value))
      if _COMPARE.value:
        out["trl"].append(_with_others(run_trl, checkpoint, prompts))
  return out


def report(kind: str, out: dict) -> dict:
  """Prints a workload's figures; returns the record's part."""
  rows = _PROMPTS.value * _GROUP.value
  print(f"\n{kind}: {_PROMPTS.value} prompts x {_GROUP.value} = {rows} rows, "
        f"max_new_tokens {_MAX_NEW.value}, loss_type {_LOSS.value}; EOS shift "
        f"{out['eos']['eos_shift']:+.2f} (mean P(EOS) on random rows "
        f"{out['eos']['p_eos_mean']:.3g})")
  if "max_abs_logp_diff" in out:
    print(f"  same model both sides: max |logp diff| "
          f"{out['max_abs_logp_diff']:.1e}")
  figures = {"eos": out["eos"],
             "max_abs_logp_diff": out.get("max_abs_logp_diff")}
  sides = [("rljax", ("sample", "reward", "advantage", "train"))]
  if out["rljax_shrink"]:
    sides.append(("rljax_shrink", ("sample", "reward", "advantage", "train")))
  if out["trl"]:
    sides.append(("trl", ("sample", "score", "train")))
  for side, parts in sides:
    merged = {k: [v for run in out[side] for v in run[k]]
              for k in out[side][0] if isinstance(out[side][0][k], list)}
    others = [run["others_cores"] for run in out[side] if "others_cores" in run]
    step = _summary(merged["step_s"])
    split = {p: statistics.mean(merged[f"{p}_s"]) for p in parts}
    length = statistics.mean(merged["completion_length"])
    truncated = statistics.mean(merged["truncated"])
    print(f"  {side:<12} step {step['mean']:7.3f} s mean, {step['median']:7.3f}"
          f" s median over {len(merged['step_s'])} steps; "
          + ", ".join(f"{p} {v:.3f}" for p, v in split.items())
          + f"; completion length {length:.1f}, truncated "
          f"{100 * truncated:.1f}%")
    print("        per step: " + " ".join(f"{s:.3f}" for s in merged["step_s"])
          + ("; other processes busy: " + ", ".join(f"{o:.2f}" for o in others)
             + " cores (per run)" if others else ""))
    figures[side] = {"step_s": step, "split_s": split,
                     "steps_s": merged["step_s"],
                     "completion_length_mean": length,
                     "truncated_fraction": truncated,
                     "generated_tokens_per_step": statistics.mean(
                         merged["generated_tokens"]),
                     "other_processes_cores_per_run": others}
    if side == "trl":
      figures["versions"] = out["trl"][0]["versions"]
  if out["trl"]:
    for stat in ("mean", "median"):
      figures[f"ratio_trl_over_rljax_{stat}"] = (
          figures["trl"]["step_s"][stat] / figures["rljax"]["step_s"][stat])
    print(f"  TRL / rljax whole step: {figures['ratio_trl_over_rljax_mean']:.2f}x"
          f" (medians: {figures['ratio_trl_over_rljax_median']:.2f}x)")
    if out["rljax_shrink"]:
      for stat in ("mean", "median"):
        figures[f"ratio_trl_over_rljax_shrink_{stat}"] = (
            figures["trl"]["step_s"][stat]
            / figures["rljax_shrink"]["step_s"][stat])
      print(f"  TRL / rljax with sampler.shrink_batch_to={_SHRINK.value}: "
            f"{figures['ratio_trl_over_rljax_shrink_mean']:.2f}x (medians: "
            f"{figures['ratio_trl_over_rljax_shrink_median']:.2f}x)")
  return figures


def main(argv):
  del argv
  for kind in _WORKLOADS.value:
    if kind not in ("fixed", "long_tailed"):
      raise ValueError(f"--workloads: {kind!r}; accepted fixed, long_tailed.")
  if _COMPARE.value:
    import trl  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  logging.set_verbosity(logging.WARNING)  # the runs' INFO lines (orbax, ...)
  load = [os.getloadavg()[0]]
  results = {kind: workload(kind) for kind in _WORKLOADS.value}
  load.append(os.getloadavg()[0])
  figures = {kind: report(kind, out) for kind, out in results.items()}
  # Other processes on the machine skew both sides (2 cores, 2 threads each).
  print(f"\n1-minute load average at start / end: {load[0]:.2f} / {load[1]:.2f}"
        f" ({os.cpu_count()} CPUs)")
  figures["load_average_start_end"] = load
  if _RECORD_DIR.value:
    print("record:", write_record(
        "bench_rl_step", figures, _RECORD_DIR.value,
        {"model": MODEL, "prompts": _PROMPTS.value,
         "group_size": _GROUP.value, "max_new_tokens": _MAX_NEW.value,
         "prompt_tokens": [_PROMPT_MIN.value, _PROMPT_MAX.value],
         "loss_type": _LOSS.value, "learning_rate": _LR.value,
         "steps": _STEPS.value, "warmup": _WARMUP.value,
         "rounds": _ROUNDS.value, "compare_trl": _COMPARE.value,
         "threads": _THREADS.value, "shrink_batch_to": _SHRINK.value}))


if __name__ == "__main__":
  app.run(main)
