"""Policy models: the decoder, its KV cache, configs and presets, parameter
creation, Hugging Face config and weights I/O, and reward models (a score
head on the decoder)."""

from rljax.models import lora
from rljax.models import reward_model
from rljax.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from rljax.models.lora import TARGETS as LORA_TARGETS
from rljax.models.lora import LoraConfig
from rljax.models.hf_config import (ARCHITECTURES, hf_config_from_model_config,
                                    infer_architecture, load_hf_config,
                                    model_config_from_hf, read_hf_config)
from rljax.models.hf_weights import (HFModel, copy_files, load_hf_checkpoint,
                                     load_hf_pretrained, save_hf_checkpoint)
from rljax.models.kv_cache import KVCache, LayerKV, init_cache
from rljax.models.paged_cache import PagedKVCache, init_paged_cache
from rljax.models.packing import Packing, pack_rows
from rljax.models.reward_model import (RewardModelConfig,
                                       load_hf_reward_model,
                                       save_hf_reward_model)
from rljax.models.scoring import map_row_chunks, sequence_logprobs
from rljax.models.params import (attach_base, count_params, init_adapters,
                                 init_params, param_logical_axes,
                                 param_shapes, param_shardings)
from rljax.models.transformer import (Decoder, attend, compute_logits,
                                      output_projection, positions_from_mask)

__all__ = [
    "PRESETS", "ModelConfig", "RopeScaling", "get_preset", "count_params",
    "LORA_TARGETS", "LoraConfig", "lora", "attach_base", "init_adapters",
    "init_params", "param_logical_axes", "param_shapes", "param_shardings",
    "Decoder", "KVCache", "LayerKV", "attend", "compute_logits", "init_cache",
    "PagedKVCache", "init_paged_cache",
    "map_row_chunks", "output_projection", "Packing", "pack_rows",
    "positions_from_mask",
    "sequence_logprobs",
    "ARCHITECTURES", "HFModel", "copy_files", "hf_config_from_model_config",
    "infer_architecture", "load_hf_checkpoint", "load_hf_config",
    "load_hf_pretrained", "model_config_from_hf", "read_hf_config",
    "save_hf_checkpoint", "reward_model", "RewardModelConfig",
    "load_hf_reward_model", "save_hf_reward_model",
]
