"""Which Hugging Face tensor each distillax parameter is, and how its layout differs.

HF linear weights are (out, in), ours (in, ...out) with heads split out; a stacked parameter has
leading dims HF stores as separate tensors: the layers under `scan_layers`, the experts of a
Qwen3-MoE or Mixtral layer (one tensor per expert, `mlp.experts.{e}.gate_proj.weight`), or
both; its `Source` lists their names in row-major order. gpt-oss stores each layer's experts in
one tensor, with gate and up interleaved column by column in `gate_up_proj`: two of our
parameters ('even' and 'odd' layouts, hf/layout.py) share it, and `interleave` joins them on
export.
Qwen3.5 shares tensors by blocks of rows (`Layout.rows`): a Gated DeltaNet layer's q, k and v
are one `in_proj_qkv`, and a gated attention layer's q_proj holds each head's query rows then its
output-gate rows; `join_parts` stacks them back on export. Phi-3/4 keep a layer's q, k and v in
one `qkv_proj` and its gate and up in one `gate_up_proj` the same way, and Qwen3-Next a Gated
DeltaNet layer's q, k, v, z and b, a in one `in_proj_qkvz` / `in_proj_ba` by key head. Gemma 4's
MoE block keeps each layer's experts stacked (expert, out, in): gate and up as the first and
second halves of the rows of `experts.gate_up_proj` ('first_half' / 'second_half'), down as
`experts.down_proj` ('experts_T'). DeepSeek V3's latent attention and DeepSeek V3's and
GLM-4.5's MoE parts (choice bias, shared experts) are named in hf/deepseek.py.
"""

from __future__ import annotations

import dataclasses

from distillax.models.config import TransformerConfig
from distillax.models.hf.config_out import hf_architecture
from distillax.models.hf.deepseek import FAMILIES as DEEPSEEK_FAMILIES
from distillax.models.hf.deepseek import MOE_SOURCES as DEEPSEEK_MOE_SOURCES
from distillax.models.hf.deepseek import mla_sources
from distillax.models.hf.layout import Layout, interleave, join_parts  # noqa: F401 (re-exported)
from distillax.models.hf.llama4 import LLAMA4, llama4_sources

# Expert weights: ours (expert, in, out) stacked from one HF (out, in) tensor per expert "{e}".
_EXPERT_NAMES = {  # architecture -> (module, router, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "Qwen3_5MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "Qwen3NextForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    **{arch: ("mlp", "gate", "gate_proj", "up_proj", "down_proj") for arch in DEEPSEEK_FAMILIES},
}
# Qwen3-MoE's and Qwen3.5-MoE's experts as transformers 5 holds them in memory (its
# save_pretrained writes them per expert, as above; a checkpoint may store them this way):
# gate and up as the row halves of one (expert, 2 * out, in) tensor per layer, down (expert,
# out, in).
_FUSED_EXPERT_ARCHS = (("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
                       + DEEPSEEK_FAMILIES)
_FUSED_EXPERT_SOURCES = {
    ("mlp", "gate"): ("mlp.experts.gate_up_proj", Layout("first_half")),
    ("mlp", "up"): ("mlp.experts.gate_up_proj", Layout("second_half")),
    ("mlp", "down"): ("mlp.experts.down_proj", Layout("experts_T")),
}
# Qwen3.5-MoE's shared expert (models/moe/shared.py) and its output gate, (1, embed) in HF.
_SHARED_EXPERT_SOURCES = {
    ("mlp", "shared_expert", "gate"): ("mlp.shared_expert.gate_proj.weight", Layout("T")),
    ("mlp", "shared_expert", "up"): ("mlp.shared_expert.up_proj.weight", Layout("T")),
    ("mlp", "shared_expert", "down"): ("mlp.shared_expert.down_proj.weight", Layout("T")),
    ("mlp", "shared_expert", "output_gate"): ("mlp.shared_expert_gate.weight", Layout("T")),
}
# gpt-oss keeps each layer's experts stacked in one tensor per kind, stored (expert, in, out),
# gate and up interleaved column by column in gate_up_proj, and biases everywhere.
_GPT_OSS_SOURCES = {
    ("mlp", "router"): ("mlp.router.weight", Layout("T")),
    ("mlp", "router_bias"): ("mlp.router.bias", Layout("copy")),
    ("mlp", "gate"): ("mlp.experts.gate_up_proj", Layout("even")),
    ("mlp", "up"): ("mlp.experts.gate_up_proj", Layout("odd")),
    ("mlp", "gate_bias"): ("mlp.experts.gate_up_proj_bias", Layout("even")),
    ("mlp", "up_bias"): ("mlp.experts.gate_up_proj_bias", Layout("odd")),
    ("mlp", "down"): ("mlp.experts.down_proj", Layout("copy")),
    ("mlp", "down_bias"): ("mlp.experts.down_proj_bias", Layout("copy")),
}


# Gemma 4's MoE block (models/moe/gemma4.py): the experts and their router, the dense MLP beside
# them and the two branches' own norms.
_GEMMA4_MOE_SOURCES = {
    ("mlp", "router"): ("router.proj.weight", Layout("T")),
    ("mlp", "router_scale"): ("router.scale", Layout("copy")),
    ("mlp", "expert_scale"): ("router.per_expert_scale", Layout("copy")),
    ("mlp", "gate"): ("experts.gate_up_proj", Layout("first_half")),
    ("mlp", "up"): ("experts.gate_up_proj", Layout("second_half")),
    ("mlp", "down"): ("experts.down_proj", Layout("experts_T")),
    ("mlp", "dense", "gate"): ("mlp.gate_proj.weight", Layout("T")),
    ("mlp", "dense", "up"): ("mlp.up_proj.weight", Layout("T")),
    ("mlp", "dense", "down"): ("mlp.down_proj.weight", Layout("T")),
    ("mlp", "dense_post_norm", "scale"): ("post_feedforward_layernorm_1.weight", Layout("copy")),
    ("mlp", "experts_pre_norm", "scale"): ("pre_feedforward_layernorm_2.weight", Layout("copy")),
    ("mlp", "experts_post_norm", "scale"): ("post_feedforward_layernorm_2.weight",
                                            Layout("copy")),
}


def _expert_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, Layout]]:
  if config.moe_dense_mlp:
    return dict(_GEMMA4_MOE_SOURCES)
  arch = hf_architecture(config)
  if arch == "GptOssForCausalLM":
    return dict(_GPT_OSS_SOURCES)
  if arch == LLAMA4:  # stacked, under feed_forward: llama4_sources
    return {}
  module, router, gate, up, down = _EXPERT_NAMES[arch]
  return {
      ("mlp", "router"): (f"{module}.{router}.weight", Layout("T")),
      ("mlp", "gate"): (f"{module}.experts.{{e}}.{gate}.weight", Layout("T")),
      ("mlp", "up"): (f"{module}.experts.{{e}}.{up}.weight", Layout("T")),
      ("mlp", "down"): (f"{module}.experts.{{e}}.{down}.weight", Layout("T")),
  }


