"""Llama 4's text decoder (Llama4ForCausalLM) against transformers 5.24: the full forward, a
KV-cached decode across chunk boundaries and packed documents against each document run alone;
each Llama 4 part moves the logits; the export is the file transformers' own save_pretrained
writes (q/k rows with side-by-side RoPE pairs, stacked experts), tensor for tensor; a
Llama4ForConditionalGeneration checkpoint's text tower reads as the same weights; Scout's and
Maverick's config.json read as the presets; a student of teacher blocks keeps each block's
RoPE, chunking and MLP; one-line refusals.

A tiny random model built from a config (nothing is downloaded): 4 layers, the 4th RoPE-free
(full attention, temperature tuning at floor 4, scale 0.5), the others in chunks of 4 positions
with q/k L2 norms; 4 experts of width 24 (top-1, sigmoid, input-scaled) beside a shared expert
in layers 1 and 3, dense MLPs of width 40 in layers 0 and 2. Weights and norm scales
(1 + N(0, 0.3^2)) are drawn wider than HF's init so every part shows in the logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.transformer import with_config  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (blocks_state, cached_decode_delta,  # noqa: E402
                              packed_documents_delta, saved_with_logits, torch_logits)
from tests.support.models import forward, param_arrays  # noqa: E402

C, F = "chunked_attention", "full_attention"
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              attention_chunk_size=4, floor_scale=4, attn_scale=0.5, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 50.0})
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _llama4(**changes):
  torch.manual_seed(0)
  config = transformers.Llama4TextConfig(**{**CONFIG, **changes}, attn_implementation="eager")
  return transformers.Llama4ForCausalLM(config)


@pytest.fixture(scope="module")
def hf_model():
  model = _llama4()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(*((1.0, 0.3) if "norm" in name else (0.0, 0.1)))
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("llama4"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0])


def _delta(model, want) -> float:
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  return float(np.max(np.abs(got - want)))


def test_llama4_matches_transformers_full_forward_cached_decode_and_packed(
    hf_model, hf_checkpoint, ours):
  """Prefill 5 tokens, then 6 greedy steps (through the chunk boundaries at 4 and 8); packed rows
  hold a 4 and a 7, a 6 and a 5-token document (positions, chunks and temperatures restart).
  Without its chunks, its temperature tuning or its q/k norms it is another model."""
  cfg = ours.config
  assert (cfg.rope_free_layers, cfg.attention_chunk_size, cfg.qk_l2_norm,
          cfg.attn_temperature_floor_scale, cfg.attn_temperature_scale) == ((3,), 4, True, 4, 0.5)
  assert (cfg.moe_layers, cfg.router, cfg.moe_scale_inputs, cfg.mlp_dim, cfg.expert_mlp_dim,
          cfg.shared_expert_mlp_dim) == ((1, 3), "sigmoid", True, 40, 24, 24)
  want = hf_checkpoint[1]
  full = _delta(ours, want)
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :5], steps=6)
  packed = packed_documents_delta(hf_model, ours, TOKENS, cuts=[4, 6])
  print(f"\nllama4 max |dlogit| vs transformers: full forward {full:.1e}, cached decode "
        f"{decode:.1e}, packed documents {packed:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0
  assert max(full, decode, packed) <= 1e-4
  for off in ({"attention_chunk_size": None}, {"attn_temperature_floor_scale": None},
              {"qk_l2_norm": False}):
    assert _delta(with_config(ours, **off), want) > 1e-2, off


def test_llama4_export_is_transformers_own_file_and_the_wrapper_reads_the_same(
    hf_model, hf_checkpoint, ours, tmp_path):
  path = hf_checkpoint[0]
  hf.save(ours, tmp_path / "export")
  written = json.loads((tmp_path / "export" / "config.json").read_text())
  assert (written["model_type"], written["moe_layers"], written["no_rope_layers"],
          written["layer_types"]) == ("llama4_text", [1, 3], [1, 1, 1, 0], [C, C, C, F])
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  read = transformers.AutoConfig.from_pretrained(tmp_path / "export")
  assert (type(read).__name__, read.intermediate_size_mlp, read.floor_scale) == (
      "Llama4TextConfig", 40, 4)
  theirs = load_file(str(path / "model.safetensors"))
  mine = load_file(str(tmp_path / "export" / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)
  # A released Llama4ForConditionalGeneration checkpoint: the text tower under
  # language_model.*, beside a vision tensor the text decoder leaves out.
  wrapped = tmp_path / "wrapped"
  wrapped.mkdir()
  state = {"language_model." + k: v for k, v in theirs.items()}
  state["vision_model.patch_embedding.linear.weight"] = np.ones((8, 12), np.float32)
  save_file(state, str(wrapped / "model.safetensors"), metadata={"format": "pt"})
  (wrapped / "config.json").write_text(json.dumps({
      "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
      "text_config": json.loads((path / "config.json").read_text()),
      "vision_config": {"hidden_size": 8}}))
  model = hf.load(wrapped)
  assert model.config == ours.config
  for name, array in param_arrays(model).items():
    np.testing.assert_array_equal(array, param_arrays(ours)[name], err_msg=name)


def test_scout_and_maverick_config_json_read_as_the_presets():
  text = dict(vocab_size=202_048, hidden_size=5120, intermediate_size=8192,
              intermediate_size_mlp=16_384, num_hidden_layers=48, num_attention_heads=40,
              num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500_000.0,
              num_experts_per_tok=1, attention_chunk_size=8192, hidden_act="silu",
              architectures=["Llama4ForCausalLM"])
  scout = {**text, "num_local_experts": 16, "interleave_moe_layer_step": 1,
           "use_qk_norm": True, "max_position_embeddings": 10_485_760,
           "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
  maverick = {**text, "num_local_experts": 128, "interleave_moe_layer_step": 2,
              "use_qk_norm": False, "max_position_embeddings": 1_048_576, "rope_scaling": None}
  assert config_from_hf(scout, dtype="bfloat16") == get_preset("llama4-scout-17b-16e")
  assert config_from_hf(maverick, dtype="bfloat16") == get_preset("llama4-maverick-17b-128e")


def test_a_llama4_student_of_teacher_blocks_keeps_each_blocks_parts(hf_model, hf_checkpoint):
  """Blocks (3, 0): the RoPE-free MoE block (full attention, temperature) then a RoPE dense
  block (chunked, L2 norms); its logits are transformers' Llama 4 of those two layers."""
  layers = (3, 0)
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), layers)
  cfg = source.model_config()
  assert (cfg.rope_free_layers, cfg.moe_layers) == ((0,), (0,))
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  picked = _llama4(num_hidden_layers=2, no_rope_layers=[0, 1], moe_layers=[0])
  picked.load_state_dict(blocks_state(hf_model, layers))
  assert _delta(student, torch_logits(picked.eval(), TOKENS)) <= 1e-4


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for Llama4ForCausalLM"),
    ({"layer_types": [F, C, C, F]}, "chunked attention exactly in the layers with RoPE"),
    ({"moe_layers": []}, "a Llama 4 without MoE layers"),
])
def test_what_distillax_does_not_read_of_llama4_is_refused_in_one_line(changes, message):
  with pytest.raises(UserError, match=message):
    config_from_hf({**CONFIG, "architectures": ["Llama4ForCausalLM"], **changes})
