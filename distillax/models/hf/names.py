"""Which Hugging Face tensor each distillax parameter is, and how its layout differs.

HF linear weights are (out, in), ours (in, ...out) with heads split out; a stacked parameter has
leading dims HF stores as separate tensors: the layers under `scan_layers`, the experts of a
Qwen3-MoE or Mixtral layer (one tensor per expert, `mlp.experts.{e}.gate_proj.weight`), or
both; its `Source` lists their names in row-major order. gpt-oss stores each layer's experts in
one tensor, with gate and up interleaved column by column in `gate_up_proj`: two of our
parameters ('even' and 'odd' layouts) share it, and `interleave` joins them on export.
Qwen3.5 shares tensors by blocks of rows (`Layout.rows`): a Gated DeltaNet layer's q, k and v
are one `in_proj_qkv`, and a gated attention layer's q_proj holds each head's query rows then its
output-gate rows; `join_parts` stacks them back on export. Gemma 4's MoE block keeps each layer's
experts stacked (expert, out, in): gate and up as the first and second halves of the rows of
`experts.gate_up_proj` ('first_half' / 'second_half'), down as `experts.down_proj`
('experts_T').
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distillax.models.config import TransformerConfig
from distillax.models.hf.config_out import hf_architecture
from distillax.models.hf.deepseek import FAMILIES as DEEPSEEK_FAMILIES
from distillax.models.hf.deepseek import MOE_SOURCES as DEEPSEEK_MOE_SOURCES
from distillax.models.hf.deepseek import mla_sources

INTERLEAVED = ("even", "odd")  # the column parity of each layout
HALVES = ("first_half", "second_half")  # ours (E, in, F) <- rows [h*F, (h+1)*F) of HF (E, 2F, in)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Ours <-> HF for one tensor kind. HF linear weights are (out, in); ours are (in, ...out)."""

  # 'copy' | 'T' | 'out_heads' (D,H,K)<-(H*K,D) | 'in_heads' (H,K,D)<-(D,H*K)
  # | 'flat_heads' (H,K)<-(H*K,) (q/k/v biases) | 'even' / 'odd' (...,F)<-(...,2F): the even or
  # odd columns of a tensor two of ours share (gpt-oss's interleaved gate_up_proj)
  # | 'experts_T' (E,A,B)<-(E,B,A) | 'first_half' / 'second_half' (E,A,F)<-(E,2F,A): the first or
  # second F rows per expert, transposed (Gemma 4's gate_up_proj)
  kind: str
  # A tensor of HF rows shared with other parameters: (groups, offset, size, period) = ours is,
  # in HF form, rows g * period + offset + [0, size) of every group g (None: the whole tensor).
  rows: tuple[int, int, int, int] | None = None

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    shape = self._own_hf_shape(ours)
    if self.rows is None:
      return shape
    groups, _, _, period = self.rows
    return (groups * period,) + shape[1:]

  def parts(self) -> tuple[object, int, int]:
    """(this parameter's key among the tensor's parts, its share, the whole): a shared tensor
    is complete when the shares of the parts that arrived add up to the whole."""
    if self.kind in INTERLEAVED + HALVES:
      return self.kind, 1, 2
    return self.rows[1], self.rows[2], self.rows[3]

  @property
  def shared(self) -> bool:
    return self.kind in INTERLEAVED + HALVES or self.rows is not None

  def _own_hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "conv":
      return (ours[1], 1, ours[0])
    if self.kind == "copy":
      return ours
    if self.kind == "T":
      return ours[::-1]
    if self.kind == "out_heads":
      return (ours[1] * ours[2], ours[0])
    if self.kind == "flat_heads":
      return (ours[0] * ours[1],)
    if self.kind in INTERLEAVED:
      return ours[:-1] + (2 * ours[-1],)
    if self.kind == "experts_T":
      return (ours[0], ours[2], ours[1])
    if self.kind in HALVES:
      return (ours[0], 2 * ours[2], ours[1])
    return (ours[2], ours[0] * ours[1])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """x in HF's layout (for 'even' / 'odd': x as is; `interleave` joins the two halves)."""
    if self.kind in ("copy",) + INTERLEAVED:
      return x
    if self.kind == "conv":
      return x.T[:, None, :]
    if self.kind == "T":
      return x.T
    if self.kind in ("experts_T",) + HALVES:  # (for a half: `join_parts` stacks the two)
      return x.transpose(0, 2, 1)
    if self.kind == "out_heads":
      return x.reshape(x.shape[0], -1).T
    if self.kind == "flat_heads":
      return x.reshape(-1)
    return x.reshape(-1, x.shape[2]).T

  def read(self, tensor, index: tuple[slice, ...], ours: tuple[int, ...]) -> np.ndarray:
    """The block `ours[index]` read from the HF tensor slice handle (only what it needs)."""
    if self.rows is not None:
      tensor = _RowBlock(tensor, self.rows)
    r = [range(*s.indices(n)) for s, n in zip(index, ours)]
    sl = lambda rg: slice(rg.start, rg.stop)
    if self.kind == "conv":  # ours (K, C) from hf (C, 1, K)
      return tensor[sl(r[1]), 0:1, sl(r[0])][:, 0, :].T
    if self.kind == "copy":
      return tensor[tuple(sl(x) for x in r)]
    if self.kind == "T":
      return tensor[sl(r[1]), sl(r[0])].T
    if self.kind in ("experts_T",) + HALVES:  # ours (E, A, B) from hf (E, B, A) or (E, 2B, A)
      offset = HALVES.index(self.kind) * ours[2] if self.kind in HALVES else 0
      rows = slice(offset + r[2].start, offset + r[2].stop)
      return tensor[sl(r[0]), rows, sl(r[1])].transpose(0, 2, 1)
    if self.kind == "out_heads":  # ours (D, H, K) from hf (H*K, D)
      D, H, K = ours
      rows = tensor[r[1].start * K:r[1].stop * K, sl(r[0])]
      return rows.reshape(len(r[1]), K, len(r[0]))[:, sl(r[2]), :].transpose(2, 0, 1)
    if self.kind in INTERLEAVED:  # ours (..., F) from hf (..., 2F), every other column
      cols = slice(2 * r[-1].start, 2 * r[-1].stop)
      block = tensor[tuple(sl(x) for x in r[:-1]) + (cols,)]
      return block[..., INTERLEAVED.index(self.kind)::2]
    if self.kind == "flat_heads":  # ours (H, K) from hf (H*K,)
      H, K = ours
      return tensor[r[0].start * K:r[0].stop * K].reshape(len(r[0]), K)[:, sl(r[1])]
    H, K, D = ours  # 'in_heads': ours (H, K, D) from hf (D, H*K)
    cols = tensor[sl(r[2]), r[0].start * K:r[0].stop * K]
    return cols.reshape(len(r[2]), len(r[0]), K)[:, :, sl(r[1])].transpose(1, 2, 0)


