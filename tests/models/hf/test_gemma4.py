"""Gemma 4's text decoder (Gemma4ForCausalLM, and the text tower of a
Gemma4ForConditionalGeneration checkpoint) against transformers 5.24: the full forward, KV-cached
decode, packed documents against each document alone, export back with an exact round trip, and
students of teacher blocks (kept as transformers runs those blocks, or refused in one line).

A tiny random model built from a config (nothing is downloaded): 5 layers (sliding, full,
sliding, sliding, full; window 4), per-layer inputs of width 8, the last 2 layers sharing the
keys/values of layers 2 (sliding) and 1 (full) with double-wide MLPs, head_dim 16 on sliding
layers and 32 on full ones, RoPE base 10k on sliding layers and a proportional RoPE (half the
pairs turning, base 100) on full ones, a final soft-cap, layer scalars drawn away from 1: the
released E2B's parts. transformers writes the full layers' head_dim only into per_layer_config
(which distillax reads first), not as global_head_dim, the key of the released config.json
files: the fixture writes that too.

The MoE variant (the 26B-A4B's enable_moe_block: a dense MLP beside routed experts, each with its
own norms) runs in a 3-layer model of the same parts (sliding, full, full; the last sharing the
full layer's keys/values) with 4 experts of width 24, top-2: parity, its export, and the
multimodal wrapper's text tower, which is this MoE variant.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import ConfigError, UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.attention.layer import KVCache  # noqa: E402
from distillax.models.config import ROPE_GLOBAL, ROPE_LOCAL  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.models.init import param_count  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.sampler import generate  # noqa: E402
from distillax.models.transformer import with_config  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (blocks_state, cached_decode_delta,  # noqa: E402
                              packed_documents_delta, torch_logits)
from tests.support.models import Normal, forward, random_model  # noqa: E402

S, F = "sliding_attention", "full_attention"
ROPES = {S: {"rope_type": "default", "rope_theta": 10_000.0},
         F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0}}
GLOBAL_HEAD_DIM = 32
TEXT = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=GLOBAL_HEAD_DIM,
            sliding_window=4, layer_types=[S, F, S, S, F], hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=97, num_kv_shared_layers=2, final_logit_softcapping=30.0,
            rope_parameters=ROPES, pad_token_id=0, bos_token_id=2, eos_token_id=1,
            max_position_embeddings=64, use_double_wide_mlp=True)
MOE_TEXT = {**TEXT, "num_hidden_layers": 3, "layer_types": [S, F, F], "num_kv_shared_layers": 1,
            "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 24}
TOKENS = np.random.default_rng(1).integers(3, 90, size=(2, 11)).astype(np.int64)


def _randomize(model):
  """Weights wider than HF's init, norm scales 1 + N(0, 0.1^2), layer scalars 0.5..1.3, so
  every part shows."""
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.1)
    scalars = [b for name, b in model.named_buffers() if name.endswith("layer_scalar")]
    for i, b in enumerate(scalars):
      b.fill_(0.5 + 0.2 * i)
  return model.eval()


def _save(model, path, text_config_key=None):
  """save_pretrained, then global_head_dim written into config.json (see the docstring)."""
  model.save_pretrained(path)
  config = json.loads((path / "config.json").read_text())
  (config[text_config_key] if text_config_key else config)["global_head_dim"] = GLOBAL_HEAD_DIM
  (path / "config.json").write_text(json.dumps(config))
  return path


@pytest.fixture(scope="module")
def hf_model():
  config = transformers.Gemma4TextConfig(**TEXT, attn_implementation="eager")
  return _randomize(transformers.Gemma4ForCausalLM(config))


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return _save(hf_model, tmp_path_factory.mktemp("gemma4"))


def test_gemma4_import_matches_transformers_full_forward(hf_model, hf_checkpoint):
  model = hf.load(hf_checkpoint)
  cfg = model.config
  assert (cfg.per_layer_input_dim, cfg.num_kv_shared_layers, cfg.final_logit_softcap) == (8, 2,
                                                                                          30.0)
  assert (cfg.rope_theta, cfg.rope_local_theta, cfg.global_rope_fraction) == (100.0, 10_000.0, 0.5)
  assert [cfg.layer_head_dim(i) for i in range(5)] == [16, 32, 16, 16, 32]
  assert [cfg.layer_mlp_dim(i) for i in range(5)] == [48, 48, 48, 96, 96]
  assert [cfg.kv_source_layer(i) for i in range(5)] == [None, None, None, 2, 1]
  assert model.layers[3].attn.k is None and model.layers[2].attn.k is not None
  # sharing layers cache nothing; the cache is as wide as the widest layer
  assert KVCache.zeros(cfg, 1, 8).k_NxBxSxKxH.shape == (3, 1, 8, 2, 32)
  want = torch_logits(hf_model, TOKENS)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  delta = float(np.max(np.abs(got - want)))
  print(f"\ngemma4 full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0 and delta <= 1e-4


def test_gemma4_cached_decode_matches_transformers(hf_model, hf_checkpoint):
  """Prefill 6 tokens, then 5 greedy steps: the sliding window (4) is passed, and the sharing
  layers read their source layers' cached keys/values."""
  delta = cached_decode_delta(hf_model, hf.load(hf_checkpoint), TOKENS[:, :6], steps=5)
  print(f"\ngemma4 cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_gemma4_packed_documents_match_each_document_alone_in_transformers(hf_model,
                                                                           hf_checkpoint):
  """Row 0 packs a 4-token and a 7-token document (positions restart), row 1 a 6 and a 5."""
  delta = packed_documents_delta(hf_model, hf.load(hf_checkpoint), TOKENS, cuts=[4, 6])
  print(f"\ngemma4 packed documents: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_gemma4_sampler_over_left_padded_prompts_matches_greedy_full_forwards(hf_checkpoint):
  """The sampler's KV cache (sharing layers cache nothing; full layers wider): greedy
  generation over prompts of 6 and 4 tokens (the shorter padded ahead of it in the cache)
  equals argmax decoding each prompt alone by full forwards."""
  model = hf.load(hf_checkpoint)
  lengths, new = np.array([6, 4]), 3
  out = generate(model, jnp.asarray(TOKENS[:, :6], jnp.int32), jnp.asarray(lengths),
                 max_new_tokens=new)
  seqs, rows = np.array(TOKENS), np.arange(2)
  for step in range(new):
    logits = np.asarray(forward(model, jnp.asarray(seqs, jnp.int32)).logits_BxLxV)
    seqs[rows, lengths + step] = logits[rows, lengths + step - 1].argmax(-1)
  np.testing.assert_array_equal(out.tokens_BxT, seqs[rows[:, None], lengths[:, None] +
                                                     np.arange(new)])


def test_gemma4_multimodal_checkpoint_loads_its_text_tower(tmp_path):
  """A Gemma4ForConditionalGeneration with tiny vision and audio towers: its text decoder
  (weights under model.language_model.; Gemma 4's MoE block) loads and gives the wrapper's
  logits on text, its experts run by tokamax's grouped matmul."""
  text = {**MOE_TEXT, "num_hidden_layers": 4, "layer_types": [S, F, S, F]}
  config = transformers.Gemma4Config(
      text_config=text,
      vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         position_embedding_size=64, patch_size=4),
      audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        subsampling_conv_channels=[4, 4], output_proj_dims=16),
      boi_token_id=90, eoi_token_id=91, image_token_id=92, video_token_id=93, boa_token_id=94,
      eoa_token_index=95, audio_token_id=96, attn_implementation="eager")
  wrapper = _randomize(transformers.Gemma4ForConditionalGeneration(config))
  path = _save(wrapper, tmp_path, "text_config")
  model = hf.load(path)
  assert model.config.num_layers == 4 and model.config.num_kv_shared_layers == 1
  assert model.config.moe_dense_mlp and model.config.num_experts == 4
  model = with_config(model, moe_impl="tokamax")
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  delta = float(np.max(np.abs(got - torch_logits(wrapper, TOKENS))))
  assert delta <= 1e-4


