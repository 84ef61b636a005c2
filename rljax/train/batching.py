"""Host-side conversions between text, token arrays and rollout batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax import sampling
from rljax.tokenizers import Tokenizer
from rljax.train.steps import RLBatch


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[list[int]]:
  """Token ids of each prompt, with BOS first when the tokenizer has one."""
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  return [bos + tokenizer.encode(p) for p in prompts]


def check_prompt_lengths(tokenizer: Tokenizer, prompts: Sequence[str],
                         buckets: Sequence[int]) -> int:
  """Longest prompt in tokens; a clear error if no bucket holds it."""
  longest = max(len(ids) for ids in encode_prompts(tokenizer, prompts))
  if longest > max(buckets):
    raise ValueError(
        f"sampler.prompt_buckets={tuple(buckets)}: the longest prompt has "
        f"{longest} tokens, more than the largest bucket; accepted: buckets "
        f"whose largest is >= {longest}.")
  return longest


def decode_completions(tokenizer: Tokenizer, tokens_NxT: np.ndarray,
                       mask_NxT: np.ndarray, eos_ids: Sequence[int]) -> list[str]:
  """Completion texts (without the EOS token)."""
  out = []
  for row, m in zip(np.asarray(tokens_NxT), np.asarray(mask_NxT)):
    ids = [int(i) for i in row[m] if int(i) not in eos_ids]
    out.append(tokenizer.decode(ids))
  return out


def rollout_to_batch(rollout: sampling.Rollout, advantages_N) -> RLBatch:
  """Joins prompt and completion into the trainer's ``[N, P + T]`` layout."""
  tokens, input_mask = rollout.sequences()
  p = rollout.prompt_tokens.shape[1]
  zeros_mask = np.zeros(rollout.prompt_mask.shape, bool)
  zeros_f = np.zeros(rollout.prompt_mask.shape, np.float32)
  loss_mask = np.concatenate([zeros_mask, np.asarray(rollout.completion_mask)], 1)
  sampler_lp = np.concatenate([zeros_f, np.asarray(rollout.sampler_logprobs)], 1)
  del p
  return RLBatch(np.asarray(tokens), np.asarray(input_mask), loss_mask,
                 np.asarray(advantages_N, np.float32), sampler_lp)


def sft_arrays(tokenizer: Tokenizer, prompts: Sequence[str],
               completions: Sequence[str], width: int):
  """Right-padded ``(tokens, input_mask, loss_mask)`` for supervised warm-up.

  The loss covers the completion tokens and the EOS after them.
  """
  n = len(prompts)
  tokens = np.full((n, width), tokenizer.pad_id, np.int32)
  input_mask = np.zeros((n, width), bool)
  loss_mask = np.zeros((n, width), bool)
  for i, (p, c) in enumerate(zip(encode_prompts(tokenizer, prompts), completions)):
    ids = tokenizer.encode(c) + [tokenizer.eos_id]
    row = (p + ids)[:width]
    tokens[i, :len(row)] = row
    input_mask[i, :len(row)] = True
    loss_mask[i, len(p):len(row)] = True
  return tokens, input_mask, loss_mask
