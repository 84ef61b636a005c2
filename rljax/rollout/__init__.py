"""The rollout engine: prompts and episodes in, scored batches out
(docs/rollouts.md, docs/architecture.md).

A layer below ``rljax.train``, which it imports nothing of: the trainer
hands it a sampler (the policy function), its sampling needs and a
postprocess callback (``collector.Postprocess``; the trainer's is
``rljax.train.Postprocessor``).

* ``Collector`` (``collector.py``): one batch, prompts -> rollout -> rewards
  ``[N, R]`` -> the trainer's batch; it feeds prompts through selection,
  replay and allocation (``allocated.py``), and merges sampled rounds
  (``rounds.py``).
* Plans: the static batch (``rljax.sampling``), slots refilled as rows end
  with or without carrying unfinished groups (``partial.SlotRollouts``),
  and multi-turn episodes, on the static batch or on slots
  (``multi_turn.MultiTurnSampler``; ``episodes.py``, ``observations.py``).
* Schedules (``schedules.py``): when a batch is sampled relative to the
  updates, synchronous or up to ``k`` versions ahead.

Environments themselves (``rljax.envs``) import no JAX.
"""

from rljax.rollout import allocated, rounds, schedules
from rljax.rollout.collector import Collected, Collector, Postprocess
from rljax.rollout.episodes import Episodes
from rljax.rollout.multi_turn import MultiTurnSampler, TurnConfig
from rljax.rollout.observations import ObservationFormat
from rljax.rollout.partial import PartialConfig, SlotRollouts
from rljax.rollout.rounds import Sampled, scored_rows
from rljax.rollout.schedules import OffPolicy, Schedule, Synchronous

__all__ = [
    "Collected", "Collector", "Episodes", "MultiTurnSampler",
    "ObservationFormat", "OffPolicy", "PartialConfig", "Postprocess",
    "Sampled", "Schedule", "SlotRollouts", "Synchronous", "TurnConfig",
    "allocated", "rounds", "schedules", "scored_rows",
]
