"""OLMo 3 (Olmo3ForCausalLM) against transformers 5.24: the full forward (unrolled and scanned),
KV-cached decode and packed documents against each document run alone; the export is the file
transformers' own save_pretrained writes, tensor for tensor; a student of teacher blocks keeps
each block's attention and RoPE; what distillax does not read is refused in one line.

A tiny random model built from a config (nothing is downloaded): 4 layers of types sliding,
full, sliding, sliding (window 5 < the 11 tokens), head_dim 12 (not hidden / heads), the full
layer's RoPE YaRN x4 at base 500, the sliding layers' plain at base 50. Weights and norm scales
(1 + N(0, 0.3^2): OLMo's norms are plain w) are drawn wider than HF's init so every part shows
in the logits.
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
from distillax.models.config import ROPE_GLOBAL, ROPE_LOCAL, TransformerConfig  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.hf.config_out import config_to_hf, hf_architecture  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.trainers.sources.kinds import BlocksSource, HFSource  # noqa: E402
from tests.support.hf import (blocks_state, cached_decode_delta,  # noqa: E402
                              packed_documents_delta, saved_with_logits, torch_logits)
from tests.support.models import forward  # noqa: E402

S, F = "sliding_attention", "full_attention"
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              sliding_window=5, layer_types=[S, F, S, S], tie_word_embeddings=False,
              rope_parameters={F: {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16,
                                   "attention_factor": 1.2},
                               S: {"rope_type": "default", "rope_theta": 50.0}})
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _olmo3(**changes):
  torch.manual_seed(0)
  config = transformers.Olmo3Config(**{**CONFIG, **changes}, attn_implementation="eager")
  return transformers.Olmo3ForCausalLM(config)


@pytest.fixture(scope="module")
def hf_model():
  model = _olmo3()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(*((1.0, 0.3) if "norm" in name else (0.0, 0.1)))
  return model.eval()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("olmo3"), TOKENS)


@pytest.fixture(scope="module")
def ours(hf_checkpoint):
  return hf.load(hf_checkpoint[0])


def _delta(model, want) -> float:
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  return float(np.max(np.abs(got - want)))


def test_olmo3_matches_transformers_full_forward_cached_decode_and_packed(
    hf_model, hf_checkpoint, ours):
  """Prefill 6 tokens, then 5 greedy steps; packed rows hold a 4 and a 7, a 6 and a 5-token
  document (positions restart). The scanned layout runs the same function."""
  cfg = ours.config
  assert (cfg.pre_norms, cfg.use_post_norms, cfg.qk_norm_across_heads) == (False, True, True)
  assert cfg.local_layers() == [True, False, True, True] and cfg.sliding_window == 5
  assert cfg.layer_ropes() == (ROPE_LOCAL, ROPE_GLOBAL, ROPE_LOCAL, ROPE_LOCAL)
  assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling_type) == (500.0, 50.0, "yarn")
  path, want = hf_checkpoint
  full = _delta(ours, want)
  scanned = _delta(hf.load(path, scan_layers=True), want)
  decode = cached_decode_delta(hf_model, ours, TOKENS[:, :6], steps=5)
  packed = packed_documents_delta(hf_model, ours, TOKENS, cuts=[4, 6])
  print(f"\nolmo3 max |dlogit| vs transformers: full forward {full:.1e} (scanned {scanned:.1e}), "
        f"cached decode {decode:.1e}, packed documents {packed:.1e}")  # README table
  assert float(np.abs(want).max()) > 1.0
  assert max(full, scanned, decode, packed) <= 1e-4
  # Each per-layer part matters: YaRN on the sliding layers too is another model.
  assert _delta(hf.load(path, rope_local_theta=None), want) > 1e-2


def test_olmo3_export_is_transformers_own_file(hf_checkpoint, ours, tmp_path):
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["model_type"], written["layer_types"], written["sliding_window"]) == (
      "olmo3", [S, F, S, S], 5)
  assert written["rope_parameters"][S] == {"rope_type": "default", "rope_theta": 50.0}
  assert config_from_hf(config_to_hf(ours.config)) == ours.config
  read = transformers.AutoConfig.from_pretrained(tmp_path)
  assert (type(read).__name__, read.layer_types, read.rope_parameters[F]["factor"]) == (
      "Olmo3Config", [S, F, S, S], 4.0)
  theirs = load_file(str(hf_checkpoint[0] / "model.safetensors"))
  mine = load_file(str(tmp_path / "model.safetensors"))
  assert sorted(mine) == sorted(theirs)
  for name, array in theirs.items():
    np.testing.assert_array_equal(mine[name], array, err_msg=name)
  # The presets' shapes are what OLMo 3's config.json says, as transformers reads it.
  seven_b = transformers.Olmo3Config(
      vocab_size=100_278, hidden_size=4096, intermediate_size=11_008, num_hidden_layers=32,
      num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6,
      max_position_embeddings=65_536, rope_theta=500_000.0, sliding_window=4096,
      rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 8192,
                    "attention_factor": 1.2079441541679836})
  assert config_from_hf(seven_b.to_dict(), dtype="bfloat16", scan_layers=True) == get_preset(
      "olmo3-7b")


def test_an_olmo3_student_of_teacher_blocks_keeps_each_blocks_attention(hf_model,
                                                                       hf_checkpoint):
  """Blocks (3, 1): a sliding block (plain RoPE at base 50) then the full one (YaRN); its logits
  are transformers' OLMo 3 of layer_types [sliding, full] with those blocks' weights."""
  layers = (3, 1)
  source = BlocksSource(HFSource(str(hf_checkpoint[0]), "teacher.hf_path"), layers)
  cfg = source.model_config()
  assert cfg.local_layers() == [True, False]
  assert cfg.layer_ropes() == (ROPE_LOCAL, ROPE_GLOBAL)
  student = source.load(cfg, pt.create_mesh({"data": 8, "model": 1}),
                        pt.rules_from_config({"strategy": "fsdp"}), seed=0)
  picked = _olmo3(num_hidden_layers=2, layer_types=[S, F])
  picked.load_state_dict(blocks_state(hf_model, layers))
  assert _delta(student, torch_logits(picked.eval(), TOKENS)) <= 1e-4


@pytest.mark.parametrize("changes, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for Olmo3ForCausalLM"),
    ({"layer_types": [S, F]}, "must name 'sliding_attention' or 'full_attention' for each of "
                              "num_hidden_layers=4"),
    ({"rope_parameters": {F: {"rope_type": "default", "rope_theta": 5.0},
                          S: {"rope_type": "linear", "rope_theta": 5.0, "factor": 2.0}}},
     "sliding_attention rope_type='linear' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
])
def test_what_distillax_does_not_read_of_olmo3_is_refused_in_one_line(changes, message):
  with pytest.raises(UserError, match=message):
    config_from_hf({**CONFIG, "architectures": ["Olmo3ForCausalLM"], **changes})


def test_olmo_block_configs_that_no_family_holds_are_refused():
  with pytest.raises(ConfigError, match="pre_norms=False leaves the blocks without a norm"):
    TransformerConfig(pre_norms=False)
  with pytest.raises(ConfigError, match="qk_norm_across_heads=True .*model.qk_norm=False"):
    TransformerConfig(qk_norm_across_heads=True)
  with pytest.raises(UserError, match="no Hugging Face equivalent"):
    hf_architecture(get_preset("tiny_olmo3", qkv_bias=True))
