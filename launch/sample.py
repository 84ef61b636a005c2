r"""Samples completions from a trained run or a freshly initialised preset.

  python -m launch.sample --workdir=/tmp/rljax_demo --prompt="12+34=" --num_samples=4
  python -m launch.sample --workdir=/tmp/rljax_demo --prompts_file=prompts.txt --greedy
  python -m launch.sample --preset=tiny --prompt="hello"   # random weights, byte-level ids

Prints each prompt followed by its completions.
"""

from absl import app, flags
import jax

from launch import cli
from rljax import models, sampling, tokenizers

_WORKDIR = flags.DEFINE_string("workdir", None, "a training run directory")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default latest)")
_PRESET = flags.DEFINE_string("preset", None, "init this preset instead of a run")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "a prompt (repeatable)")
_FILE = flags.DEFINE_string("prompts_file", None, "one prompt per line")
_NUM = flags.DEFINE_integer("num_samples", 1, "samples per prompt")
_MAX = flags.DEFINE_integer("max_new_tokens", 32, "tokens per sample at most")
_TEMP = flags.DEFINE_float("temperature", 1.0, "sampling temperature")
_TOP_K = flags.DEFINE_integer("top_k", None, "top-k")
_TOP_P = flags.DEFINE_float("top_p", None, "top-p")
_MIN_P = flags.DEFINE_float("min_p", None, "min-p")
_GREEDY = flags.DEFINE_bool("greedy", False, "argmax decoding")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")


class _ByteTokenizer:
  """Bytes as ids 4..259 for presets without a tokenizer (demo only)."""
  vocab_size, bos_id, eos_id, pad_id = 260, 2, 3, 0

  def encode(self, text):
    return [b + 4 for b in text.encode()]

  def decode(self, ids):
    return bytes(i - 4 for i in ids if 4 <= i < 260).decode(errors="replace")


def main(argv):
  del argv
  cli.setup_logging()
  prompts = list(_PROMPT.value)
  if _FILE.value:
    with open(_FILE.value) as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  if not prompts:
    raise app.UsageError("give --prompt (repeatable) or --prompts_file.")
  if _WORKDIR.value:
    from rljax.train import load_policy
    policy = load_policy(_WORKDIR.value, _STEP.value)
    params, mc, tok = policy.params, policy.model_config, policy.tokenizer
  elif _PRESET.value:
    tok = _ByteTokenizer()
    mc = models.get_preset(_PRESET.value, vocab_size=max(
        tok.vocab_size, models.get_preset(_PRESET.value).vocab_size))
    params = models.init_params(mc, jax.random.key(_SEED.value))
  else:
    raise app.UsageError("give --workdir (a run) or --preset.")
  method = (sampling.SamplingMethod(greedy=True) if _GREEDY.value else
            sampling.SamplingMethod(temperature=_TEMP.value, top_k=_TOP_K.value,
                                    top_p=_TOP_P.value, min_p=_MIN_P.value))
  config = sampling.SamplerConfig(
      num_samples=_NUM.value, max_new_tokens=_MAX.value, method=method,
      eos_ids=tuple(getattr(tok, "eos_ids", (tok.eos_id,))), pad_id=tok.pad_id)
  tokens, mask = sampling.pad_prompts(tokenizers.encode_prompts(tok, prompts),
                                      config.prompt_buckets, tok.pad_id)
  rollout = jax.device_get(sampling.sample(
      params, tokens, mask, jax.random.key(_SEED.value), model_config=mc,
      config=config))
  texts = tokenizers.decode_completions(tok, rollout.completion_tokens,
                                        rollout.completion_mask, config.eos_ids)
  for i, prompt in enumerate(prompts):
    print(f"=== {prompt!r}")
    for j in range(_NUM.value):
      row = i * _NUM.value + j
      end = "" if rollout.finished[row] else "  [truncated]"
      print(f"  {texts[row]!r}{end}")


if __name__ == "__main__":
  cli.run(main)
