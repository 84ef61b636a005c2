"""Generative judges: a language model reads the answer and gives a verdict.

The reward kind ``judge`` (``rewards.names`` entry ``"judge:<path>"``,
settings ``rewards.judges.*``). ``<path>`` is a Hugging Face causal LM
directory or an rljax run directory; its params are frozen. For each
(prompt, completion) of the batch the judge reads ``template`` (with
``{prompt}`` and ``{completion}`` filled in; rendered as a user turn through
its chat template when it has one), samples a short verdict with rljax's own
KV-cache sampler (greedy, or ``num_samples`` samples at ``temperature`` and
their majority), and ``parser`` turns the verdict's text into a score. The
whole RL batch is judged in one sampler call on the policy's mesh.

The built-in parser (``parse_verdict``) reads "yes"/"no" (1/0) at the start
of the verdict, else the first number in it. A verdict it cannot read is "no
reward" for that sample (``reward/<name>/none``, out of
``reward/<name>/valid_frac``, and so inside ``rewards.max_failure_fraction``'s
count): a judge that emits garbage costs its own column, never the run.

Randomness: the sampling key of a batch is ``fold_in(key(seed), crc32 of the
batch's judge prompts)``: reproducible, resumable, with no state and no
hidden seed (``seed`` is the run's).

References: Zheng et al., "Judging LLM-as-a-Judge with MT-Bench and
Chatbot Arena", https://arxiv.org/abs/2306.05685; the rubric-judge and
generative-verifier line (Zhang et al., "Generative Verifiers: Reward
Modeling as Next-Token Prediction", https://arxiv.org/abs/2408.15240).
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from rljax import distributed, models, sampling
from rljax import tokenizers as tok_lib

PREFIX = "judge:"
"""The ``rewards.names`` prefix of the reward kind ``judge``."""

_YES = re.compile(r"\s*(yes|correct|true)\b", re.IGNORECASE)
_NO = re.compile(r"\s*(no|incorrect|wrong|false)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def is_judge(name: str) -> bool:
  return isinstance(name, str) and name.startswith(PREFIX)


def label(name: str) -> str:
  """The metric label of ``"judge:<path>"``: the directory's name."""
  base = os.path.basename(os.path.normpath(name[len(PREFIX):])) or "judge"
  return re.sub(r"[^A-Za-z0-9_.\-]", "_", base)


def check(name: str) -> str:
  """The judge's directory, checked to be a run or a Hugging Face one."""
  path = name[len(PREFIX):]
  if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
      os.path.join(path, "config.json")):
    return path
  raise FileNotFoundError(
      f"rewards.names entry {name!r}: {path} holds neither checkpoints/ (an "
      "rljax run directory) nor config.json (a Hugging Face causal LM); "
      "accepted: one of them.")


def parse_verdict(text: str) -> float | None:
  """1.0 for a verdict starting "yes" (or "correct", "true"), 0.0 for "no"
  ("incorrect", "wrong", "false"), else the first number; None if none."""
  if _YES.match(text):
    return 1.0
  if _NO.match(text):
    return 0.0
  number = _NUMBER.search(text)
  return float(number.group()) if number else None


def majority(values: Sequence[float | None]) -> float | None:
  """The most frequent parsed value (ties: the one seen first); None when no
  value parsed."""
  counts = collections.Counter(v for v in values if v is not None)
  if not counts:
    return None
  best = max(counts.values())
  return next(v for v in values if v is not None and counts[v] == best)


def get_parser(name: str) -> Callable[[str], float | None]:
  """``parse_verdict`` for ``""``, else ``"package.module:function"``."""
  if not name:
    return parse_verdict
  module, _, attr = name.partition(":")
  try:
    return getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError, ValueError) as e:
    raise ValueError(f"rewards.judges.parser={name!r} cannot be imported "
                     f"({e}); accepted: '' (the built-in yes/no or number "
                     "parser) or 'package.module:function'.") from e


