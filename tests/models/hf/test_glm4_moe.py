"""GLM-4.5 (Glm4MoeForCausalLM) against transformers 5.24: the full forward and KV-cached decode,
the export transformers loads (tensor for tensor its own file), a student of a dense and an MoE
teacher block, the published shape's architecture, and what stays refused in one line.

One tiny random model (nothing is downloaded): an odd vocabulary of 97, 3 layers (the first dense
of width 48, two with 8 experts of width 16, top-2 in 2 groups with 1 kept, sigmoid scores with
the choice bias, scaled 2.5, one shared expert), grouped-query attention (4 query heads of 16 over
2 key/value heads) with half of each head turned by RoPE, q/k/v biases and q/k norms. Weights are
drawn wider than HF's init, as tests/models/hf/test_deepseek.py draws them.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from distillax import partitioning as pt  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf, hf_architecture  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.transformer import layer_params  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (  # noqa: E402
    assert_export_is_the_checkpoint, cached_decode_delta, saved_with_logits)
from tests.support.models import forward  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
              attention_bias=True, use_qk_norm=True, max_position_embeddings=64,
              tie_word_embeddings=False)
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  model = transformers.Glm4MoeForCausalLM(
      transformers.Glm4MoeConfig(**CONFIG, attn_implementation="eager"))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 1.0 if name.endswith("gate.weight") else
                0.5 if name.startswith("lm_head") else 0.1)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.3)
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("glm4_moe"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0])


def test_glm45_matches_transformers_full_forward_and_cached_decode(hf_model, hf_checkpoint,
                                                                   ours):
  cfg = ours.config
  assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.qkv_bias, cfg.qk_norm) == (
      0.5, 8, True, True)
  assert (cfg.moe_layers, cfg.router, cfg.router_groups, cfg.routed_scaling_factor) == (
      (1, 2), "sigmoid", 2, 2.5)
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  full = float(np.max(np.abs(got - hf_checkpoint[1])))
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :7], steps=3)
  print(f"\nglm-4.5 max |dlogit| vs transformers: full forward {full:.1e}, cached decode "
        f"{decode:.1e}")
  assert float(np.abs(hf_checkpoint[1]).max()) > 1.0
  assert max(full, decode) <= 1e-4


def test_glm45_exports_transformers_own_file(hf_checkpoint, ours, tmp_path):
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["model_type"], written["rope_parameters"]["partial_rotary_factor"],
          written["attention_bias"], written["use_qk_norm"]) == ("glm4_moe", 0.5, True, True)
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  assert_export_is_the_checkpoint(hf_checkpoint[0], tmp_path, TOKENS, hf_checkpoint[1])


def test_a_glm45_student_of_blocks_keeps_each_blocks_mlp(hf_checkpoint, ours):
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), (2, 0))
  cfg = source.model_config()
  assert (cfg.num_layers, cfg.moe_layers) == (2, (0,))  # an MoE block first: no HF class
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  for i, t in enumerate((2, 0)):
    for a, b in zip(jax.tree.leaves(layer_params(student)[i]),
                    jax.tree.leaves(layer_params(ours)[t])):
      np.testing.assert_array_equal(a, b)
  # GLM-4.5's dense layers come first (first_k_dense_replace): this order has no config.json
  with pytest.raises(UserError, match="has no Hugging Face equivalent"):
    hf_architecture(cfg)


def test_glm45_preset_and_refusals():
  assert hf_architecture(get_preset("glm-4.5")) == "Glm4MoeForCausalLM"
  yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "mscale": 1.0,
          "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}
  with pytest.raises(UserError) as raised:
    config_from_hf({**CONFIG, "architectures": ["Glm4MoeForCausalLM"], "rope_parameters": yarn})
  assert "yarn mscale=1.0, mscale_all_dim=1.0 is DeepSeek's form; distillax reads it for " \
         "DeepseekV3ForCausalLM only" in str(raised.value)
