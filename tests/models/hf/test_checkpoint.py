"""HF checkpoints: parity with transformers on tiny random models, export, round trips, errors.

Runs only with the `hf` extra (torch + transformers); everything is built locally from configs,
nothing is downloaded (HF_HUB_OFFLINE=1 in conftest).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distillax import partitioning as pt  # noqa: E402
from distillax.errors import UserError  # noqa: E402
from distillax.models.hf import checkpoint as hf  # noqa: E402
from distillax.models.presets import get_preset  # noqa: E402
from distillax.models.hf.config_out import hf_architecture  # noqa: E402
from tests.support.models import Normal, forward, param_arrays, random_model  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, attn_implementation="eager")
TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 12)).astype(np.int64)
MAX_DIFFS = {}  # family -> measured max |logit diff|, printed at the end (pytest -s)


def _hf_model(family):
  torch.manual_seed({"llama": 0, "gemma": 1, "gemma2": 2}[family])
  if family == "llama":  # GQA, untied, Llama 3.1 RoPE scaling
    cfg = transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                    "factor": 4.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})
    model = transformers.LlamaForCausalLM(cfg)
  elif family == "gemma":  # MQA, head_dim != hidden / heads, tied
    cfg = transformers.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=32)
    model = transformers.GemmaForCausalLM(cfg)
  else:  # GQA, sliding window shorter than the sequence, soft-caps, query scalar != head_dim
    cfg = transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=10.0,
                                    final_logit_softcapping=5.0)
    model = transformers.Gemma2ForCausalLM(cfg)
  with torch.no_grad():  # random norms too, so the (1 + w) and w forms are both exercised
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


@pytest.fixture(scope="module", params=["llama", "gemma", "gemma2"])
def hf_checkpoint(request, tmp_path_factory):
  family = request.param
  model = _hf_model(family)
  path = tmp_path_factory.mktemp(family)
  model.save_pretrained(path)
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(TOKENS)).logits.numpy()
  return family, path, logits


def _record(family, key, diff):
  MAX_DIFFS.setdefault(family, {})[key] = diff
  print(f"\n[hf parity] {family} {key}: max |logit diff| = {diff:.3e}")


def test_import_matches_transformers(hf_checkpoint):
  family, path, want = hf_checkpoint
  model = hf.load(path)
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  diff = float(np.max(np.abs(got - want)))
  _record(family, "import", diff)
  assert diff <= 1e-4
  assert model.config.tie_embeddings == (family != "llama")


def test_import_sharded_and_scanned(hf_checkpoint):
  family, path, want = hf_checkpoint
  mesh = pt.create_mesh({"data": 4, "model": 2})
  # Gemma's single kv head cannot split over model=2: it is replicated instead.
  rules = pt.rules_from_config({"strategy": "fsdp_tp", "replicate_indivisible": True})
  model = hf.load(path, mesh=mesh, rules=rules, scan_layers=True)
  q = model.layers.attn.q[...]
  assert tuple(q.sharding.spec) == (None, "data", "model", None)
  assert q.addressable_shards[0].data.shape == (2, 16, 2, q.shape[3])
  graphdef, state = nnx.split(model)

  @jax.jit
  def logits(state, tokens):
    with pt.use_rules(mesh, rules):
      return nnx.merge(graphdef, state)(tokens).logits_BxLxV

  tokens = jnp.asarray(np.tile(TOKENS, (4, 1)), jnp.int32)  # batch 8: divisible by data=4
  diff = float(np.max(np.abs(np.asarray(logits(state, tokens)) - np.tile(want, (4, 1, 1)))))
  _record(family, "import sharded+scan", diff)
  assert diff <= 1e-4


def test_export_loads_in_transformers_with_same_logits(hf_checkpoint, tmp_path):
  family, path, _ = hf_checkpoint
  ours = hf.load(path)
  ours = random_model(ours.config, seed=11, init=Normal(0.1))  # fresh weights, same architecture
  hf.save(ours, tmp_path)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == hf_architecture(ours.config)
  with torch.no_grad():
    theirs = reloaded(input_ids=torch.tensor(TOKENS)).logits.numpy()
  got = np.asarray(forward(ours, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  diff = float(np.max(np.abs(got - theirs)))
  _record(family, "export", diff)
  assert diff <= 1e-4


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", {}),
    ("tiny_gemma", {"scan_layers": True, "param_dtype": "bfloat16", "dtype": "bfloat16"}),
])
def test_save_load_round_trip_is_exact_including_multi_file(preset, overrides, tmp_path):
  model = random_model(get_preset(preset, **overrides), seed=5)
  hf.save(model, tmp_path, max_shard_bytes=20_000)  # forces several files + index
  index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 1
  mesh = pt.create_mesh({"data": 8, "model": 1})
  back = hf.load(tmp_path, mesh=mesh, rules="fsdp", dtype=overrides.get("dtype"),
                 scan_layers=model.config.scan_layers)
  assert back.config == model.config.replace(max_seq_len=back.config.max_seq_len)
  a, b = param_arrays(model), param_arrays(back)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---- bad input --------------------------------------------------------------------------------

@pytest.fixture()
def llama_dir(tmp_path):
  model = random_model(get_preset("tiny"), seed=1)
  hf.save(model, tmp_path / "ckpt")
  return tmp_path / "ckpt"


def test_missing_config(llama_dir):
  (llama_dir / "config.json").unlink()
  with pytest.raises(UserError, match="config.json not found"):
    hf.load(llama_dir)


def test_missing_weights_file(llama_dir):
  (llama_dir / "model.safetensors").unlink()
  with pytest.raises(UserError, match="no \\*.safetensors"):
    hf.load(llama_dir)


def test_missing_shard_listed_in_index(tmp_path):
  hf.save(random_model(get_preset("tiny"), seed=1), tmp_path, max_shard_bytes=20_000)
  files = sorted(set(json.loads((tmp_path / hf.INDEX_FILE).read_text())["weight_map"].values()))
  (tmp_path / files[1]).unlink()
  with pytest.raises(UserError, match=files[1]):
    hf.load(tmp_path)


def test_unsupported_architecture(llama_dir):
  cfg = json.loads((llama_dir / "config.json").read_text())
  cfg["architectures"], cfg["model_type"] = ["BloomForCausalLM"], "bloom"
  (llama_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(UserError, match="unsupported architecture 'BloomForCausalLM'"):
    hf.load(llama_dir)


def test_shape_mismatch_names_tensor_and_file(llama_dir):
  cfg = json.loads((llama_dir / "config.json").read_text())
  cfg["intermediate_size"] = 96
  (llama_dir / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(UserError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' in "
                                      r"model\.safetensors has shape \((128, 64|64, 128)\) but "
                                      r"config\.json implies"):
    hf.load(llama_dir)


def test_missing_tensor(llama_dir):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(llama_dir / "model.safetensors"))
  del tensors["model.layers.1.self_attn.v_proj.weight"]
  save_file(tensors, str(llama_dir / "model.safetensors"))
  with pytest.raises(UserError, match="model.layers.1.self_attn.v_proj.weight"):
    hf.load(llama_dir)


def test_config_without_hf_equivalent_is_refused(tmp_path):
  odd = get_preset("tiny", norm_scale_plus_one=True)  # swiglu with Gemma norms: no HF class
  with pytest.raises(UserError, match="no Hugging Face equivalent"):
    hf.save(random_model(odd), tmp_path)
  assert not any(tmp_path.iterdir())


def teardown_module():
  if MAX_DIFFS:
    print("\n[hf parity] max |logit diff| per family:", json.dumps(MAX_DIFFS, indent=1))
