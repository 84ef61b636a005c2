"""Training: the Algorithm, config -> components, rollouts, steps, the loop.

The parts a researcher recomposes (DESIGN.md section 2):

* ``Algorithm`` (``algorithm.py``): advantage chain, coefficient chain,
  optimizer and what sampling they need; ``algorithm_from_config`` builds
  one from config names.
* ``build`` (``build.py``): the only reader of a ConfigDict; ``build(config)``
  returns ``Components``.
* ``Collector`` (``rollout.py``): prompts -> Rollout -> rewards [N, R] ->
  advantages -> ``RLBatch``.
* ``make_rl_step`` / ``jit_rl_step`` (``steps.py``), ``run_sft`` (``sft.py``).
* ``critic`` (``critic.py``): PPO's value model, GAE's values and the
  clipped value loss; ``distill`` (``distill.py``): on-policy distillation's
  teacher and its per-token reverse-KL advantage.
* ``run`` (``loop.py``): the synchronous loop with resume, evaluation,
  checkpoints and signals.
"""

from rljax.train import build, critic, distill
from rljax.train.algorithm import (ADVANTAGE_PRESETS, ADVANTAGE_TRANSFORMS,
                                   IS_CORRECTIONS, OBJECTIVES, Algorithm,
                                   advantage_chain, coefficient_chain,
                                   optimizer)
from rljax.train.algorithm import from_config as algorithm_from_config
from rljax.train.build import Components, validate
from rljax.train.evaluation import evaluate, group_metrics
from rljax.train.loop import init_state, run
from rljax.train.policy import Policy, load_policy
from rljax.train.rollout import Collected, Collector, pivot_rows
from rljax.train.sft import SFTConfig, run_sft
from rljax.train.steps import (OLD_LOGPROBS, RLBatch, RLStepConfig, TrainState,
                               jit_rl_step, make_rl_step, make_sft_step,
                               mismatch_statistics)

__all__ = [
    "build", "critic", "distill", "ADVANTAGE_PRESETS", "ADVANTAGE_TRANSFORMS", "IS_CORRECTIONS",
    "OBJECTIVES", "Algorithm", "advantage_chain", "coefficient_chain",
    "optimizer", "algorithm_from_config", "Components", "validate",
    "evaluate", "group_metrics", "init_state", "run", "Policy", "load_policy",
    "Collected", "Collector", "pivot_rows", "SFTConfig", "run_sft",
    "OLD_LOGPROBS", "RLBatch", "RLStepConfig", "TrainState", "jit_rl_step",
    "make_rl_step", "make_sft_step", "mismatch_statistics",
]
