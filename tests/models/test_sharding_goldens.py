"""Golden sharding dumps of real `Transformer` presets, per partitioning preset and mesh.

Like MaxText's sharding dumps: for every parameter of the abstract model (`nnx.eval_shape`, no
memory) each dump records its shape, dtype, logical axes, mesh spec and bytes per device, so a
change to the rules or to the model's logical axes that moves a parameter fails here with the
paths that moved. Regenerate deliberately with DISTILLAX_UPDATE_GOLDENS=1 and read the diff
before committing it.

The models cover the features that change the tree: `tiny` (untied output, GQA with 2 kv heads),
`tiny_gemma` (tied embeddings, post norms), `tiny_gemma3` (Gemma 3: q/k norms over head_dim
and six layers), `tiny_gemma4` (Gemma 4: per-layer input tables and gates, layer scalars, wider
full layers, sharing layers without k/v, double-wide MLPs), `tiny_qwen35` (Qwen3.5: Gated
DeltaNet layers over key and value heads, with a conv, decay and norm of their own, and a gated
full-attention layer), `tiny_olmo3` (OLMo 3: post norms only, q/k norms over whole
projections), `tiny_phi3` (Phi-4-mini's: Llama's tree, tied), `tiny_qwen3_next` (Qwen3-Next:
tiny_qwen35's layers with experts beside a gated shared expert), `tiny_llama4` (Llama 4: dense
and MoE layers with a shared expert, no norm parameters on q/k), `llama3.2-1b` (a published shape:
stacked layers under scan, bfloat16, 128k vocabulary), `tiny_moe` (stacked experts and a router:
where the 'expert' rules of fsdp_ep / ep_tp place them), `tiny_qwen3_moe` (Qwen3-MoE with dense
layers: dense MLPs and experts in alternate layers), `tiny_deepseek_v3` (latent attention: the
'latent' widths fsdp splits like embed; a dense layer, then experts with their router's choice
bias and a shared expert) and `tiny_glm4_moe` (GLM-4.5: biased, q/k-normed grouped attention,
the same MoE). tiny's 4 query and 2 kv heads do not divide a model axis of 4 or 8; the default
rules reject that, so the dumps are made with `replicate_indivisible` (the dim falls back to its
replicated rule) and list the paths that need it.
"""

import json
import os
import pathlib

import pytest

from distillax import partitioning as pt
from distillax.errors import PartitioningError
from tests.models.sharding import plan, rows_by_path

GOLDEN_DIR = pathlib.Path(__file__).parent / "goldens"
MODELS = ("tiny", "tiny_gemma", "llama3.2-1b", "tiny_moe", "tiny_gemma3", "tiny_gemma4",
          "tiny_qwen35", "tiny_qwen3_moe", "tiny_olmo3", "tiny_phi3", "tiny_qwen3_next",
          "tiny_llama4", "tiny_deepseek_v3", "tiny_glm4_moe")
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]


def _spec_json(spec):
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def _rejected_by_default(rows, strategy, data, model):
  """Paths whose spec the default rules (replicate_indivisible=False) refuse to resolve."""
  rules = pt.rules_from_config({"strategy": strategy})
  mesh = pt.create_mesh({"data": data, "model": model})
  rejected = []
  for r in rows:
    try:
      rules.resolve(r.logical, r.shape, mesh, r.path)
    except PartitioningError:
      rejected.append(r.path)
  return rejected


def sharding_dump(preset, strategy, data, model):
  rows = plan(preset, strategy, data, model, replicate_indivisible=True)
  return {
      "model": preset, "strategy": strategy, "mesh": {"data": data, "model": model},
      "raises_without_replicate_indivisible": _rejected_by_default(rows, strategy, data, model),
      "total_bytes": sum(r.bytes_total for r in rows),
      "bytes_per_device": sum(r.bytes_per_device for r in rows),
      "params": {r.path: {"shape": list(r.shape), "dtype": r.dtype, "logical": list(r.logical),
                          "mesh": _spec_json(r.mesh_spec),
                          "bytes_per_device": r.bytes_per_device} for r in rows},
  }


def dumps(dump) -> str:
  """JSON with one line per parameter, so a golden reads (and diffs) like a plan table."""
  head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in dump.items() if k != "params"]
  body = ",\n".join(f"  {json.dumps(p)}: {json.dumps(e)}" for p, e in dump["params"].items())
  return "{\n" + "\n".join(head) + '\n "params": {\n' + body + "\n }\n}\n"


