r"""Exports the params of a training run's checkpoint.

  python -m launch.export --workdir=/tmp/rljax_demo --format=hf
  python -m launch.export --workdir=/tmp/rljax_demo --out=/tmp/policy.safetensors
  python -m launch.export --workdir=/tmp/lora_run --merge     # = --format=hf
  python -m launch.export --workdir=/tmp/lora_run --adapters  # = --format=peft

``hf`` writes a directory ``transformers`` loads (default
``<workdir>/export/hf``): the weights, ``config.json`` and
``generation_config.json`` with the tokenizer's BOS, EOS and pad ids, and
the tokenizer: a source checkpoint's files, or the run's own sentencepiece
model as ``tokenizer.model``, ``tokenizer.json`` (``hf`` extra),
``tokenizer_config.json`` and ``special_tokens_map.json``, encoding prompts
to the ids the policy was trained on (BOS first). The weights, index and
``config.json`` of an earlier export there are replaced. A LoRA run's
adapters are merged into the weights (``--merge`` says so). ``peft``
(``--adapters``; a LoRA run only; default ``<workdir>/export/adapters``)
writes the adapters alone as ``adapter_model.safetensors`` and
``adapter_config.json``, with the frozen base they were trained on as an
``hf`` directory in its ``base/``, for ``peft.PeftModel.from_pretrained``.
``safetensors`` (default ``<workdir>/export/policy.safetensors``) writes one
file with rljax's parameter names (``layers_0.attn.q_kernel``, ...) plus the
model config as metadata (``--out`` must not be a directory). Prints what
was written and, for ``hf`` and ``peft``, how to load it.
"""

import os
import sys

from absl import flags

from launch import cli
from rljax.train import export_policy, load_policy

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default latest)")
_OUT = flags.DEFINE_string(
    "out", None, "output file or directory (default <workdir>/export/hf, "
    "<workdir>/export/adapters or <workdir>/export/policy.safetensors)")
_FORMAT = flags.DEFINE_enum("format", "safetensors", ["safetensors", "hf", "peft"],
                            "output format")
_MERGE = flags.DEFINE_bool(
    "merge", False, "a LoRA run's adapters merged into the weights, as a "
    "Hugging Face directory (--format=hf)")
_ADAPTERS = flags.DEFINE_bool(
    "adapters", False, "a LoRA run's adapters alone, as a peft directory with "
    "their base in base/ (--format=peft)")


def output_format(fmt: str, fmt_given: bool, merge: bool, adapters: bool) -> str:
  """The format ``--format``, ``--merge`` and ``--adapters`` ask for.

  Args:
    fmt: ``--format``'s value.
    fmt_given: whether ``--format`` was on the command line.
    merge: ``--merge``.
    adapters: ``--adapters``.

  Returns:
    ``"hf"`` for ``--merge``, ``"peft"`` for ``--adapters``, else ``fmt``.

  Raises:
    ValueError: ``--merge`` with ``--adapters``, or either with a
      ``--format`` of another format.
  """
  if merge and adapters:
    raise ValueError("--merge and --adapters: accepted one of them (--merge "
                     "writes the merged model, --adapters the adapters alone).")
  for flag, wanted in (("merge", merge), ("adapters", adapters)):
    implied = "hf" if flag == "merge" else "peft"
    if wanted and fmt_given and fmt != implied:
      raise ValueError(f"--{flag} with --format={fmt}: --{flag} is "
                       f"--format={implied}; accepted one of them, or both "
                       "agreeing.")
    if wanted:
      return implied
  return fmt


def main(argv):
  del argv
  cli.setup_logging()
  try:
    fmt = output_format(_FORMAT.value, flags.FLAGS["format"].present,
                        _MERGE.value, _ADAPTERS.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  try:
    policy = load_policy(_WORKDIR.value, _STEP.value)
  except (FileNotFoundError, ValueError) as e:
    step = "" if _STEP.value is None else f" --step={_STEP.value}"
    sys.exit(f"error: --workdir={_WORKDIR.value}{step}: {e}")
  lora = policy.model_config.lora
  if fmt == "peft" and (lora is None or not lora.targets):
    flag = "--adapters" if _ADAPTERS.value else "--format=peft"
    sys.exit(f"error: {flag}: the run in --workdir={_WORKDIR.value} has no "
             "LoRA adapters (model.lora.rank=0); use --format=hf.")
  exported = export_policy(policy, _WORKDIR.value, fmt, _OUT.value)
  print(f"wrote step {policy.step} params to {exported.path}")
  if fmt in ("hf", "peft"):
    print(f"  files: {', '.join(exported.files)}")
  for note in exported.notes:
    print(f"  note: {note}")
  if _MERGE.value and lora is None:
    print("  note: the run has no LoRA adapters: --merge wrote its plain "
          "Hugging Face export.")
  path = os.path.abspath(exported.path)
  if fmt == "hf":
    print("load it with:\n"
          "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained({path!r})\n"
          f"  tokenizer = AutoTokenizer.from_pretrained({path!r})")
  elif fmt == "peft":
    base = os.path.join(path, "base")
    print("load it with:\n"
          "  from peft import PeftModel\n"
          "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  base = AutoModelForCausalLM.from_pretrained({base!r})\n"
          f"  model = PeftModel.from_pretrained(base, {path!r})\n"
          f"  tokenizer = AutoTokenizer.from_pretrained({base!r})")


if __name__ == "__main__":
  cli.run(main)
