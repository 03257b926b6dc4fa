"""Llama/Gemma-family decoders with logical axes, sharded creation, HF weights, sampling.

`distillax.models.hf.checkpoint` (safetensors import/export) is imported on demand: `from distillax.models
import hf`.
"""

from distillax.models.attention.layer import KVCache
from distillax.models.config import TransformerConfig
from distillax.models.presets import PRESETS, get_preset, preset_names
from distillax.models.init import (abstract_model, create_model, model_shardings, param_count,
                                   resolve_rules)
from distillax.models.sampler import GenerationOutput, Sampler, SamplingConfig, generate
from distillax.models.transformer import (ModelOutput, Transformer, layer_params, with_config,
                                          with_layer_layout)
