"""Config validation, presets and parameter counts against the published model sizes."""

import dataclasses
import json

import pytest

from distillax.errors import ConfigError
from distillax.models import config as mc
from distillax.models.init import param_count
from distillax.models.presets import PRESETS, config_from_dict, get_preset

# Published sizes (model cards / safetensors metadata of the Hugging Face checkpoints).
PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_presets_match_published_parameter_counts(name):
  cfg = get_preset(name)
  assert cfg.scan_layers
  assert param_count(cfg) == PUBLISHED[name]


def _closed_form(cfg, active=False):
  """Parameter count written out by hand from the shapes; `active`: a token's share of an MoE
  (its k experts and the router, the convention of the model cards' "activated" figure)."""
  D, F = cfg.embed_dim, cfg.mlp_dim
  attn = D * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  attn += 2 * cfg.head_dim if cfg.qk_norm else 0
  norms = (4 if cfg.use_post_norms else 2) * D
  mlp = 3 * D * F
  if cfg.num_experts:
    used = cfg.num_experts_per_tok if active else cfg.num_experts
    mlp = used * 3 * D * cfg.moe_mlp_dim + D * cfg.num_experts  # experts + router
  per_layer = attn + mlp + norms
  head = 0 if cfg.tie_embeddings else D * cfg.vocab_size
  return cfg.vocab_size * D + cfg.num_layers * per_layer + D + head


# Qwen3 model cards, in billions as the cards round them: (total, activated, non-embedding).
QWEN3_CARDS = {"qwen3-0.6b": (0.6, 0.6, 0.44), "qwen3-1.7b": (1.7, 1.7, 1.4), "qwen3-30b-a3b": (30.5, 3.3, 29.9),
               "qwen3-235b-a22b": (235.0, 22.0, 234.0)}


