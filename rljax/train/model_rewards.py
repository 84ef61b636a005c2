"""Rewards scored by a model on the policy's mesh: the reward kind ``model``.

A ``ModelReward`` is a reward function (``rljax.rewards.RewardFn``) whose
values are a reward model's scores (``rljax.models.reward_model``: a
decoder with a score head on the last real token), computed in a jitted
forward on the same devices as the policy, with no second serving system.
It runs in the trainer's process (``RewardSpec(in_process=True)``), so its
values enter the ``[N, R]`` reward columns like any function's, with their
weight, the failure counts and the ``reward/<name>/*`` metrics; a
non-finite score counts as ``reward/<name>/invalid``.

Two ways to read a completion:

* **Tokens** (the reward model has the policy's tokenizer): the evaluator
  hands over the rollout itself (``RewardEvaluator.evaluate(tokens=...)``)
  and the model scores ``prompt_tokens + completion_tokens`` as they were
  sampled (EOS included where the row finished): no decode/encode round
  trip.
* **Text** (another tokenizer, or a caller without tokens): each (prompt,
  completion) is rendered through the reward model's chat template as a
  user turn and an assistant turn (``rewards.models.chat_template``), or
  else as the prompt's ids, the completion's and EOS (``encode``), encoded with the
  reward model's tokenizer, left-padded and scored.

In a config a model reward is a ``rewards.names`` entry ``"model:<path>"``
(``<path>``: a Hugging Face ``*ForSequenceClassification`` directory, or a
run directory of ``launch.train_reward_model``, whose ``reward_model/``
holds one); its metric label is the directory's name. ``rewards.models.*``
holds the kind's settings. Reference: Ouyang et al., "Training language
models to follow instructions with human feedback" (RL against a learned
reward model), https://arxiv.org/abs/2203.02155; TRL's ``GRPOTrainer``
takes a sequence-classification model among its ``reward_funcs``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax import distributed
from rljax import sampling
from rljax import tokenizers as tok_lib
from rljax.models import reward_model as rm_lib
from rljax.models.hf_config import read_hf_config

PREFIX = "model:"
"""The ``rewards.names`` prefix of the reward kind ``model``."""

RUN_SUBDIR = "reward_model"
"""Where a ``launch.train_reward_model`` run keeps its exported model."""

TOKEN_MODES = ("auto", "policy", "text")

_score = jax.jit(rm_lib.scores, static_argnames="config")


def is_model_reward(name: str) -> bool:
  return isinstance(name, str) and name.startswith(PREFIX)


def label(name: str) -> str:
  """The metric label of ``"model:<path>"``: the directory's name, with
  characters outside ``[A-Za-z0-9_.-]`` replaced by ``_``."""
  base = os.path.basename(os.path.normpath(name[len(PREFIX):])) or "model"
  return re.sub(r"[^A-Za-z0-9_.\-]", "_", base)


def resolve(path: str) -> str:
  """The reward model's Hugging Face directory of ``path`` (itself, or the
  ``reward_model/`` of a reward-model run).

  Raises:
    FileNotFoundError: naming what was looked for.
  """
  for directory in (path, os.path.join(path, RUN_SUBDIR)):
    if os.path.isfile(os.path.join(directory, "config.json")):
      return directory
  raise FileNotFoundError(
      f"rewards.names entry {PREFIX}{path}: neither {path}/config.json nor "
      f"{path}/{RUN_SUBDIR}/config.json exists; accepted: a Hugging Face "
      f"sequence-classification directory ({rm_lib.ARCHITECTURES}) or a run "
      "directory of launch.train_reward_model.")


def check(name: str) -> rm_lib.RewardModelConfig:
  """Reads the config of ``"model:<path>"`` (cheap: no weights), checked to
  be a scalar reward model."""
  directory = resolve(name[len(PREFIX):])
  config = rm_lib.reward_model_config_from_hf(
      read_hf_config(directory), source=os.path.join(directory, "config.json"))
  if config.num_labels != 1:
    raise ValueError(f"rewards.names entry {name!r}: the model has "
                     f"num_labels={config.num_labels}; a reward model has one "
                     "score (accepted: num_labels=1).")
  return config


def encode(tokenizer: Any, prompt: str, completion: str,
           chat_template: bool = False) -> list[int]:
  """The ids a reward model reads for one (prompt, completion).

  With ``chat_template`` (and a tokenizer that has one): a user turn and an
  assistant turn rendered by the template. Otherwise what the policy's
  rollouts hold after SFT (``sft.sft_arrays``): the prompt's ids
  (``encode_prompts``), the completion's ``encode`` and EOS. The reward-model
  trainer encodes its pairs with this too.
  """
  if chat_template and getattr(tokenizer, "chat_template", None) is not None:
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt},
         {"role": "assistant", "content": completion}],
        add_generation_prompt=False))
  return (tok_lib.encode_prompts(tokenizer, [prompt])[0]
          + tokenizer.encode(completion) + [tokenizer.eos_id])


def shares_tokenizer(policy_tokenizer: Any, directory: str,
                     policy_dir: str = "") -> bool:
  """Whether the reward model in ``directory`` has the policy's tokenizer:
  the same sentencepiece model bytes, or the same ``tokenizer.json`` /
  ``tokenizer.model`` file as the policy's checkpoint ``policy_dir``."""
  base = getattr(policy_tokenizer, "tokenizer", policy_tokenizer)
  serialized = getattr(base, "serialized", None)
  for name in ("tokenizer.json", "tokenizer.model"):
    theirs = os.path.join(directory, name)
    if not os.path.isfile(theirs):
      continue
    with open(theirs, "rb") as f:
      data = f.read()
    ours = os.path.join(policy_dir, name) if policy_dir else ""
    if ours and os.path.isfile(ours):
      with open(ours, "rb") as f:
        return f.read() == data
    if name == "tokenizer.model" and serialized is not None:
      return serialized == data
  return False