def _gated_deltanet_sources(config: TransformerConfig) -> dict[tuple[str, ...],
                                                              tuple[str, Layout]]:
  """A Qwen3.5 linear-attention layer's token mixer (models/gated_deltanet.py)."""
  key_rows = config.linear_num_key_heads * config.linear_key_head_dim
  value_rows = config.linear_num_value_heads * config.linear_value_head_dim
  qkv, total = "linear_attn.in_proj_qkv.weight", 2 * key_rows + value_rows
  projections = {
      ("attn", "q"): (qkv, Layout("out_heads", rows=(1, 0, key_rows, total))),
      ("attn", "k"): (qkv, Layout("out_heads", rows=(1, key_rows, key_rows, total))),
      ("attn", "v"): (qkv, Layout("out_heads", rows=(1, 2 * key_rows, value_rows, total))),
      ("attn", "z"): ("linear_attn.in_proj_z.weight", Layout("out_heads")),
      ("attn", "b"): ("linear_attn.in_proj_b.weight", Layout("T")),
      ("attn", "a"): ("linear_attn.in_proj_a.weight", Layout("T")),
  }
  if config.fused_qkvz_ba:
    projections = _grouped_linear_sources(config)
  return {
      **projections,
      ("attn", "conv"): ("linear_attn.conv1d.weight", Layout("conv")),
      ("attn", "dt_bias"): ("linear_attn.dt_bias", Layout("copy")),
      ("attn", "A_log"): ("linear_attn.A_log", Layout("copy")),
      ("attn", "norm_scale"): ("linear_attn.norm.weight", Layout("copy")),
      ("attn", "o"): ("linear_attn.out_proj.weight", Layout("in_heads")),
  }


def _fused_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, Layout]]:
  """Phi-3/4's fused projections: q, k and v as the row blocks of one qkv_proj, gate and up as
  the two halves of gate_up_proj's rows."""
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  F = config.mlp_dim
  qkv, total = "self_attn.qkv_proj.weight", q + 2 * kv
  gate_up = "mlp.gate_up_proj.weight"
  return {
      ("attn", "q"): (qkv, Layout("out_heads", rows=(1, 0, q, total))),
      ("attn", "k"): (qkv, Layout("out_heads", rows=(1, q, kv, total))),
      ("attn", "v"): (qkv, Layout("out_heads", rows=(1, q + kv, kv, total))),
      ("mlp", "gate"): (gate_up, Layout("T", rows=(1, 0, F, 2 * F))),
      ("mlp", "up"): (gate_up, Layout("T", rows=(1, F, F, 2 * F))),
  }