def test_gemma4_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  ours = random_model(hf.load(hf_checkpoint).config, seed=7, init=Normal(0.15))
  hf.save(ours, tmp_path)
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "Gemma4ForCausalLM"
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_gemma4_keys_as_values_import_decode_and_export_match_transformers(tmp_path):
  """The 31B's full layers (attention_k_eq_v: no v_proj, values = keys before k_norm and RoPE)
  over 1 key/value head against the sliding layers' 2 (num_global_key_value_heads), the last
  layer sharing them: 3 layers (sliding, full, full). Read from the per_layer_config
  transformers writes; the full forward, a cached prefill (the cache as wide as the widest
  layer in heads and features) and the export back match transformers."""
  text = {**TEXT, "num_hidden_layers": 3, "layer_types": [S, F, F], "num_kv_shared_layers": 1,
          "attention_k_eq_v": True, "num_global_key_value_heads": 1}
  theirs = _randomize(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
      **text, attn_implementation="eager")))
  assert theirs.model.layers[1].self_attn.v_proj is None
  theirs.save_pretrained(tmp_path / "in")
  model = hf.load(tmp_path / "in")
  cfg = model.config
  assert (cfg.attention_k_eq_v, cfg.global_num_kv_heads, cfg.global_head_dim) == (True, 1, 32)
  assert model.layers[1].attn.v is None and model.layers[0].attn.v is not None
  assert model.layers[1].attn.k.shape == (32, 1, 32)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(theirs, TOKENS)))) <= 1e-4
  # The prefill writes and reads the cache (1 kv head of 32 features in a 2 x 32 wide cache).
  assert cached_decode_delta(theirs, model, TOKENS[:, :6], steps=0) <= 1e-4
  hf.save(model, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").eval()
  assert reloaded.model.layers[1].self_attn.k_proj.weight.shape == (32, 32)
  assert float(np.max(np.abs(got - torch_logits(reloaded, TOKENS)))) <= 1e-4
  assert hf.load(tmp_path / "out").config == cfg


# e4b: 7,463,013,418 and 26b-a4b: 25,233,141,790 (its model card's 25.2B), each run once
@pytest.mark.parametrize("name", ["tiny_gemma4", "gemma4-e2b", "tiny_gemma4_moe"])
def test_gemma4_presets_are_the_gemma4_their_config_json_builds(name):
  """Each preset through config.json and back is itself, and the Gemma4ForCausalLM it builds
  (on the meta device: no memory) has our parameters: HF's count plus one per layer
  (layer_scalar is a buffer there, a parameter here). E2B's text decoder: 4,628,569,379
  (+ the vision and audio towers: the 5.1B of its model card). gemma4-e4b, the same check run
  once (3 s): 7,463,013,418."""
  cfg = get_preset(name)
  hf_config = config_to_hf(cfg)
  assert config_from_hf(hf_config, dtype=cfg.param_dtype) == cfg
  with torch.device("meta"):
    theirs = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{
        k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}))
  first_shared = cfg.num_layers - cfg.num_kv_shared_layers
  assert [hasattr(layer.self_attn, "k_proj") for layer in theirs.model.layers] == (
      [True] * first_shared + [False] * cfg.num_kv_shared_layers)
  assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) + cfg.num_layers


