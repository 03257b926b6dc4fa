"""Gemma 3 (Gemma3ForCausalLM) against transformers 5.24: the full forward (unrolled and
scanned), KV-cached decode, packed documents against each document run alone, export back to
transformers with an exact round trip, a student of teacher blocks that keeps each block's
attention type and RoPE base, and the text decoder of a Gemma3ForConditionalGeneration
checkpoint.

A tiny random model built from a config (nothing is downloaded): 6 layers in Gemma 3's 5:1
pattern (five sliding, window 4, then one global), the global layers' RoPE at base 1e6 with
linear scaling x8 (the 4B+ checkpoints'), the sliding layers' at 1e4, q/k norms, a query
pre-attention scalar unlike head_dim. Weights and norms are drawn wider than HF's init so
every part shows in the logits.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distillax.configs import distill  # noqa: E402
from distillax.distill import unwrap_student  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.config import FULL, ROPE_GLOBAL, ROPE_LOCAL, SLIDING  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf  # noqa: E402
from distillax.trainers import recipe_for  # noqa: E402
from tests.support.hf import (cached_decode_delta, packed_documents_delta,  # noqa: E402
                              saved_with_logits, torch_logits)
from tests.support.models import Normal, forward, random_model  # noqa: E402

ROPES = {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
         SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
CONFIG = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
              sliding_window=4, max_position_embeddings=64, rope_parameters=ROPES,
              attn_implementation="eager")
TOKENS = np.random.default_rng(1).integers(0, 320, size=(2, 11)).astype(np.int64)


def _gemma3(seed: int, **changes):
  torch.manual_seed(seed)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**CONFIG, **changes}))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


@pytest.fixture(scope="module")
def hf_model():
  return _gemma3(0)


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("gemma3"), TOKENS)


def _logits(model, tokens=TOKENS, positions=None, segments=None) -> np.ndarray:
  as_jnp = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
  return np.asarray(forward(model, as_jnp(tokens), as_jnp(positions),
                            as_jnp(segments)).logits_BxLxV)


def test_gemma3_import_matches_transformers_full_forward_unrolled_and_scanned(hf_checkpoint):
  path, want = hf_checkpoint
  model = hf.load(path)
  cfg = model.config
  assert cfg.local_layers() == [True] * 5 + [False]
  assert cfg.layer_ropes() == (ROPE_LOCAL,) * 5 + (ROPE_GLOBAL,)
  assert (cfg.rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor,
          cfg.rope_local_theta) == (1e6, "linear", 8.0, 1e4)
  assert (cfg.qk_norm, cfg.use_post_norms, cfg.query_pre_attn_scalar) == (True, True, 24.0)
  delta = float(np.max(np.abs(_logits(model) - want)))
  print(f"\ngemma3 full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0 and delta <= 1e-4
  # The scanned stack picks each layer's RoPE by index: the same logits.
  assert float(np.max(np.abs(_logits(hf.load(path, scan_layers=True)) - want))) <= 1e-4
  # The local base matters: every layer at the global base is another model.
  assert float(np.max(np.abs(_logits(hf.load(path, rope_local_theta=1e6)) - want))) > 1e-2


def test_gemma3_cached_decode_matches_transformers(hf_model, hf_checkpoint):
  """Prefill 6 tokens, then 5 greedy steps: past the window of 4 in the sliding layers."""
  delta = cached_decode_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS[:, :6], steps=5)
  print(f"\ngemma3 cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_gemma3_packed_documents_match_each_document_alone_in_transformers(hf_model,
                                                                           hf_checkpoint):
  """Row 0 packs a 4-token and a 7-token document (positions restart), row 1 a 6 and a 5."""
  delta = packed_documents_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS, cuts=[4, 6])
  print(f"\ngemma3 packed documents: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_gemma3_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  ours = random_model(hf.load(hf_checkpoint[0]).config, seed=7, init=Normal(0.1))
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["architectures"] == ["Gemma3ForCausalLM"]
  assert written["rope_parameters"] == {
      FULL: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
      SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "Gemma3ForCausalLM"
  assert reloaded.config.rope_parameters[FULL]["factor"] == 8.0
  assert float(np.max(np.abs(_logits(ours) - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_a_gemma3_student_of_teacher_blocks_keeps_each_blocks_attention_and_rope(
    hf_model, hf_checkpoint):
  """Blocks (5, 0): the global block first keeps base 1e6 with its scaling and full attention,
  the sliding block second keeps base 1e4 and its window, as transformers runs those blocks
  under layer_types [full, sliding]."""
  layers = (5, 0)
  config = distill.get_config("tiny")
  config.teacher.hf_path, config.student.from_teacher.layers = str(hf_checkpoint[0]), layers
  recipe = recipe_for(config)
  cfg = recipe.model_config
  assert cfg.local_layers() == [False, True]
  assert cfg.layer_ropes() == (ROPE_GLOBAL, ROPE_LOCAL)
  student = unwrap_student(recipe.build(abstract=False)[0])[0]
  fresh = _gemma3(4, num_hidden_layers=2, layer_types=[FULL, SLIDING])
  state = hf_model.state_dict()
  renamed = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
  for i, t in enumerate(layers):
    prefix = f"model.layers.{t}."
    renamed.update({f"model.layers.{i}." + k[len(prefix):]: v for k, v in state.items()
                    if k.startswith(prefix)})
  fresh.load_state_dict(renamed)
  assert float(np.max(np.abs(_logits(student) - torch_logits(fresh, TOKENS)))) <= 1e-4


def test_a_gemma3_multimodal_checkpoint_loads_its_text_decoder(tmp_path):
  """A tiny Gemma3ForConditionalGeneration (a 1-layer SigLIP tower, its projector, an untied
  head) saved as transformers 5.24 saves it ('language_model.model.*', 'language_model.lm_head',
  'vision_tower.*', 'multi_modal_projector.*'): distillax reads the text decoder, ignores the
  rest, and its logits are the wrapper's on text."""
  text = {k: v for k, v in CONFIG.items() if k != "attn_implementation"}
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14)
  config = transformers.Gemma3Config(
      text_config={**text, "num_hidden_layers": 2, "tie_word_embeddings": False},
      vision_config=vision, mm_tokens_per_image=4, image_token_index=319, boi_token_index=317,
      eoi_token_index=318, tie_word_embeddings=False)
  torch.manual_seed(5)
  wrapper = transformers.Gemma3ForConditionalGeneration(config)
  with torch.no_grad():
    for name, p in wrapper.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  wrapper.eval().save_pretrained(tmp_path)
  from safetensors import safe_open
  with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
    names = set(f.keys())
  assert {"language_model.lm_head.weight", "language_model.model.norm.weight",
          "multi_modal_projector.mm_input_projection_weight"} <= names
  assert any(n.startswith("vision_tower.") for n in names)
  model = hf.load(tmp_path)
  assert (model.config.num_layers, model.config.tie_embeddings) == (2, False)
  assert model.config.layer_ropes() == (ROPE_LOCAL, ROPE_LOCAL)
  delta = float(np.max(np.abs(_logits(model) - torch_logits(wrapper, TOKENS))))
  print(f"\ngemma3 multimodal checkpoint, text decoder: max |dlogit| {delta:.1e}")
  assert delta <= 1e-4
