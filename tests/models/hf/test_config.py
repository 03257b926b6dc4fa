"""config.json translation, checked on the published configs of real checkpoints (no torch)."""

import pytest

from distillax.errors import UserError
from distillax.models.presets import get_preset
from distillax.models.hf.config import config_from_hf
from distillax.models.hf.config_out import config_to_hf, hf_architecture

# As published on the Hugging Face hub (older, pre-transformers-5 layout: rope_theta/rope_scaling).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                            "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 128256}
GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "head_dim": 256,
    "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 16384,
    "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000}
GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "torch_dtype": "float32", "vocab_size": 256000}


@pytest.mark.parametrize("hf,preset", [(LLAMA_3_2_1B, "llama3.2-1b"), (GEMMA_2B, "gemma-2b"),
                                       (GEMMA_2_2B, "gemma2-2b")])
def test_published_configs_give_the_presets(hf, preset):
  cfg = config_from_hf(hf, dtype="bfloat16", scan_layers=True)
  assert cfg == get_preset(preset)
  assert hf_architecture(cfg) == hf["architectures"][0]
  # and back: what we write reads as the same config
  assert config_from_hf(config_to_hf(cfg), dtype="bfloat16", scan_layers=True) == cfg


# openai/gpt-oss-20b's config.json as published (the pre-transformers-5 rope_scaling layout).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 201088}


def test_published_gpt_oss_config_gives_the_preset_and_round_trips():
  cfg = config_from_hf(GPT_OSS_20B, dtype="bfloat16", scan_layers=True)
  assert cfg == get_preset("gpt-oss-20b")
  written = config_to_hf(cfg)
  assert (written["architectures"], written["layer_types"], written["rope_parameters"]) == (
      ["GptOssForCausalLM"], GPT_OSS_20B["layer_types"],
      {**GPT_OSS_20B["rope_scaling"], "rope_theta": 150000.0})
  assert config_from_hf(written, dtype="bfloat16", scan_layers=True) == cfg
  # one attention_bias flag covers q/k/v and o in gpt-oss: a model with only one has no class
  with pytest.raises(UserError, match="no Hugging Face equivalent.*attn_out_bias=False"):
    config_to_hf(cfg.replace(attn_out_bias=False))


