"""DeepSeek V3 (DeepseekV3ForCausalLM) against transformers 5.24: the full forward and KV-cached
decode (the cache holds the latent and the RoPE key), sharded with its experts split over data
(fsdp_ep: all_to_all), the export transformers loads (tensor for tensor its own file), the
multi-token-prediction layers of a checkpoint skipped with one line, a student of a dense and an
MoE teacher block, the published shape, and what stays refused in one line.

Two tiny random models (nothing is downloaded), an odd vocabulary of 97, 3 layers (the first
dense, two with 8 experts of width 16, top-2):
- 'v3': DeepSeek V3's form: queries through a normed bottleneck (q_lora_rank 24), interleaved
  RoPE pairs, YaRN x4 with mscale 1 / 1, experts in 4 groups (2 kept), one shared expert;
- 'lite': the V2-Lite / Moonlight form: queries projected directly (q_lora_rank None),
  rotate-half RoPE, no groups, two shared experts.
Weights are drawn wider than HF's init (router std 1 so no token sits near a tie; the choice
bias std 0.3 so it changes choices; the head 0.5 so logits span a few units).
"""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import ConfigError, UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf, hf_architecture  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.transformer import layer_params  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (  # noqa: E402
    assert_export_is_the_checkpoint, cached_decode_delta, saved_with_logits, torch_logits)
from tests.support.models import forward  # noqa: E402

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=12, v_head_dim=12, max_position_embeddings=64,
             tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}
VARIANTS = {
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=YARN),
    "lite": dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                 routed_scaling_factor=1.5, rope_interleave=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _hf_model(variant):
  torch.manual_seed(0)
  config = transformers.DeepseekV3Config(**SHAPE, **VARIANTS[variant],
                                         attn_implementation="eager")
  model = transformers.DeepseekV3ForCausalLM(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 1.0 if name.endswith("gate.weight") else
                0.5 if name.startswith("lm_head") else 0.1)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.3)
  return model.eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """variant -> (variant, transformers model, saved path, its logits of TOKENS, our model),
  each built once."""
  cache = {}

  def get(variant):
    if variant not in cache:
      model = _hf_model(variant)
      path, logits = saved_with_logits(model, tmp_path_factory.mktemp(variant), TOKENS)
      cache[variant] = (variant, model, path, logits, hf.load(path))
    return cache[variant]
  return get


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, built):
  return built(request.param)


@pytest.fixture(scope="module")
def v3(built):
  return built("v3")


def test_deepseek_v3_matches_transformers_full_forward_and_cached_decode(checkpoint):
  variant, hf_model, _, want, ours = checkpoint
  cfg = ours.config
  assert (cfg.kv_lora_rank, cfg.head_dim, cfg.value_head_dim, cfg.moe_layers) == (
      16, 20, 12, (1, 2))
  assert (cfg.q_lora_rank, cfg.router_groups, cfg.shared_expert_mlp_dim) == (
      (24, 4, 16) if variant == "v3" else (0, 1, 32))
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  full = float(np.max(np.abs(got - want)))
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :7], steps=3)
  print(f"\ndeepseek-v3 ({variant}) max |dlogit| vs transformers: full forward {full:.1e}, "
        f"cached decode {decode:.1e}")
  assert float(np.abs(want).max()) > 1.0
  assert max(full, decode) <= 1e-4


def test_deepseek_v3_with_experts_split_over_data_matches_transformers(v3):
  _, _, path, want, _ = v3
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_ep"})
  model = hf.load(path, mesh=mesh, rules=rules)
  assert tuple(model.layers[1].mlp.gate.sharding.spec)[0] == "data"  # 2 experts per data row
  graphdef, state = nnx.split(model)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  got = np.asarray(logits(state, jnp.asarray(np.tile(TOKENS, (2, 1)), jnp.int32)))
  assert float(np.max(np.abs(got - np.tile(want, (2, 1, 1))))) <= 1e-4


def test_deepseek_v3_exports_transformers_own_file(checkpoint, tmp_path):
  variant, _, path, want, ours = checkpoint
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["model_type"], written["first_k_dense_replace"], written["kv_lora_rank"],
          written["q_lora_rank"]) == ("deepseek_v3", 1, 16, 24 if variant == "v3" else None)
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  assert_export_is_the_checkpoint(path, tmp_path, TOKENS, want)


def test_multi_token_prediction_layers_are_skipped_with_one_line(v3, tmp_path, caplog):
  _, _, path, _, ours = v3
  state = load_file(str(path / "model.safetensors"))
  state["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)  # an MTP layer
  state["model.layers.3.input_layernorm.weight"] = np.ones((32,), np.float32)
  save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  config = json.loads((path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
  with caplog.at_level(logging.WARNING):
    model = hf.load(tmp_path)
  lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.message]
  assert lines == [f"{tmp_path}: skipping the 2 tensors of 1 multi-token-prediction layer(s) "
                   f"(layers 3) past num_hidden_layers=3: distillax reads the main model"]
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ours))):
    np.testing.assert_array_equal(a, b)
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
  with pytest.raises(UserError, match="model.layers.3.eh_proj.weight"):
    hf.load(tmp_path)


def test_a_student_of_a_dense_and_an_moe_block_runs_as_transformers(v3, tmp_path):
  _, _, path, _, ours = v3
  source = BlocksSource(HFSource(str(path), "teacher.hf_path"), (0, 2))
  cfg = source.model_config()
  assert (cfg.num_layers, cfg.moe_layers) == (2, (1,))
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  for i, t in enumerate((0, 2)):
    for a, b in zip(jax.tree.leaves(layer_params(student)[i]),
                    jax.tree.leaves(layer_params(ours)[t])):
      np.testing.assert_array_equal(a, b)
  hf.save(student, tmp_path)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  got = np.asarray(forward(student, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert np.max(np.abs(torch_logits(theirs, TOKENS) - got)) <= 1e-4
  with pytest.raises(ConfigError, match="router_groups=4 groups of consecutive experts"):
    BlocksSource(HFSource(str(path), "teacher.hf_path"), (0, 2), experts=(0, 1)).model_config()


def test_the_deepseek_v3_preset_is_transformers_default_shape_with_v3s_yarn():
  rope = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "mscale": 1.0,
          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
          "beta_slow": 1}
  default = transformers.DeepseekV3Config(rope_parameters=rope, max_position_embeddings=163_840)
  assert config_from_hf(default.to_dict(), dtype="bfloat16") == get_preset("deepseek-v3")


@pytest.mark.parametrize("change,message", [
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(n_shared_experts=0), "n_shared_experts=0: distillax reads DeepSeek's MoE with its "
                               "shared experts"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported for DeepseekV3ForCausalLM"),
])
def test_what_distillax_does_not_read_is_refused_in_one_line(change, message):
  hf_config = {**SHAPE, **VARIANTS["v3"], "architectures": ["DeepseekV3ForCausalLM"],
               "model_type": "deepseek_v3", **change}
  with pytest.raises(UserError) as raised:
    config_from_hf(hf_config)
  assert message in str(raised.value) and "\n" not in str(raised.value)
  with pytest.raises(UserError, match="has no Hugging Face equivalent"):
    hf_architecture(get_preset("tiny_deepseek_v3", router="softmax_topk",
                               router_score_bias=False, router_groups=1))