def _differences(got, want):
  """What moved, parameter by parameter, for a failure message a reviewer can act on."""
  lines = [f"{k}: {want.get(k)!r} -> {got[k]!r}" for k in got
           if k != "params" and got[k] != want.get(k)]
  gp, wp = got["params"], want.get("params", {})
  lines += [f"new parameter {p}: {gp[p]}" for p in gp if p not in wp]
  lines += [f"parameter gone {p}: {wp[p]}" for p in wp if p not in gp]
  lines += [f"{p}: {wp[p]} -> {gp[p]}" for p in gp if p in wp and gp[p] != wp[p]]
  return lines


@pytest.mark.parametrize("preset", MODELS)
@pytest.mark.parametrize("strategy", pt.BUILTIN_PRESETS)
@pytest.mark.parametrize("data,model", MESHES)
def test_golden_sharding_dump(preset, strategy, data, model):
  path = GOLDEN_DIR / preset / f"{strategy}_{data}x{model}.json"
  got = sharding_dump(preset, strategy, data, model)
  if os.environ.get("DISTILLAX_UPDATE_GOLDENS"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(got))
  want = json.loads(path.read_text())
  assert got == want, "\n".join([f"{path} differs:"] + _differences(got, want))


# ---- what the rules say, written by hand (not read off a dump) --------------------------------

def test_tiny_fsdp_tp_4x2_by_hand():
  """embed -> data, heads/kv_heads/mlp/vocab -> model, head_dim has no rule beyond replicate."""
  rows = rows_by_path(plan("tiny", "fsdp_tp", 4, 2))
  q = rows["layers/0/attn/q"]  # (embed 64, heads 4, head_dim 16) f32
  assert q.mesh_spec == ("data", "model", None) and q.bytes_per_device == 64 * 4 * 16 * 4 // 8
  assert rows["layers/0/attn/k"].mesh_spec == ("data", "model", None)  # 2 kv heads over 2
  assert rows["layers/1/attn/o"].mesh_spec == ("model", None, "data")
  assert rows["layers/0/mlp/down"].mesh_spec == ("model", "data")
  emb = rows["embedder/embedding"]  # (vocab 256, embed 64)
  assert emb.mesh_spec == ("model", "data") and emb.bytes_per_device == 256 * 64 * 4 // 8
  assert rows["lm_head"].mesh_spec == ("data", "model")  # untied: (embed, vocab)
  # A norm scale is (embed,): split over data like every embed dim, untouched by model.
  scale = rows["layers/0/attn_norm/scale"]
  assert scale.mesh_spec == ("data",) and scale.bytes_per_device == 64 * 4 // 4


def test_tp_replicates_norm_scales_and_splits_the_rest_over_model():
  rows = rows_by_path(plan("tiny", "tp", 4, 2))
  for path in ("final_norm/scale", "layers/0/attn_norm/scale", "layers/1/mlp_norm/scale"):
    assert rows[path].replicated and rows[path].bytes_per_device == rows[path].bytes_total
  assert rows["layers/0/attn/q"].mesh_spec == (None, "model", None)
  assert rows["layers/0/mlp/gate"].mesh_spec == (None, "model")
  assert rows["embedder/embedding"].mesh_spec == ("model", None)


def test_kv_heads_that_do_not_divide_the_model_axis_fall_back_to_replicated():
  """tiny has 2 kv heads: a model axis of 4 rejects them unless replicate_indivisible is set,
  and then they take the preset's trailing ('kv_heads', None); 4 query heads still split."""
  with pytest.raises(PartitioningError, match=r"layers/0/attn/k .*'kv_heads', size 2.*size 4"):
    plan("tiny", "tp", 2, 4)
  rows = rows_by_path(plan("tiny", "tp", 2, 4, replicate_indivisible=True))
  assert rows["layers/0/attn/k"].mesh_spec == (None, None, None)
  assert rows["layers/0/attn/q"].mesh_spec == (None, "model", None)
  # On 8, the 4 query heads fall back too.
  rows = rows_by_path(plan("tiny", "fsdp_tp", 1, 8, replicate_indivisible=True))
  assert rows["layers/0/attn/q"].mesh_spec == ("data", None, None)
  assert rows["layers/0/mlp/up"].mesh_spec == ("data", "model")


def test_tied_gemma_has_no_lm_head_and_shards_its_post_norms():
  rows = rows_by_path(plan("tiny_gemma", "fsdp", 8, 1))
  assert "lm_head" not in rows and rows["embedder/embedding"].mesh_spec == (None, "data")
  assert rows["layers/1/post_mlp_norm/scale"].mesh_spec == ("data",)


