r"""Exports the params of a training run's checkpoint.

  python -m launch.export --workdir=/tmp/rljax_demo --out=/tmp/policy.safetensors
  python -m launch.export --workdir=/tmp/rljax_demo --format=hf --out=/tmp/hf_dir

``safetensors`` writes one file with rljax's parameter names (``layers_0.attn.
q_kernel``, ...) plus the model config as metadata (``--out`` must not be a
directory); ``hf`` writes a Hugging Face checkpoint directory (no extra
needed) when the model maps onto a transformers architecture, replacing the
weights, index and ``config.json`` of an earlier export there.
"""

import dataclasses
import json
import os

from absl import app, flags

from launch import cli
from rljax import models, safetensors
from rljax.train import load_policy

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default latest)")
_OUT = flags.DEFINE_string("out", None, "output file or directory", required=True)
_FORMAT = flags.DEFINE_enum("format", "safetensors", ["safetensors", "hf"],
                            "output format")


def main(argv):
  del argv
  cli.setup_logging()
  policy = load_policy(_WORKDIR.value, _STEP.value)
  if _FORMAT.value == "safetensors":
    metadata = {
        "rljax_model_config": json.dumps(dataclasses.asdict(policy.model_config)),
        "step": str(policy.step)}
    safetensors.save_file(safetensors.flatten_names(policy.params), _OUT.value,
                          metadata)
  else:
    tokenizer_dir = os.path.join(_WORKDIR.value, "tokenizer")
    files = models.save_hf_checkpoint(
        _OUT.value, policy.model_config, policy.params,
        tokenizer_from=tokenizer_dir if os.path.isdir(tokenizer_dir) else None)
    print(f"wrote {', '.join(files)}")
  print(f"wrote step {policy.step} params to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
