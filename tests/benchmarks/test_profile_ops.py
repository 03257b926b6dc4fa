"""scripts/profile_ops.py sorts a profiled step's ops into parts by the source line JAX
recorded: QAT's rounding and the quantized matmuls (distillax/quant) have parts of their own,
so a QAT or QLoRA profile says what the quantization costs."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _profile_ops():
  spec = importlib.util.spec_from_file_location(
      "profile_ops", os.path.join(ROOT, "scripts", "profile_ops.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quant_ops_have_their_own_parts():
  part_of = _profile_ops().part_of
  rounding = {"Framework op name": "jit(train_step)/jvp()/while/body/closed_call/round",
              "Source Info": "/work/distillax/models/layers.py:80 "
                             "/work/distillax/quant/ggml.py:212"}
  int8_dot = {"Framework op name": "jit(train_step)/transpose(jvp())/while/body/rematted_"
                                   "computation/BLD,DF->BLF/dot_general",
              "Source Info": "/work/distillax/quant/int8_train.py:57"}
  mlp = {"Framework op name": "jit(train_step)/jvp()/while/body/BLD,DF->BLF/dot_general",
         "Source Info": "/work/distillax/models/layers.py:80"}
  assert part_of(rounding) == ("quantization: rounding, int8 codes, nf4 dequantization "
                               "(quant/)", "forward")
  assert part_of(int8_dot) == ("quantized / adapted matmuls (quant/)", "remat")
  assert part_of(mlp) == ("MLP matmuls", "forward")
  keep_mask = {"Framework op name": "jit(train_step)/transpose(jvp())/while/body/checkpoint/"
                                    "rematted_computation/stack",
               "Source Info": "/work/distillax/quant/lora.py:187 "
                              "/work/distillax/quant/keep_mask.py:44"}
  assert part_of(keep_mask) == ("LoRA dropout keep masks (quant/keep_mask.py)", "remat")