def test_llama_1b_stacked_layers_by_hand():
  rows = rows_by_path(plan("llama3.2-1b", "fsdp_tp", 2, 4))
  q = rows["layers/attn/q"]  # (layers 16, embed 2048, heads 32, head_dim 64) bf16
  assert q.shape == (16, 2048, 32, 64) and q.dtype == "bfloat16"
  assert q.mesh_spec == (None, "data", "model", None)
  assert q.bytes_per_device == 16 * 2048 * 32 * 64 * 2 // 8
  assert rows["layers/attn/k"].mesh_spec == (None, "data", "model", None)  # 8 kv heads over 4
  emb = rows["embedder/embedding"]
  assert emb.mesh_spec == ("model", "data") and emb.bytes_per_device == 128_256 * 2048 * 2 // 8
  assert "lm_head" not in rows  # tied


@pytest.mark.parametrize("strategy", pt.BUILTIN_PRESETS)
def test_dp_replicates_everything_and_only_dp(strategy):
  rows = plan("tiny", strategy, 4, 2)
  replicated = all(r.bytes_per_device == r.bytes_total for r in rows)
  assert replicated == (strategy == "dp")


@pytest.mark.parametrize("preset", [m for m in MODELS if m not in (
    "tiny_gemma3", "tiny_gemma4", "tiny_qwen35", "tiny_qwen3_moe", "tiny_olmo3",
    "tiny_qwen3_next", "tiny_deepseek_v3", "tiny_glm4_moe")])
@pytest.mark.parametrize("data,model", MESHES)
def test_fsdp_per_device_bytes_are_total_over_data_size(preset, data, model):
  """Every embed dim of these models divides every data size, so fsdp splits every parameter
  exactly data ways and nothing over model (tiny_gemma3's and tiny_qwen3_moe's q/k norms have
  no embed dim, nor do tiny_deepseek_v3's and tiny_glm4_moe's router choice biases: below for
  tiny_gemma3 and tiny_deepseek_v3;
  nor do tiny_gemma4's per-layer input table and norm, layer scalars, or tiny_qwen35's conv,
  decay and norms: by hand below)."""
  rows = plan(preset, "fsdp", data, model)
  total = sum(r.bytes_total for r in rows)
  assert sum(r.bytes_per_device for r in rows) == total // data
  for r in rows:
    assert r.bytes_per_device * data == r.bytes_total, r.path
    assert "model" not in r.mesh_spec, r.path


def test_deepseek_v3_splits_its_latent_widths_like_embed_under_fsdp_and_fsdp_ep():
  """The latent projections and norms split over data by their 'latent' dim (q_b, kv_b have
  no embed dim); the router's choice bias (expert,) stays whole under fsdp and splits with the
  experts under fsdp_ep; the dense first layer's MLP splits by embed."""
  rows = rows_by_path(plan("tiny_deepseek_v3", "fsdp", 8, 1))
  assert rows["layers/0/attn/q_b"].mesh_spec == ("data", None, None)  # (48, heads, head_dim)
  assert rows["layers/0/attn/kv_b"].mesh_spec == ("data", None, None)  # (32, ...)
  assert rows["layers/0/attn/q_a"].mesh_spec == ("data", None)  # embed first, latent after
  assert rows["layers/0/attn/kv_a_norm/scale"].mesh_spec == ("data",)
  assert rows["layers/1/mlp/router_score_bias"].replicated
  whole = sorted(p for p, r in rows.items() if r.bytes_per_device == r.bytes_total)
  assert whole == ["layers/1/mlp/router_score_bias"]
  ep = rows_by_path(plan("tiny_deepseek_v3", "fsdp_ep", 4, 2))
  assert ep["layers/1/mlp/router_score_bias"].mesh_spec == ("data",)
  assert ep["layers/1/mlp/gate"].mesh_spec == ("data", None, None)
  assert ep["layers/0/mlp/gate"].mesh_spec == ("data", None)


def test_gemma3_keeps_its_qk_norms_whole_and_splits_the_rest_under_fsdp():
  """tiny_gemma3's q/k norm scales are (head_dim 16,), which no rule splits: whole on every
  device; every other parameter (each has an embed dim) splits 8 ways."""
  rows = plan("tiny_gemma3", "fsdp", 8, 1)
  whole = sorted(r.path for r in rows if r.bytes_per_device == r.bytes_total)
  assert whole == sorted(f"layers/{i}/attn/{n}_norm/scale" for i in range(6) for n in "qk")
  assert all(r.bytes_per_device * 8 == r.bytes_total for r in rows if r.path not in whole)