def test_unsupported_features_are_named():
  with pytest.raises(UserError, match="attention_bias"):
    config_from_hf({**LLAMA_3_2_1B, "attention_bias": True})
  with pytest.raises(UserError, match="RoPE type 'dynamic'"):
    config_from_hf({**LLAMA_3_2_1B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
  with pytest.raises(UserError, match="yarn mscale=1.0, mscale_all_dim=1.0 is DeepSeek's form; "
                                      "distillax reads it for DeepseekV3ForCausalLM only"):
    config_from_hf({**LLAMA_3_2_1B, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0}})
  with pytest.raises(UserError, match="hidden_act='relu'"):
    config_from_hf({**LLAMA_3_2_1B, "hidden_act": "relu"})
  with pytest.raises(UserError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
    config_from_hf({**LLAMA_3_2_1B, "architectures": ["GPTNeoXForCausalLM"]})


QWEN_2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN_3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000}


@pytest.mark.parametrize("hf,want", [
    # use_sliding_window=false: the 32768 window is not applied; head_dim = 896 / 14.
    (QWEN_2_5_0_5B, dict(embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, mlp_dim=4864, rope_theta=1e6, tie_embeddings=True,
                         qkv_bias=True, qk_norm=False, sliding_window=None)),
    # head_dim 128 although 1024 / 16 = 64.
    (QWEN_3_0_6B, dict(embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, mlp_dim=3072, rope_theta=1e6, tie_embeddings=True,
                       qkv_bias=False, qk_norm=True, sliding_window=None)),
    # The 4096 window on every layer.
    (MISTRAL_7B_V0_1, dict(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                           head_dim=128, mlp_dim=14336, rope_theta=1e4, norm_eps=1e-5,
                           tie_embeddings=False, qkv_bias=False, qk_norm=False,
                           sliding_window=4096, sliding_window_pattern=0)),
])
def test_published_qwen_and_mistral_configs(hf, want):
  cfg = config_from_hf(hf, dtype="bfloat16")
  assert {k: getattr(cfg, k) for k in want} == want
  assert (cfg.mlp_activation, cfg.norm_scale_plus_one, cfg.scale_embeddings) == (
      "swiglu", False, False)
  assert hf_architecture(cfg) == hf["architectures"][0]
  assert config_from_hf(config_to_hf(cfg), dtype="bfloat16") == cfg


def test_qwen_sliding_window_layers():
  on = {**QWEN_2_5_0_5B, "use_sliding_window": True, "num_hidden_layers": 4}
  # max_window_layers=0: every layer local, which Qwen export writes back the same way.
  every = config_from_hf({**on, "max_window_layers": 0})
  assert every.layer_windows() == (32768,) * 4
  back = config_to_hf(every)
  assert (back["use_sliding_window"], back["max_window_layers"]) == (True, 0)
  assert config_from_hf(back) == every
  # max_window_layers >= num layers: none local.
  assert config_from_hf({**on, "max_window_layers": 4}).sliding_window is None
  # explicit periodic layer_types are read as a pattern; layers 0-1 global then 2-3 local
  # follow none and are read layer by layer, as transformers' Qwen2 runs them.
  periodic = config_from_hf({**on, "layer_types": ["sliding_attention", "full_attention"] * 2})
  assert periodic.layer_windows() == (32768, 2**30, 32768, 2**30)
  assert periodic.layer_types is None and periodic.sliding_window_pattern == 2
  last_two = config_from_hf({**on, "max_window_layers": 2})
  assert last_two.layer_windows() == (2**30, 2**30, 32768, 32768)
  assert last_two.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
  with pytest.raises(UserError, match="layer_types has 3 entries for num_hidden_layers=4"):
    config_from_hf({**on, "layer_types": ["full_attention"] * 3})
  with pytest.raises(UserError, match=r"layer_types has \['chunked_attention'\]"):
    config_from_hf({**on, "layer_types": ["chunked_attention"] * 4})
  for partial in (periodic, last_two):  # Qwen export writes a window on every layer or none
    with pytest.raises(UserError, match=r"no Hugging Face equivalent.*local layers \[[02]"):
      config_to_hf(partial)


def test_qwen_and_mistral_features_without_hf_class_are_refused():
  with pytest.raises(UserError, match="attention_bias=true"):
    config_from_hf({**QWEN_3_0_6B, "attention_bias": True})  # Qwen 3 would bias o_proj too
  with pytest.raises(UserError, match="hidden_act='gelu'"):
    config_from_hf({**MISTRAL_7B_V0_1, "hidden_act": "gelu"})
  both = get_preset("tiny", qkv_bias=True, qk_norm=True)
  with pytest.raises(UserError, match="no Hugging Face equivalent.*qkv_bias=True, qk_norm=True"):
    hf_architecture(both)
  alternating = get_preset("tiny", num_layers=4, sliding_window=8, sliding_window_pattern=2)
  with pytest.raises(UserError, match="no Hugging Face equivalent"):
    hf_architecture(alternating)  # SwiGLU with alternating windows: no HF class
  assert hf_architecture(alternating.replace(sliding_window_pattern=0)) == "MistralForCausalLM"
  assert hf_architecture(get_preset("tiny", qkv_bias=True)) == "Qwen2ForCausalLM"
  assert hf_architecture(get_preset("tiny", qk_norm=True)) == "Qwen3ForCausalLM"
  # A shared expert is Qwen3.5-MoE's alone, and that class always gates it.
  qwen3_moe = get_preset("tiny", qk_norm=True, num_experts=4, norm_topk_prob=True)
  assert hf_architecture(qwen3_moe) == "Qwen3MoeForCausalLM"
  with pytest.raises(UserError, match="no Hugging Face equivalent.*shared_expert_mlp_dim=16"):
    hf_architecture(qwen3_moe.replace(shared_expert_mlp_dim=16))
  assert hf_architecture(get_preset("tiny_qwen35_moe")) == "Qwen3_5MoeForCausalLM"
  with pytest.raises(UserError, match="no Hugging Face equivalent.*shared_expert_mlp_dim=48"):
    hf_architecture(get_preset("tiny_qwen35_moe", shared_expert_gate=False))
  with pytest.raises(UserError, match="qk_norm"):
    get_preset("tiny", qk_norm="yes")


# As published (Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 config.json, shape keys).
QWEN_3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "vocab_size": 151936,
    "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 48, "attention_bias": False}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "vocab_size": 32000, "sliding_window": None,
    "tie_word_embeddings": False, "router_aux_loss_coef": 0.02}


def test_moe_configs_map_to_experts_and_back():
  qwen = config_from_hf(QWEN_3_30B_A3B)
  assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.expert_mlp_dim, qwen.router,
          qwen.norm_topk_prob, qwen.qk_norm) == (128, 8, 768, "softmax_topk", True, True)
  mixtral = config_from_hf(MIXTRAL_8X7B)
  assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.expert_mlp_dim,
          mixtral.router, mixtral.qk_norm) == (8, 2, 14336, "topk_softmax", False)
  for cfg in (qwen, mixtral):
    assert config_from_hf(config_to_hf(cfg)) == cfg
  assert config_to_hf(qwen)["moe_intermediate_size"] == 768
  # Qwen3-MoE's dense layers: every decoder_sparse_step-th layer not in mlp_only_layers has
  # experts (tests/models/hf/test_qwen3_moe_dense.py runs one against transformers).
  sparse = config_from_hf({**QWEN_3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
  assert sparse.moe_layers == tuple(range(3, 48, 2))
  with pytest.raises(UserError, match="decoder_sparse_step=0, mlp_only_layers=\\[\\] must be "
                                      "a positive integer"):
    config_from_hf({**QWEN_3_30B_A3B, "decoder_sparse_step": 0})
  with pytest.raises(UserError, match="no Hugging Face equivalent.*num_experts=4"):
    hf_architecture(get_preset("tiny_gemma", num_experts=4))  # GeGLU experts: no HF MoE class
  with pytest.raises(UserError, match="no Hugging Face equivalent.*router='softmax_topk'"):
    hf_architecture(get_preset("tiny", num_experts=4))  # Qwen's router without Qwen's q/k norm
