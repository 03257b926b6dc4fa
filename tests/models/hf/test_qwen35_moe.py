"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, the text decoder) against transformers 5.24: the full
forward, KV-cached decode and packed documents against each document run alone; the export is
the file transformers' own save_pretrained writes, tensor for tensor; experts stored fused
(transformers' in-memory layout: gate_up_proj, down_proj) under the
Qwen3_5MoeForConditionalGeneration wrapper's text tower read as the same weights; and a student of
teacher blocks that keeps two experts per layer keeps the shared expert whole.

A tiny random model built from a config (nothing is downloaded): Qwen3.5's 4 layers (three Gated
DeltaNet, one gated full attention) with 4 experts of width 24 (top-2, renormalised) beside a
shared expert of width 40 whose output a sigmoid gate scales. Weights and norms are drawn wider
than HF's init so every part shows in the logits; A_log and dt_bias keep HF's init.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.transformer import layer_params  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (cached_decode_delta, packed_documents_delta,  # noqa: E402
                              saved_with_logits, widened_qwen35)
from tests.support.models import forward  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
              linear_num_value_heads=4, moe_intermediate_size=24,
              shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=64, tie_word_embeddings=False)
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  config = transformers.Qwen3_5MoeTextConfig(**CONFIG, attn_implementation="eager")
  return widened_qwen35(transformers.Qwen3_5MoeForCausalLM(config))


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("qwen35_moe"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0], linear_attention_chunk=4)  # 11 tokens: 3 chunks


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_qwen35_moe_matches_transformers_full_forward_cached_decode_and_packed(
    hf_model, hf_checkpoint, ours):
  """Prefill the 11 tokens (chunked), then a greedy step (recurrent, conv and delta-rule state
  carried); packed rows hold a 4 and a 7, a 6 and a 5-token document. One shape throughout but
  the step's: eager calls reuse each other's compiled ops."""
  cfg = ours.config
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_mlp_dim, cfg.norm_topk_prob,
          cfg.shared_expert_mlp_dim, cfg.shared_expert_gate) == (4, 2, 24, True, 40, True)
  assert cfg.token_mixers == ("linear_attention",) * 3 + ("full_attention",)
  want = hf_checkpoint[1]
  got = forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV
  full = float(np.max(np.abs(np.asarray(got) - want)))
  decode = cached_decode_delta(hf_model, ours, TOKENS, steps=1)
  packed = packed_documents_delta(hf_model, ours, TOKENS, cuts=[4, 6])
  print(f"\nqwen3.5-moe max |dlogit| vs transformers: full forward {full:.1e}, cached decode "
        f"{decode:.1e}, packed documents {packed:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0
  assert max(full, decode, packed) <= 1e-4


def test_qwen35_moe_export_is_transformers_own_file_and_fused_wrapper_reads_the_same(
    hf_model, hf_checkpoint, ours, tmp_path):
  path = hf_checkpoint[0]
  hf.save(ours, tmp_path / "export")
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  assert (written["model_type"], written["shared_expert_intermediate_size"],
          written["moe_intermediate_size"], written["num_experts"]) == (
              "qwen3_5_moe_text", 40, 24, 4)
  assert config_from_hf(config_to_hf(ours.config), linear_attention_chunk=4) == ours.config
  # The preset's shape is transformers' default (Qwen3.5-35B-A3B's); its RoPE base and context
  # are the dense Qwen3.5 presets'.
  default = config_from_hf(transformers.Qwen3_5MoeTextConfig().to_dict(), dtype="bfloat16")
  assert default.replace(rope_theta=1e7, max_seq_len=262_144) == get_preset("qwen3.5-35b-a3b")
  read = transformers.AutoConfig.from_pretrained(tmp_path / "export")
  assert (type(read).__name__, read.shared_expert_intermediate_size) == (
      "Qwen3_5MoeTextConfig", 40)
  theirs = load_file(str(path / "model.safetensors"))
  mine = load_file(str(tmp_path / "export" / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)

  # The wrapper's text tower with its experts fused, as transformers holds them in memory
  # (model.language_model.*, gate_up_proj (E, 2F, D), down_proj (E, D, F)), beside a vision
  # tensor and a multi-token-prediction one the text decoder ignores.
  wrapped = tmp_path / "wrapped"
  wrapped.mkdir()
  state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k):
           v.numpy() for k, v in hf_model.state_dict().items()}
  assert state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 32)
  state["model.visual.patch_embed.proj.weight"] = np.ones((16, 3), np.float32)
  state["mtp.fc.weight"] = np.ones((32, 64), np.float32)
  save_file(state, str(wrapped / "model.safetensors"), metadata={"format": "pt"})
  text = {k: v for k, v in CONFIG.items() if k != "tie_word_embeddings"}
  (wrapped / "config.json").write_text(json.dumps({
      "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
      "tie_word_embeddings": False, "text_config": {**text, "model_type": "qwen3_5_moe_text"},
      "vision_config": {"depth": 1}}))
  model = hf.load(wrapped, linear_attention_chunk=4)
  assert model.config == ours.config
  for a, b in zip(_params(model), _params(ours)):
    np.testing.assert_array_equal(a, b)


def test_a_qwen35_moe_student_of_blocks_keeps_chosen_experts_and_the_whole_shared_expert(
    hf_checkpoint, ours):
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), (3, 0),
                        experts=(2, 0))
  cfg = source.model_config()
  assert (cfg.token_mixers, cfg.num_experts, cfg.shared_expert_mlp_dim) == (
      ("full_attention", "linear_attention"), 2, 40)
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  teacher = layer_params(ours)
  for i, t in enumerate((3, 0)):
    mine, theirs = layer_params(student)[i]["mlp"], teacher[t]["mlp"]
    np.testing.assert_array_equal(mine["router"], np.asarray(theirs["router"])[:, [2, 0]])
    np.testing.assert_array_equal(mine["gate"], np.asarray(theirs["gate"])[[2, 0]])
    for a, b in zip(jax.tree.leaves(mine["shared_expert"]),
                    jax.tree.leaves(theirs["shared_expert"])):
      np.testing.assert_array_equal(a, b)