def _attention_part_sources(config: TransformerConfig
                            ) -> dict[tuple[str, ...], tuple[str, Layout]]:
  """An attention layer's optional parts: biases, sinks, q/k norms, Qwen3.5's output gate."""
  sources = {}
  if config.qkv_bias:
    for proj in "qkv":
      sources[("attn", f"{proj}_bias")] = (f"self_attn.{proj}_proj.bias", Layout("flat_heads"))
  if config.attn_out_bias:
    sources[("attn", "o_bias")] = ("self_attn.o_proj.bias", Layout("copy"))
  if config.attention_sinks:
    sources[("attn", "sinks")] = ("self_attn.sinks", Layout("copy"))
  if config.qk_norm:  # OLMo's over whole projections: (heads, head_dim) <- (heads * head_dim,)
    norm = Layout("flat_heads" if config.qk_norm_across_heads else "copy")
    sources[("attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", norm)
    sources[("attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", norm)
  if config.attn_output_gate:  # Qwen3.5's q_proj: each head's query rows, then its gate rows
    H, Dh = config.num_heads, config.head_dim
    sources[("attn", "q")] = ("self_attn.q_proj.weight",
                              Layout("out_heads", rows=(H, 0, Dh, 2 * Dh)))
    sources[("attn", "out_gate")] = ("self_attn.q_proj.weight",
                                     Layout("out_heads", rows=(H, Dh, Dh, 2 * Dh)))
  return sources


def _grouped_linear_sources(config: TransformerConfig
                            ) -> dict[tuple[str, ...], tuple[str, Layout]]:
  """Qwen3-Next's in_proj_qkvz and in_proj_ba: per key head, its q and k rows, then the v and
  z rows of its r = Hv / Hk value heads; its value heads' b then a rows."""
  dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
  groups = config.linear_num_key_heads
  r = config.linear_num_value_heads // groups
  period = 2 * dk + 2 * r * dv
  qkvz, ba = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
  return {
      ("attn", "q"): (qkvz, Layout("out_heads", rows=(groups, 0, dk, period))),
      ("attn", "k"): (qkvz, Layout("out_heads", rows=(groups, dk, dk, period))),
      ("attn", "v"): (qkvz, Layout("out_heads", rows=(groups, 2 * dk, r * dv, period))),
      ("attn", "z"): (qkvz, Layout("out_heads", rows=(groups, 2 * dk + r * dv, r * dv, period))),
      ("attn", "b"): (ba, Layout("T", rows=(groups, 0, r, 2 * r))),
      ("attn", "a"): (ba, Layout("T", rows=(groups, r, r, 2 * r))),
  }


def _family_sources(sources: dict, config: TransformerConfig, layer: int | None) -> dict:
  """`sources` with a layer's experts (not in a dense layer of moe_layers) and DeepSeek's
  latent attention in place of the dense MLP's and ordinary attention's tensors."""
  wrap = lambda table: {k: (n, Layout(kind)) for k, (n, kind) in table.items()}
  if config.num_experts and (layer is None or config.layer_is_moe(layer)):
    sources = {k: v for k, v in sources.items() if k not in _DENSE_MLP}
    sources.update(_expert_sources(config))
    if config.router_score_bias:  # DeepSeek V3, GLM-4.5: the choice bias, shared experts
      sources.update(wrap(DEEPSEEK_MOE_SOURCES))
    elif config.shared_expert_mlp_dim:
      sources.update(_SHARED_EXPERT_SOURCES)
  if config.kv_lora_rank:
    sources = {k: v for k, v in sources.items() if k[0] != "attn"}
    sources.update(wrap(mla_sources(config)))
  return sources


_DENSE_MLP = (("mlp", "gate"), ("mlp", "up"), ("mlp", "down"))


def _layer_sources(config: TransformerConfig,
                   layer: int | None = None) -> dict[tuple[str, ...], tuple[str, Layout]]:
  """Block sub-path -> (HF name suffix under model.layers.{i}., layout); a suffix with "{e}"
  names one tensor per expert. `layer`: which layer (a hybrid model's layers differ)."""
  mlp_norm = "pre_feedforward_layernorm" if config.use_post_norms else "post_attention_layernorm"
  sources = {
      ("attn_norm", "scale"): ("input_layernorm.weight", Layout("copy")),
      ("attn", "q"): ("self_attn.q_proj.weight", Layout("out_heads")),
      ("attn", "k"): ("self_attn.k_proj.weight", Layout("out_heads")),
      ("attn", "v"): ("self_attn.v_proj.weight", Layout("out_heads")),
      ("attn", "o"): ("self_attn.o_proj.weight", Layout("in_heads")),
      ("mlp_norm", "scale"): (f"{mlp_norm}.weight", Layout("copy")),
      ("mlp", "gate"): ("mlp.gate_proj.weight", Layout("T")),
      ("mlp", "up"): ("mlp.up_proj.weight", Layout("T")),
      ("mlp", "down"): ("mlp.down_proj.weight", Layout("T")),
  }
  sources = _family_sources(sources, config, layer)
  if config.use_post_norms:
    sources[("post_attn_norm", "scale")] = ("post_attention_layernorm.weight", Layout("copy"))
    sources[("post_mlp_norm", "scale")] = ("post_feedforward_layernorm.weight", Layout("copy"))
  sources.update(_attention_part_sources(config))
  if not config.pre_norms:  # OLMo: post norms only
    del sources[("attn_norm", "scale")], sources[("mlp_norm", "scale")]
  if config.fused_qkv_gate_up:  # Phi-3/4
    sources.update(_fused_sources(config))
  if hf_architecture(config) == LLAMA4:  # its RoPE pairs and feed_forward module
    sources.update(llama4_sources(config, layer is None or config.layer_is_moe(layer)))
  if layer is not None and config.layer_is_linear(layer):
    sources = {k: v for k, v in sources.items() if k[0] != "attn"}
    sources.update(_gated_deltanet_sources(config))
  if config.per_layer_input_dim:  # Gemma 4
    sources[("per_layer", "gate")] = ("per_layer_input_gate.weight", Layout("T"))
    sources[("per_layer", "projection")] = ("per_layer_projection.weight", Layout("T"))
    sources[("per_layer", "norm", "scale")] = ("post_per_layer_input_norm.weight",
                                               Layout("copy"))
  if config.layer_scalar:
    sources[("scalar",)] = ("layer_scalar", Layout("copy"))
  if layer is not None and not config.layer_owns_kv(layer):  # attends an earlier layer's k/v
    for key in (("attn", "k"), ("attn", "v"), ("attn", "k_norm", "scale")):
      sources.pop(key, None)
  if layer is not None and config.layer_keys_are_values(layer):  # Gemma 4 31B: no v_proj
    sources.pop(("attn", "v"), None)
  return sources


_TOP_SOURCES = {
    ("embedder", "embedding"): ("model.embed_tokens.weight", Layout("copy")),
    ("final_norm", "scale"): ("model.norm.weight", Layout("copy")),
    ("lm_head",): ("lm_head.weight", Layout("T")),
    # Gemma 4's per-layer inputs (models/per_layer_inputs.py)
    ("per_layer_inputs", "embedding"): ("model.embed_tokens_per_layer.weight", Layout("copy")),
    ("per_layer_inputs", "projection"): ("model.per_layer_model_projection.weight", Layout("T")),
    ("per_layer_inputs", "norm", "scale"): ("model.per_layer_projection_norm.weight",
                                            Layout("copy")),
}


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one of our parameters comes from: HF tensor names, one per index of the leading
  stacked dims `lead` (layers under scan, experts, both: row-major; () = one tensor)."""

  names: tuple[str, ...]
  layout: Layout
  lead: tuple[int, ...] = ()

  def split(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one HF tensor's block in ours: `shape` without the stacked dims."""
    return tuple(shape[len(self.lead):])


def fused_experts_stored(names, config: TransformerConfig) -> bool:
  """Whether a checkpoint with tensors `names` stores a Qwen3(.5)-MoE's experts fused."""
  return (config.num_experts > 0 and hf_architecture(config) in _FUSED_EXPERT_ARCHS
          and any(name.endswith(".mlp.experts.gate_up_proj") for name in names))


def source_of(path: tuple, config: TransformerConfig, fused_experts: bool = False) -> Source:
  """fused_experts: read the experts from transformers' fused tensors (fused_experts_stored)."""
  keys = tuple(str(k) for k in path)
  if keys[0] != "layers":
    name, layout = _TOP_SOURCES[keys]
    return Source((name,), layout)
  sources = _layer_sources(config, None if config.scan_layers else int(keys[1]))
  if fused_experts:
    sources.update(_FUSED_EXPERT_SOURCES)
  suffix, layout = sources[keys[1:] if config.scan_layers else keys[2:]]
  layers = range(config.num_layers) if config.scan_layers else [keys[1]]
  experts = range(config.num_experts) if "{e}" in suffix else [0]
  lead = (((config.num_layers,) if config.scan_layers else ())
          + ((config.num_experts,) if "{e}" in suffix else ()))
  names = tuple(f"model.layers.{i}.{suffix.format(e=e)}" for i in layers for e in experts)
  return Source(names, layout, lead)


def key_path(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
