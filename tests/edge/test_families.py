"""Gemma 3, Gemma 4, Qwen3.5 (and its MoE) and SmolLM3 students as GGUF (llama.cpp's gemma3,
gemma4, qwen35, qwen35moe and smollm3), run in llama.cpp (the edge extra, f32 KV cache, every
kernel path this CPU can force) against distillax's forward at the dense exports' tolerances:
the plain forward for f32, the QAT forward (q4_0 weights, q8_0 rows) for q4_0. What llama.cpp
fixes in code and a model would run differently is refused in one line.

Measured here (40 tokens, reference kernels), max |logit difference|:
  gemma3   f32 2.1e-4 (logit scale 3.9), q4_0 1.2e-6 (4.1), with llama.cpp's fp16 GELU table
           in distillax's forward (helpers.table_gelu; Gemma 2's f32 is 1.6e-4 the same way)
  gemma4   f32 2.3e-3 (logit scale 4.0; 1.3e-3 without keys as values), the GELU table in
           the MLPs and the per-layer input gates. That is the noise floor of this model, not a
           difference of the two: a 1e-7 to 3e-7 relative nudge of the GELU inputs moves
           distillax's own logits by 2e-4 to 1.7e-3 (its norms re-amplify whichever gate crosses
           an fp16 rounding point); hence f32's tolerance of 5e-3. q4_0 (QAT forward, without
           keys as values) agrees to 1.4e-6 (logit scale 3.7) at seed 0, where no rounding
           flips; at seed 1, and with keys as values, 0.049 and 0.02 to 0.057 at a few
           positions, exact at the others: the same noise, as a 1e-7 nudge of the QAT
           forward's q8_0 activations moves its own logits by 0.15 to 0.17.
  qwen35   f32 4.8e-6 (logit scale 12.4), q4_0 2.9e-6 (12.3) with linear_key_head_dim =
           linear_value_head_dim = 32 (at 16, a value head is half a q4_0 block and llama.cpp's
           value-head order regroups ssm_out's blocks: refused below). Without that reorder the
           f32 export differs by 0.23.
  qwen35moe f32 4.3e-6 (logit scale 6.6); q4_0 with linear head dims 32 and a shared expert
           64 wide (whole q4_0 blocks): 1.4e-6 (5.8) at seed 1; at seed 0 1.4e-6 at 39 of the
           40 positions and 0.024 at one, where no router is near a tie (the 2nd and 3rd expert
           probabilities differ by >= 5e-3 in every layer): a rounding flip, as gemma4's.
  smollm3  f32 4.8e-6 (logit scale 12.3), q4_0 3.8e-6
  gemma4 MoE (tiny_gemma4_moe: experts beside a dense MLP, keys as values) f32 6.8e-4 (logit
           scale 4.1); q4_0 median 1.2e-7 at seeds 0 and 1, with 0.025 and 0.040 at 2 and 4 of
           the 40 positions: the q8_0-activation noise of Gemma 4 with keys as values above.
The q4_0 runs were measured by hand (add them to the parametrize list below to rerun them):
their block path is the one test_llama_cpp's gemma2 and llama q4_0 runs hold, and they took 4 to
52 s each, with the machine's load deciding.
"""

import numpy as np
import pytest

