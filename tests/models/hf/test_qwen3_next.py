"""Qwen3-Next (Qwen3NextForCausalLM) against transformers 5.24: the full forward, KV-cached
decode and packed documents against each document run alone; the export is the file
transformers' own save_pretrained writes (in_proj_qkvz / in_proj_ba grouped by key head),
tensor for tensor; multi-token-prediction weights are left out; transformers' defaults read as
the qwen3-next-80b-a3b preset's shape; a student of teacher blocks keeps each block's token
mixer and dense or routed MLP.

A tiny random model built from a config (nothing is downloaded): three Gated DeltaNet layers (2
key heads of 8, 4 value heads of 6) then a gated attention layer, 4 experts of width 24 (top-2,
not renormalised) beside a gated shared expert of width 40 in layers 0, 2 and 3, a dense MLP of
width 40 in layer 1 (mlp_only_layers). Weights and norms are drawn wider than HF's init so every
part shows in the logits; A_log and dt_bias keep HF's init.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (blocks_state, cached_decode_delta,  # noqa: E402
                              packed_documents_delta, saved_with_logits, torch_logits,
                              widened_qwen35)
from tests.support.models import forward, param_arrays  # noqa: E402

L, F = "linear_attention", "full_attention"
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24,
              shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=64,
              tie_word_embeddings=False)
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _qwen3_next(**changes):
  torch.manual_seed(0)
  config = transformers.Qwen3NextConfig(**{**CONFIG, **changes}, attn_implementation="eager")
  return widened_qwen35(transformers.Qwen3NextForCausalLM(config))


@pytest.fixture(scope="module")
def hf_model():
  return _qwen3_next()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("qwen3_next"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0], linear_attention_chunk=4)  # 11 tokens: 3 chunks


def _delta(model, want) -> float:
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  return float(np.max(np.abs(got - want)))


def test_qwen3_next_matches_transformers_full_forward_cached_decode_and_packed(
    hf_model, hf_checkpoint, ours):
  """Prefill 6 tokens (chunked), then 3 greedy steps (recurrent, conv and delta-rule state
  carried); packed rows hold a 4 and a 7, a 6 and a 5-token document."""
  cfg = ours.config
  assert (cfg.fused_qkvz_ba, cfg.moe_layers, cfg.norm_topk_prob, cfg.shared_expert_gate,
          cfg.mlp_dim, cfg.expert_mlp_dim) == (True, (0, 2, 3), False, True, 40, 24)
  assert cfg.token_mixers == (L, L, L, F) and cfg.rotary_dim == 4
  want = hf_checkpoint[1]
  full = _delta(ours, want)
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :6], steps=3)
  packed = packed_documents_delta(hf_model, ours, TOKENS, cuts=[4, 6])
  print(f"\nqwen3-next max |dlogit| vs transformers: full forward {full:.1e}, cached decode "
        f"{decode:.1e}, packed documents {packed:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0
  assert max(full, decode, packed) <= 1e-4


def test_qwen3_next_export_is_transformers_own_file_and_mtp_is_left_out(
    hf_checkpoint, ours, tmp_path):
  path = hf_checkpoint[0]
  hf.save(ours, tmp_path / "export")
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  assert (written["model_type"], written["mlp_only_layers"], written["norm_topk_prob"]) == (
      "qwen3_next", [1], False)
  assert config_from_hf(config_to_hf(ours.config), linear_attention_chunk=4) == ours.config
  read = transformers.AutoConfig.from_pretrained(tmp_path / "export")
  assert (type(read).__name__, read.mlp_only_layers, read.layer_types) == (
      "Qwen3NextConfig", [1], [L, L, L, F])
  theirs = load_file(str(path / "model.safetensors"))
  mine = load_file(str(tmp_path / "export" / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  assert mine["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * (16 + 24), 32)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)
  # A released checkpoint's multi-token-prediction head (mtp.*), which transformers ignores.
  with_mtp = tmp_path / "with_mtp"
  with_mtp.mkdir()
  save_file({**theirs, "mtp.fc.weight": np.ones((32, 64), np.float32)},
            str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
  (with_mtp / "config.json").write_text((path / "config.json").read_text())
  for name, array in param_arrays(hf.load(with_mtp, linear_attention_chunk=4)).items():
    np.testing.assert_array_equal(array, param_arrays(ours)[name], err_msg=name)


def test_transformers_defaults_are_the_80b_presets_shape():
  """Qwen3NextConfig's defaults are Qwen3-Next-80B-A3B's shape; its config.json adds
  intermediate_size 5120 (no layer uses it), RoPE base 1e7 and a 262,144 context."""
  default = transformers.Qwen3NextConfig(intermediate_size=5120,
                                         max_position_embeddings=262_144).to_dict()
  default["rope_parameters"]["rope_theta"] = 10_000_000.0
  assert config_from_hf(default, dtype="bfloat16") == get_preset("qwen3-next-80b-a3b")


def test_a_qwen3_next_student_of_teacher_blocks_keeps_mixers_and_mlps(hf_model, hf_checkpoint):
  """Blocks (3, 1): the gated attention block with experts, then the dense DeltaNet block; its
  logits are transformers' Qwen3-Next of layer_types [full, linear] with mlp_only_layers [1]."""
  layers = (3, 1)
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), layers)
  cfg = source.model_config()
  assert (cfg.token_mixers, cfg.moe_layers) == ((F, L), (0,))
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  picked = _qwen3_next(num_hidden_layers=2, layer_types=[F, L])
  picked.load_state_dict(blocks_state(hf_model, layers))
  assert _delta(student, torch_logits(picked.eval(), TOKENS)) <= 1e-4
