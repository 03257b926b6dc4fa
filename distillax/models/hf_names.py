"""Which Hugging Face tensor each distillax parameter is, and how its layout differs.

HF linear weights are (out, in), ours (in, ...out) with heads split out; a stacked parameter has
leading dims HF stores as separate tensors: the layers under `scan_layers`, the experts of a
Qwen3-MoE or Mixtral layer (one tensor per expert, `mlp.experts.{e}.gate_proj.weight`), or
both; its `Source` lists their names in row-major order. gpt-oss stores each layer's experts in
one tensor, with gate and up interleaved column by column in `gate_up_proj`: two of our
parameters ('even' and 'odd' layouts) share it, and `interleave` joins them on export.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distillax.models.config import TransformerConfig
from distillax.models.hf_config import hf_architecture

INTERLEAVED = ("even", "odd")  # the column parity of each layout


@dataclasses.dataclass(frozen=True)
class Layout:
  """Ours <-> HF for one tensor kind. HF linear weights are (out, in); ours are (in, ...out)."""

  # 'copy' | 'T' | 'out_heads' (D,H,K)<-(H*K,D) | 'in_heads' (H,K,D)<-(D,H*K)
  # | 'flat_heads' (H,K)<-(H*K,) (q/k/v biases) | 'even' / 'odd' (...,F)<-(...,2F): the even or
  # odd columns of a tensor two of ours share (gpt-oss's interleaved gate_up_proj)
  kind: str

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
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
    return (ours[2], ours[0] * ours[1])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    """x in HF's layout (for 'even' / 'odd': x as is; `interleave` joins the two halves)."""
    if self.kind in ("copy",) + INTERLEAVED:
      return x
    if self.kind == "T":
      return x.T
    if self.kind == "out_heads":
      return x.reshape(x.shape[0], -1).T
    if self.kind == "flat_heads":
      return x.reshape(-1)
    return x.reshape(-1, x.shape[2]).T

  def read(self, tensor, index: tuple[slice, ...], ours: tuple[int, ...]) -> np.ndarray:
    """The block `ours[index]` read from the HF tensor slice handle (only what it needs)."""
    r = [range(*s.indices(n)) for s, n in zip(index, ours)]
    sl = lambda rg: slice(rg.start, rg.stop)
    if self.kind == "copy":
      return tensor[tuple(sl(x) for x in r)]
    if self.kind == "T":
      return tensor[sl(r[1]), sl(r[0])].T
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


# Expert weights: ours (expert, in, out) stacked from one HF (out, in) tensor per expert "{e}".
_EXPERT_NAMES = {  # architecture -> (module, router, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
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


def _expert_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, Layout]]:
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


def _layer_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, Layout]]:
  """Block sub-path -> (HF name suffix under model.layers.{i}., layout); a suffix with "{e}"
  names one tensor per expert."""
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
  if config.num_experts:
    for key in ("gate", "up", "down"):
      del sources[("mlp", key)]
    sources.update(_expert_sources(config))
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
  return sources


_TOP_SOURCES = {
    ("embedder", "embedding"): ("model.embed_tokens.weight", Layout("copy")),
    ("final_norm", "scale"): ("model.norm.weight", Layout("copy")),
    ("lm_head",): ("lm_head.weight", Layout("T")),
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


def source_of(path: tuple, config: TransformerConfig) -> Source:
  keys = tuple(str(k) for k in path)
  if keys[0] != "layers":
    name, layout = _TOP_SOURCES[keys]
    return Source((name,), layout)
  sources = _layer_sources(config)
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