class _RowBlock:
  """A slice handle that sees only one parameter's rows of a shared HF tensor (Layout.rows)."""

  def __init__(self, tensor, rows: tuple[int, int, int, int]):
    self.tensor, self.rows = tensor, rows

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    groups, offset, size, period = self.rows
    ours = np.arange(groups * size)[index[0]]
    hf_rows = ours // size * period + offset + ours % size
    low = int(hf_rows.min()) if len(hf_rows) else 0
    block = self.tensor[(slice(low, int(hf_rows.max()) + 1 if len(hf_rows) else 0),) + index[1:]]
    return block[hf_rows - low]


def join_parts(layout: Layout, parts: dict) -> np.ndarray:
  """The HF tensor several parameters share, from their parts in HF form keyed by
  `Layout.parts()[0]`: gpt-oss's interleaved columns, or Qwen3.5's blocks of rows."""
  if layout.kind in INTERLEAVED:
    return interleave(parts["even"], parts["odd"])
  if layout.kind in HALVES:
    return np.concatenate([parts[h] for h in HALVES], axis=1)
  groups = layout.rows[0]
  blocks = [parts[k].reshape((groups, -1) + parts[k].shape[1:]) for k in sorted(parts)]
  joined = np.concatenate(blocks, axis=1)
  return joined.reshape((-1,) + joined.shape[2:])


# Expert weights: ours (expert, in, out) stacked from one HF (out, in) tensor per expert "{e}".
_EXPERT_NAMES = {  # architecture -> (module, router, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "Qwen3_5MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    **{arch: ("mlp", "gate", "gate_proj", "up_proj", "down_proj") for arch in DEEPSEEK_FAMILIES},
}
# Qwen3-MoE's and Qwen3.5-MoE's experts as transformers 5 holds them in memory (its
# save_pretrained writes them per expert, as above; a checkpoint may store them this way):
# gate and up as the row halves of one (expert, 2 * out, in) tensor per layer, down (expert,
# out, in).
_FUSED_EXPERT_ARCHS = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM") + DEEPSEEK_FAMILIES
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
  return {
      ("attn", "q"): (qkv, Layout("out_heads", rows=(1, 0, key_rows, total))),
      ("attn", "k"): (qkv, Layout("out_heads", rows=(1, key_rows, key_rows, total))),
      ("attn", "v"): (qkv, Layout("out_heads", rows=(1, 2 * key_rows, value_rows, total))),
      ("attn", "z"): ("linear_attn.in_proj_z.weight", Layout("out_heads")),
      ("attn", "b"): ("linear_attn.in_proj_b.weight", Layout("T")),
      ("attn", "a"): ("linear_attn.in_proj_a.weight", Layout("T")),
      ("attn", "conv"): ("linear_attn.conv1d.weight", Layout("conv")),
      ("attn", "dt_bias"): ("linear_attn.dt_bias", Layout("copy")),
      ("attn", "A_log"): ("linear_attn.A_log", Layout("copy")),
      ("attn", "norm_scale"): ("linear_attn.norm.weight", Layout("copy")),
      ("attn", "o"): ("linear_attn.out_proj.weight", Layout("in_heads")),
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
  if config.qkv_bias:
    for proj in "qkv":
      sources[("attn", f"{proj}_bias")] = (f"self_attn.{proj}_proj.bias", Layout("flat_heads"))
  if config.attn_out_bias:
    sources[("attn", "o_bias")] = ("self_attn.o_proj.bias", Layout("copy"))
  if config.attention_sinks:
    sources[("attn", "sinks")] = ("self_attn.sinks", Layout("copy"))
  if config.qk_norm:
    sources[("attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", Layout("copy"))
    sources[("attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", Layout("copy"))
  if config.attn_output_gate:  # Qwen3.5's q_proj: each head's query rows, then its gate rows
    H, Dh = config.num_heads, config.head_dim
    sources[("attn", "q")] = ("self_attn.q_proj.weight",
                              Layout("out_heads", rows=(H, 0, Dh, 2 * Dh)))
    sources[("attn", "out_gate")] = ("self_attn.q_proj.weight",
                                     Layout("out_heads", rows=(H, Dh, Dh, 2 * Dh)))
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


def interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
  """(..., 2F) with even[..., f] at column 2f and odd[..., f] at 2f + 1."""
  return np.stack([even, odd], axis=-1).reshape(even.shape[:-1] + (2 * even.shape[-1],))
