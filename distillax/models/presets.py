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


def _deepseek_v3(**kw) -> TransformerConfig:
  """DeepSeek V3's shape (config.json): latent attention (latent 512, queries through 1536,
  heads of 128 + 64 RoPE features, values of 128, RoPE pairs interleaved), YaRN x40 over 4096
  with mscale 1 / 1, the first 3 layers dense (18,432), then 8 of 256 experts of width 2048 in
  8 groups (4 kept, sigmoid router with its choice bias, scaled 2.5) beside one shared expert.
  Layers stay unrolled (dense and MoE layers differ: no scan)."""
  base = dict(vocab_size=129_280, embed_dim=7168, num_layers=61, num_heads=128, num_kv_heads=128,
              head_dim=192, v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536,
              qk_rope_head_dim=64, rope_interleaved=True, mlp_dim=18_432, norm_eps=1e-6,
              rope_theta=10_000.0, rope_scaling_type="yarn", rope_scaling_factor=40.0,
              rope_original_max_len=4096, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0,
              num_experts=256, num_experts_per_tok=8, moe_mlp_dim=2048, router="sigmoid",
              router_score_bias=True, router_groups=8, router_groups_kept=4, norm_topk_prob=True,
              routed_scaling_factor=2.5, shared_expert_mlp_dim=2048, moe_layers=tuple(range(3, 61)),
              max_seq_len=163_840, param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  return TransformerConfig(**base)


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
    # DeepSeek V3 at test size: latent attention (latent 32, queries through 48, heads of 16 +
    # 8 RoPE features, values of 16, interleaved RoPE, YaRN x4 with mscale 1 / 1), a dense first
    # layer, then one of 8 experts of width 32 in 4 groups (2 kept; top-2, sigmoid with its
    # choice bias, scaled 2.5) beside a shared expert of width 32.
    "tiny_deepseek_v3": _deepseek_v3(
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
    # Qwen3.5-35B-A3B's text decoder (the shape of transformers' Qwen3_5MoeTextConfig defaults;
    # RoPE base and context as the dense Qwen3.5's): 8 of 256 experts of width 512 beside a
    # gated shared expert of width 512 in each of 40 layers.
    "qwen3.5-35b-a3b": _qwen35(embed_dim=2048, num_layers=40, num_heads=16, num_kv_heads=2,
                               mlp_dim=512, linear_num_key_heads=16, linear_num_value_heads=32,
                               tie_embeddings=False, num_experts=256, num_experts_per_tok=8,
                               moe_mlp_dim=512, norm_topk_prob=True, shared_expert_mlp_dim=512,
                               shared_expert_gate=True),
    "deepseek-v3": _deepseek_v3(),  # also DeepSeek-R1 and V3.1 (the same shape): 671B
    # Kimi K2 (config.json): DeepSeek V3's block with 64 heads, 8 of 384 experts in one group
    # scaled 2.827, one dense layer, RoPE base 50k with YaRN x32 (beta 1 / 1), 163,840 tokens.
    "kimi-k2": _deepseek_v3(vocab_size=163_840, num_heads=64, num_kv_heads=64, num_experts=384,
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
