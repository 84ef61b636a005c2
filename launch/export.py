r"""Exports the params of a training run's checkpoint.

  python -m launch.export --workdir=/tmp/rljax_demo --format=hf
  python -m launch.export --workdir=/tmp/rljax_demo --out=/tmp/policy.safetensors

``hf`` writes a directory ``transformers`` loads (default
``<workdir>/export/hf``): the weights, ``config.json`` and
``generation_config.json`` with the tokenizer's BOS, EOS and pad ids, and
the tokenizer: a source checkpoint's files, or the run's own sentencepiece
model as ``tokenizer.model``, ``tokenizer.json`` (``hf`` extra),
``tokenizer_config.json`` and ``special_tokens_map.json``, encoding prompts
to the ids the policy was trained on (BOS first). The weights, index and
``config.json`` of an earlier export there are replaced. ``safetensors``
(default ``<workdir>/export/policy.safetensors``) writes one file with
rljax's parameter names (``layers_0.attn.q_kernel``, ...) plus the model
config as metadata (``--out`` must not be a directory). Prints what was
written and, for ``hf``, how to load it.
"""

import os
import sys

from absl import flags

from launch import cli
from rljax.train import export_policy, load_policy

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default latest)")
_OUT = flags.DEFINE_string(
    "out", None, "output file or directory (default <workdir>/export/hf or "
    "<workdir>/export/policy.safetensors)")
_FORMAT = flags.DEFINE_enum("format", "safetensors", ["safetensors", "hf"],
                            "output format")


def main(argv):
  del argv
  cli.setup_logging()
  try:
    policy = load_policy(_WORKDIR.value, _STEP.value)
  except (FileNotFoundError, ValueError) as e:
    step = "" if _STEP.value is None else f" --step={_STEP.value}"
    sys.exit(f"error: --workdir={_WORKDIR.value}{step}: {e}")
  exported = export_policy(policy, _WORKDIR.value, _FORMAT.value, _OUT.value)
  print(f"wrote step {policy.step} params to {exported.path}")
  if _FORMAT.value == "hf":
    print(f"  files: {', '.join(exported.files)}")
  for note in exported.notes:
    print(f"  note: {note}")
  if _FORMAT.value == "hf":
    path = os.path.abspath(exported.path)
    print("load it with:\n"
          "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained({path!r})\n"
          f"  tokenizer = AutoTokenizer.from_pretrained({path!r})")


if __name__ == "__main__":
  cli.run(main)