@pytest.mark.parametrize("name", sorted(QWEN3_CARDS))
def test_qwen3_presets_match_their_model_cards(name):
  cfg = get_preset(name)
  total, active = param_count(cfg), _closed_form(cfg, active=True)
  assert total == _closed_form(cfg)
  embeddings = cfg.vocab_size * cfg.embed_dim * (1 if cfg.tie_embeddings else 2)
  for ours, card in zip((total, active, total - embeddings), QWEN3_CARDS[name]):
    assert ours / 1e9 == pytest.approx(card, rel=0.02)
  assert (cfg.qk_norm, cfg.vocab_size, cfg.head_dim, cfg.rope_theta) == (True, 151_936, 128, 1e6)
  if cfg.num_experts:
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob) == (
        128, 8, "softmax_topk", True)
  # 30,532,122,624 / 3,353,032,704 and 235,093,634,560 / 22,190,763,520, by hand from the
  # config.json shapes: the two MoE presets' exact totals, and their active parameters.
  exact = {"qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
           "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520)}
  if name in exact:
    assert (total, active) == exact[name]


# gpt-oss, by hand from config.json's shapes (D 2880, 64 heads of 64 over 8 kv heads, experts
# of width 2880, vocab 201,088, untied): attention 2880*64*144 weights + 4096+512+512+2880 biases
# + 64 sinks = 26,550,144; an expert 2880*5760 + 5760 + 2880*2880 + 2880 = 24,891,840; the router
# 2880*E + E; two norms 5,760; embedding and unembedding 579,133,440 each; final norm 2,880.
# Active (the model card's convention): attention, 4 experts, router and norms of every layer,
# plus the unembedding. The card: 20b 20.9B total / 3.6B active, 120b 116.8B / 5.1B.
GPT_OSS = {"gpt-oss-20b": (20_914_757_184, 3_608_304_384, 20.9, 3.6),
           "gpt-oss-120b": (116_829_156_672, 5_132_846_592, 116.8, 5.1)}


@pytest.mark.parametrize("name", sorted(GPT_OSS))
def test_gpt_oss_presets_match_their_model_cards(name):
  cfg = get_preset(name)
  total, active, card_total, card_active = GPT_OSS[name]
  assert param_count(cfg) == total
  unembedding = cfg.vocab_size * cfg.embed_dim
  per_layer_active = 26_550_144 + 4 * 24_891_840 + 2880 * cfg.num_experts + cfg.num_experts + 5760
  assert cfg.num_layers * per_layer_active + unembedding == active
  assert (total / 1e9, active / 1e9) == (pytest.approx(card_total, abs=0.05),
                                         pytest.approx(card_active, abs=0.05))
  assert cfg.local_layers()[:4] == [True, False, True, False]


# Qwen3.5, by hand from config.json's text_config shapes (D, vocab 248,320, heads of 256, a
# Gated DeltaNet of Hk key / Hv value heads of 128 and a 4-tap conv over q, k, v):
# a DeltaNet layer = in_proj_qkv (2 Hk + Hv) 128 D + in_proj_z and out_proj 2 (128 Hv) D
#   + in_proj_b/a 2 Hv D + conv 4 (2 Hk + Hv) 128 + dt_bias, A_log 2 Hv + norm 128;
# a full-attention layer = q_proj (with its gate) 2 H 256 D + k/v 2 K 256 D + o H 256 D + q/k
#   norms 512; every layer: MLP 3 D F + 2 D norms. 0.8B: D 1024, F 3584, H 8, K 2, Hk = Hv = 16:
# DeltaNet 10,543,264, attention 7,340,544; 18 + 6 layers, tied embedding 254,279,680 + final
# norm 1024 = 752,393,024 (the card's 0.8B counts the vision tower too). 9B: D 4096, F 12,288,
# H 16, K 4, Hk 16, Hv 32: DeltaNet 67,403,968, attention 58,720,768; 24 + 8 layers, embedding
# and unembedding 1,017,118,720 each + 4096 = 8,953,803,264 (8.95B, llama.cpp's text-only count).
QWEN35 = {"qwen3.5-0.8b": 752_393_024, "qwen3.5-9b": 8_953_803_264}


@pytest.mark.parametrize("name", sorted(QWEN35))
def test_qwen35_presets_count_their_config_json_shapes(name):
  cfg = get_preset(name)
  assert param_count(cfg) == QWEN35[name]
  assert cfg.token_mixers[:4] == ("linear_attention",) * 3 + ("full_attention",)
  assert (cfg.num_linear_layers, cfg.rotary_dim) == (cfg.num_layers * 3 // 4, 64)
  from distillax.models.hf.config import config_from_hf
  from distillax.models.hf.config_out import config_to_hf
  assert config_from_hf(config_to_hf(cfg), dtype="bfloat16") == cfg  # a Qwen3_5ForCausalLM


# Gemma 3 and SmolLM3, by hand from config.json's shapes. Gemma 3 layer = q/o 2 H Dh D + k/v
# 2 K Dh D + q/k norms 2 Dh + MLP 3 D F + 4 D norms; tied embedding V D + final norm D. 1B: D 1152,
# F 6912, H 4, K 1, Dh 256: 26,842,112 x 26 + 301,989,888 + 1152 = 999,885,952 (the card's
# 1B). 27B: V 262,208, D 5376, F 21,504, H 32, K 16, Dh 128: 412,898,560 x 62 + 1,409,630,208
# + 5376 = 27,009,346,304 (the text tower of the card's 27B). SmolLM3 3B: D 2048, F 11,008, H 16,
# K 4, Dh 128: 78,123,008 x 36 + tied 262,668,288 + 2048 = 3,075,098,624 (the card's 3.08B).
GEMMA3_SMOLLM3 = {"gemma3-1b": 999_885_952, "gemma3-27b": 27_009_346_304,
                  "smollm3-3b": 3_075_098_624}


@pytest.mark.parametrize("name", sorted(GEMMA3_SMOLLM3))
def test_gemma3_and_smollm3_presets_count_their_config_json_shapes(name):
  from distillax.models.hf.config import config_from_hf
  from distillax.models.hf.config_out import config_to_hf
  cfg = get_preset(name)
  assert param_count(cfg) == GEMMA3_SMOLLM3[name] == _closed_form(cfg)
  if name.startswith("gemma3"):  # five sliding layers (base 10k) to a global one (1M)
    assert cfg.layer_ropes()[:6] == (mc.ROPE_LOCAL,) * 5 + (mc.ROPE_GLOBAL,)
  else:  # every 4th layer without RoPE
    assert cfg.rope_free_layers == tuple(range(3, 36, 4))
  assert config_from_hf(config_to_hf(cfg), dtype="bfloat16", scan_layers=True) == cfg


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma", "tiny_gemma3", "demo_teacher",
                                  "demo_student"])
def test_small_presets(name):
  cfg = get_preset(name)
  assert param_count(cfg) == _closed_form(cfg)
  assert cfg.vocab_size == 256


def test_demo_sizes():
  assert 4e6 <= param_count(get_preset("demo_teacher")) <= 8e6
  assert 1e6 <= param_count(get_preset("demo_student")) <= 2e6


def test_scan_layout_does_not_change_count():
  cfg = get_preset("tiny_gemma")
  assert param_count(cfg.replace(scan_layers=True)) == param_count(cfg)


def test_gemma2_alternates_local_and_global_layers():
  cfg = get_preset("gemma2-2b")
  assert [cfg.layer_uses_sliding_window(i) for i in range(4)] == [True, False, True, False]
  assert cfg.layer_windows()[:2] == (4096, mc.GLOBAL_WINDOW)
  assert get_preset("tiny").layer_windows() is None
  every = cfg.replace(sliding_window_pattern=0)
  assert all(every.layer_uses_sliding_window(i) for i in range(cfg.num_layers))


