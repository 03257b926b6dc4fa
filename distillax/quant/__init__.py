"""Quantization numerics, as transforms of a student model (the step does not change).

  QuantConfig / QuantRule       ordered (module_path regex, weight_qtype, act_qtype, tile_size)
  quantize_for_training         QAT: fake-quantized forward, straight-through backward, same state
  full_precision, check_swappable   the delayed start (`start_step`) swaps GraphDefs, not state
  quantize_post_training        PTQ baseline: weights rounded once (+ activation rounding)
  apply_lora / merge_lora       LoRA adapters (LoRAParam, trainable=LoRAParam); base_qtype: QLoRA
  save_adapters / load_adapters the adapters alone, safetensors
  with_lora_dropout             the training objective with adapter dropout keyed by the step rng
  export_quantized / load_quantized / size_report   integer weights + scales, safetensors + JSON
  int8_model / Int8Weight       a frozen model (teacher.int8) whose matmuls run int8 x int8 ->
                                int32: int8 codes + per-channel scales, inputs rounded per token

Built on qwix's numerics (`qwix.quantize` / `dequantize`) and its interception of `jnp.einsum`;
see intercept.py for why its QtProvider matmul is not used. GGUF files and llama.cpp, which run
these numerics on a device, are distillax.edge (a floor above: nothing here imports it).
"""

from distillax.quant.config import (ACT_QTYPES, INT4_INT8_RULES, WEIGHT_QTYPES, QuantConfig,
                                    QuantRule)
from distillax.quant.export import (export_quantized, format_size_report, load_quantized,
                                    size_report)
from distillax.quant.fakequant import QuantSiteParam, WeightQuant
from distillax.quant.int8_model import Int8Weight, int8_model
from distillax.quant.lora import (LoRAParam, LoRAWeight, apply_lora, load_adapters, lora_dropout,
                                  merge_lora, save_adapters, with_lora_dropout)
from distillax.quant.qat import (check_swappable, full_precision, quantize_for_training,
                                 quantize_post_training)
from distillax.quant.sites import MatmulSite, find_matmul_sites
from distillax.quant.weights import QuantizedValue, QuantizedWeight

__all__ = [
    "ACT_QTYPES", "INT4_INT8_RULES", "WEIGHT_QTYPES", "QuantConfig", "QuantRule", "export_quantized",
    "format_size_report", "load_quantized", "size_report", "QuantSiteParam",
    "WeightQuant", "LoRAParam", "LoRAWeight", "apply_lora", "load_adapters", "lora_dropout",
    "merge_lora", "save_adapters", "with_lora_dropout", "check_swappable", "full_precision",
    "quantize_for_training", "quantize_post_training", "MatmulSite", "find_matmul_sites",
    "QuantizedValue", "QuantizedWeight", "Int8Weight", "int8_model",
]