class JudgeReward:
  """A generative judge as a reward function (module docstring).

  Args:
    model_config, params: the judge's decoder (frozen).
    tokenizer: its tokenizer.
    template: the judge's prompt, with ``{prompt}`` and ``{completion}``
      (``rewards.judges.template``'s default asks for yes or no).
    max_new_tokens: verdict length at most.
    num_samples: verdicts per completion (1: greedy; more: sampled at
      ``temperature``, majority).
    parser: verdict text -> score or None.
    seed: the run's seed (the base of each batch's key).
    mesh: the params' mesh; None: the default device.
    chat_template: render the template as a user turn when the tokenizer has
      a chat template.
    group: the run's processes (``distributed.ProcessGroup``). With
      several, each process is called with its own rows: their prompts are
      padded to the longest bucket of any process and judged in one global
      sampler call on ``mesh``, keyed by every process's prompts (so the
      verdicts are those of one process judging the whole batch), and each
      process takes back its rows' verdicts.
  """

  def __init__(self, model_config: models.ModelConfig, params: Any,
               tokenizer: Any, *, template: str,
               max_new_tokens: int = 8, num_samples: int = 1,
               temperature: float = 1.0,
               parser: Callable[[str], float | None] = parse_verdict,
               seed: int = 0, mesh: jax.sharding.Mesh | None = None,
               chat_template: bool = True,
               group: distributed.ProcessGroup | None = None):
    try:
      template.format(prompt="", completion="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"rewards.judges.template={template!r}: {e!r}; "
                       "accepted: a format string with only {prompt} and "
                       "{completion} fields.") from e
    self.model_config, self.params, self.tokenizer = (model_config, params,
                                                      tokenizer)
    self.template, self.parser, self.num_samples = template, parser, num_samples
    self._chat = chat_template and getattr(tokenizer, "chat_template",
                                           None) is not None
    self._key = jax.random.key(seed)
    self._mesh = mesh
    self._group = group or distributed.ProcessGroup()
    if not self._group.single and mesh is None:
      raise ValueError("JudgeReward with several processes needs the mesh.")
    method = (sampling.SamplingMethod(greedy=True) if num_samples == 1
              else sampling.SamplingMethod(temperature=temperature))
    self._sampler = functools.partial(
        sampling.SamplerConfig, num_samples=num_samples,
        max_new_tokens=max_new_tokens, method=method,
        eos_ids=tuple(getattr(tokenizer, "eos_ids", None)
                      or (tokenizer.eos_id,)),
        pad_id=tokenizer.pad_id, cache_dtype="float32")
    self._samplers: dict[int, Any] = {}

  def encode(self, prompt: str, completion: str) -> list[int]:
    """The judge's prompt ids for one (prompt, completion)."""
    text = self.template.format(prompt=prompt, completion=completion)
    if self._chat:
      return self.tokenizer.encode(self.tokenizer.apply_chat_template(
          [{"role": "user", "content": text}], add_generation_prompt=True))
    return tok_lib.encode_prompts(self.tokenizer, [text])[0]

  def _sample_fn(self, bucket: int):
    if bucket not in self._samplers:
      config = self._sampler(prompt_buckets=(bucket,))
      shardings = (None if self._mesh is None else
                   models.param_shardings(self.model_config, self._mesh))
      self._samplers[bucket] = (sampling.make_sampler(
          self.model_config, config, self._mesh, shardings), config)
    return self._samplers[bucket]

  def verdicts(self, prompts: Sequence[str], completions: Sequence[str]
               ) -> list[list[str]]:
    """The judge's ``num_samples`` verdict texts for each completion."""
    ids = [self.encode(p, c) for p, c in zip(prompts, completions)]
    group, mesh = self._group, self._mesh
    bucket = group.max_int(max(16, 1 << (max(len(i) for i in ids) - 1
                                         ).bit_length()))
    tokens, mask = sampling.pad_prompts(ids, (bucket,), self.tokenizer.pad_id)
    # The key of the whole batch's prompts, the same on every process.
    key = jax.random.fold_in(self._key, zlib.crc32(
        group.gather_rows(tokens, mesh).tobytes()))
    fn, config = self._sample_fn(bucket)
    rollout = fn(self.params, group.global_array(tokens, mesh),
                 group.global_array(mask, mesh), key)
    completion_tokens, completion_mask = distributed.local_rows_many(
        group, rollout.completion_tokens, rollout.completion_mask)
    texts = tok_lib.decode_completions(self.tokenizer, completion_tokens,
                                       completion_mask, config.eos_ids)
    k = self.num_samples
    return [texts[i * k:(i + 1) * k] for i in range(len(ids))]

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               **unused_fields: Any) -> list[float | None]:
    if not completions:
      return []
    return [majority([self.parser(t) for t in texts])
            for texts in self.verdicts(prompts, completions)]


def load(name: str, *, model: tuple[models.ModelConfig, Any, Any],
         mesh: jax.sharding.Mesh | None, seed: int, settings: Any,
         group: distributed.ProcessGroup | None = None) -> JudgeReward:
  """The ``JudgeReward`` of a ``rewards.names`` entry ``"judge:<path>"``.

  Args:
    name: the entry.
    model: the judge's ``(model_config, params, tokenizer)``
      (``rljax.train.policy.load_judge`` reads a run or a Hugging Face
      directory).
    mesh: where its params are.
    seed: the run's seed.
    settings: ``rewards.judges.*``.
    group: the run's processes (``JudgeReward``).
  """
  path = check(name)
  model_config, params, tokenizer = model
  tok_lib.check_tokenizer_vocab(tokenizer, model_config.vocab_size, path)
  return JudgeReward(
      model_config, params, tokenizer, template=settings.template,
      max_new_tokens=settings.max_new_tokens,
      num_samples=settings.num_samples, temperature=settings.temperature,
      parser=get_parser(settings.parser), seed=seed, mesh=mesh,
      chat_template=settings.chat_template, group=group)
