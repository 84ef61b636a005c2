"""Small type aliases shared across rljax.

Only names that several modules use live here; a module's private types stay
in that module. Nothing here imports from the rest of rljax.
"""

from __future__ import annotations

from typing import Literal

import jax

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PRNGKey = jax.Array  # A typed key from `jax.random.key`, or a legacy uint32[2].
Scalar = jax.Array  # A 0-d array.

# A flat mapping of metric name to 0-d array, returned by every `*_metrics`
# helper and safe to `jax.device_get` and write out as-is.
Metrics = dict[str, jax.Array]

# How a per-token loss is reduced to a scalar (see `objectives.aggregate_loss`).
Aggregation = Literal[
    "token_mean",
    "sequence_mean_token_mean",
    "sequence_mean_token_sum",
    "sequence_mean_token_sum_norm",
    "token_sum",
    "sequence_mean_token_scale",
]

# Whether an importance weight is taken per token or per sequence.
ImportanceLevel = Literal["token", "sequence"]
