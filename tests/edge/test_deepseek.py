"""DeepSeek V3 as llama.cpp's deepseek2 and GLM-4.5 as its glm4moe (edge/deepseek.py), run in
llama.cpp (the edge extra, f32 KV cache, reference kernels) against distillax's forward: the
logits within the dense exports' tolerances and llama.cpp's KV-cached greedy decode token for
token equal to distillax's. What llama.cpp would compute differently is refused in one line.

Models: PEAKED random draws (a clear next token), a dense layer then layers of 8 experts of width
32 (top-2) in groups, sigmoid routing with the choice bias, scaled 2.5, a shared expert;
- deepseek2: tiny_deepseek_v3 with rotate-half RoPE (the export reorders the pairs llama.cpp
  turns), queries through the bottleneck, YaRN x4 with mscale 1 / 1 (llama.cpp's
  yarn_log_multiplier); 'lite': queries projected directly (q_lora_rank 0), interleaved RoPE;
- glm4moe: tiny_glm4_moe (partial RoPE, q/k/v biases, q/k norms). Quantized experts are
  tests/edge/test_moe.py's (qwen3moe: the same stacked experts).
"""

import numpy as np
import pytest

from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import gguf_architecture, write_gguf
from distillax.errors import UserError
from distillax.models.presets import get_preset
from tests.edge.helpers import IDS, VOCAB, greedy, logits
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {
    "deepseek2": get_preset("tiny_deepseek_v3", vocab_size=VOCAB, rope_interleaved=False),
    "deepseek2-lite": get_preset("tiny_deepseek_v3", vocab_size=VOCAB, q_lora_rank=0,
                                 rope_scaling_factor=None, rope_yarn_mscale=0.0,
                                 rope_yarn_mscale_all_dim=0.0),
    "glm4moe": get_preset("tiny_glm4_moe", vocab_size=VOCAB),
}
Q4_RULES = ((".*", "q4_0", "q8_0", None),)
PROMPT, NEW_TOKENS = IDS[:8], 16


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_cpp_runs_deepseek_and_glm_exports_and_decodes_the_same_tokens(tmp_path, name):
  model = random_model(CONFIGS[name], init=PEAKED)
  info = write_gguf(model, tmp_path / "m.gguf")
  assert info["architecture"] == name.split("-")[0]
  assert "blk.0.ffn_gate.weight" in info["types"] and "blk.1.exp_probs_b.bias" in info["types"]
  if name.startswith("deepseek2"):
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= set(info["types"])
  ours = logits(model, IDS)
  llm = gguf_runtime.load(tmp_path / "m.gguf")
  try:
    theirs = gguf_runtime.logits(llm, IDS)
    tokens = gguf_runtime.greedy(llm, PROMPT, NEW_TOKENS)
  finally:
    llm.close()
  delta = float(np.abs(theirs - ours).max())
  print(f"\n{name} f32: max |logit difference| vs llama.cpp {delta:.1e}")
  assert delta <= 1e-4
  assert np.abs(ours).max() > 5  # a logit scale that makes the tolerance meaningful
  expected, margin = greedy(model, PROMPT, NEW_TOKENS)
  assert tokens == expected and len(set(expected)) > NEW_TOKENS // 2
  assert margin > 10 * delta  # no near-tie decided a token


@pytest.mark.parametrize("name,change,says", [
    ("deepseek2", dict(norm_eps=1e-5), "llama.cpp's deepseek2 norms the latents with the "
                                       "layers' epsilon; norm_eps=1e-05 differs"),
    ("deepseek2", dict(rope_yarn_mscale=0.5), "llama.cpp's deepseek2 scales YaRN's cos/sin by "
                                              "1; rope_yarn_mscale=0.5 != "
                                              "rope_yarn_mscale_all_dim=1.0"),
    ("glm4moe", dict(rope_scaling_type="yarn", rope_scaling_factor=4.0),
     "llama.cpp applies yarn RoPE scaling only to the gpt-oss, olmo2 and deepseek2 "
     "architectures, not glm4moe"),
])
def test_what_llama_cpp_would_run_differently_is_refused_in_one_line(name, change, says):
  with pytest.raises(UserError) as raised:
    gguf_architecture(CONFIGS[name].replace(**change))
  assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_quantized_latent_expansion_is_refused(tmp_path):
  model = random_model(CONFIGS["deepseek2"], init=PEAKED)
  with pytest.raises(UserError, match="llama.cpp's deepseek2 stores attn/kv_b split"):
    write_gguf(model, tmp_path / "m.gguf", quant="q4_0", rules=Q4_RULES)
  assert not (tmp_path / "m.gguf").exists()
