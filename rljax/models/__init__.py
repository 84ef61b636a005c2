"""Policy models: the decoder, its configs and presets, parameter creation."""

from rljax.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from rljax.models.hf import (HFModel, hf_config_from_model_config,
                             load_hf_checkpoint, load_hf_config,
                             load_hf_pretrained, model_config_from_hf,
                             save_hf_checkpoint)
from rljax.models.scoring import sequence_logprobs
from rljax.models.params import (count_params, init_params, param_logical_axes,
                                 param_shapes, param_shardings)
from rljax.models.transformer import (Decoder, KVCache, LayerKV, attend,
                                      compute_logits, init_cache,
                                      output_projection, positions_from_mask)

__all__ = [
    "PRESETS", "ModelConfig", "RopeScaling", "get_preset", "count_params",
    "init_params", "param_logical_axes", "param_shapes", "param_shardings",
    "Decoder", "KVCache", "LayerKV", "attend", "compute_logits", "init_cache",
    "output_projection", "positions_from_mask", "sequence_logprobs",
    "HFModel", "hf_config_from_model_config", "load_hf_checkpoint",
    "load_hf_config", "load_hf_pretrained", "model_config_from_hf",
    "save_hf_checkpoint",
]