def test_olmo3_qk_norms_follow_their_heads():
  """tiny_olmo3's q/k norm scales span whole projections, (heads 4, head_dim 16) and (kv_heads
  2, 16): no embed dim, so whole on every device under fsdp; under fsdp_tp their heads split
  over model as the q and k projections' do. It has no pre-norms, only post norms."""
  rows = rows_by_path(plan("tiny_olmo3", "fsdp", 8, 1))
  whole = sorted(p for p, r in rows.items() if r.bytes_per_device == r.bytes_total)
  assert whole == sorted(f"layers/{i}/attn/{n}_norm/scale" for i in range(4) for n in "qk")
  assert "layers/0/attn_norm/scale" not in rows and "layers/0/mlp_norm/scale" not in rows
  tp = rows_by_path(plan("tiny_olmo3", "fsdp_tp", 4, 2))
  assert tp["layers/0/attn/q_norm/scale"].mesh_spec == ("model", None)
  assert tp["layers/0/attn/q"].mesh_spec == ("data", "model", None)
  assert tp["layers/0/attn/k_norm/scale"].mesh_spec == ("model", None)


def test_tiny_moe_expert_parallel_presets_by_hand():
  """fsdp_ep: each data group holds 4/4 = 1 expert whole (embed cannot take data as well), the
  router and attention as fsdp; ep_tp: the experts over data and their width over model."""
  ep = rows_by_path(plan("tiny_moe", "fsdp_ep", 4, 2))
  gate = ep["layers/0/mlp/gate"]  # (expert 4, embed 64, mlp 32) f32
  assert gate.mesh_spec == ("data", None, None) and gate.bytes_per_device == 64 * 32 * 4
  assert ep["layers/1/mlp/down"].mesh_spec == ("data", None, None)
  assert ep["layers/0/mlp/router"].mesh_spec == ("data", None)  # (embed, expert): embed first
  assert ep["layers/0/attn/q"].mesh_spec == ("data", None, None)
  ep_tp = rows_by_path(plan("tiny_moe", "ep_tp", 4, 2))
  assert ep_tp["layers/0/mlp/up"].mesh_spec == ("data", None, "model")
  assert ep_tp["layers/0/mlp/down"].mesh_spec == ("data", "model", None)
  assert ep_tp["layers/0/mlp/router"].mesh_spec == (None, "data")
  assert rows_by_path(plan("tiny", "fsdp_ep", 4, 2)) == rows_by_path(plan("tiny", "fsdp", 4, 2))


def test_gemma4_per_layer_parts_by_hand():
  """fsdp_tp on 4 x 2: the per-layer input table is a vocabulary table (vocab over model), its
  packed per-layer width has no rule (replicated); the full layer's wider heads split like any;
  a sharing layer has no k/v; the layer scalar is replicated."""
  rows = rows_by_path(plan("tiny_gemma4", "fsdp_tp", 4, 2))
  table = rows["per_layer_inputs/embedding"]  # (vocab 256, 5 layers x 8)
  assert table.shape == (256, 40) and table.mesh_spec == ("model", None)
  assert rows["per_layer_inputs/projection"].mesh_spec == ("data", None)
  assert rows["layers/0/per_layer/gate"].mesh_spec == ("data", None)
  assert rows["layers/1/attn/q"].shape == (64, 4, 32)  # global_head_dim 32
  assert rows["layers/1/attn/q"].mesh_spec == ("data", "model", None)
  assert "layers/3/attn/k" not in rows and "layers/2/attn/k" in rows
  assert rows["layers/3/mlp/up"].shape == (64, 256)  # double-wide
  assert rows["layers/0/scalar"].replicated


