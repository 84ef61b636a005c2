"""Training: the algorithm table, config -> components, rollouts, steps, the loop.

The parts a researcher recomposes (docs/architecture.md):

* ``table`` (``table.py``): every algorithm name a config accepts, one entry
  each (factory, fields, traits); ``schema`` (``schema.py``): every config
  field's default, range and meaning.
* ``Algorithm`` (``algorithm.py``): advantage chain, coefficient chain,
  optimizer and what sampling they need; ``algorithm_from_config`` builds
  one from config names.
* ``build`` (``build.py``): the only reader of a ConfigDict; ``build(config)``
  returns ``Components``.
* ``Postprocessor`` (``batch_layout.py``): what the trainer hands the
  rollout engine's ``rljax.rollout.Collector`` (prompts -> Rollout ->
  rewards [N, R] -> advantages -> ``RLBatch``).
* ``make_rl_step`` / ``jit_rl_step`` (``steps.py``): ``prepare_inputs`` and
  a sum of loss terms; ``run_sft`` and ``make_sft_step`` (``sft.py``).
* ``critic`` (``critic.py``): PPO's value model, GAE's values and the
  clipped value loss; ``distill`` (``distill.py``): on-policy distillation's
  per-token reverse-KL advantage (its teacher: ``policy.load_teacher``).
* ``run`` (``loop.py``): the synchronous loop, with ``session`` (set-up,
  resume, checkpoints, summary) and ``guards`` (signals, non-finite updates,
  failing rewards).
* ``load_policy`` (``policy.py``) reads a finished run back;
  ``export_policy`` (``export.py``) writes it as a safetensors file, a
  directory ``transformers`` loads (a LoRA run's adapters merged), or a LoRA
  run's adapters in ``peft``'s layout.
"""

from rljax.train import build, critic, distill, schema, table
from rljax.train.algorithm import (ADVANTAGE_PRESETS, ADVANTAGE_TRANSFORMS,
                                   IS_CORRECTIONS, OBJECTIVES, Algorithm,
                                   advantage_chain, coefficient_chain,
                                   optimizer)
from rljax.train.algorithm import from_config as algorithm_from_config
from rljax.train.build import Components, validate
from rljax.train.evaluation import evaluate, group_metrics
from rljax.train.export import Exported, export_policy
from rljax.train.loop import run
from rljax.train.policy import Policy, load_policy, load_teacher
from rljax.train.batch_layout import Postprocessor, pivot_rows
from rljax.train.sft import SFTConfig, make_sft_step, run_sft
from rljax.train.steps import (OLD_LOGPROBS, RLBatch, RLStepConfig,
                               StepInputs, TrainState, check_batch,
                               init_state,
                               jit_rl_step, make_rl_step, mismatch_statistics,
                               prepare_inputs)

__all__ = [
    "build", "critic", "distill", "schema", "table", "ADVANTAGE_PRESETS",
    "ADVANTAGE_TRANSFORMS", "IS_CORRECTIONS", "OBJECTIVES", "Algorithm",
    "advantage_chain", "coefficient_chain", "optimizer",
    "algorithm_from_config", "Components", "validate", "evaluate",
    "group_metrics", "Exported", "export_policy", "run", "Policy",
    "load_policy", "load_teacher",
    "Postprocessor", "pivot_rows", "SFTConfig", "make_sft_step",
    "run_sft", "OLD_LOGPROBS", "RLBatch", "RLStepConfig", "StepInputs",
    "TrainState", "check_batch", "init_state", "jit_rl_step", "make_rl_step",
    "mismatch_statistics", "prepare_inputs",
]