@pytest.mark.parametrize("key, value", [("use_bidirectional_attention", "all")])
def test_gemma4_parts_not_read_yet_are_refused_in_one_line(key, value):
  hf_config = {**TEXT, "architectures": ["Gemma4ForCausalLM"], key: value}
  with pytest.raises(UserError, match=f"Gemma 4 with {key}={value!r} is not supported yet"):
    config_from_hf(hf_config)


@pytest.mark.parametrize("change, message", [
    (dict(scan_layers=True), "model.scan_layers=True cannot stack Gemma 4's layers"),
    (dict(num_kv_shared_layers=4), "layer 1 (full_attention) has no earlier full_attention layer"),
    (dict(num_kv_shared_layers=5), "must leave at least one of the model.num_layers=5 layers"),
    (dict(global_rope_fraction=0.3), "model.global_rope_fraction=0.3 must be in (0, 1]"),
])
def test_gemma4_config_refuses_with_the_field_and_value(change, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    get_preset("tiny_gemma4").replace(**change)


def test_a_gemma4_student_of_teacher_blocks_keeps_each_blocks_parts(hf_model, hf_checkpoint):
  """Blocks (2, 1, 4), loaded sharded: a sliding block (head_dim 16, base 10k), a full one
  (head_dim 32, proportional RoPE) and the full sharing block 4, which attends with block 1's
  keys/values and keeps its double-wide MLP; each keeps its columns of the per-layer inputs.
  Its logits are those of transformers' Gemma 4 of layer_types [sliding, full, full] with one
  sharing layer and the teacher's weights of those blocks."""
  layers = (2, 1, 4)
  source = BlocksSource(HFSource(str(hf_checkpoint), "teacher.hf_path"), layers)
  cfg = source.model_config()
  assert cfg.local_layers() == [True, False, False]
  assert cfg.layer_ropes() == (ROPE_LOCAL, ROPE_GLOBAL, ROPE_GLOBAL)
  assert [cfg.layer_head_dim(i) for i in range(3)] == [16, 32, 32]
  assert [cfg.kv_source_layer(i) for i in range(3)] == [None, None, 1]
  assert [cfg.layer_mlp_dim(i) for i in range(3)] == [48, 48, 96]
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  P = TEXT["hidden_size_per_layer_input"]
  columns = [t * P + p for t in layers for p in range(P)]
  state = blocks_state(hf_model, layers)
  state["model.embed_tokens_per_layer.weight"] = state[
      "model.embed_tokens_per_layer.weight"][:, columns]
  state["model.per_layer_model_projection.weight"] = state[
      "model.per_layer_model_projection.weight"][columns]
  picked = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{
      **TEXT, "num_hidden_layers": 3, "layer_types": [S, F, F], "num_kv_shared_layers": 1},
      attn_implementation="eager"))
  picked.load_state_dict(state)
  got = np.asarray(forward(student, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(picked.eval(), TOKENS)))) <= 1e-4


