"""gpt-oss checkpoints: parity with transformers both ways (full forward and KV-cached decode),
exact round trips, and the released MXFP4 expert packing dequantized on load.

A tiny random GptOssForCausalLM (vocab 97, 2 layers: sliding then full, window 4; 4 experts,
top-2) built locally from a config; nothing is downloaded. Every gpt-oss part is live: q/k/v/o
biases, sinks, YaRN RoPE (gpt-oss's own parameters: factor 32, truncate off, attention factor
0.1 ln 32 + 1), the router bias, expert biases, and a swiglu_limit of 0.4 so the clamps bite.
The router weights are drawn wide (std 1) so no token sits near a routing tie.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf
from distillax.models.moe import mxfp4  # noqa: E402
from distillax.models.hf.config import config_from_hf  # noqa: E402
from distillax.models.layers import rope_attention_factor, rope_inverse_frequencies  # noqa: E402
from tests.support.hf import cached_decode_delta, saved_with_logits, torch_logits  # noqa: E402
from tests.support.models import Normal, forward, random_model  # noqa: E402

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4,
              swiglu_limit=0.4, tie_word_embeddings=False, attn_implementation="eager")
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)


def _hf_model():
  torch.manual_seed(3)
  model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG))
  with torch.no_grad():
    for name, p in model.named_parameters():
      std = 0.3 if "norm" in name else 1.0 if name.endswith("router.weight") else 0.1
      p.normal_(0.0, std)
  return model.eval()


@pytest.fixture(scope="module")
def hf_model():
  return _hf_model()


@pytest.fixture(scope="module")
def hf_checkpoint(hf_model, tmp_path_factory):
  return saved_with_logits(hf_model, tmp_path_factory.mktemp("gpt_oss"), TOKENS)


def test_gpt_oss_import_matches_transformers_full_forward_and_sharded(hf_checkpoint):
  path, want = hf_checkpoint
  model = hf.load(path)
  cfg = model.config
  assert (cfg.attention_sinks, cfg.qkv_bias, cfg.attn_out_bias, cfg.router_bias,
          cfg.expert_bias, cfg.mlp_activation) == (True, True, True, True, True, "clamped_swiglu")
  assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_yarn_truncate) == (
      "yarn", 32.0, False)
  assert cfg.local_layers() == [True, False]  # gpt-oss: sliding, full, sliding, ...
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  delta = float(np.max(np.abs(got - want)))
  print(f"\ngpt_oss full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4

  # Layers stacked, the experts' width over model: each device reads the even or odd columns
  # of its half of the interleaved gate_up_proj.
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "tp", "replicate_indivisible": True})
  scanned = hf.load(path, mesh=mesh, rules=rules, scan_layers=True)
  assert scanned.layers.mlp.gate.addressable_shards[0].data.shape == (2, 4, 32, 16)
  assert scanned.layers.mlp.up_bias.addressable_shards[0].data.shape == (2, 4, 16)
  graphdef, state = nnx.split(scanned)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  got = np.asarray(logits(state, jnp.asarray(TOKENS, jnp.int32)))
  assert float(np.max(np.abs(got - want))) <= 1e-4


def test_gpt_oss_cached_decode_matches_transformers(hf_model, hf_checkpoint):
  """Prefill 7 tokens (blockwise with sinks), then 4 greedy steps (the reference path against
  the cache), past the sliding window of 4."""
  delta = cached_decode_delta(hf_model, hf.load(hf_checkpoint[0]), TOKENS[:, :7], steps=4)
  print(f"\ngpt_oss cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_gpt_oss_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  ours = random_model(hf.load(hf_checkpoint[0], scan_layers=True).config, seed=7,
                      init=Normal(0.1))
  hf.save(ours, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["layer_types"] == ["sliding_attention", "full_attention"]
  assert written["rope_parameters"]["rope_type"] == "yarn"
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "GptOssForCausalLM"
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(reloaded, TOKENS)))) <= 1e-4
  back = hf.load(tmp_path, scan_layers=True)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("truncate,attention_factor,rotary", [(True, None, 1.0), (False, 1.5, 1.0),
                                                              (False, None, 0.5)])
def test_yarn_frequencies_and_attention_factor_match_transformers(truncate, attention_factor,
                                                                  rotary):
  """head_dim 64 (gpt-oss's), theta 150k, factor 32 over 4096: the ramp spans pairs ~8..17 (of
  32; with RoPE on half of head_dim, pairs ~4..9 of 16)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
          "beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 4096,
          "partial_rotary_factor": rotary}
  if attention_factor is not None:
    rope["attention_factor"] = attention_factor
  hf_cfg = transformers.GptOssConfig(head_dim=64, rope_parameters=rope,
                                     max_position_embeddings=131072)
  want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
  ours = config_from_hf(json.loads(hf_cfg.to_json_string())).replace(
      partial_rotary_factor=rotary)
  np.testing.assert_allclose(rope_inverse_frequencies(ours), want_freq.numpy(), rtol=1e-6)
  assert rope_attention_factor(ours) == pytest.approx(want_factor, rel=1e-12)
  plain = rope_inverse_frequencies(ours.replace(rope_scaling_factor=None))
  assert np.sum(~np.isclose(rope_inverse_frequencies(ours), plain)) > 10  # yarn slowed them


