"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers 5.24: the full forward with LongRoPE's
short and long divisors, a KV-cached decode that crosses from one set to the other, packed
documents against each document run alone; the export is the file transformers' own
save_pretrained writes (fused qkv_proj and gate_up_proj), tensor for tensor; Phi-4-mini's own
config.json reads as the preset; a student of teacher blocks; one-line refusals.

A tiny random model built from a config (nothing is downloaded): 3 layers, head_dim 8 of which
three quarters turn (partial_rotary_factor 0.75: 3 pairs; transformers checks LongRoPE's lists
against hidden / heads, so head_dim stays that), LongRoPE over an
original context of 8 (so 11 tokens take the long divisors, 6 the short ones; attention factor
sqrt(1 + ln 8 / ln 8)), a sliding window of 7 on every layer, tied embeddings. Weights and norm
scales (1 + N(0, 0.3^2)) are drawn wider than HF's init so every part shows in the logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import ConfigError, UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf, hf_architecture  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.transformer import with_config  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (blocks_state, cached_decode_delta,  # noqa: E402
                              packed_documents_delta, saved_with_logits, torch_logits)
from tests.support.models import forward  # noqa: E402

ROPE = {"rope_type": "longrope", "rope_theta": 50.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.3, 1.7], "long_factor": [2.0, 5.0, 9.0]}
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              original_max_position_embeddings=8, sliding_window=7,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
              rope_parameters=ROPE)
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _phi3(**changes):
  torch.manual_seed(0)
  config = transformers.Phi3Config(**{**CONFIG, **changes}, attn_implementation="eager")
  return transformers.Phi3ForCausalLM(config)


@pytest.fixture(scope="module")
def hf_model():
  model = _phi3()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(*((1.0, 0.3) if "norm" in name else (0.0, 0.1)))
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("phi3"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0])


def _delta(model, want, tokens=TOKENS) -> float:
  got = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32)).logits_BxLxV)
  return float(np.max(np.abs(got - want)))


def test_phi3_matches_transformers_long_and_short_cached_decode_and_packed(
    hf_model, hf_checkpoint, ours):
  """11 tokens take the long divisors, their first 6 the short ones; the decode prefills 5
  (short) and steps 6 tokens, the last three past the original context (long); packed rows
  hold a 4 and a 7, a 6 and a 5-token document (positions restart: short)."""
  cfg = ours.config
  assert (cfg.fused_qkv_gate_up, cfg.rotary_dim, cfg.rope_scaling_type) == (True, 6, "longrope")
  assert (cfg.rope_long_factors, cfg.rope_original_max_len, cfg.rope_scaling_factor) == (
      (2.0, 5.0, 9.0), 8, 8.0)
  assert cfg.local_layers() == [True] * 3 and cfg.tie_embeddings
  path, want = hf_checkpoint
  full = _delta(ours, want)
  short = _delta(ours, torch_logits(hf_model, TOKENS[:, :6]), TOKENS[:, :6])
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :5], steps=6)
  packed = packed_documents_delta(hf_model, ours, TOKENS, cuts=[4, 6])
  print(f"\nphi3 max |dlogit| vs transformers: full forward {full:.1e} (long divisors), "
        f"{short:.1e} (short), cached decode {decode:.1e}, packed documents {packed:.1e}")
  assert float(np.abs(want).max()) > 1.0
  assert max(full, short, decode, packed) <= 1e-4
  # The long divisors matter: the short ones over 11 tokens are another function.
  assert _delta(with_config(ours, rope_original_max_len=16, rope_attention_factor=2 ** 0.5),
                want) > 1e-2


def test_phi3_export_is_transformers_own_file(hf_checkpoint, ours, tmp_path):
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["model_type"], written["partial_rotary_factor"],
          written["rope_parameters"]["long_factor"]) == ("phi3", 0.75, [2.0, 5.0, 9.0])
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  read = transformers.AutoConfig.from_pretrained(tmp_path)
  assert (type(read).__name__, read.rope_parameters["partial_rotary_factor"],
          read.rope_parameters["rope_type"]) == ("Phi3Config", 0.75, "longrope")
  theirs = load_file(str(hf_checkpoint[0] / "model.safetensors"))
  mine = load_file(str(tmp_path / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  assert mine["model.layers.0.self_attn.qkv_proj.weight"].shape == (32 + 2 * 16, 32)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)


def test_phi4_mini_config_json_reads_as_the_preset():
  """Phi-4-mini's released config.json (transformers 4's keys: rope_scaling 'longrope', the
  partial factor and original context at the top), as the phi-4-mini preset; Phi-4's too."""
  mini = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
          "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131_072,
          "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
          "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
          "rms_norm_eps": 1e-5, "rope_theta": 10_000.0, "sliding_window": 262_144,
          "tie_word_embeddings": True, "vocab_size": 200_064, "attention_bias": False,
          "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                           "long_factor": list(get_preset("phi-4-mini").rope_long_factors)}}
  assert config_from_hf(mini, dtype="bfloat16", scan_layers=True) == get_preset("phi-4-mini")
  # Phi3Config reads an older config's rope type 'yarn' (with LongRoPE's lists) as longrope.
  as_yarn = {**mini, "rope_scaling": {**mini["rope_scaling"], "type": "yarn"}}
  assert config_from_hf(as_yarn, dtype="bfloat16", scan_layers=True) == get_preset("phi-4-mini")
  phi4 = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 17_920,
          "max_position_embeddings": 16_384, "num_attention_heads": 40, "num_hidden_layers": 40,
          "num_key_value_heads": 10, "rms_norm_eps": 1e-5, "rope_theta": 250_000.0,
          "vocab_size": 100_352, "tie_word_embeddings": False, "sliding_window": None}
  assert config_from_hf(phi4, dtype="bfloat16", scan_layers=True) == get_preset("phi-4")


def test_a_phi3_student_of_teacher_blocks_reads_fused_blocks(hf_model, hf_checkpoint):
  layers = (2, 0)
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), layers)
  student = source.load(source.model_config(), pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  picked = _phi3(num_hidden_layers=2)
  picked.load_state_dict(blocks_state(hf_model, layers))
  assert _delta(student, torch_logits(picked.eval(), TOKENS)) <= 1e-4


@pytest.mark.parametrize("changes, error, message", [
    ({"hidden_act": "gelu"}, UserError, "hidden_act='gelu' is not supported for Phi3ForCausalLM"),
    ({"rope_parameters": {**ROPE, "long_factor": None}}, UserError,
     "longrope RoPE needs 'short_factor', 'long_factor'"),
    ({"rope_parameters": {**ROPE, "long_factor": [2.0, 5.0]}}, ConfigError,
     r"rope_long_factors=\(2.0, 5.0\) must list 3 positive divisors"),
])
def test_what_distillax_does_not_read_of_phi3_is_refused_in_one_line(changes, error, message):
  with pytest.raises(error, match=message):
    config_from_hf({**CONFIG, "architectures": ["Phi3ForCausalLM"], **changes})


def test_longrope_outside_phi3_is_refused():
  with pytest.raises(ConfigError, match="rope_short_factors is LongRoPE's"):
    get_preset("tiny", rope_short_factors=(1.0,) * 8)
  with pytest.raises(UserError, match="no Hugging Face equivalent"):
    hf_architecture(get_preset("tiny_phi3", fused_qkv_gate_up=False))
  with pytest.raises(UserError, match="no Hugging Face equivalent"):
    hf_architecture(get_preset("tiny_phi3", qk_norm=True))