@pytest.mark.parametrize("layers, message", [
    ((0, 3, 4), "teacher block 3 attends with the keys/values of block 2, so block 2 must be "
                "the last sliding_attention block before the sharing ones"),
    ((4, 1), "teacher blocks [4] compute no keys/values of their own "
             "(model.num_kv_shared_layers=2), so they come after every block that does: list "
             "them last, e.g. (1, 4)"),
    ((1, 2), "ends with teacher block 2, a sliding_attention block"),
])
def test_a_gemma4_student_of_blocks_that_cannot_share_as_taught_is_refused(layers, message):
  teacher = config_from_hf({**TEXT, "architectures": ["Gemma4ForCausalLM"]})
  with pytest.raises(ConfigError, match=re.escape(f"student.from_teacher.layers={layers}")
                     + ".*" + re.escape(message)):
    teacher.select_layers(layers)


def test_gemma4_with_equal_rope_bases_keeps_a_plain_rope_on_sliding_layers(tmp_path):
  """Sliding and full layers on one base (100): the sliding layers still turn every pair of
  their head_dim (a default RoPE), not the first pairs of the full layers' proportional one
  (imported as one RoPE, this model's logits were 1.7 off)."""
  text = dict(TEXT, rope_parameters={S: {"rope_type": "default", "rope_theta": 100.0},
                                     F: ROPES[F]})
  config = transformers.Gemma4TextConfig(**text, attn_implementation="eager")
  hf_model = _randomize(transformers.Gemma4ForCausalLM(config))
  model = hf.load(_save(hf_model, tmp_path))
  assert (model.config.rope_theta, model.config.rope_local_theta) == (100.0, 100.0)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(hf_model, TOKENS)))) <= 1e-4
  # Without the sliding layers' own base the model is not Gemma4ForCausalLM's: not exported.
  with pytest.raises(UserError, match="set model.rope_local_theta"):
    config_to_hf(model.config.replace(rope_local_theta=None))


@pytest.fixture(scope="module")
def hf_moe_model():
  config = transformers.Gemma4TextConfig(**MOE_TEXT, attn_implementation="eager")
  return _randomize(transformers.Gemma4ForCausalLM(config))


