"""Rollout sampling: KV cache, prefill + decode loop, sampling methods, tree
rollouts (TreePO's and LATR's) and the static batch on a paged KV cache."""

from rljax.models.kv_cache import KVCache, LayerKV, init_cache
from rljax.sampling.methods import (SamplingMethod, apply_temperature,
                                    inverse_cdf_sample, min_p,
                                    sample_tokens, top_k, top_p)
from rljax.sampling.jitting import make_sampler
from rljax.sampling.sampler import (Rollout, SamplerConfig,
                                    pad_prompts, pick_bucket, sample,
                                    segment_ends, shrink_levels)
from rljax.sampling.speculative import Draft, make_speculative_sampler
from rljax.sampling.drafts import DraftStore, Speculation
from rljax.sampling.paged import PagedConfig, make_paged_sampler
from rljax.sampling.tree import TreeConfig, make_tree_sampler
from rljax.sampling.latr import LatrConfig, make_latr_sampler

__all__ = [
    "KVCache", "LayerKV", "init_cache", "SamplingMethod", "apply_temperature",
    "inverse_cdf_sample",
    "min_p", "sample_tokens", "top_k", "top_p", "Rollout", "SamplerConfig",
    "make_sampler", "pad_prompts", "pick_bucket", "sample", "segment_ends",
    "shrink_levels",
    "Draft", "DraftStore", "Speculation", "make_speculative_sampler",
    "PagedConfig", "make_paged_sampler", "TreeConfig", "make_tree_sampler",
    "LatrConfig", "make_latr_sampler",
]
