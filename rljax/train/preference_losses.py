"""The table of preference losses ``preference.loss`` accepts, and their
checks (``build.validate``); ``rljax/train/preference.py`` trains them and
``docs/preference.md`` lists them (``tests/test_preference.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from rljax.objectives import preference as pref_lib


@dataclasses.dataclass(frozen=True)
class PreferenceEntry:
  """One name ``preference.loss`` accepts.

  Attributes:
    summary: one line for the docs' table.
    reference: whether the loss reads a reference model.
    unpaired: KTO: each completion is labelled on its own.
    loss: ``fn(logprobs, **settings) -> (loss, metrics)`` (paired), or
      ``objectives.preference.kto_loss``'s signature (unpaired).
    settings: the ``preference.*`` fields it reads.
    paper: the citation.
  """

  summary: str
  reference: bool
  unpaired: bool
  loss: Callable[..., Any]
  settings: tuple[str, ...]
  paper: str


PREFERENCE_LOSSES: dict[str, PreferenceEntry] = {
    "dpo": PreferenceEntry(
        "DPO; with preference.label_smoothing > 0 conservative DPO (cDPO)",
        True, False, pref_lib.dpo_loss,
        ("beta", "label_smoothing", "nll_coef"),
        "Rafailov et al. 2023, arXiv:2305.18290; Mitchell 2023 (cDPO)"),
    "robust_dpo": PreferenceEntry(
        "robust DPO: unbiased under label flips of rate "
        "preference.label_smoothing", True, False, pref_lib.robust_dpo_loss,
        ("beta", "label_smoothing", "nll_coef"),
        "Chowdhury et al. 2024, arXiv:2403.00409"),
    "ipo": PreferenceEntry(
        "IPO: squared distance of the length-normalised log-ratio margin "
        "to 1 / (2 beta)", True, False, pref_lib.ipo_loss,
        ("beta", "nll_coef"), "Azar et al. 2023, arXiv:2310.12036"),
    "simpo": PreferenceEntry(
        "SimPO: reference-free, length-normalised, target margin "
        "preference.simpo_gamma", False, False, pref_lib.simpo_loss,
        ("beta", "simpo_gamma", "label_smoothing", "nll_coef"),
        "Meng et al. 2024, arXiv:2405.14734"),
    "orpo": PreferenceEntry(
        "ORPO: the chosen side's NLL plus beta times the odds-ratio term, "
        "no reference", False, False, pref_lib.orpo_loss, ("beta",),
        "Hong et al. 2024, arXiv:2403.07691"),
    "kto": PreferenceEntry(
        "KTO: unpaired desirable / undesirable completions against the "
        "batch's KL reference point", True, True, pref_lib.kto_loss,
        ("beta", "desirable_weight", "undesirable_weight"),
        "Ethayarajh et al. 2024, arXiv:2402.01306"),
}


def entry(name: str) -> PreferenceEntry:
  """The entry of ``preference.loss=name``; a clear error otherwise."""
  if name not in PREFERENCE_LOSSES:
    raise ValueError(f"preference.loss={name!r}: accepted '' (RL) or one of "
                     f"{tuple(PREFERENCE_LOSSES)}.")
  return PREFERENCE_LOSSES[name]


def loss_settings(name: str, p: Any) -> dict[str, float]:
  """The keyword settings of ``name``'s loss from ``preference.*``."""
  rename = {"simpo_gamma": "gamma"}
  return {rename.get(f, f): float(p[f]) for f in entry(name).settings}


def validate(config: Any) -> None:
  """The ``preference.*`` checks beyond each field's range (before any
  compile)."""
  p = config.preference
  if not p.loss:
    return
  e = entry(p.loss)
  if p.loss == "robust_dpo" and not p.label_smoothing < 0.5:
    raise ValueError(f"preference.label_smoothing={p.label_smoothing!r} with "
                     "preference.loss='robust_dpo': accepted [0, 0.5) (it "
                     "divides by 1 - 2 eps).")
  if p.reference and not e.reference:
    raise ValueError(f"preference.reference={p.reference!r} with "
                     f"preference.loss={p.loss!r}, which reads no reference "
                     "model; accepted: preference.reference=''.")
  if p.reference and not os.path.exists(p.reference):
    raise ValueError(f"preference.reference={p.reference!r} does not exist; "
                     "accepted: '' (the policy as the run starts) or an rljax "
                     "run directory or Hugging Face checkpoint directory.")
  if p.reference and config.model.lora.rank:
    raise ValueError(f"preference.reference={p.reference!r} with "
                     f"model.lora.rank={config.model.lora.rank}: a LoRA run's "
                     "reference is its frozen base; accepted: "
                     "preference.reference=''.")
  if not p.online and p.online_top_fraction != 1.0:
    raise ValueError(
        f"preference.online_top_fraction={p.online_top_fraction!r} with "
        "preference.online=False: it keeps the online pairs with the largest "
        "score gaps, and offline pairs have no scores; accepted: 1.0, or "
        "preference.online=True.")
  if p.online and p.precompute_reference:
    raise ValueError("preference.precompute_reference=True with "
                     "preference.online=True: online pairs are sampled anew "
                     "each step, so there is nothing to compute ahead; "
                     "accepted: one or the other.")
  if p.online:
    need = max(config.sampler.prompt_buckets) + config.sampler.max_new_tokens
    if p.max_length < need:
      raise ValueError(
          f"preference.max_length={p.max_length} with preference.online="
          f"True: a sampled row is up to the longest prompt bucket "
          f"({max(config.sampler.prompt_buckets)}) plus "
          f"sampler.max_new_tokens ({config.sampler.max_new_tokens}) "
          f"tokens; accepted: >= {need}.")
  if config.rl.max_staleness or config.rl.sampler_devices:
    raise ValueError(
        "preference.loss is set with rl.max_staleness="
        f"{config.rl.max_staleness} / rl.sampler_devices="
        f"{config.rl.sampler_devices}: preference training samples nothing "
        "while it trains; accepted: 0 for both.")


__all__ = ["PREFERENCE_LOSSES", "PreferenceEntry", "entry", "loss_settings",
           "validate"]
