"""config.json translation, checked on the published configs of real checkpoints (no torch)."""

import pytest

from distillax.errors import UserError
from distillax.models.config import get_preset
from distillax.models.hf_config import config_from_hf, config_to_hf, hf_architecture

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


def test_unsupported_features_are_named():
  with pytest.raises(UserError, match="attention_bias"):
    config_from_hf({**LLAMA_3_2_1B, "attention_bias": True})
  with pytest.raises(UserError, match="RoPE type 'yarn'"):
    config_from_hf({**LLAMA_3_2_1B, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
  with pytest.raises(UserError, match="hidden_act='relu'"):
    config_from_hf({**LLAMA_3_2_1B, "hidden_act": "relu"})
  with pytest.raises(UserError, match="unsupported architecture 'Qwen2ForCausalLM'"):
    config_from_hf({**LLAMA_3_2_1B, "architectures": ["Qwen2ForCausalLM"]})