from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import gguf_architecture, write_gguf
from distillax.errors import UserError
from distillax.models.config import FULL, SLIDING
from distillax.models.presets import get_preset
from tests.edge.helpers import VOCAB
from tests.edge.test_llama_cpp import run
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {
    # 5 sliding layers (window 8 < the 40 tokens, RoPE base 10k) then a global one at 1M with
    # linear x8 scaling; llama.cpp scales queries by head_dim at this size.
    "gemma3": get_preset("tiny_gemma3", vocab_size=VOCAB, query_pre_attn_scalar=None),
    # Every Gemma 4 part: per-layer inputs (32 wide: a q4_0 block), the last two layers on
    # earlier keys/values (llama.cpp's rule: the sliding one layer 1's, the full one layer 2's)
    # with double-wide MLPs, full layers 32 wide over 1 key/value head, their keys as values,
    # with proportional RoPE over a quarter of their pairs, value norms, layer scalars,
    # soft-cap 30, window 8.
    "gemma4": get_preset("tiny_gemma4", vocab_size=VOCAB, per_layer_input_dim=32,
                         layer_types=(SLIDING, SLIDING, FULL, SLIDING, FULL),
                         attention_k_eq_v=True, global_num_kv_heads=1),
    # Gemma 4's MoE block (the 26B-A4B's): 4 experts of width 32 (top-2) beside a dense MLP,
    # full layers on 1 key/value head, keys as values; sliding, sliding, full. Its experts run
    # by the dense reference dispatch (the transformers parity tests run ragged and tokamax).
    "gemma4_moe": get_preset("tiny_gemma4_moe", vocab_size=VOCAB, moe_impl="dense"),
    # Qwen3.5: three Gated DeltaNet layers (2 key heads, 4 value heads: llama.cpp's tiled value
    # heads matter) then one gated attention layer turning a quarter of head_dim (M-RoPE).
    "qwen35": get_preset("tiny_qwen35", vocab_size=VOCAB),
    # Qwen3.5-MoE: those layers with 4 experts of width 32 (top-2, renormalised) beside a shared
    # expert of width 48 whose output a sigmoid gate scales.
    "qwen35moe": get_preset("tiny_qwen35_moe", vocab_size=VOCAB),
    # SmolLM3's every-4th RoPE-free layer, at theta 50 so RoPE turns far within 40 tokens.
    "smollm3": get_preset("tiny", vocab_size=VOCAB, num_layers=4, rope_free_layers=(3,),
                          rope_theta=50.0),
}


@pytest.mark.parametrize("arch,quant,tolerance", [
    ("gemma3", "f32", 1e-3), ("gemma4", "f32", 5e-3), ("gemma4_moe", "f32", 5e-3),
    ("qwen35", "f32", 1e-4), ("qwen35moe", "f32", 1e-4), ("smollm3", "f32", 1e-4)])
def test_newer_families_match_llama_cpp(tmp_path, arch, quant, tolerance):
  assert gguf_architecture(CONFIGS[arch]) == arch.split("_")[0]
  model = random_model(CONFIGS[arch], init=PEAKED)
  kernels = gguf_runtime.kernel_paths()
  r = run(model, tmp_path / "m.gguf", quant, llama_cpp_gelu=arch.startswith("gemma"),
          kernels=kernels)
  for path in kernels:
    delta = float(np.abs(r[path]["logits"] - r["distillax"]).max())
    print(f"\n{arch} {quant} {path}: max |dlogit| llama.cpp vs distillax {delta:.1e} (logit "
          f"scale {np.abs(r['distillax']).max():.1f})")
    assert delta <= tolerance, path


@pytest.mark.parametrize("changes,says", [
    ({"sliding_window_pattern": 2}, "slides five layers in six"),
    ({"rope_local_theta": 20_000.0}, "base 10000"),
    ({"query_pre_attn_scalar": 24.0}, r"scales queries by 16\*\*-0.5"),
])
def test_what_llama_cpps_gemma3_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["gemma3"].replace(**changes))


@pytest.mark.parametrize("changes,says", [
    # The preset's own layers: its sharing sliding layer reads layer 2 in distillax, layer 1 (a
    # full layer, so llama.cpp aborts) in llama.cpp.
    ({"layer_types": get_preset("tiny_gemma4").layer_types},
     "sliding layer the keys/values of layer 1 .* layer 3 of this model reads layer 2's"),
    ({"per_layer_input_vocab_size": 128}, "per_layer_input_vocab_size=128 cannot be stored"),
    ({"rope_local_theta": None}, "set rope_local_theta"),
])
def test_what_llama_cpps_gemma4_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["gemma4"].replace(**changes))


def test_what_llama_cpps_qwen35_stores_otherwise_is_refused(tmp_path):
  with pytest.raises(UserError, match="linear_value_head_dim=32 cannot be stored"):
    gguf_architecture(CONFIGS["qwen35"].replace(linear_value_head_dim=32))
  model = random_model(CONFIGS["qwen35"], init=PEAKED)
  with pytest.raises(UserError, match=r"layers/0/attn/o as q4_0 would hold blocks of 32"):
    write_gguf(model, tmp_path / "m.gguf", quant="q4_0")
  assert not (tmp_path / "m.gguf").exists()


def test_what_llama_cpps_smollm3_runs_otherwise_is_refused():
  with pytest.raises(UserError, match=r"every 4th layer \[3\]"):
    gguf_architecture(CONFIGS["smollm3"].replace(rope_free_layers=(1,)))
