"""Training: train state, jitted RL/SFT steps, the host loop, evaluation."""

from rljax.train.algorithms import (ADVANTAGES, IS_CORRECTIONS, OBJECTIVES,
                                    advantage_transform, coefficient_transform,
                                    optimizer)
from rljax.train.evaluation import evaluate, group_metrics
from rljax.train.loop import run, validate
from rljax.train.policy import Policy, load_policy
from rljax.train.steps import (RLBatch, RLStepConfig, TrainState, make_rl_step,
                               make_sft_step)

__all__ = [
    "ADVANTAGES", "IS_CORRECTIONS", "OBJECTIVES", "advantage_transform",
    "coefficient_transform", "optimizer", "evaluate", "group_metrics", "run",
    "validate", "Policy", "load_policy", "RLBatch", "RLStepConfig", "TrainState", "make_rl_step",
    "make_sft_step",
]
