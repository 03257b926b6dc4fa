"""Qwen3-MoE and Mixtral checkpoints: parity with transformers both ways, exact round trips.

Tiny random transformers models (vocab 97, 2 layers, 4 experts, top-2) built locally from
configs; nothing is downloaded. The router weights are drawn wide (std 1) so no token sits near
a tie between its k-th and (k+1)-th expert, where float rounding could route torch and JAX
differently. HF checkpoints keep one tensor per expert; ours stacks them on an 'expert' axis.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.support.hf import cached_decode_delta, saved_with_logits, torch_logits  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from tests.support.models import Normal, forward, random_model  # noqa: E402

SHAPES = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
              max_position_embeddings=64, attn_implementation="eager",
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
TOKENS = np.random.default_rng(1).integers(0, 97, size=(2, 11)).astype(np.int64)
FAMILIES = {  # family -> (config class, model class, extra config fields)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, intermediate_size=40, moe_intermediate_size=24,
                       norm_topk_prob=False, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, intermediate_size=24, tie_word_embeddings=False)),
}


def _hf_model(family):
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(len(family))
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPES, **extra))
  with torch.no_grad():
    for name, p in model.named_parameters():
      std = 0.3 if "norm" in name else 1.0 if name.endswith("gate.weight") else 0.1
      p.normal_(0.0, std)
  return model.eval()


def _torch_logits(model):
  return torch_logits(model, TOKENS)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
  family = request.param
  return (family, *saved_with_logits(_hf_model(family), tmp_path_factory.mktemp(family), TOKENS))


def test_moe_import_matches_transformers_unrolled_and_sharded_scanned(hf_checkpoint):
  family, path, want = hf_checkpoint
  model = hf.load(path)
  cfg = model.config
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_mlp_dim) == (4, 2, 24)
  assert (cfg.router, cfg.qk_norm) == (("softmax_topk", True) if family == "qwen3_moe"
                                       else ("topk_softmax", False))
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  delta = float(np.max(np.abs(got - want)))
  print(f"\n{family} full forward: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4

  # Experts over data (4 per device group of 2: one expert each on 4 of the 8 devices' rows),
  # layers stacked: each device reads only its experts' tensors.
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "tp", "rules": [("expert", "data")],
                                "replicate_indivisible": True})
  scanned = hf.load(path, mesh=mesh, rules=rules, scan_layers=True)
  gate = scanned.layers.mlp.gate
  assert tuple(gate.sharding.spec) == (None, "data", None, "model")
  assert gate.addressable_shards[0].data.shape == (2, 1, 32, 12)
  graphdef, state = nnx.split(scanned)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  tokens = jnp.asarray(np.tile(TOKENS, (4, 1)), jnp.int32)
  got = np.asarray(logits(state, tokens))
  assert float(np.max(np.abs(got - np.tile(want, (4, 1, 1))))) <= 1e-4


def test_moe_cached_decode_matches_transformers(hf_checkpoint):
  """Prefill 7 tokens, then 4 greedy single-token steps against the KV cache."""
  family, path, _ = hf_checkpoint
  delta = cached_decode_delta(_hf_model(family), hf.load(path), TOKENS[:, :7], steps=4)
  print(f"\n{family} cached decode: max |dlogit| vs transformers {delta:.1e}")  # README table
  assert delta <= 1e-4


def test_moe_export_loads_in_transformers_and_round_trips_exactly(hf_checkpoint, tmp_path):
  family, path, _ = hf_checkpoint
  ours = random_model(hf.load(path, scan_layers=True).config, seed=7, init=Normal(0.1))
  hf.save(ours, tmp_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == FAMILIES[family][1]
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  assert float(np.max(np.abs(got - _torch_logits(reloaded)))) <= 1e-4
  back = hf.load(tmp_path, scan_layers=True)
  assert back.config == ours.config
  for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                  jax.tree.leaves(nnx.state(back, nnx.Param))):
    np.testing.assert_array_equal(a, b)
