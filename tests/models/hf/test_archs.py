"""Qwen 2, Qwen 3 and Mistral checkpoints: parity with transformers both ways, exact round trips.

Each family is a tiny random transformers model with odd shapes (vocab 97, 3 layers, 6 query
heads over 2 kv heads, head_dim != hidden / heads where the family allows it) and random norm
and bias weights, so the feature that sets it apart really changes the logits: Qwen 2's q/k/v
biases, Qwen 3's q/k RMSNorm (here with tied embeddings), Mistral's sliding window (5, shorter
than the 13-token sequence). Built locally from configs; nothing is downloaded.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.support.hf import saved_with_logits, torch_logits  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from tests.support.models import Normal, forward, param_arrays, random_model  # noqa: E402

SHAPES = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
              attn_implementation="eager")
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 13)).astype(np.int64)
FAMILIES = {  # family -> (config class, model class, extra config fields)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=10, sliding_window=5)),
}
MAX_DIFFS = {}  # family -> {check: measured max |logit diff|}, printed at the end (pytest -s)


def _hf_model(family):
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(len(family))
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPES, **extra))
  with torch.no_grad():  # random norms and biases: every weight shapes the logits
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


def _torch_logits(model):
  return torch_logits(model, TOKENS)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
  family = request.param
  return (family, *saved_with_logits(_hf_model(family), tmp_path_factory.mktemp(family), TOKENS))


def _record(family, key, diff):
  MAX_DIFFS.setdefault(family, {})[key] = diff
  print(f"\n[hf parity] {family} {key}: max |logit diff| = {diff:.3e}")


def test_import_matches_transformers(hf_checkpoint):
  family, path, want = hf_checkpoint
  model = hf.load(path)
  cfg = model.config
  assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
  assert cfg.layer_windows() == ((5, 5, 5) if family == "mistral" else None)
  assert cfg.head_dim == {"qwen2": 8, "qwen3": 12, "mistral": 10}[family]
  assert cfg.tie_embeddings == (family == "qwen3")
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  diff = float(np.max(np.abs(got - want)))
  _record(family, "import", diff)
  assert diff <= 1e-4


def test_import_sharded_and_scanned(hf_checkpoint):
  family, path, want = hf_checkpoint
  mesh = pt.create_mesh({"data": 4, "model": 2})
  # vocab 97 divides neither mesh axis: those dimensions are replicated instead.
  rules = pt.rules_from_config({"strategy": "fsdp_tp", "replicate_indivisible": True})
  model = hf.load(path, mesh=mesh, rules=rules, scan_layers=True, remat="full")
  attn = model.layers.attn
  assert tuple(attn.q.sharding.spec) == (None, "data", "model", None)
  if family == "qwen2":  # biases split over their heads like the projections they follow
    assert tuple(attn.q_bias.sharding.spec) == (None, "model", None)
    assert tuple(attn.k_bias.sharding.spec) == (None, "model", None)
    assert attn.k_bias.addressable_shards[0].data.shape == (3, 1, 8)
  if family == "qwen3":  # head_dim is never split: the norm scales are whole on every device
    assert attn.q_norm.scale.addressable_shards[0].data.shape == (3, 12)
  graphdef, state = nnx.split(model)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  tokens = jnp.asarray(np.tile(TOKENS, (4, 1)), jnp.int32)  # batch 8: divisible by data=4
  diff = float(np.max(np.abs(np.asarray(logits(state, tokens)) - np.tile(want, (4, 1, 1)))))
  _record(family, "import sharded+scan+remat", diff)
  assert diff <= 1e-4


def test_export_loads_in_transformers_with_same_logits(hf_checkpoint, tmp_path):
  family, path, _ = hf_checkpoint
  ours = random_model(hf.load(path).config, seed=7, init=Normal(0.1))  # fresh weights, same family
  hf.save(ours, tmp_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == FAMILIES[family][1]
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  diff = float(np.max(np.abs(got - _torch_logits(reloaded))))
  _record(family, "export", diff)
  assert diff <= 1e-4


def test_export_then_import_is_exact(hf_checkpoint, tmp_path):
  family, path, _ = hf_checkpoint
  ours = random_model(hf.load(path, scan_layers=True).config, seed=8)
  hf.save(ours, tmp_path, max_shard_bytes=10_000)  # several files + index
  mesh = pt.create_mesh({"data": 4, "model": 2})
  back = hf.load(tmp_path, mesh=mesh, rules={"strategy": "fsdp_tp",
                                             "replicate_indivisible": True}, scan_layers=True)
  assert back.config == ours.config
  a, b = param_arrays(ours), param_arrays(back)
  assert a.keys() == b.keys()
  assert any("bias" in k or "q_norm" in k for k in a) == (family != "mistral")
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("hf_fields,named", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "'GPT2LMHeadModel' (model_type 'gpt2')"),
    ({"model_type": "gpt2"}, "'gpt2'"),
])
def test_unsupported_model_type_names_the_supported_ones(hf_fields, named, tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({**hf_fields, "vocab_size": 97}))
  with pytest.raises(UserError) as raised:
    hf.load(tmp_path)
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith(f"{tmp_path / 'config.json'}: unsupported architecture {named}; ")
  for arch, model_type in [("LlamaForCausalLM", "llama"), ("GemmaForCausalLM", "gemma"),
                           ("Gemma2ForCausalLM", "gemma2"), ("Qwen2ForCausalLM", "qwen2"),
                           ("Qwen3ForCausalLM", "qwen3"), ("MistralForCausalLM", "mistral")]:
    assert f"{arch} ({model_type})" in message


def teardown_module():
  if MAX_DIFFS:
    print("\n[hf parity] max |logit diff| per family:", json.dumps(MAX_DIFFS, indent=1))
