"""Tiny reward models for tests: a random decoder with a random score head,
saved as a Hugging Face sequence classifier (what ``model:<path>`` reads)."""

import os

import jax

from rljax import models
from rljax.models import reward_model as rm


def tiny_reward_model(path, tokenizer=None, seed=0):
  """Writes the model (with ``tokenizer``'s sentencepiece file, so that it
  reads the policy's tokens) to ``path``; returns ``path`` as a string."""
  preset = models.get_preset("tiny")
  if tokenizer is not None:
    preset = preset.replace(vocab_size=tokenizer.vocab_size)
  config = rm.RewardModelConfig(preset)
  params = rm.init_params(config, jax.random.key(seed))
  kernel = jax.random.normal(jax.random.key(seed + 7),
                             (config.decoder.d_model, 1))
  rm.save_hf_reward_model(path, config, {"decoder": params["decoder"],
                                         "score": {"kernel": kernel}})
  if tokenizer is not None:
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
      f.write(tokenizer.serialized)
  return str(path)
