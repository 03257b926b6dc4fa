"""Deployment: a trained student as a GGUF file, and what llama.cpp makes of it.

  gguf_export     write_gguf (f32 / f16 / q8_0 / q4_0, the QAT rules' blocks bit for bit) and
                  `distillax export --format gguf`
  gguf_vocab      distillax tokenizers as llama.cpp vocabularies (the same ids for the same text)
  gguf_runtime    a GGUF in llama.cpp (the edge extra): logits, greedy decode, tokenize, and
                  measure_in_subprocess (a child process with numpy and llama_cpp only)
  measurements    figures on distillax's own batches: validation loss over packed segments,
                  speed and memory in interleaved rounds, agreement with distillax's forward

The numerics these files carry (ggml's q8_0 / q4_0 rounding, fake quantization, the rules) are
quant/'s: this room imports them and quant/ never imports this room. Nothing is imported here,
so `distillax.edge.runtime` loads without JAX.
"""
