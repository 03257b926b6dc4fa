"""Qwen3.5 (Qwen3_5ForCausalLM, the dense text decoder) against transformers 5.24: the full
forward (also loaded sharded, each device reading its heads' rows of the shared in_proj_qkv and
q_proj tensors), KV-cached decode, packed documents against each document run alone, export
back to transformers with an exact round trip, and the text decoder of a
Qwen3_5ForConditionalGeneration checkpoint.

A tiny random model built from a config (nothing is downloaded): 4 layers (three Gated DeltaNet,
one gated full attention), 2 key heads serving 4 value heads, partial RoPE over a quarter of
head_dim 16. Weights and norms are drawn wider than HF's init so every part shows in the logits;
A_log and dt_bias keep HF's init (decay rates 0.01..16).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distillax import partitioning as pt  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from distillax.models.transformer import layer_params  # noqa: E402
from tests.support.hf import (cached_decode_delta, packed_documents_delta,  # noqa: E402
                              saved_with_logits, torch_logits, widened_qwen35)
from tests.support.models import Normal, forward, random_model  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=64,
              tie_word_embeddings=False, attn_implementation="eager")
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  return widened_qwen35(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG)))


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("qwen35"), TOKENS)


def test_qwen35_import_matches_transformers_full_forward_and_sharded(hf_checkpoint):
  path, want = hf_checkpoint
  model = hf.load(path, linear_attention_chunk=4)  # 11 tokens: 3 chunks, the last partial
  cfg = model.config
  assert cfg.token_mixers == ("linear_attention",) * 3 + ("full_attention",)
  assert (cfg.partial_rotary_factor, cfg.attn_output_gate, cfg.rotary_dim) == (0.25, True, 4)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  delta = float(np.max(np.abs(got - want)))
  print(f"\nqwen3.5 full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0 and delta <= 1e-4

  # Heads over model: each device reads one key head of in_proj_qkv and two query heads (with
  # their gate rows) of q_proj.
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "tp", "replicate_indivisible": True})
  sharded = hf.load(path, mesh=mesh, rules=rules)
  assert sharded.layers[0].attn.q.addressable_shards[0].data.shape == (32, 1, 8)
  assert sharded.layers[3].attn.out_gate.addressable_shards[0].data.shape == (32, 2, 16)
  graphdef, state = nnx.split(sharded)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  got = np.asarray(logits(state, jnp.asarray(TOKENS, jnp.int32)))
  assert float(np.max(np.abs(got - want))) <= 1e-4


def test_qwen35_cached_decode_matches_transformers(hf_model, hf_checkpoint):
  """Prefill 6 tokens (chunked), then 5 greedy steps (recurrent, conv state carried)."""
  delta = cached_decode_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS[:, :6], steps=5)
  print(f"\nqwen3.5 cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_qwen35_packed_documents_match_each_document_alone_in_transformers(hf_model,
                                                                           hf_checkpoint):
  """Row 0 packs a 4-token and a 7-token document (positions restart), row 1 a 6 and a 5:
  each document's logits are transformers' for that document alone."""
  model = hf.load(hf_checkpoint[0], linear_attention_chunk=4)
  delta = packed_documents_delta(hf_model, model, TOKENS, cuts=[4, 6])
  print(f"\nqwen3.5 packed documents: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_qwen35_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  ours = random_model(hf.load(hf_checkpoint[0]).config, seed=7, init=Normal(0.1))
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
  assert written["rope_parameters"]["partial_rotary_factor"] == 0.25
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "Qwen3_5ForCausalLM"
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_qwen35_multimodal_checkpoint_loads_its_text_decoder(tmp_path):
  """A Qwen3_5ForConditionalGeneration with a 1-block vision tower, tied at the wrapper's level
  (config.json: tie_word_embeddings true outside, false in text_config; no lm_head stored), its
  text decoder under model.language_model., and a multi-token-prediction tensor (mtp.*, as the
  released checkpoints carry; transformers ignores it): distillax reads the text decoder,
  ignores the rest, and its logits are the wrapper's on text."""
  vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                patch_size=4, num_position_embeddings=16)
  text = {k: v for k, v in CONFIG.items() if k not in ("attn_implementation",
                                                       "tie_word_embeddings")}
  config = transformers.Qwen3_5Config(
      text_config=text, vision_config=vision, image_token_id=92, video_token_id=93,
      vision_start_token_id=94, vision_end_token_id=95, tie_word_embeddings=True,
      attn_implementation="eager")
  torch.manual_seed(3)
  wrapper = transformers.Qwen3_5ForConditionalGeneration(config)
  with torch.no_grad():
    for name, p in wrapper.named_parameters():
      if not name.endswith(("A_log", "dt_bias")):
        p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  wrapper.eval().save_pretrained(tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["tie_word_embeddings"], written["text_config"]["tie_word_embeddings"]) == (
      True, False)
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tmp_path / "model.safetensors"))
  assert "lm_head.weight" not in tensors and any(n.startswith("model.visual.") for n in tensors)
  tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  model = hf.load(tmp_path, linear_attention_chunk=4)
  assert (model.config.num_layers, model.config.tie_embeddings) == (4, True)
  assert model.config.token_mixers == ("linear_attention",) * 3 + ("full_attention",)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  want = torch_logits(wrapper, TOKENS)
  delta = float(np.max(np.abs(got - want)))
  print(f"\nqwen3.5 multimodal checkpoint, text decoder: max |dlogit| {delta:.1e}")
  assert float(np.abs(want).max()) > 1.0 and delta <= 1e-4


def test_a_qwen35_student_of_teacher_blocks_keeps_each_blocks_token_mixer(hf_checkpoint):
  """Blocks (3, 0, 1), loaded sharded: the gated attention block first, then two Gated DeltaNet
  blocks, each the teacher's block bit for bit (a block's mixer is its weights' kind, so equal
  weights under these token_mixers are the blocks transformers runs under layer_types [full,
  linear, linear])."""
  layers = (3, 0, 1)
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), layers)
  cfg = source.model_config()
  assert cfg.token_mixers == ("full_attention", "linear_attention", "linear_attention")
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  teacher = layer_params(hf.load(hf_checkpoint[0]))
  for i, t in enumerate(layers):
    mine, theirs = layer_params(student)[i], teacher[t]
    assert jax.tree.structure(mine) == jax.tree.structure(theirs), (i, t)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
