"""Reward functions: protocol, built-in verifiers, parallel evaluation.

Pure Python and numpy; nothing here imports JAX, so reward functions run in
light worker processes.

The protocol: ``reward_fn(prompts, completions, **example_fields) ->
list[float | None]``, batched, with example fields as lists aligned with the
batch. ``RewardEvaluator`` runs weighted ``RewardSpec``s in a process pool
with a per-call timeout and returns rewards ``[N, R]``, their total and
metrics; ``verifiers`` holds the built-in functions, ``parsing`` the
extraction helpers and the safe arithmetic evaluator.

Reward functions are user code and are isolated from the trainer: each
worker runs in its own process group (killed whole at a timeout, at
``close()`` and at exit, children included), under an optional memory limit,
and sends back only plain floats and status codes, never a pickle. Every
failure (exception, ``SystemExit``, timeout, death, unconvertible,
non-finite or out-of-float32-range value) is counted in the metrics and
never stops training; ``evaluation``'s docstring lists how each is counted.
"""

from rljax.rewards import parsing
from rljax.rewards import verifiers
from rljax.rewards.evaluation import batch_metrics
from rljax.rewards.evaluation import combine_rewards
from rljax.rewards.evaluation import merge_results
from rljax.rewards.evaluation import RewardEvaluator
from rljax.rewards.evaluation import RewardFn
from rljax.rewards.evaluation import RewardResult
from rljax.rewards.evaluation import reward_spec
from rljax.rewards.evaluation import RewardSpec
from rljax.rewards.parsing import evaluate_expression
from rljax.rewards.parsing import extract_boxed
from rljax.rewards.parsing import extract_final_answer
from rljax.rewards.parsing import extract_hash_answer
from rljax.rewards.parsing import extract_last_number
from rljax.rewards.parsing import extract_tag
from rljax.rewards.parsing import parse_number
from rljax.rewards.verifiers import arithmetic
from rljax.rewards.verifiers import check_countdown
from rljax.rewards.verifiers import countdown
from rljax.rewards.verifiers import exact_match
from rljax.rewards.verifiers import format_match
from rljax.rewards.verifiers import get_reward_fn
from rljax.rewards.verifiers import math_answer
from rljax.rewards.verifiers import numeric_match
from rljax.rewards.verifiers import REWARD_FNS

__all__ = [
    "REWARD_FNS",
    "RewardEvaluator",
    "RewardFn",
    "RewardResult",
    "RewardSpec",
    "arithmetic",
    "batch_metrics",
    "check_countdown",
    "combine_rewards",
    "countdown",
    "evaluate_expression",
    "exact_match",
    "extract_boxed",
    "extract_final_answer",
    "extract_hash_answer",
    "extract_last_number",
    "extract_tag",
    "format_match",
    "get_reward_fn",
    "math_answer",
    "merge_results",
    "numeric_match",
    "parse_number",
    "parsing",
    "reward_spec",
    "verifiers",
]
