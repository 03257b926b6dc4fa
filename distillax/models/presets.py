"""Named model configs: shapes small enough for the tests and the CPU demo, and the published
shapes of real checkpoints (config.json values only; nothing is downloaded), built on each
family's fixed parts (models/family_bases.py)."""

from __future__ import annotations

from typing import Any, Mapping

from distillax.errors import ConfigError
from distillax.models.config import FULL, SLIDING, TransformerConfig
from distillax.models.family_bases import (PHI4_MINI_LONG_FACTORS, deepseek_v3, gemma, gemma2,
                                           gemma3, gemma4, gpt_oss, llama3, llama4, olmo3, phi,
                                           qwen3, qwen3_moe, qwen35, qwen35_mixers, smollm3)


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
    "tiny_gemma3": gemma3(vocab_size=256, embed_dim=64, num_layers=6, num_heads=4,
                          num_kv_heads=2, head_dim=16, mlp_dim=128, query_pre_attn_scalar=24.0,
                          sliding_window=8, rope_scaling_type="linear", rope_scaling_factor=8.0,
                          max_seq_len=128, scan_layers=False, param_dtype="float32",
                          dtype="float32"),
    # Every Gemma 4 feature distillax reads, at test size: sliding (window 8, head_dim 16, RoPE
    # base 10k) and full layers (head_dim 32, proportional RoPE at 1M; the last one full),
    # per-layer inputs of width 8, the last 2 layers on the keys/values of layers 2 (sliding) and
    # 1 (full) with double-wide MLPs, q/k and value norms, layer scalars, final soft-cap.
    "tiny_gemma4": gemma4(
        vocab_size=256, embed_dim=64, num_layers=5, num_heads=4, num_kv_heads=2, head_dim=16,
        global_head_dim=32, mlp_dim=128, sliding_window=8, per_layer_input_dim=8,
        layer_types=(SLIDING, FULL, SLIDING, SLIDING, FULL), num_kv_shared_layers=2,
        double_wide_shared_mlp=True, max_seq_len=128, param_dtype="float32", dtype="float32"),
    # Gemma 4 26B-A4B's parts at test size: 4 experts of width 32 (top-2) beside a dense MLP of
    # width 64 in each of 3 layers (sliding, sliding, full), full layers on 1 key/value head whose
    # keys are their values; no per-layer inputs or key/value sharing (as the 26B).
    "tiny_gemma4_moe": gemma4(
        vocab_size=256, embed_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        global_head_dim=32, mlp_dim=64, sliding_window=8, per_layer_input_dim=0,
        sliding_window_pattern=3, attention_k_eq_v=True, global_num_kv_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32, router="gemma4",
        moe_dense_mlp=True, max_seq_len=128, param_dtype="float32", dtype="float32"),
    # Every gpt-oss feature at test size: q/k/v/o biases, sinks, sliding then full layers, YaRN,
    # router and expert biases, the clamped SwiGLU; 4 experts of width 32, top-2.
    "tiny_gpt_oss": gpt_oss(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
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
    # DeepSeek V3 at test size: latent attention (latent 32, queries through 48, heads of 16 +
    # 8 RoPE features, values of 16, interleaved RoPE, YaRN x4 with mscale 1 / 1), a dense first
    # layer, then one of 8 experts of width 32 in 4 groups (2 kept; top-2, sigmoid with its
    # choice bias, scaled 2.5) beside a shared expert of width 32.
    "tiny_deepseek_v3": deepseek_v3(
        vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=24,
        v_head_dim=16, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, mlp_dim=128,
        rope_scaling_factor=4.0, rope_original_max_len=32, num_experts=8, num_experts_per_tok=2,
        moe_mlp_dim=32, router_groups=4, router_groups_kept=2, shared_expert_mlp_dim=32,
        moe_layers=(1,), max_seq_len=128, param_dtype="float32", dtype="float32"),
    # GLM-4.5 at test size: partial RoPE (half of each 16-feature head), q/k/v biases, q/k norms,
    # a dense first layer, then 8 experts of width 32 in 2 groups (1 kept; top-2, sigmoid with its
    # choice bias, scaled 2.5) beside a shared expert of width 32.
    "tiny_glm4_moe": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, norm_eps=1e-5, partial_rotary_factor=0.5, qkv_bias=True, qk_norm=True,
        num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32, router="sigmoid",
        router_score_bias=True, router_groups=2, router_groups_kept=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, shared_expert_mlp_dim=32, moe_layers=(1, 2), max_seq_len=128),
    # Qwen3.5 at test size: three Gated DeltaNet layers then one gated full-attention layer
    # (partial RoPE over a quarter of head_dim, q/k norms), (1 + scale) norms.
    "tiny_qwen35": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128),
    # Qwen3.5-MoE at test size: tiny_qwen35's layers with 4 experts of width 32 (top-2,
    # renormalised) beside a sigmoid-gated shared expert of width 48 in every layer.
    "tiny_qwen35_moe": TransformerConfig(
        vocab_size=256, embed_dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=32, norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128, num_experts=4,
        num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True, shared_expert_mlp_dim=48,
        shared_expert_gate=True),
    # OLMo 3 at test size: post norms only, q/k norms over whole projections, three sliding
    # layers (window 8, RoPE unscaled) then a full one (YaRN x8 over 32 positions).
    "tiny_olmo3": olmo3(vocab_size=256, embed_dim=64, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=16, mlp_dim=128, sliding_window=8,
                        rope_original_max_len=32, max_seq_len=128, scan_layers=False,
                        param_dtype="float32", dtype="float32"),
    # Phi-4-mini at test size: fused projections, RoPE over three quarters of each head (6 of
    # 8 pairs) with LongRoPE: the short divisors up to 32 positions, the long ones past them.
    "tiny_phi3": phi(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
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
        partial_rotary_factor=0.25, rope_theta=10_000_000.0, token_mixers=qwen35_mixers(4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, max_seq_len=128, num_experts=4,
        num_experts_per_tok=2, moe_mlp_dim=32, norm_topk_prob=True, shared_expert_mlp_dim=48,
        shared_expert_gate=True, fused_qkvz_ba=True),
    # Llama 4 at test size: layers 0-2 with RoPE in chunks of 8 positions and q/k L2 norms,
    # layer 3 RoPE-free with temperature tuning (floor 8); 4 experts of width 32 (top-1, sigmoid,
    # input-scaled) beside a shared expert in layers 1 and 3, dense MLPs of width 128 in 0 and 2.
    "tiny_llama4": llama4(vocab_size=256, embed_dim=64, num_layers=4, num_heads=4,
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
    "llama3.2-1b": llama3(embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                          head_dim=64, mlp_dim=8192, tie_embeddings=True),
    "llama3.2-3b": llama3(embed_dim=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                          head_dim=128, mlp_dim=8192, tie_embeddings=True),
    "llama3.1-8b": llama3(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                          head_dim=128, mlp_dim=14_336, tie_embeddings=False,
                          rope_scaling_factor=8.0),
    "gemma-2b": gemma(embed_dim=2048, num_layers=18, num_heads=8, num_kv_heads=1, mlp_dim=16_384),
    "gemma-7b": gemma(embed_dim=3072, num_layers=28, num_heads=16, num_kv_heads=16,
                      mlp_dim=24_576),
    "gemma2-2b": gemma2(embed_dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
                        mlp_dim=9216),
    "gemma2-9b": gemma2(embed_dim=3584, num_layers=42, num_heads=16, num_kv_heads=8,
                        mlp_dim=14_336),
    "gemma3-1b": gemma3(embed_dim=1152, num_layers=26, num_heads=4, num_kv_heads=1,
                        mlp_dim=6912, query_pre_attn_scalar=256.0, sliding_window=512,
                        max_seq_len=32_768),
    "gemma3-27b": gemma3(vocab_size=262_208, embed_dim=5376, num_layers=62, num_heads=32,
                         num_kv_heads=16, head_dim=128, mlp_dim=21_504,
                         query_pre_attn_scalar=168.0, sliding_window=1024,
                         rope_scaling_type="linear", rope_scaling_factor=8.0,
                         max_seq_len=131_072),
    "smollm3-3b": smollm3(embed_dim=2048, num_layers=36, num_heads=16, num_kv_heads=4,
                          mlp_dim=11_008),
    "qwen3-0.6b": qwen3(embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                        mlp_dim=3072, tie_embeddings=True),
    "qwen3-1.7b": qwen3(embed_dim=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                        mlp_dim=6144, tie_embeddings=True),
    "qwen3-30b-a3b": qwen3_moe(embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                               mlp_dim=6144, moe_mlp_dim=768),
    "qwen3-235b-a22b": qwen3_moe(embed_dim=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                 mlp_dim=12_288, moe_mlp_dim=1536),
    "gpt-oss-20b": gpt_oss(num_layers=24, num_experts=32),
    "gpt-oss-120b": gpt_oss(num_layers=36, num_experts=128),
    # Gemma 4 E2B / E4B text decoders (config.json text_config values: every 5th / 6th layer
    # full); E2B's 20 sharing layers have double-wide MLPs.
    "gemma4-e2b": gemma4(embed_dim=1536, num_layers=35, num_heads=8, num_kv_heads=1,
                         mlp_dim=6144, sliding_window_pattern=5,
                         num_kv_shared_layers=20, double_wide_shared_mlp=True),
    "gemma4-e4b": gemma4(embed_dim=2560, num_layers=42, num_heads=8, num_kv_heads=2,
                         mlp_dim=10_240, sliding_window_pattern=6,
                         num_kv_shared_layers=18),
    # Gemma 4 26B-A4B's text decoder (its config.json's text_config, as quoted by several public
    # loaders' tests): 30 layers 5 sliding : 1 full (window 1024), 8 of 128 experts of width 704
    # beside a dense MLP of 2112, full layers on 2 key/value heads whose keys are their values.
    "gemma4-26b-a4b": gemma4(embed_dim=2816, num_layers=30, num_heads=16, num_kv_heads=8,
                             mlp_dim=2112, sliding_window=1024, sliding_window_pattern=6,
                             per_layer_input_dim=0, attention_k_eq_v=True,
                             global_num_kv_heads=2, num_experts=128, num_experts_per_tok=8,
                             moe_mlp_dim=704, router="gemma4", moe_dense_mlp=True,
                             max_seq_len=262_144),
    "qwen3.5-0.8b": qwen35(embed_dim=1024, num_layers=24, num_heads=8, num_kv_heads=2,
                           mlp_dim=3584, linear_num_key_heads=16, linear_num_value_heads=16,
                           tie_embeddings=True),
    "qwen3.5-9b": qwen35(embed_dim=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                         mlp_dim=12_288, linear_num_key_heads=16, linear_num_value_heads=32,
                         tie_embeddings=False),
    "olmo3-7b": olmo3(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                      head_dim=128, mlp_dim=11_008),
    "olmo3-32b": olmo3(embed_dim=5120, num_layers=64, num_heads=40, num_kv_heads=8,
                       head_dim=128, mlp_dim=27_648),
    # Qwen3-Next-80B-A3B (config.json: transformers' Qwen3NextConfig shape with intermediate_size
    # 5120, which no layer uses, RoPE base 1e7 and 262,144 context): 10 of 512 experts of width
    # 512 beside a gated shared expert in each of 48 layers, three DeltaNet layers in four.
    "qwen3-next-80b-a3b": qwen35(vocab_size=151_936, embed_dim=2048, num_layers=48,
                                 num_heads=16, num_kv_heads=2, mlp_dim=5120,
                                 linear_num_key_heads=16, linear_num_value_heads=32,
                                 tie_embeddings=False, num_experts=512, num_experts_per_tok=10,
                                 moe_mlp_dim=512, norm_topk_prob=True,
                                 shared_expert_mlp_dim=512, shared_expert_gate=True,
                                 fused_qkvz_ba=True),
    # Llama 4 Scout: 16 experts in every layer, q/k L2 norms, Llama 3.1 RoPE x16 over 8192.
    "llama4-scout-17b-16e": llama4(num_experts=16, qk_l2_norm=True, rope_scaling_factor=16.0,
                                   rope_low_freq_factor=1.0, rope_high_freq_factor=1.0,
                                   rope_original_max_len=8192, max_seq_len=10_485_760),
    # Llama 4 Maverick: 128 experts in every other layer, no q/k norms, unscaled RoPE.
    "llama4-maverick-17b-128e": llama4(num_experts=128, moe_layers=tuple(range(1, 48, 2)),
                                       max_seq_len=1_048_576),
    # Phi-4-mini (config.json): 3 quarters of each head turn, LongRoPE x32 over 4096, tied.
    "phi-4-mini": phi(vocab_size=200_064, embed_dim=3072, num_layers=32, num_heads=24,
                      num_kv_heads=8, mlp_dim=8192, partial_rotary_factor=0.75,
                      rope_theta=10_000.0, rope_scaling_type="longrope",
                      rope_scaling_factor=32.0, rope_original_max_len=4096,
                      rope_short_factors=(1.0,) * 48, rope_long_factors=PHI4_MINI_LONG_FACTORS,
                      tie_embeddings=True, max_seq_len=131_072),
    # Phi-4 (14B; config.json): every feature turns, plain RoPE at 250k, 16k context, untied.
    "phi-4": phi(vocab_size=100_352, embed_dim=5120, num_layers=40, num_heads=40,
                 num_kv_heads=10, mlp_dim=17_920, rope_theta=250_000.0, max_seq_len=16_384),
    # Qwen3.5-35B-A3B's text decoder (the shape of transformers' Qwen3_5MoeTextConfig defaults;
    # RoPE base and context as the dense Qwen3.5's): 8 of 256 experts of width 512 beside a
    # gated shared expert of width 512 in each of 40 layers.
    "qwen3.5-35b-a3b": qwen35(embed_dim=2048, num_layers=40, num_heads=16, num_kv_heads=2,
                              mlp_dim=512, linear_num_key_heads=16, linear_num_value_heads=32,
                              tie_embeddings=False, num_experts=256, num_experts_per_tok=8,
                              moe_mlp_dim=512, norm_topk_prob=True, shared_expert_mlp_dim=512,
                              shared_expert_gate=True),
    "deepseek-v3": deepseek_v3(),  # also DeepSeek-R1 and V3.1 (the same shape): 671B
    # Kimi K2 (config.json): DeepSeek V3's block with 64 heads, 8 of 384 experts in one group
    # scaled 2.827, one dense layer, RoPE base 50k with YaRN x32 (beta 1 / 1), 163,840 tokens.
    "kimi-k2": deepseek_v3(vocab_size=163_840, num_heads=64, num_kv_heads=64, num_experts=384,
                           router_groups=1, router_groups_kept=1, routed_scaling_factor=2.827,
                           moe_layers=tuple(range(1, 61)), rope_theta=50_000.0,
                           rope_scaling_factor=32.0, rope_yarn_beta_fast=1.0,
                           rope_yarn_beta_slow=1.0, max_seq_len=131_072),
    # GLM-4.5 (config.json): 92 layers, 96 query heads of 128 over 8 key/value heads, half of
    # each head turned (RoPE base 1M), q/k/v biases and q/k norms, the first 3 layers dense
    # (12,288), then 8 of 160 experts of width 1536 (sigmoid, scaled 2.5) beside a shared one.
    "glm-4.5": TransformerConfig(
        vocab_size=151_552, embed_dim=5120, num_layers=92, num_heads=96, num_kv_heads=8,
        head_dim=128, mlp_dim=12_288, norm_eps=1e-5, rope_theta=1_000_000.0,
        partial_rotary_factor=0.5, qkv_bias=True, qk_norm=True, num_experts=160,
        num_experts_per_tok=8, moe_mlp_dim=1536, router="sigmoid", router_score_bias=True,
        norm_topk_prob=True, routed_scaling_factor=2.5, shared_expert_mlp_dim=1536,
        moe_layers=tuple(range(3, 92)), max_seq_len=131_072, param_dtype="bfloat16",
        dtype="bfloat16"),
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
