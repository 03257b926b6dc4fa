"""OLMo 3, Phi-3/4, Qwen3-Next and Llama 4 as GGUF (llama.cpp's olmo2, phi3, qwen3next and
llama4), run in llama.cpp (the edge extra, f32 KV cache, reference kernels) against distillax's
forward: the logits of 40 tokens, and greedy decoding token for token (llama.cpp's KV-cached
decode against distillax's full forward), with a top-1 margin that dwarfs the two runtimes'
logit difference. What llama.cpp fixes in code and a model would run differently is refused in
one line.

Measured here (40 tokens), max |logit difference| (logit scale):
  olmo2  f32 8.1e-6 (6.7), YaRN x8 on the full layer, its sliding layers unscaled; tied:
         4.3e-5 (35.2), the embedding written again as output.weight
  phi3   f32 5.7e-6 (12.4) with LongRoPE's long divisors, 3.8e-6 with the short ones. llama.cpp
         0.3.36 picks the set by its context size (n_ctx, rounded up to 256, past the original
         context: long), transformers and distillax by a forward's positions, so the two agree
         where both pick one set: 40 tokens past an original context of 32 (long), or an
         original context of 256 that n_ctx does not pass (short). With 64, llama.cpp's long
         set against distillax's short one differs by 0.18.
  qwen3next f32 5.2e-6 (5.8): DeltaNet layers stored grouped by key head (ssm_in, ssm_ba) in
         Hugging Face's value-head order, experts and a gated shared expert in every layer
  llama4 f32 5.7e-6 (9.1): RoPE-free 4th layer, q/k L2 norms, Llama 3.1 RoPE (rope_freqs), MoE
         in layers 1 and 3 beside dense ones. llama.cpp fixes chunks of 8192 and the temperature
         floor at 8192, so at 40 tokens neither acts here; the transformers parity test holds
         both (chunks of 4, floor 4).
"""

import numpy as np
import pytest

from distillax.edge.export import gguf_architecture
from distillax.errors import UserError
from distillax.models.presets import get_preset
from tests.edge.helpers import VOCAB
from tests.edge.test_llama_cpp import run
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {
    # OLMo 3: three sliding layers (window 8 < the 40 tokens, plain RoPE) then a full one with
    # YaRN x8 over 32 positions; base 50 so RoPE turns far within 40 tokens.
    "olmo2": get_preset("tiny_olmo3", vocab_size=VOCAB, rope_theta=50.0, rope_local_theta=50.0),
}
# Phi-4-mini: fused q/k/v and gate/up, RoPE over three quarters of each head, LongRoPE; untied so
# the PEAKED rows make a sequence. 40 tokens pass the original context of 32: the long divisors.
CONFIGS["phi3"] = get_preset("tiny_phi3", vocab_size=VOCAB, rope_theta=50.0,
                             tie_embeddings=False)
# An original context of 256 that neither the 40 tokens nor llama.cpp's context pass: the short.
CONFIGS["phi3_short"] = CONFIGS["phi3"].replace(rope_original_max_len=256, max_seq_len=256)
# Qwen3-Next: three Gated DeltaNet layers (2 key heads, 4 value heads) then a gated attention
# layer, 4 experts (top-2, renormalised) beside a gated shared expert in every layer; the dense
# reference dispatch (the transformers parity test runs ragged).
CONFIGS["qwen3next"] = get_preset("tiny_qwen3_next", vocab_size=VOCAB, moe_impl="dense")
# Llama 4: llama.cpp's own chunk size and temperature floor, Llama 3.1 RoPE over 32 positions.
CONFIGS["llama4"] = get_preset("tiny_llama4", vocab_size=VOCAB, attention_chunk_size=8192,
                               attn_temperature_floor_scale=8192, rope_theta=50.0,
                               rope_scaling_factor=8.0, rope_original_max_len=32,
                               moe_impl="dense")
SEEDS = {"qwen3next": 4}  # its greedy run's smallest top-1 margin: 0.023 (seed 0: 0.0015)
# Tied, the embedding is written a second time as llama.cpp's output.weight (a PEAKED tied model
# predicts each token itself, so its greedy run repeats one id: compared, not required to vary).
CONFIGS["olmo2_tied"] = CONFIGS["olmo2"].replace(tie_embeddings=True)