# ---- MXFP4 ------------------------------------------------------------------------------------

_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pack_mxfp4(w_xRxI: np.ndarray):
  """Our own packer: (blocks (..., R, I/32, 16), scales (..., R, I/32)) of float rows, each
  block of 32 scaled by the power of two that brings its largest magnitude to at most 6, then
  rounded to the nearest e2m1 magnitude (the sign in bit 3), low nibble = even element."""
  groups = w_xRxI.reshape(w_xRxI.shape[:-1] + (-1, 32))
  amax = np.abs(groups).max(-1)
  exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
  scaled = groups / np.exp2(exponent)[..., None]
  code = np.abs(np.abs(scaled)[..., None] - _MAGNITUDES).argmin(-1) + 8 * (scaled < 0)
  blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (exponent + 127).astype(np.uint8)


def test_mxfp4_packer_and_dequantizer_by_hand_and_against_transformers():
  row = np.zeros(32)
  row[:4] = [0.5, -1.0, 6.0, 3.0]  # largest 6: scale 2**0, byte 127
  blocks, scales = _pack_mxfp4(row[None, None])
  # codes 1, 8+2, 7, 5: bytes 1 | 10 << 4 = 0xA1 and 7 | 5 << 4 = 0x57
  assert (blocks[0, 0, 0, :2].tolist(), scales[0, 0, 0]) == ([0xA1, 0x57], 127)
  np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales)[0, 0], row)
  doubled = mxfp4.dequantize(blocks, scales + 1)[0, 0, :4]  # e8m0 128 = 2**1
  np.testing.assert_array_equal(doubled, [1.0, -2.0, 12.0, 6.0])

  rng = np.random.default_rng(0)  # every byte and a spread of exponents, (E, R, G, 16)
  blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 135, size=(3, 5, 2), dtype=np.uint8)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
  np.testing.assert_array_equal(np.swapaxes(mxfp4.dequantize(blocks, scales), -1, -2), theirs)


def test_mxfp4_packed_checkpoint_loads_dequantized(hf_model, tmp_path):
  """The released layout: gate_up_proj / down_proj as `_blocks` + `_scales` (rows = outputs),
  quantization_config mxfp4, every other tensor bfloat16. transformers runs in float32 on the
  same bfloat16 values and on its own dequantization of our packing."""
  state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
  reference = _hf_model()
  with torch.no_grad():
    for name in [k for k in state if not k.endswith(("gate_up_proj", "down_proj"))]:
      state[name] = state[name].to(torch.bfloat16)
      reference.get_parameter(name).copy_(state[name].float())
    for name in [k for k in state if k.endswith(("gate_up_proj", "down_proj"))]:
      rows = state.pop(name).numpy().swapaxes(-1, -2)  # (E, out, in)
      blocks, scales = _pack_mxfp4(rows)
      state[f"{name}_blocks"], state[f"{name}_scales"] = map(torch.from_numpy, (blocks, scales))
      reference.get_parameter(name).copy_(convert_moe_packed_tensors(
          torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32))
  save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
            metadata={"format": "pt"})
  hf_config = json.loads(hf_model.config.to_json_string())
  hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  ours = hf.load(tmp_path)
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - torch_logits(reference, TOKENS)))) <= 1e-4
  # the packing is coarse: the dequantized model is not the original one
  assert float(np.max(np.abs(got - torch_logits(hf_model, TOKENS)))) > 1e-3
  # One expert per device row and half of each one's columns per device: every shard is
  # dequantized from its own experts' blocks and rows alone, and the whole equals the above.
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "tp", "rules": [("expert", "data")],
                                "replicate_indivisible": True})
  sharded = hf.load(tmp_path, mesh=mesh, rules=rules)
  assert sharded.layers[0].mlp.gate.addressable_shards[0].data.shape == (1, 32, 16)
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(sharded, nnx.Param))):
    np.testing.assert_array_equal(a, b)

  hf_config["quantization_config"] = {"quant_method": "bitsandbytes"}
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(UserError, match="quant_method='bitsandbytes' is not supported"):
    hf.load(tmp_path)
  del hf_config["quantization_config"]
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  with pytest.raises(UserError, match="down_proj_blocks.*MXFP4-packed.*no quantization_config"):
    hf.load(tmp_path)
