"""Mixture-of-experts students as GGUF: Qwen3-MoE as llama.cpp's qwen3moe, Mixtral as its llama
and gpt-oss as its gpt-oss (experts stacked in ffn_{gate,up,down}_exps, the router in
ffn_gate_inp, f32; gpt-oss's sinks, biases, sliding layers and YaRN), run in
llama.cpp (the edge extra, f32 KV cache) against distillax's forward at the dense exports'
tolerances: the plain forward for f32 / f16, the QAT forward (q8_0 / q4_0 experts, q8_0 rows)
for q8_0 / q4_0. What llama.cpp would compute differently is refused in one line.

Measured here (40 tokens, logit scale ~6.6, reference kernels), max |logit difference| (q8_0
by hand; the test holds the others):
  qwen3moe  f32 3.1e-6, f16 7.5e-3, q8_0 1.7e-6 (0.14 vs full precision), q4_0 1.9e-6 (4.6)
  mixtral   f32 3.1e-6, q4_0 1.4e-6 (3.1 vs full precision)
  gpt-oss   f32 3.1e-6, q4_0 1.9e-6 (2.7 vs full precision), with rope_yarn_truncate=True;
            gpt-oss's own truncate=False differs by 9.9e-4 (f32) and 0.11 (q4_0): refused
"""

import gguf
import numpy as np
import pytest

from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import gguf_architecture, write_gguf
from distillax.errors import UserError
from distillax.models.presets import get_preset
from distillax.quant import quantize_for_training
from tests.edge.helpers import IDS, VOCAB, field, greedy, logits
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {  # 2 layers, 4 experts of width 32, top 2
    "qwen3moe": get_preset("tiny_moe", vocab_size=VOCAB, router="softmax_topk",
                           norm_topk_prob=True, qk_norm=True),
    "mixtral": get_preset("tiny_moe", vocab_size=VOCAB),
    # Sinks, q/k/v/o biases, router and expert biases, clamped SwiGLU, sliding even layers
    # (window 8 < the 40 tokens), YaRN with the ramp ends rounded as llama.cpp rounds them.
    "gpt-oss": get_preset("tiny_gpt_oss", vocab_size=VOCAB, rope_yarn_truncate=True),
}
ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama", "gpt-oss": "gpt-oss"}
QAT_RULES = {"q8_0": ((".*", "q8_0", "q8_0", None),), "q4_0": ((".*", "q4_0", "q8_0", None),)}
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "q8_0": 1e-3, "q4_0": 1e-3}  # the dense exports'
PROMPT, NEW_TOKENS = IDS[:8], 24


@pytest.fixture(scope="module")
def models():
  return {arch: random_model(config, init=PEAKED) for arch, config in CONFIGS.items()}


def _llama_cpp(path, generate=False):
  llm = gguf_runtime.load(path)
  try:
    out = gguf_runtime.logits(llm, IDS)
    return (out, gguf_runtime.greedy(llm, PROMPT, NEW_TOKENS)) if generate else (out, None)
  finally:
    llm.close()


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "f32"), ("qwen3moe", "f16"),
                                        ("qwen3moe", "q4_0"),  # q8_0: same path, by hand
                                        ("mixtral", "f32"), ("mixtral", "q4_0"),
                                        ("gpt-oss", "f32"), ("gpt-oss", "q4_0")])
def test_llama_cpp_runs_moe_exports_within_the_dense_tolerances(models, tmp_path, arch, quant):
  model, rules = models[arch], QAT_RULES.get(quant)
  info = write_gguf(model, tmp_path / "m.gguf", quant=quant, rules=rules)
  assert info["architecture"] == ARCH[arch]
  assert info["types"]["blk.1.ffn_gate_inp.weight"] == "f32"  # the router: full precision
  assert info["types"]["blk.1.ffn_down_exps.weight"] == quant
  if arch == "gpt-oss":  # llama.cpp loads only when every tensor it reads is there
    assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias"} <= set(info["types"])
  reference = quantize_for_training(model, {"rules": rules}) if rules else model
  ours = logits(reference, IDS)
  generate = quant == "q4_0" and arch == "qwen3moe"
  theirs, tokens = _llama_cpp(tmp_path / "m.gguf", generate)
  assert np.abs(theirs - ours).max() <= TOLERANCE[quant]
  assert np.abs(ours).max() > 5  # a logit scale that makes the tolerance meaningful
  if rules:  # llama.cpp computes the rounded model, not the full-precision one
    assert np.abs(theirs - logits(model, IDS)).max() > 20 * TOLERANCE[quant]
  if generate:  # llama.cpp's KV-cached decode, token by token
    expected, margin = greedy(reference, PROMPT, NEW_TOKENS)
    assert tokens == expected and len(set(expected)) > NEW_TOKENS // 2
    # No near-tie decided it: every step's top-1 lead dwarfs the runtimes' logit difference.
    assert margin > 100 * np.abs(theirs - ours).max()


def test_the_experts_are_stacked_tensors_with_the_moe_keys(models, tmp_path):
  config = CONFIGS["qwen3moe"]
  write_gguf(models["qwen3moe"], tmp_path / "m.gguf")
  reader = gguf.GGUFReader(tmp_path / "m.gguf")
  for key, value in (("expert_count", 4), ("expert_used_count", 2),
                     ("expert_feed_forward_length", 32), ("feed_forward_length", 32)):
    assert field(reader, f"qwen3moe.{key}") == value, key
  shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # ne0 first
  D, F, E = config.embed_dim, config.expert_mlp_dim, config.num_experts
  assert shapes["blk.0.ffn_gate_inp.weight"] == (D, E)
  assert shapes["blk.0.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == (D, F, E)
  assert shapes["blk.0.ffn_down_exps.weight"] == (F, D, E)
  # Expert 2's down projection, row-major [embed, expert_ff]: our (F, D) matrix transposed.
  down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
  ours = np.asarray(models["qwen3moe"].layers[0].mlp.down[...])
  np.testing.assert_array_equal(np.asarray(down.data).reshape(E, D, F)[2], ours[2].T)


@pytest.mark.parametrize("change,says", [
    (dict(norm_topk_prob=False), "llama.cpp's qwen3moe renormalises the top-k router weights; "
                                 "norm_topk_prob=False would run differently there (set it to "
                                 "True)"),
    (dict(moe_capacity_factor=1.25), "llama.cpp runs every expert dropless; moe_capacity_factor="
                                     "1.25 drops tokens in this model (set it to None)"),
    (dict(rope_yarn_truncate=False), "llama.cpp floors and ceils the ends of YaRN's ramp; "
                                     "rope_yarn_truncate=False (gpt-oss's own setting) runs "
                                     "differently there (max |logit difference| 1e-3 on a tiny "
                                     "model, 0.11 at q4_0): train the student with "
                                     "--config.model.rope_yarn_truncate=True to deploy it in "
                                     "llama.cpp"),
    (dict(swiglu_limit=6.0), "llama.cpp's gpt-oss clamps its SwiGLU with alpha 1.702 and limit "
                             "7.0; swiglu_alpha=1.702, swiglu_limit=6.0 would run differently "
                             "there"),
])
def test_what_llama_cpp_would_run_differently_is_refused_in_one_line(change, says):
  arch = "gpt-oss" if "rope_yarn_truncate" in change or "swiglu_limit" in change else "qwen3moe"
  with pytest.raises(UserError) as raised:
    gguf_architecture(CONFIGS[arch].replace(**change))
  assert str(raised.value) == says
