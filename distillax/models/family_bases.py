"""Each published family's fixed config.json parts as a function of its sizes: the bases the
named shapes of models/presets.py are built on (`llama3(embed_dim=..., num_layers=...)`).
Values from the families' config.json files; nothing is downloaded.
"""

from __future__ import annotations

from distillax.models.config import FULL, LINEAR, TransformerConfig


def llama3(**kw) -> TransformerConfig:
  base = dict(vocab_size=128_256, mlp_activation="swiglu", norm_eps=1e-5, rope_theta=500_000.0,
              rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_len=8192, max_seq_len=131_072, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def gemma(**kw) -> TransformerConfig:
  base = dict(vocab_size=256_000, mlp_activation="geglu", norm_eps=1e-6, norm_scale_plus_one=True,
              rope_theta=10_000.0, tie_embeddings=True, scale_embeddings=True, max_seq_len=8192,
              head_dim=256, scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def gemma2(**kw) -> TransformerConfig:
  return gemma(use_post_norms=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
               query_pre_attn_scalar=256.0, sliding_window=4096, sliding_window_pattern=2, **kw)


def gemma3(**kw) -> TransformerConfig:
  # Gemma 3 config.json: q/k norms and post norms, no soft-caps, sliding layers 5:1 whose RoPE
  # base is 10k (unscaled), global layers at 1M (linear x8 from 4B up), vocabulary 262,144.
  base = dict(vocab_size=262_144, use_post_norms=True, qk_norm=True, sliding_window_pattern=6,
              rope_theta=1_000_000.0, rope_local_theta=10_000.0)
  return gemma(**{**base, **kw})


def smollm3(**kw) -> TransformerConfig:
  # SmolLM3 config.json: Llama with no RoPE in every 4th layer, RoPE base 5M, 64k context.
  base = dict(vocab_size=128_256, mlp_activation="swiglu", norm_eps=1e-6, rope_theta=5_000_000.0,
              head_dim=128, max_seq_len=65_536, tie_embeddings=True, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  free = tuple(i for i in range(base["num_layers"]) if (i + 1) % 4 == 0)
  return TransformerConfig(rope_free_layers=free, **base)


def gemma4(**kw) -> TransformerConfig:
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


def gpt_oss(**kw) -> TransformerConfig:
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


def qwen3(**kw) -> TransformerConfig:
  base = dict(vocab_size=151_936, mlp_activation="swiglu", norm_eps=1e-6, rope_theta=1_000_000.0,
              qk_norm=True, head_dim=128, max_seq_len=40_960, scan_layers=True,
              param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def qwen3_moe(**kw) -> TransformerConfig:
  # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers); mlp_dim is config.json's
  # intermediate_size, which no layer of these checkpoints uses.
  return qwen3(num_experts=128, num_experts_per_tok=8, router="softmax_topk",
               norm_topk_prob=True, tie_embeddings=False, **kw)


def deepseek_v3(**kw) -> TransformerConfig:
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


def qwen35_mixers(num_layers: int, interval: int = 4) -> tuple[str, ...]:
  """Qwen3.5's layer types: every `interval`-th layer full attention, the rest Gated DeltaNet."""
  return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def qwen35(**kw) -> TransformerConfig:
  """Qwen3.5's dense text decoder (config.json's text_config): Gated DeltaNet layers with one
  gated full-attention layer in four, partial RoPE over a quarter of head_dim 256. Layers stay
  unrolled (the two kinds of layer have different weights: no scan)."""
  base = dict(vocab_size=248_320, head_dim=256, mlp_activation="swiglu", norm_eps=1e-6,
              norm_scale_plus_one=True, qk_norm=True, attn_output_gate=True,
              partial_rotary_factor=0.25, rope_theta=10_000_000.0, max_seq_len=262_144,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4,
              param_dtype="bfloat16", dtype="bfloat16")
  base.update(kw)
  return TransformerConfig(token_mixers=qwen35_mixers(base["num_layers"]), **base)


def olmo3(**kw) -> TransformerConfig:
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
PHI4_MINI_LONG_FACTORS = (
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66,
    32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77)


def phi(**kw) -> TransformerConfig:
  """Phi-3/4 (Phi3ForCausalLM): Llama's block stored with fused qkv_proj / gate_up_proj."""
  base = dict(mlp_activation="swiglu", norm_eps=1e-5, fused_qkv_gate_up=True, head_dim=128,
              scan_layers=True, param_dtype="bfloat16", dtype="bfloat16")
  return TransformerConfig(**{**base, **kw})


def llama4(**kw) -> TransformerConfig:
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
