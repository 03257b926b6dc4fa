"""Qwen3-MoE with dense layers (`mlp_only_layers`, `decoder_sparse_step`) against transformers
5.24: the full forward and KV-cached decode, the export transformers loads (tensor for tensor its
own file), a student of teacher blocks that keeps a dense and an MoE block, and what stays
refused in one line (llama.cpp's qwen3moe has experts in every layer; Mixtral has no dense
layers).

One tiny random model (nothing is downloaded): 4 layers, mlp_only_layers=[0] and
decoder_sparse_step=2, so layers 0 and 2 are dense MLPs of width 40 and layers 1 and 3 hold 4
experts of width 24 (top-2, renormalised); an odd vocabulary of 101. Router weights are drawn
wide (std 1) so no token sits near a tie between its 2nd and 3rd expert, the head wide (0.5) so
the logits span a few units.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from distillax import partitioning as pt  # noqa: E402
from distillax.edge.export import gguf_architecture  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf, hf_architecture  # noqa: E402
from distillax.models.transformer import layer_params  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (  # noqa: E402
    assert_export_is_the_checkpoint, cached_decode_delta, saved_with_logits)
from tests.support.models import forward  # noqa: E402

CONFIG = dict(vocab_size=101, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              intermediate_size=40, moe_intermediate_size=24, norm_topk_prob=True,
              mlp_only_layers=[0], decoder_sparse_step=2, max_position_embeddings=64,
              tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
TOKENS = np.random.default_rng(1).integers(0, 101, size=(2, 11)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(
      transformers.Qwen3MoeConfig(**CONFIG, attn_implementation="eager"))
  with torch.no_grad():
    for name, p in model.named_parameters():
      std = (0.3 if "norm" in name else 1.0 if name.endswith("gate.weight") else
             0.5 if name.startswith("lm_head") else 0.1)
      p.normal_(0.0, std)
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("qwen3_moe_dense"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0])


def test_qwen3_moe_with_dense_layers_matches_transformers_full_forward_and_cached_decode(
    hf_model, hf_checkpoint, ours):
  cfg = ours.config
  assert cfg.moe_layers == (1, 3) and (cfg.mlp_dim, cfg.expert_mlp_dim) == (40, 24)
  assert [type(b.mlp).__name__ for b in ours.layers] == ["MLP", "MoE", "MLP", "MoE"]
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  full = float(np.max(np.abs(got - hf_checkpoint[1])))
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :7], steps=3)
  print(f"\nqwen3-moe with dense layers max |dlogit| vs transformers: full forward {full:.1e}, "
        f"cached decode {decode:.1e}")
  assert float(np.abs(hf_checkpoint[1]).max()) > 1.0
  assert max(full, decode) <= 1e-4


def test_qwen3_moe_with_dense_layers_exports_transformers_own_file(hf_checkpoint, ours,
                                                                   tmp_path):
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["mlp_only_layers"], written["decoder_sparse_step"],
          written["intermediate_size"]) == ([0, 2], 1, 40)
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  assert_export_is_the_checkpoint(hf_checkpoint[0], tmp_path, TOKENS, hf_checkpoint[1])


def test_a_student_of_a_dense_and_an_moe_block_keeps_each_blocks_mlp(hf_checkpoint, ours):
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), (2, 3))
  cfg = source.model_config()
  assert (cfg.num_layers, cfg.moe_layers) == (2, (1,))
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  teacher = layer_params(ours)
  for i, t in enumerate((2, 3)):
    for a, b in zip(jax.tree.leaves(layer_params(student)[i]), jax.tree.leaves(teacher[t])):
      np.testing.assert_array_equal(a, b)


def test_what_no_runtime_holds_is_refused_in_one_line(ours):
  with pytest.raises(UserError) as raised:
    gguf_architecture(ours.config)
  assert str(raised.value) == ("llama.cpp's qwen3moe has experts in every layer; this model's "
                               "layers [0, 2] have a dense MLP (model.moe_layers=[1, 3]): export "
                               "it with --format hf")
  mixtral = ours.config.replace(qk_norm=False, router="topk_softmax")
  with pytest.raises(UserError, match="has no Hugging Face equivalent") as raised:
    hf_architecture(mixtral)
  assert "moe_layers=(1, 3)" in str(raised.value) and "\n" not in str(raised.value)
