"""SmolLM3 (SmolLM3ForCausalLM) against transformers 5.24: the full forward (unrolled and
scanned), KV-cached decode, packed documents against each document run alone, and export back
to transformers with an exact round trip.

A tiny random model built from a config (nothing is downloaded): 4 layers, the 4th without RoPE
(no_rope_layer_interval 4), with the pad/bos/eos ids inside the tiny vocabulary. Weights and
norm scales (1 + N(0, 0.3^2)) are drawn wider than HF's init so every part shows in the logits.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.config import ROPE_GLOBAL, ROPE_NONE  # noqa: E402
from tests.support.hf import (cached_decode_delta, packed_documents_delta,  # noqa: E402
                              saved_with_logits, torch_logits)
from tests.support.models import Normal, forward, random_model  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 50.0},
              attn_implementation="eager")
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_model():
  torch.manual_seed(0)
  model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**CONFIG))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(*((1.0, 0.3) if "norm" in name else (0.0, 0.1)))  # norms: weight, not 1 + weight
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("smollm3"), TOKENS)


def _logits(model) -> np.ndarray:
  return np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)


def test_smollm3_import_matches_transformers_full_forward_unrolled_and_scanned(hf_checkpoint):
  path, want = hf_checkpoint
  model = hf.load(path)
  assert model.config.rope_free_layers == (3,)
  assert model.config.layer_ropes() == (ROPE_GLOBAL,) * 3 + (ROPE_NONE,)
  delta = float(np.max(np.abs(_logits(model) - want)))
  print(f"\nsmollm3 full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0 and delta <= 1e-4
  assert float(np.max(np.abs(_logits(hf.load(path, scan_layers=True)) - want))) <= 1e-4
  # The RoPE-free layer matters: RoPE in every layer is another model.
  assert float(np.max(np.abs(_logits(hf.load(path, rope_free_layers=None)) - want))) > 1e-2


def test_smollm3_cached_decode_matches_transformers(hf_model, hf_checkpoint):
  delta = cached_decode_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS[:, :6], steps=5)
  print(f"\nsmollm3 cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_smollm3_packed_documents_match_each_document_alone_in_transformers(hf_model,
                                                                            hf_checkpoint):
  """Row 0 packs a 4-token and a 7-token document (positions restart), row 1 a 6 and a 5."""
  delta = packed_documents_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS, cuts=[4, 6])
  print(f"\nsmollm3 packed documents: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_smollm3_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  ours = random_model(hf.load(hf_checkpoint[0]).config.replace(rope_free_layers=(0, 2)), seed=7,
                      init=Normal(0.1))
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["architectures"], written["no_rope_layers"]) == (["SmolLM3ForCausalLM"],
                                                                   [0, 1, 0, 1])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "SmolLM3ForCausalLM"
  assert float(np.max(np.abs(_logits(ours) - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)