def test_qwen35_gated_deltanet_parts_by_hand():
  """fsdp_tp on 4 x 2: a Gated DeltaNet layer's q/k (2 key heads), v/z (4 value heads) and its
  a/b/decay/dt_bias (per value head) split their heads over model and embed over data; its conv
  (4 taps x 128 channels: q, k and v of every head packed) and its output norm over head_dim
  have no rule and stay whole; the gated full layer's output gate splits like its queries.
  Under fsdp on 8 those whole parts are all that is not split 8 ways."""
  rows = rows_by_path(plan("tiny_qwen35", "fsdp_tp", 4, 2))
  q = rows["layers/0/attn/q"]  # (embed 64, key heads 2, 16) f32
  assert q.mesh_spec == ("data", "model", None) and q.bytes_per_device == 64 * 2 * 16 * 4 // 8
  assert rows["layers/0/attn/v"].shape == (64, 4, 16)
  assert rows["layers/0/attn/z"].mesh_spec == ("data", "model", None)
  assert rows["layers/0/attn/a"].mesh_spec == ("data", "model")
  assert rows["layers/0/attn/A_log"].mesh_spec == ("model",)
  assert rows["layers/0/attn/A_log"].bytes_per_device == 4 * 4 // 2
  conv = rows["layers/2/attn/conv"]
  assert conv.shape == (4, 2 * 2 * 16 + 4 * 16) and conv.replicated
  assert rows["layers/0/attn/o"].mesh_spec == ("model", None, "data")
  assert rows["layers/3/attn/out_gate"].mesh_spec == rows["layers/3/attn/q"].mesh_spec == (
      "data", "model", None)
  assert rows["layers/3/attn/k"].logical == ("embed", "kv_heads", "head_dim")
  fsdp = plan("tiny_qwen35", "fsdp", 8, 1)
  whole = sorted(r.path for r in fsdp if r.bytes_per_device == r.bytes_total)
  assert whole == sorted([f"layers/{i}/attn/{n}" for i in range(3)
                          for n in ("A_log", "conv", "dt_bias", "norm_scale")]
                         + ["layers/3/attn/k_norm/scale", "layers/3/attn/q_norm/scale"])
  assert all(r.bytes_per_device * 8 == r.bytes_total for r in fsdp if r.path not in whole)


def test_tiny_gemma4_moe_places_its_router_scales_and_dense_branch_by_hand():
  """Gemma 4's MoE block under the expert-parallel and tensor-parallel rules: its per-expert
  scales go with the experts (over data under fsdp_ep), the router's input scale and the
  branches' norms with embed, the dense MLP beside the experts like any MLP."""
  ep = rows_by_path(plan("tiny_gemma4_moe", "fsdp_ep", 4, 2))
  assert ep["layers/0/mlp/gate"].mesh_spec == ("data", None, None)  # (expert, embed, mlp)
  assert ep["layers/0/mlp/expert_scale"].mesh_spec == ("data",)  # (expert,)
  assert ep["layers/0/mlp/router_scale"].mesh_spec == ("data",)  # (embed,)
  assert ep["layers/0/mlp/dense/gate"].mesh_spec == ("data", None)  # (embed, mlp)
  assert ep["layers/0/mlp/experts_pre_norm/scale"].mesh_spec == ("data",)
  tp = rows_by_path(plan("tiny_gemma4_moe", "tp", 8, 1))
  assert tp["layers/0/mlp/up"].mesh_spec == (None, None, "model")
  assert tp["layers/0/mlp/dense/down"].mesh_spec == ("model", None)
  assert tp["layers/0/mlp/expert_scale"].mesh_spec == (None,)


def test_tiny_qwen35_moe_places_its_shared_expert_like_a_dense_mlp_by_hand():
  """Qwen3.5-MoE's shared expert beside the experts: under fsdp_ep and fsdp_tp its gate, up and
  down take the specs the dense Qwen3.5's MLP takes, while the experts go over data under
  fsdp_ep; its (embed, 1) output gate splits embed only."""
  for strategy in ("fsdp_ep", "fsdp_tp"):
    dense = rows_by_path(plan("tiny_qwen35", strategy, 4, 2))
    rows = rows_by_path(plan("tiny_qwen35_moe", strategy, 4, 2))
    for part in ("gate", "up", "down"):
      assert (rows[f"layers/0/mlp/shared_expert/{part}"].mesh_spec
              == dense[f"layers/0/mlp/{part}"].mesh_spec), (strategy, part)
    assert rows["layers/3/mlp/shared_expert/output_gate"].mesh_spec == ("data", None)
  assert dense["layers/0/mlp/gate"].mesh_spec == ("data", "model")  # fsdp_tp: (embed, mlp)
  assert rows["layers/0/mlp/shared_expert/gate"].mesh_spec == ("data", "model")
  ep = rows_by_path(plan("tiny_qwen35_moe", "fsdp_ep", 4, 2))
  assert ep["layers/0/mlp/gate"].mesh_spec == ("data", None, None)  # (expert, embed, mlp)
  assert ep["layers/0/mlp/shared_expert/gate"].mesh_spec == ("data", None)