@pytest.fixture(scope="module")
def hf_moe_checkpoint(hf_moe_model, tmp_path_factory):
  return _save(hf_moe_model, tmp_path_factory.mktemp("gemma4_moe"))


def test_gemma4_moe_import_and_export_match_transformers(hf_moe_model, hf_moe_checkpoint,
                                                         tmp_path):
  """The router (its scale and per-expert scales drawn at random), the experts' gate_up_proj
  halves and the dense branch with its norms: the full forward (given positions and one segment
  id, so the packed run reuses its compile), a cached prefill of 6 and 3 decode steps, and packed
  documents match transformers (the ragged dispatch; the multimodal test runs tokamax's, the
  llama.cpp test the dense reference); the export loads in transformers with these logits and
  reads back exactly."""
  model = hf.load(hf_moe_checkpoint)
  cfg = model.config
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_mlp_dim, cfg.router,
          cfg.moe_dense_mlp) == (4, 2, 24, "gemma4", True)
  positions = jnp.broadcast_to(jnp.arange(TOKENS.shape[1], dtype=jnp.int32), TOKENS.shape)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32), positions,
                           jnp.ones(TOKENS.shape, jnp.int32)).logits_BxLxV)
  want = torch_logits(hf_moe_model, TOKENS)
  deltas = {"full forward": float(np.max(np.abs(got - want))),
            "cached decode": cached_decode_delta(hf_moe_model, model, TOKENS[:, :6], steps=3),
            "packed documents": packed_documents_delta(hf_moe_model, model, TOKENS, cuts=[4, 6])}
  print("\n" + "; ".join(f"gemma4 moe {k}: max |dlogit| {v:.1e}" for k, v in deltas.items()))
  assert float(np.abs(want).max()) > 1.0 and max(deltas.values()) <= 1e-4
  hf.save(model, tmp_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert reloaded.model.layers[0].experts.gate_up_proj.shape == (4, 48, 32)
  assert float(np.max(np.abs(got - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path)
  assert back.config == cfg
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_student_of_gemma4_moe_blocks_keeps_their_experts_and_dense_branch(
    hf_moe_checkpoint):
  """Blocks (0, 2) would leave sharing block 2 without its source (refused); blocks (0, 1), a
  sliding then a full MoE block, loaded sharded with the experts over data (fsdp_ep) and keeping
  all four experts in reverse order (student.from_teacher.experts): each student block holds its
  teacher block's router columns, per-expert scales and experts in that order, and its router
  input scale, dense MLP and norms whole (the teacher's forward is transformers')."""
  with pytest.raises(ConfigError, match="block 1 must be the last full_attention block"):
    BlocksSource(HFSource(str(hf_moe_checkpoint), "teacher.hf_path"), (0, 2)).model_config()
  layers, order = (0, 1), [3, 2, 1, 0]
  source = BlocksSource(HFSource(str(hf_moe_checkpoint), "teacher.hf_path"), layers,
                        experts=tuple(order))
  cfg = source.model_config()
  assert cfg.local_layers() == [True, False] and cfg.moe_dense_mlp and cfg.num_experts == 4
  mesh = pt.create_mesh({"data": 4, "model": 2})
  student = source.load(cfg, mesh, pt.rules_from_config({"strategy": "fsdp_ep"}), seed=0)
  teacher = hf.load(hf_moe_checkpoint)
  for j, t in enumerate(layers):
    ours = nnx.to_pure_dict(nnx.state(student.layers[j].mlp, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(teacher.layers[t].mlp, nnx.Param))
    for name in ("gate", "up", "down", "expert_scale"):
      np.testing.assert_array_equal(ours[name], np.asarray(theirs[name])[order])
    np.testing.assert_array_equal(ours["router"], np.asarray(theirs["router"])[:, order])
    for name in ("router_scale", "dense", "dense_post_norm", "experts_pre_norm",
                 "experts_post_norm"):
      for a, b in zip(jax.tree.leaves(ours[name]), jax.tree.leaves(theirs[name]), strict=True):
        np.testing.assert_array_equal(a, b)