@pytest.mark.parametrize("name,tolerance", [("olmo2", 1e-4), ("olmo2_tied", 1e-4),
                                            ("phi3", 1e-4), ("phi3_short", 1e-4),
                                            ("qwen3next", 1e-4), ("llama4", 1e-4)])
def test_llama_cpp_runs_these_families_as_distillax_does(tmp_path, name, tolerance):
  arch = name.split("_")[0]
  assert gguf_architecture(CONFIGS[name]) == arch
  model = random_model(CONFIGS[name], seed=SEEDS.get(name, 0), init=PEAKED)
  r = run(model, tmp_path / "m.gguf", "f32", generate=True)
  delta = float(np.abs(r["llama_cpp"] - r["distillax"]).max())
  print(f"\n{name} f32: max |dlogit| llama.cpp vs distillax {delta:.1e} (logit scale "
        f"{np.abs(r['distillax']).max():.1f}); greedy margin {r['margin']:.3f}")
  assert np.abs(r["distillax"]).max() > 1.0 and delta <= tolerance
  assert r["reference"]["tokens"] == r["distillax_tokens"]
  if not model.config.tie_embeddings:
    assert len(set(r["distillax_tokens"])) > 8  # a sequence, not one repeated id
  assert r["margin"] > 100 * delta  # no near-tie decided it


@pytest.mark.parametrize("changes,says", [
    ({"head_dim": 32}, r"head_dim = embed_dim / num_heads = 16; head_dim=32 cannot be stored"),
    ({"sliding_window_pattern": 2}, "slides three layers in four"),
    ({"rope_local_theta": None}, "turns its sliding layers unscaled .* set rope_local_theta=50.0"),
    ({"rope_attention_factor": 1.5}, r"scales cos/sin by 0.1 ln\(factor\) \+ 1 = 1.207944"),
])
def test_what_llama_cpps_olmo2_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["olmo2"].replace(**changes))


def test_what_llama_cpps_phi3_stores_otherwise_is_refused():
  with pytest.raises(UserError, match=r"head_dim = embed_dim / num_heads = 16; head_dim=8"):
    gguf_architecture(CONFIGS["phi3"].replace(head_dim=8, partial_rotary_factor=1.0,
                                              rope_scaling_factor=None, rope_short_factors=None,
                                              rope_long_factors=None))
  with pytest.raises(UserError, match="attends over the whole context; sliding_window=8"):
    gguf_architecture(CONFIGS["phi3"].replace(sliding_window=8, sliding_window_pattern=0))


@pytest.mark.parametrize("changes,says", [
    ({"moe_layers": (0, 2, 3)}, r"qwen3next has experts in every layer; .*layers \[1\] have a"),
    ({"num_experts": 0, "shared_expert_mlp_dim": 0, "shared_expert_gate": False},
     "qwen3next runs routed experts in every layer; this model has none"),
    ({"norm_topk_prob": False}, "shared expert beside renormalised top-k experts"),
    ({"linear_value_head_dim": 8}, "one state size for Gated DeltaNet keys and values"),
])
def test_what_llama_cpps_qwen3next_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["qwen3next"].replace(**changes))


@pytest.mark.parametrize("changes,says", [
    ({"attention_chunk_size": 8}, r"attention_chunk_size=8 \(llama.cpp: 8192\)"),
    ({"attn_temperature_floor_scale": 8}, r"attn_temperature_floor_scale=8 \(llama.cpp: 8192\)"),
    ({"rope_free_layers": (1,)}, r"rope_free_layers=\(1,\) \(llama.cpp: \(3,\)\)"),
    ({"qk_l2_norm": False}, r"qk_l2_norm=False \(llama.cpp: True\)"),
    ({"moe_layers": (1, 2)}, r"moe_layers=\(1, 2\) \(llama.cpp: every k-th layer\)"),
])
def test_what_llama_cpps_llama4_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["llama4"].replace(**changes))