def test_a_model_of_some_blocks_keeps_each_blocks_attention():
  """A student made of teacher blocks attends in each block as the teacher did, in the one form
  that says it: a pattern when the blocks follow one, else per-layer types."""
  gemma2 = get_preset("gemma2-2b")  # sliding, full, sliding, full, ...
  both_sliding = gemma2.select_layers((0, 2))
  assert both_sliding.layer_windows() == (4096, 4096) and both_sliding.layer_types is None
  assert both_sliding.sliding_window_pattern == 0  # every layer local is a pattern
  mixed = gemma2.select_layers((1, 0, 2))  # a full block first, then two sliding ones
  assert mixed.layer_types == (mc.FULL, mc.SLIDING, mc.SLIDING)
  assert mixed.layer_windows() == (mc.GLOBAL_WINDOW, 4096, 4096)
  assert mixed.local_layers() == [False, True, True]
  assert gemma2.select_layers((0, 1, 4, 3)) == gemma2.replace(num_layers=4)  # the pattern
  assert gemma2.select_layers((1, 3)).sliding_window is None  # no layer local: no window
  mistral = get_preset("tiny", sliding_window=5, sliding_window_pattern=0)
  assert mistral.select_layers((1, 0)).layer_windows() == (5, 5)
  # config.json stores the types as a list; the config read back is the same.
  assert mc.TransformerConfig.from_dict(json.loads(json.dumps(mixed.to_dict()))) == mixed
  with pytest.raises(ConfigError, match=r"model.layer_types=.*each of the model.num_layers=3"):
    mixed.replace(layer_types=(mc.FULL, mc.SLIDING))
  with pytest.raises(ConfigError, match=r"model.layer_types=.*'sliding_attention' or"):
    mixed.replace(layer_types=("local",) * 3)
  with pytest.raises(ConfigError, match="must be a list"):
    mixed.replace(layer_types="sliding_attention")


@pytest.mark.parametrize("changes,field", [
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(mlp_activation="relu"), "mlp_activation"),
    (dict(remat="some"), "remat"),
    (dict(dtype="int8"), "dtype"),
    (dict(param_dtype="float17"), "param_dtype"),
    (dict(embed_dim=0), "embed_dim"),
    (dict(sliding_window=-3), "sliding_window"),
])
def test_bad_values_raise_config_error_naming_the_field(changes, field):
  with pytest.raises(ConfigError, match=field):
    get_preset("tiny").replace(**changes)


def test_unknown_preset_and_field():
  with pytest.raises(ConfigError, match="tiny"):
    get_preset("nope")
  with pytest.raises(ConfigError, match="widht"):
    get_preset("tiny").replace(widht=3)


def test_dict_round_trip_and_frozen():
  cfg = config_from_dict({"preset": "tiny_gemma", "num_layers": 3})
  assert cfg.num_layers == 3 and cfg.use_post_norms
  assert mc.TransformerConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.num_layers = 4


def test_every_field_declares_its_kind_and_every_list_of_fields_is_derived_from_it():
  """The storage and compute fields are named here by hand; every other field is shape. The
  sources' run fields, init_from's compute fields and the workdir identity read the kinds."""
  from distillax.models.config import (COMPUTE, SHAPE, STORAGE, field_kind, fields_of_kind)
  from distillax.trainers.sources import RUN_FIELDS
  from distillax.trainers.sources.select import COMPUTE_FIELDS
  from distillax.trainers.workdir import NOT_JOB_IDENTITY
  names = [f.name for f in dataclasses.fields(mc.TransformerConfig)]
  assert fields_of_kind(STORAGE) == ("param_dtype", "scan_layers")
  assert fields_of_kind(COMPUTE) == ("dtype", "remat", "attention_impl", "splash_blocks",
                                     "splash_fused_bwd", "moe_impl",
                                     "moe_capacity_factor", "linear_attention_impl",
                                     "linear_attention_chunk")
  assert fields_of_kind(SHAPE) == tuple(n for n in names if n not in (
      "param_dtype", "scan_layers", "dtype", "remat", "attention_impl", "splash_blocks",
      "splash_fused_bwd", "moe_impl", "moe_capacity_factor", "linear_attention_impl",
      "linear_attention_chunk"))
  assert [field_kind(n) for n in ("vocab_size", "param_dtype", "remat")] == [
      SHAPE, STORAGE, COMPUTE]
  assert set(RUN_FIELDS) == {"param_dtype", "scan_layers", "dtype", "remat", "attention_impl",
                             "splash_blocks", "splash_fused_bwd", "moe_impl", "moe_capacity_factor", "linear_attention_impl",
                             "linear_attention_chunk"}
  assert COMPUTE_FIELDS == ("dtype", "remat", "attention_impl", "splash_blocks",
                            "splash_fused_bwd", "moe_impl", "moe_capacity_factor",
                            "linear_attention_impl", "linear_attention_chunk")
  assert {k for k in NOT_JOB_IDENTITY if k.startswith("model.")} == {
      "model.dtype", "model.remat", "model.attention_impl", "model.splash_blocks",
      "model.splash_fused_bwd", "model.moe_impl", "model.moe_capacity_factor",
      "model.linear_attention_impl", "model.linear_attention_chunk"}
  with pytest.raises(ConfigError, match="unknown model config field 'nope'"):
    field_kind("nope")
