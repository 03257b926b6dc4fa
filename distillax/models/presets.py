"""Named model configs: shapes small enough for the tests and the CPU demo, and the published
shapes of real checkpoints (config.json values only; nothing is downloaded)."""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import ConfigError
from distillax.models.config import FULL, LINEAR, SLIDING, TransformerConfig


def _llama3(**kw) -> TransformerConfig:
  base = dict(vocab_size=128_256, mlp_activation="swiglu", norm_eps=1e-5, rope_theta=500_000.0,
              rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_len=8192, max_seq_len=131_072, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _gemma(**kw) -> TransformerConfig:
  base = dict(vocab_size=256_000, mlp_activation="geglu", norm_eps=1e-6, norm_scale_plus_one=True,
              rope_theta=10_000.0, tie_embeddings=True, scale_embeddings=True, max_seq_len=8192,
              head_dim=256, scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _gemma2(**kw) -> TransformerConfig:
  return _gemma(use_post_norms=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                query_pre_attn_scalar=256.0, sliding_window=4096, sliding_window_pattern=2, **kw)


def _gemma3(**kw) -> TransformerConfig:
  # Gemma 3 config.json: q/k norms and post norms, no soft-caps, sliding layers 5:1 whose RoPE
  # base is 10k (unscaled), global layers at 1M (linear x8 from 4B up), vocabulary 262,144.
  base = dict(vocab_size=262_144, use_post_norms=True, qk_norm=True, sliding_window_pattern=6,
              rope_theta=1_000_000.0, rope_local_theta=10_000.0)
  return _gemma(**{**base, **kw})


def _smollm3(**kw) -> TransformerConfig:
  # SmolLM3 config.json: Llama with no RoPE in every 4th layer, RoPE base 5M, 64k context.
  base = dict(vocab_size=128_256, mlp_activation="swiglu", norm_eps=1e-6, rope_theta=5_000_000.0,
              head_dim=128, max_seq_len=65_536, tie_embeddings=True, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  free = tuple(i for i in range(base["num_layers"]) if (i + 1) % 4 == 0)
  return TransformerConfig(rope_free_layers=free, **base)


def _gemma4(**kw) -> TransformerConfig:
  """Gemma 4's text decoder (config.json's text_config): sliding layers (window 512, head_dim
  256, RoPE base 10k) and every n-th layer full (head_dim 512, proportional RoPE over a quarter
  of its pairs at 1M), per-layer inputs of width 256 from a second 262,144-row table, the last
  num_kv_shared_layers on earlier layers' keys/values, q/k and value norms, soft-cap 30. Layers
  stay unrolled (their shapes differ: no scan)."""
  base = dict(vocab_size=262_144, head_dim=256, global_head_dim=512, mlp_activation="geglu",
              norm_eps=1e-6, tie_embeddings=True, scale_embeddings=True, use_post_norms=True,
              qk_norm=True, value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0,
              final_logit_softcap=30.0, sliding_window=512, rope_theta=1_000_000.0,
              rope_local_theta=10_000.0, global_rope_fraction=0.25, per_layer_input_dim=256,
              max_seq_len=131_072, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _gpt_oss(**kw) -> TransformerConfig:
  # gpt-oss-20b / 120b config.json: biased q/k/v/o with sinks, sliding (128) then full layers,
  # YaRN x32 over 4096 (truncate off), 4 of E biased experts of width 2880 (clamped SwiGLU).
  base = dict(vocab_size=201_088, embed_dim=2880, num_heads=64, num_kv_heads=8, head_dim=64,
              mlp_dim=2880, norm_eps=1e-5, rope_theta=150_000.0, rope_scaling_type="yarn",
              rope_scaling_factor=32.0, rope_original_max_len=4096, rope_yarn_truncate=False,
              sliding_window=128, sliding_window_pattern=2, qkv_bias=True, attn_out_bias=True,
              attention_sinks=True, num_experts_per_tok=4, router="topk_softmax",
              router_bias=True, expert_bias=True, mlp_activation="clamped_swiglu",
              max_seq_len=131_072, scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _qwen3(**kw) -> TransformerConfig:
  base = dict(vocab_size=151_936, mlp_activation="swiglu", norm_eps=1e-6, rope_theta=1_000_000.0,
              qk_norm=True, head_dim=128, max_seq_len=40_960, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _qwen3_moe(**kw) -> TransformerConfig:
  # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers); mlp_dim is config.json's
  # intermediate_size, which no layer of these checkpoints uses.
  return _qwen3(num_experts=128, num_experts_per_tok=8, router="softmax_topk",
                norm_topk_prob=True, tie_embeddings=False, **kw)


def _qwen35_mixers(num_layers: int, interval: int = 4) -> tuple[str, ...]:
  """Qwen3.5's layer types: every `interval`-th layer full attention, the rest Gated DeltaNet."""
  return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def _qwen35(**kw) -> TransformerConfig:
  """Qwen3.5's dense text decoder (config.json's text_config): Gated DeltaNet layers with one
  gated full-attention layer in four, partial RoPE over a quarter of head_dim 256. Layers stay
  unrolled (the two kinds of layer have different weights: no scan)."""
  base = dict(vocab_size=248_320, head_dim=256, mlp_activation="swiglu", norm_eps=1e-6,
              norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
              partial_rotary_factor=0.25, rope_theta=10_000_000.0, max_seq_len=262_144,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4,
              param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  return TransformerConfig(token_mixers=_qwen35_mixers(base["num_layers"]), **base)


def _olmo3(**kw) -> TransformerConfig:
  """OLMo 3 (Olmo-3-1025-7B / Olmo-3-32B config.json): OLMo 2's post-norm block with q/k norms
  over whole projections, three sliding layers (window 4096, RoPE unscaled at 500k) then a full
  one (YaRN x8 over 8192, attention factor 1.2079), 64k context, vocabulary 100,278."""
  base = dict(vocab_size=100_278, mlp_activation="swiglu", norm_eps=1e-6, pre_norms=False,
              use_post_norms=True, qk_norm=True, qk_norm_across_heads=True,
              rope_theta=500_000.0, rope_scaling_type="yarn", rope_scaling_factor=8.0,
              rope_original_max_len=8192, rope_attention_factor=1.2079441541679836,
              rope_local_theta=500_000.0, sliding_window=4096, sliding_window_pattern=4,
              max_seq_len=65_536, scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


# Phi-4-mini's LongRoPE divisors (config.json rope_scaling, as quoted by public loaders' tests):
# one per turning pair (96 of head_dim 128 turn); the short set is all ones.
_PHI4_MINI_LONG_FACTORS = (
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)


def _phi(**kw) -> TransformerConfig:
  """Phi-3/4 (Phi3ForCausalLM): Llama's block stored with fused qkv_proj / gate_up_proj."""
  base = dict(mlp_activation="swiglu", norm_eps=1e-5, fused_qkv_gate_up=True, head_dim=128,
              scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def _llama4(**kw) -> TransformerConfig:
  """Llama 4's text decoder (Llama-4-Scout-17B-16E / Maverick-17B-128E config.json text_config):
  every 4th layer RoPE-free (full attention, temperature tuning at floor 8192), the others in
  chunks of 8192 positions; experts of width 8192 chosen top-1 by a sigmoid router that scales
  their input, beside a shared expert; dense layers of width 16384. Layers stay unrolled (the
  RoPE-free ones attend otherwise: no scan)."""
  base = dict(vocab_size=202_048, embed_dim=5120, num_layers=48, num_heads=40, num_kv_heads=8,
              head_dim=128, mlp_dim=16_384, mlp_activation="swiglu", norm_eps=1e-5,
              rope_theta=500_000.0, attention_chunk_size=8192, attn_temperature_floor_scale=8192,
              attn_temperature_scale=0.1, num_experts_per_tok=1, moe_mlp_dim=8192,
              router="sigmoid", moe_scale_inputs=True, shared_expert_mlp_dim=8192,
              param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  free = tuple(i for i in range(base["num_layers"]) if (i + 1) % 4 == 0)
  return TransformerConfig(rope_free_layers=free, **base)


PRESETS: dict[str, TransformerConfig] = {
    # Seconds-fast test shapes: byte vocabulary, GQA (4 query heads over 2 kv heads).
    "tiny": TransformerConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=128),
    # Every Gemma-2 feature at test size: GeGLU, (1+scale) norms, sqrt(D) embeddings, tied
    # output, post norms, soft-capping, query pre-attention scalar, alternating sliding window.
    "tiny_gemma": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, mlp_activation="geglu", norm_scale_plus_one=True, tie_embeddings=True,
        scale_embeddings=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
        query_pre_attn_scalar=16.0, sliding_window=8, sliding_window_pattern=2,
        use_post_norms=True, max_seq_len=128),
    # Every Gemma 3 feature at test size: 5 sliding layers (window 8, RoPE base 10k) then a
    # global one (1M, linear x8), q/k norms, post norms, a query scalar unlike head_dim.
    "tiny_gemma3": _gemma3(vocab_size=256, embed_dim=64, num_layers=6, num_heads=4,
                           num_kv_heads=2, head_dim=16, mlp_dim=128, query_pre_attn_scalar=24.0,
                           sliding_window=8, rope_scaling_type="linear", rope_scaling_factor=8.0,
                           max_seq_len=128, scan_layers=False, param_dtype="float32",
                           dtype="float32"),
    # Every Gemma 4 feature distillax reads, at test size: sliding (window 8, head_dim 16, RoPE
    # base 10k) and full layers (head_dim 32, proportional RoPE at 1M; the last one full),
    # per-layer inputs of width 8, the last 2 layers on the keys/values of layers 2 (sliding) and
    # 1 (full) with double-wide MLPs, q/k and value norms, layer scalars, final soft-cap.
    "tiny_gemma4": _gemma4(
        vocab_size=256, embed_dim=64, num_layers=5, num_heads=4, num_kv_heads=2, head_dim=16,
        global_head_dim=32, mlp_dim=128, sliding_window=8, per_layer_input_dim=8,
        layer_types=(SLIDING, FULL, SLIDING, SLIDING, FULL), num_kv_shared_layers=2,
        double_wide_shared_mlp=True, max_seq_len=128, param_dtype="float32", dtype="float32"),
    # Gemma 4 26B-A4B's parts at test size: 4 experts of width 32 (top-2) beside a dense MLP of
    # width 64 in each of 3 layers (sliding, sliding, full), full layers on 1 key/value head whose
    # keys are their values; no per-layer inputs or key/value sharing (as the 26B).
    "tiny_gemma4_moe": _gemma4(
        vocab_size=256, embed_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        global_head_dim=32, mlp_dim=64, sliding_window=8, per_layer_input_dim=0,
        sliding_window_pattern=3, attention_k_eq_v=True, global_num_kv_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32, router="gemma4",
        moe_dense_mlp=True, max_seq_len=128, param_dtype="float32", dtype="float32"),
    # Every gpt-oss feature at test size: q/k/v/o biases, sinks, sliding then full layers, YaRN,
    # router and expert biases, the clamped SwiGLU; 4 experts of width 32, top-2.
    "tiny_gpt_oss": _gpt_oss(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, mlp_dim=32, num_experts=4,
                             num_experts_per_tok=2, sliding_window=8, max_seq_len=128,
                             scan_layers=False, param_dtype="float32", dtype="float32"),
    # A Mixtral at test size: 4 experts of width 32 in every layer, top-2 (softmax over the 2).
    "tiny_moe": TransformerConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, mlp_dim=128, num_experts=4,
                                  num_experts_per_tok=2, moe_mlp_dim=32, router="topk_softmax",
                                  max_seq_len=128),
    # Qwen3-MoE with dense layers at test size (mlp_only_layers=[0], decoder_sparse_step=2):
    # dense MLPs of width 128 in layers 0 and 2, 4 experts of width 32 (top-2, renormalised) in
    # layers 1 and 3, q/k norms.
    "tiny_qwen3_moe": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32,
        norm_topk_prob=True, moe_layers=(1, 3), max_seq_len=128),
    # Qwen3.5 at test size: three Gated DeltaNet layers then one gated full-attention layer
    # (partial RoPE over a quarter of head_dim, q/k norms), (1 + scale) norms.
    "tiny_qwen35": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=_qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128),
    # Qwen3.5-MoE at test size: tiny_qwen35's layers with 4 experts of width 32 (top-2,
    # renormalised) beside a sigmoid-gated shared expert of width 48 in every layer.
    "tiny_qwen35_moe": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=32, norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=_qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128, num_experts=4,
        num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True, shared_expert_mlp_dim=48,
        shared_expert_gate=True),
    # OLMo 3 at test size: post norms only, q/k norms over whole projections, three sliding
    # layers (window 8, RoPE unscaled) then a full one (YaRN x8 over 32 positions).
    "tiny_olmo3": _olmo3(vocab_size=256, embed_dim=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=128, sliding_window=8,
                         rope_original_max_len=32, max_seq_len=128, scan_layers=False,
                         param_dtype="float32", dtype="float32"),
    # Phi-4-mini at test size: fused projections, RoPE over three quarters of each head (6 of
    # 8 pairs) with LongRoPE: the short divisors up to 32 positions, the long ones past them.
    "tiny_phi3": _phi(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp_dim=128, partial_rotary_factor=0.75,
                      rope_scaling_type="longrope", rope_scaling_factor=4.0,
                      rope_original_max_len=32,
                      rope_short_factors=(1.0, 1.0, 1.1, 1.2, 1.5, 2.0),
                      rope_long_factors=(1.0, 1.5, 2.5, 4.0, 6.0, 8.0), tie_embeddings=True,
                      max_seq_len=128, scan_layers=False, param_dtype="float32",
                      dtype="float32"),
    # Qwen3-Next at test size: tiny_qwen35_moe's function stored as Qwen3-Next stores it (a
    # DeltaNet layer's q, k, v, z and b, a fused by key head), value heads as wide as key heads.
    "tiny_qwen3_next": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=64, norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=_qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128, num_experts=4,
        num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True, shared_expert_mlp_dim=48,
        shared_expert_gate=True, fused_qkvz_ba=True),
    # Llama 4 at test size: layers 0-2 with RoPE in chunks of 8 positions and q/k L2 norms,
    # layer 3 RoPE-free with temperature tuning (floor 8); 4 experts of width 32 (top-1, sigmoid,
    # input-scaled) beside a shared expert in layers 1 and 3, dense MLPs of width 128 in 0 and 2.
    "tiny_llama4": _llama4(vocab_size=256, embed_dim=64, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=16, mlp_dim=128, num_experts=4,
                           moe_mlp_dim=32, shared_expert_mlp_dim=32, moe_layers=(1, 3),
                           attention_chunk_size=8, attn_temperature_floor_scale=8,
                           qk_l2_norm=True, max_seq_len=128, param_dtype="float32",
                           dtype="float32"),
    # CPU demo pair (byte-level): a ~4.8M teacher and a ~1.5M student that train a few hundred
    # steps on two cores in minutes. Same family and head_dim so every KD strategy applies.
    "demo_teacher": TransformerConfig(vocab_size=256, embed_dim=256, num_layers=6, num_heads=8,
                                      num_kv_heads=4, head_dim=32, mlp_dim=768,
                                      tie_embeddings=True, max_seq_len=256),
    "demo_student": TransformerConfig(vocab_size=256, embed_dim=128, num_layers=6, num_heads=4,
                                      num_kv_heads=2, head_dim=32, mlp_dim=512,
                                      tie_embeddings=True, max_seq_len=256),
    # Published shapes (Hugging Face config.json of each checkpoint).
    "llama3.2-1b": _llama3(embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                           head_dim=64, mlp_dim=8192, tie_embeddings=True),
    "llama3.2-3b": _llama3(embed_dim=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                           head_dim=128, mlp_dim=8192, tie_embeddings=True),
    "llama3.1-8b": _llama3(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                           head_dim=128, mlp_dim=14_336, tie_embeddings=False,
                           rope_scaling_factor=8.0),
    "gemma-2b": _gemma(embed_dim=2048, num_layers=18, num_heads=8, num_kv_heads=1, mlp_dim=16_384),
    "gemma-7b": _gemma(embed_dim=3072, num_layers=28, num_heads=16, num_kv_heads=16,
                       mlp_dim=24_576),
    "gemma2-2b": _gemma2(embed_dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
                         mlp_dim=9216),
    "gemma2-9b": _gemma2(embed_dim=3584, num_layers=42, num_heads=16, num_kv_heads=8,
                         mlp_dim=14_336),
    "gemma3-1b": _gemma3(embed_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                         mlp_dim=6912, query_pre_attn_scalar=256.0, sliding_window=512,
                         max_seq_len=32_768),
    "gemma3-27b": _gemma3(vocab_size=262_208, embed_dim=5376, num_layers=62, num_heads=32,
                          num_kv_heads=16, head_dim=128, mlp_dim=21_504,
                          query_pre_attn_scalar=168.0, sliding_window=1024,
                          rope_scaling_type="linear", rope_scaling_factor=8.0,
                          max_seq_len=131_072),
    "smollm3-3b": _smollm3(embed_dim=2048, num_layers=36, num_heads=16, num_kv_heads=4,
                           mlp_dim=11_008),
    "qwen3-0.6b": _qwen3(embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                         mlp_dim=3072, tie_embeddings=True),
    "qwen3-1.7b": _qwen3(embed_dim=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                         mlp_dim=6144, tie_embeddings=True),
    "qwen3-30b-a3b": _qwen3_moe(embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                mlp_dim=6144, moe_mlp_dim=768),
    "qwen3-235b-a22b": _qwen3_moe(embed_dim=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                  mlp_dim=12_288, moe_mlp_dim=1536),
    "gpt-oss-20b": _gpt_oss(num_layers=24, num_experts=32),
    "gpt-oss-120b": _gpt_oss(num_layers=36, num_experts=128),
    # Gemma 4 E2B / E4B text decoders (config.json text_config values: every 5th / 6th layer
    # full); E2B's 20 sharing layers have double-wide MLPs.
    "gemma4-e2b": _gemma4(embed_dim=1536, num_layers=35, num_heads=8, num_kv_heads=1,
                          mlp_dim=6144, sliding_window_pattern=5,
                          num_kv_shared_layers=20, double_wide_shared_mlp=True),
    "gemma4-e4b": _gemma4(embed_dim=2560, num_layers=42, num_heads=8, num_kv_heads=2,
                          mlp_dim=10_240, sliding_window_pattern=6,
                          num_kv_shared_layers=18),
    # Gemma 4 26B-A4B's text decoder (its config.json's text_config, as quoted by several public
    # loaders' tests): 30 layers 5 sliding : 1 full (window 1024), 8 of 128 experts of width 704
    # beside a dense MLP of 2112, full layers on 2 key/value heads whose keys are their values.
    "gemma4-26b-a4b": _gemma4(embed_dim=2816, num_layers=30, num_heads=16, num_kv_heads=8,
                              mlp_dim=2112, sliding_window=1024, sliding_window_pattern=6,
                              per_layer_input_dim=0, attention_k_eq_v=True,
                              global_num_kv_heads=2, num_experts=128, num_experts_per_tok=8,
                              moe_mlp_dim=704, router="gemma4", moe_dense_mlp=True,
                              max_seq_len=262_144),
    "qwen3.5-0.8b": _qwen35(embed_dim=1024, num_layers=24, num_heads=8, num_kv_heads=2,
                            mlp_dim=3584, linear_num_key_heads=16, linear_num_value_heads=16,
                            tie_embeddings=True),
    "qwen3.5-9b": _qwen35(embed_dim=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                          mlp_dim=12_288, linear_num_key_heads=16, linear_num_value_heads=32,
                          tie_embeddings=False),
    "olmo3-7b": _olmo3(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, mlp_dim=11_008),
    "olmo3-32b": _olmo3(embed_dim=5120, num_layers=64, num_heads=40, num_kv_heads=8,
                        head_dim=128, mlp_dim=27_648),
    # Qwen3-Next-80B-A3B (config.json: transformers' Qwen3NextConfig shape with intermediate_size
    # 5120, which no layer uses, RoPE base 1e7 and 262,144 context): 10 of 512 experts of width
    # 512 beside a gated shared expert in each of 48 layers, three DeltaNet layers in four.
    "qwen3-next-80b-a3b": _qwen35(vocab_size=151_936, embed_dim=2048, num_layers=48,
                                  num_heads=16, num_kv_heads=2, mlp_dim=5120,
                                  linear_num_key_heads=16, linear_num_value_heads=32,
                                  tie_embeddings=False, num_experts=512, num_experts_per_tok=10,
                                  moe_mlp_dim=512, norm_topk_prob=True,
                                  shared_expert_mlp_dim=512, shared_expert_gate=True,
                                  fused_qkvz_ba=True),
    # Llama 4 Scout: 16 experts in every layer, q/k L2 norms, Llama 3.1 RoPE x16 over 8192.
    "llama4-scout-17b-16e": _llama4(num_experts=16, qk_l2_norm=True, rope_scaling_factor=16.0,
                                    rope_low_freq_factor=1.0, rope_high_freq_factor=1.0,
                                    rope_original_max_len=8192, max_seq_len=10_485_760),
    # Llama 4 Maverick: 128 experts in every other layer, no q/k norms, unscaled RoPE.
    "llama4-maverick-17b-128e": _llama4(num_experts=128, moe_layers=tuple(range(1, 48, 2)),
                                        max_seq_len=1_048_576),
    # Phi-4-mini (config.json): 3 quarters of each head turn, LongRoPE x32 over 4096, tied.
    "phi-4-mini": _phi(vocab_size=200_064, embed_dim=3072, num_layers=32, num_heads=24,
                       num_kv_heads=8, mlp_dim=8192, partial_rotary_factor=0.75,
                       rope_theta=10_000.0, rope_scaling_type="longrope",
                       rope_scaling_factor=32.0, rope_original_max_len=4096,
                       rope_short_factors=(1.0,) * 48, rope_long_factors=_PHI4_MINI_LONG_FACTORS,
                       tie_embeddings=True, max_seq_len=131_072),
    # Phi-4 (14B; config.json): every feature turns, plain RoPE at 250k, 16k context, untied.
    "phi-4": _phi(vocab_size=100_352, embed_dim=5120, num_layers=40, num_heads=40,
                  num_kv_heads=10, mlp_dim=17_920, rope_theta=250_000.0, max_seq_len=16_384),
    # Qwen3.5-35B-A3B's text decoder (the shape of transformers' Qwen3_5MoeTextConfig defaults;
    # RoPE base and context as the dense Qwen3.5's): 8 of 256 experts of width 512 beside a
    # gated shared expert of width 512 in each of 40 layers.
    "qwen3.5-35b-a3b": _qwen35(embed_dim=2048, num_layers=40, num_heads=16, num_kv_heads=2,
                               mlp_dim=512, linear_num_key_heads=16, linear_num_value_heads=32,
                               tie_embeddings=False, num_experts=256, num_experts_per_tok=8,
                               moe_mlp_dim=512, norm_topk_prob=True, shared_expert_mlp_dim=512,
                               shared_expert_gate=True),
}


def preset_names() -> tuple[str, ...]:
  return tuple(PRESETS)


def get_preset(name: str, **overrides) -> TransformerConfig:
  """A named preset, optionally with fields replaced (`get_preset('tiny', scan_layers=True)`)."""
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def config_from_dict(values: Mapping[str, Any]) -> TransformerConfig:
  """A model section as a config: a 'preset' key starts from that preset, other keys override."""
  values = dict(values)
  base = get_preset(values.pop("preset")) if values.get("preset") else TransformerConfig()
  return base.replace(**values)