class ModelReward:
  """A reward model as a reward function (see the module docstring).

  Args:
    config, params: the reward model (``models.load_hf_reward_model``).
    tokenizer: the reward model's tokenizer (the text path).
    score_tokens: score the policy's tokens when the caller hands them over
      (the reward model has the policy's tokenizer).
    chat_template: render text through ``tokenizer``'s chat template when it
      has one.
    mesh: the params' mesh (text-path inputs are replicated on it); None:
      the default device.
    group: the run's processes (``distributed.ProcessGroup``). With
      several, each process is called with its own rows (its block of the
      batch): their ids are padded to the longest of every process's
      bucket, scored as one global batch on ``mesh`` and each process takes
      back its rows; a rollout handed over is the global one.
  """

  def __init__(self, config: rm_lib.RewardModelConfig, params: Any,
               tokenizer: Any, *, score_tokens: bool,
               chat_template: bool = True, mesh: Mesh | None = None,
               group: distributed.ProcessGroup | None = None):
    if config.num_labels != 1:
      raise ValueError(f"ModelReward: num_labels={config.num_labels}; a "
                       "reward model has one score (accepted: 1).")
    self.config, self.params, self.tokenizer = config, params, tokenizer
    self.reads_tokens = score_tokens
    self._chat = chat_template and getattr(tokenizer, "chat_template",
                                           None) is not None
    self._mesh = mesh
    self._group = group or distributed.ProcessGroup()
    if not self._group.single and mesh is None:
      raise ValueError("ModelReward with several processes needs the mesh.")

  def _values(self, tokens_BxT: Any, mask_BxT: Any) -> np.ndarray:
    """This process's rows' scores (float64; a non-finite one is inf)."""
    out = np.asarray(self._group.local_rows(_score(
        self.params, config=self.config, tokens_BxT=tokens_BxT,
        input_mask_BxT=mask_BxT)), np.float64)[:, 0]
    # Non-finite is a failed score (counted invalid), never "no reward".
    return np.where(np.isfinite(out), out, np.inf)

  def score_tokens(self, rollout: Any) -> np.ndarray:
    """``[N]`` scores of a rollout's ``prompt_tokens + completion_tokens``
    (``prompt_mask``, ``completion_mask``); what the evaluator calls when
    ``reads_tokens`` and it has the rollout. With several processes the
    rollout is the global batch and this process's rows come back."""
    tokens = jax.numpy.concatenate([rollout.prompt_tokens,
                                    rollout.completion_tokens], 1)
    mask = jax.numpy.concatenate([rollout.prompt_mask,
                                  rollout.completion_mask], 1)
    return self._values(tokens, mask)

  def encode(self, prompt: str, completion: str) -> list[int]:
    """The reward model's ids of one (prompt, completion): ``encode``."""
    return encode(self.tokenizer, prompt, completion, self._chat)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               **unused_fields: Any) -> np.ndarray:
    n = len(completions)
    if not n:
      return np.zeros(0)
    ids = [self.encode(p, c) for p, c in zip(prompts, completions)]
    group = self._group
    bucket = group.max_int(max(16, 1 << (max(len(i) for i in ids) - 1
                                         ).bit_length()))
    tokens, mask = sampling.pad_prompts(ids, (bucket,),
                                        self.tokenizer.pad_id)
    if not group.single:  # one global batch, each process's rows its block
      tokens, mask = (group.global_array(x, self._mesh) for x in (tokens,
                                                                  mask))
    elif self._mesh is not None:
      replicated = NamedSharding(self._mesh, PartitionSpec())
      tokens, mask = jax.device_put((tokens, mask), replicated)
    return self._values(tokens, mask)


ENSEMBLE_PREFIX = "ensemble:"
"""The ``rewards.names`` prefix of a reward-model ensemble:
``"ensemble:<path>,<path>,..."`` (``EnsembleReward``)."""

AGGREGATIONS = ("mean", "worst", "mean_minus_std")


def is_ensemble(name: str) -> bool:
  return isinstance(name, str) and name.startswith(ENSEMBLE_PREFIX)


def ensemble_members(name: str) -> list[str]:
  """The ``"model:<path>"`` entries of ``"ensemble:<path>,<path>,..."``.

  Raises:
    ValueError: naming the entry when it has fewer than two paths.
  """
  paths = [p.strip() for p in name[len(ENSEMBLE_PREFIX):].split(",")
           if p.strip()]
  if len(paths) < 2:
    raise ValueError(f"rewards.names entry {name!r}: an ensemble needs at "
                     f"least two reward models, comma-separated; got "
                     f"{len(paths)}.")
  return [PREFIX + p for p in paths]


def aggregate(scores_MxN: np.ndarray, aggregation: str, k: float
              ) -> np.ndarray:
  """One reward per row from ``M`` reward models' scores (Coste et al.
  2023, "Reward Model Ensembles Help Mitigate Overoptimization",
  https://arxiv.org/abs/2310.02743): ``"mean"``; ``"worst"`` (their
  worst-case optimisation, the minimum); ``"mean_minus_std"`` (mean
  minus ``k`` times the members' standard deviation, ``ddof=0``: an
  uncertainty penalty, as their uncertainty-weighted optimisation's
  variance). A row that any member failed to score (non-finite) is a
  failed score of the ensemble (inf: counted invalid)."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"rewards.ensemble.aggregation={aggregation!r}: "
                     f"accepted {AGGREGATIONS}.")
  scores = np.asarray(scores_MxN, np.float64)
  bad = ~np.all(np.isfinite(scores), axis=0)
  scores = np.where(np.isfinite(scores), scores, 0.0)
  if aggregation == "mean":
    out = scores.mean(0)
  elif aggregation == "worst":
    out = scores.min(0)
  else:
    out = scores.mean(0) - k * scores.std(0)
  return np.where(bad, np.inf, out)


class EnsembleReward:
  """Several reward models as one reward: each scores the batch
  (``ModelReward``), ``aggregate`` combines their scores. It reads the
  policy's tokens only when every member does."""

  def __init__(self, members: Sequence[ModelReward], aggregation: str,
               k: float = 1.0):
    aggregate(np.zeros((2, 1)), aggregation, k)  # checks the name
    self.members, self.aggregation, self.k = list(members), aggregation, k
    self.reads_tokens = all(m.reads_tokens for m in self.members)
    self.params = [m.params for m in self.members]

  def score_tokens(self, rollout: Any) -> np.ndarray:
    return aggregate(np.stack([m.score_tokens(rollout)
                               for m in self.members]),
                     self.aggregation, self.k)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               **fields: Any) -> np.ndarray:
    return aggregate(np.stack([m(prompts, completions, **fields)
                               for m in self.members]),
                     self.aggregation, self.k)


def load(name: str, *, policy_tokenizer: Any, policy_dir: str = "",
         mesh: Mesh | None = None, tokens: str = "auto",
         chat_template: bool = True, param_dtype: str | None = None,
         group: distributed.ProcessGroup | None = None) -> ModelReward:
  """The ``ModelReward`` of a ``rewards.names`` entry ``"model:<path>"``.

  Args:
    name: the entry.
    policy_tokenizer, policy_dir: the policy's tokenizer and checkpoint
      directory (``model.path``; empty for a trained sentencepiece one).
    mesh: where the params go (``models.reward_model.shardings``).
    tokens: ``"auto"`` scores the policy's tokens when the reward model has
      the policy's tokenizer (``shares_tokenizer``), else the text;
      ``"policy"`` always the tokens (its vocabulary must cover the
      policy's); ``"text"`` always the text.
    chat_template: the text path renders through the chat template.
    param_dtype: the params' dtype (None: the checkpoint's).
    group: the run's processes (``ModelReward``).
  """
  if tokens not in TOKEN_MODES:
    raise ValueError(f"rewards.models.tokens={tokens!r}: accepted "
                     f"{TOKEN_MODES}.")
  directory = resolve(name[len(PREFIX):])
  check(name)
  config, params = rm_lib.load_hf_reward_model(directory, mesh,
                                               param_dtype=param_dtype)
  same = (tokens == "policy" or tokens == "auto" and shares_tokenizer(
      policy_tokenizer, directory, policy_dir))
  if same:
    tok_lib.check_tokenizer_vocab(policy_tokenizer, config.decoder.vocab_size,
                                  directory)
    tokenizer = policy_tokenizer
  else:
    tokenizer = tok_lib.load_hf_tokenizer(directory)
    tok_lib.check_tokenizer_vocab(tokenizer, config.decoder.vocab_size,
                                  directory)
  return ModelReward(config, params, tokenizer, score_tokens=same,
                     chat_template=chat_template, mesh=mesh, group=group)
