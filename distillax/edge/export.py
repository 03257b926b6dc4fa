"""A distillax Transformer as one GGUF file that llama.cpp runs (`distillax export --format gguf`).

  write_gguf(model, "student-q4_0.gguf", quant="q4_0", rules=config.qat.rules,
             tokenizer=make_tokenizer("byte"))

Architectures: what `hf_config_out.hf_architecture` names, as llama.cpp's llama (Llama, and
Mistral when no layer's window is shorter than the context; Mixtral, its experts included),
gemma, gemma2, gemma3, gemma4, qwen2, qwen3, qwen3moe, qwen35(moe), gpt-oss, smollm3, olmo2
(OLMo 3), phi3 (Phi-3/4), qwen3next, llama4, deepseek2 (DeepSeek V3) and glm4moe (GLM-4.5), with
llama.cpp's tensor names and `{arch}.*` keys (edge/layout.py; gemma4's and qwen35's own:
edge/gemma4_qwen35.py; the others' hooks: edge/arch_hooks.py). Conventions llama.cpp expects and
we follow: tensors are row-major [out, in] (GGUF ne0 = in, the axis ggml's blocks run along);
Llama's and SmolLM3's q/k rows are permuted from the rotate-half layout to llama.cpp's
interleaved RoPE (others rotate halves); (1 + scale) norms (Gemma 1-3, Qwen3.5) are stored as
1 + scale (llama.cpp multiplies by the stored weight); Gemma's sqrt(embed_dim) embedding scale
is llama.cpp's own; tied embeddings: no `output.weight` (llama.cpp reuses token_embd); Llama 3.1
RoPE scaling goes in as the `rope_freqs` factors convert_hf_to_gguf.py writes. Features llama.cpp
would silently run differently (a sliding window on a llama/qwen arch, Gemma 2 without soft-caps,
an MoE that drops tokens for capacity, ...) are refused with a UserError before anything is
written: `edge/arch_checks.py` decides the architecture and holds those refusals.

Types (`quant`): f32 writes every tensor as float32; f16 writes matrices as float16 (norms and
biases stay f32, as llama.cpp's converter does); q8_0 / q4_0 quantize the matmul weights the
quant `rules` select (the rules of QAT, first match wins; without rules every matmul weight,
tied embedding included), the others stay f32; an MoE router (ffn_gate_inp) is always f32, as
QAT keeps it in full precision. A matmul weight is flattened to [out, in] with its contracted
axes (increasing order) as `in` (an MoE's stacked experts to [expert, out, in]), the layout
`quant/ggml.py` blocks QAT weights in, and quantized by that same code: the blocks in the file
are the numbers the QAT forward used, bit for bit. Norms and biases are always f32.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.data.tokenizer import ByteTokenizer, Tokenizer
from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.models.transformer import Transformer, with_config, with_layer_layout
from distillax.quant import ggml
from distillax.quant.config import GGML_WEIGHT_QTYPES, QuantConfig
from distillax.quant.graph import flat_pure_dict
from distillax.edge.arch_checks import ARCHITECTURES, gguf_architecture  # noqa: F401 (re-exported)
from distillax.edge.arch_hooks import HOOKS, arch_tensors
from distillax.edge.gemma4_qwen35 import (QWEN35_ARCHS, check_qwen35_blocks, gemma4_moe_tensors,
                                          gemma4_rope_freqs, qwen35_tensors)
from distillax.edge.layout import add_hparams, gguf_name, rope_freq_factors
from distillax.edge.vocab import vocab_of
from distillax.quant.qat import full_precision, weight_quants
from distillax.quant.sites import MatmulSite, find_matmul_sites

QUANTS = ("f32", "f16", "q8_0", "q4_0")
_EXPERT_BIASES = ("mlp/gate_bias", "mlp/up_bias", "mlp/down_bias")
_TABLES = ("embedder/embedding", "per_layer_inputs/embedding")  # [vocab, width] as stored


# ---- tensors -------------------------------------------------------------------------------

def tensor_types(model: Transformer, quant: str, rules: Sequence[Any] | None = None
                 ) -> tuple[dict[str, tuple[tuple[int, ...], tuple[int, ...]]], dict[str, str]]:
  """({param name: (the axes its matmul contracts, its group axes: an MoE's experts)},
  {param name: 'f32' | 'f16' | 'q8_0' | 'q4_0'}) with one-layer names ('layers/3/attn/q'): how
  `write_gguf` stores each parameter.

  The rules are matched in the model's own layout, as QAT matched them (a scanned model's
  module paths are 'layers/attn', an unrolled one's 'layers/3/attn'); stacked parameters then
  give every layer the type of the stack.
  """
  if quant not in QUANTS:
    raise UserError(f"--quant={quant!r} is unknown; use one of {', '.join(QUANTS)}")
  sites = {s.name: s for s in find_matmul_sites(model)}
  plans = _ggml_plans(quant, rules, list(sites.values())) if quant in GGML_WEIGHT_QTYPES else {}
  layouts, types = {}, {}
  for name in flat_pure_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))):
    matrix = name == "embedder/embedding" or (name in sites and not sites[name].is_router)
    kind = plans[name][1].qtype if name in plans else (
        "f16" if quant == "f16" and matrix else "f32")  # an MoE router stays f32
    for layer_name in _per_layer(name, model.config):
      types[layer_name] = kind
      if name in sites:
        layouts[layer_name] = (sites[name].contract_axes, sites[name].batch_axes)
  return layouts, types


def _per_layer(name: str, config: TransformerConfig) -> list[str]:
  if config.scan_layers and name.startswith("layers/"):
    return [f"layers/{i}/{name[len('layers/'):]}" for i in range(config.num_layers)]
  return [name]


def _ggml_plans(quant: str, rules, sites: list[MatmulSite]):
  qcfg = QuantConfig.from_config({"rules": tuple(rules)}) if rules else QuantConfig.simple(quant)
  for i, rule in enumerate(qcfg.rules):
    if rule.weight_qtype not in (None,) + GGML_WEIGHT_QTYPES:
      raise UserError(f"qat.rules[{i}] weight_qtype={rule.weight_qtype!r} has no GGUF type; "
                      f"use llama.cpp's {' or '.join(GGML_WEIGHT_QTYPES)} in the rules (and "
                      f"train QAT with them) for a GGUF export")
  used = {r.weight_qtype for r in qcfg.rules if r.weight_qtype}
  if quant not in used:
    raise UserError(f"--quant {quant}, but the qat.rules quantize to {sorted(used)}; pass "
                    f"--quant {sorted(used)[0]} or change the rules")
  return weight_quants(qcfg, sites, "float32")


def _rows(x: np.ndarray, layout, name: str) -> np.ndarray:
  """GGUF's row-major [out, in] of a matmul weight (in = its contracted axes, increasing), one
  per group index for stacked experts ([expert, out, in]); the untied embedding as it is
  ([vocab, embed]); norms and biases flattened."""
  if layout is None:  # gpt-oss's expert biases keep one row per expert
    keep = name in _TABLES or name.endswith(_EXPERT_BIASES)
    return x if keep else x.reshape(-1)
  contract, groups = sorted(layout[0]), sorted(layout[1])
  free = [a for a in range(x.ndim) if a not in contract and a not in groups]
  n_in = int(np.prod([x.shape[a] for a in contract]))
  lead = tuple(x.shape[a] for a in groups)
  return np.transpose(x, groups + free + contract).reshape(lead + (-1, n_in))


def _rope_interleave(rows: np.ndarray, n_heads: int) -> np.ndarray:
  """Llama q/k rows: rotate-half pairs (i, i + d/2) -> llama.cpp's adjacent pairs (2i, 2i+1)."""
  return (rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:])
          .swapaxes(1, 2).reshape(rows.shape))


def gguf_arrays(model: Transformer, layouts: dict[str, tuple]):
  """Yields (the params a tensor is made of: one, Qwen3.5's merged ones or none, GGUF name, float32
  array as llama.cpp reads it) for every tensor of an unrolled model, before quantization."""
  config = model.config
  arch = gguf_architecture(config)
  params = {name: _host(value).astype(np.float32) for name, value
            in flat_pure_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}
  rows = {}  # name: its rows, as llama.cpp reads them
  for name, value in params.items():
    x = _rows(value, layouts.get(name), name)
    if name.endswith("norm/scale") and config.norm_scale_plus_one:
      x = (np.float32(1) + x).astype(np.float32)
    adjacent = arch in ("llama", "smollm3") or arch in HOOKS and HOOKS[arch].interleaved_rope
    if adjacent and name.endswith(("attn/q", "attn/k")):
      x = _rope_interleave(x, config.num_heads if name.endswith("q") else config.num_kv_heads)
    rows[name] = x
  tensors = [((name,), name, x) for name, x in rows.items()]
  if config.moe_dense_mlp:
    merged = [t for i in range(config.num_layers) for t in gemma4_moe_tensors(i, rows)]
    taken = {source for sources, _, _ in merged for source in sources}
    tensors = [t for t in tensors if t[1] not in taken] + merged
  if arch in QWEN35_ARCHS:
    merged = [t for i in range(config.num_layers) for t in qwen35_tensors(i, rows, params, config)]
    taken = {source for sources, _, _ in merged for source in sources}
    tensors = [t for t in tensors if t[1] not in taken] + merged
  if arch in HOOKS:
    tensors = arch_tensors(HOOKS[arch], config, tensors, rows, params)
  for sources, name, x in tensors:
    yield sources, gguf_name(name, config, arch), np.ascontiguousarray(x)
  if arch in ("llama", "llama4") and config.rope_scaling_factor is not None:
    yield (), "rope_freqs.weight", rope_freq_factors(config)
  if arch == "gemma4":
    yield (), "rope_freqs.weight", gemma4_rope_freqs(config)
  for name, x in HOOKS[arch].extra(config) if arch in HOOKS else ():
    yield (), name, x


def _host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # all gather; process 0 writes
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def encode_tensor(rows: np.ndarray, ggml_type: str) -> np.ndarray:
  """What the file stores for one tensor: float32 / float16 values or ggml's block bytes,
  quantized by the code that rounds QAT weights (`ggml.quantize`)."""
  if ggml_type == "f32":
    return rows.astype(np.float32)
  if ggml_type == "f16":
    return rows.astype(np.float16)
  codes, scales = ggml.quantize(jnp.asarray(rows), ggml_type, (rows.ndim - 1,))
  return ggml.pack_blocks(np.asarray(codes), np.asarray(scales), ggml_type)


def _one_type(sources: tuple[str, ...], gguf_tensor: str, types: dict[str, str]) -> str:
  kinds = sorted({types.get(name, "f32") for name in sources} or {"f32"})
  if len(kinds) > 1:
    raise UserError(f"llama.cpp stores {', '.join(sources)} as one tensor, {gguf_tensor}, but "
                    f"the quant rules give them {kinds}; give them one type in the rules")
  return kinds[0]


# ---- the file ------------------------------------------------------------------------------

def _gguf():
  try:
    import gguf
  except ImportError:
    raise UserError("GGUF export needs the gguf package; install the edge extra: pip install "
                    "'distillax[edge]'") from None
  return gguf


def _plain(model: nnx.Module) -> Transformer:
  """The plain model (no fake quantization, no interception) in its own layer layout; an MoE
  under the reference dispatch traced as the ragged one (the same weights and numbers), whose
  grouped matmuls name the expert axis of each expert weight (the dense one's einsums do not)."""
  if not isinstance(getattr(model, "config", None), TransformerConfig):
    raise UserError(f"GGUF export takes a distillax Transformer, not {type(model).__name__}")
  model = full_precision(model)
  if model.config.num_experts and model.config.moe_impl == "dense":
    model = with_config(model, moe_impl="ragged")
  return model


def write_gguf(model: nnx.Module, path: str | os.PathLike, *, quant: str = "f32",
               rules: Sequence[Any] | None = None, tokenizer: Tokenizer | None = None,
               add_bos: bool = True) -> dict[str, Any]:
  """Writes `model` as a GGUF file (see the module docstring for the types and conventions).

  rules: quant rules (QAT's `qat.rules`) choosing q8_0 / q4_0 per matmul weight; tokenizer: the
  one the model was trained with (byte-level when omitted); add_bos: whether llama.cpp adds BOS
  (distillax's data.add_bos). Returns {'path', 'architecture', 'types': {GGUF name: type},
  'bytes'}; only process 0 writes, every process must call it.
  """
  gguf = _gguf()
  model = _plain(model)
  config = model.config
  arch = gguf_architecture(config)
  vocab = vocab_of(tokenizer or ByteTokenizer(), config.vocab_size)
  layouts, types = tensor_types(model, quant, rules)
  if arch in QWEN35_ARCHS:
    check_qwen35_blocks(config, types)
  if arch in HOOKS:  # deepseek2: kv_b's blocks
    HOOKS[arch].check_types(config, types)
  model = with_layer_layout(model, False)
  writer = gguf.GGUFWriter(os.fspath(path), arch)
  add_hparams(writer, config, arch, quant)
  vocab.write(writer, add_bos)
  stored = {}
  for sources, gguf_tensor, rows in gguf_arrays(model, layouts):
    ggml_type = _one_type(sources, gguf_tensor, types)
    data = encode_tensor(rows, ggml_type)
    raw = None if ggml_type in ("f32", "f16") else gguf.GGMLQuantizationType[ggml_type.upper()]
    writer.add_tensor(gguf_tensor, data, raw_shape=data.shape if raw else None, raw_dtype=raw)
    stored[gguf_tensor] = ggml_type
  if jax.process_index() == 0:  # only now, every check passed, is anything written
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
  writer.close()
  size = os.path.getsize(path) if os.path.exists(path) else 0
  return {"path": os.fspath(path), "architecture": arch, "types": stored, "bytes": size}


# ---- `distillax export --format gguf` --------------------------------------------------------

def check_export_args(fmt: str, quant: str | None) -> str:
  """The --quant of an export (f32 when omitted), checked before anything is loaded."""
  if fmt != "gguf":
    if quant is not None:
      raise UserError(f"--quant applies to --format gguf, not --format {fmt}; drop --quant or "
                      f"export --format gguf")
    return ""
  quant = quant or "f32"
  if quant not in QUANTS:
    raise UserError(f"--quant={quant!r} is unknown; use one of {', '.join(QUANTS)}")
  _gguf()
  return quant


def export_run(model: nnx.Module, output: str, quant: str, rules: Sequence[Any] | None,
               tokenizer: Tokenizer, add_bos: bool) -> str:
  """Writes `<output>/model-<quant>.gguf` for a run's trained student with the run's tokenizer
  and, for q8_0 / q4_0, the config's qat.rules (every matmul weight in `quant` when it has
  none); returns the line the command prints."""
  path = os.path.join(output, f"model-{quant}.gguf")
  info = write_gguf(model, path, quant=quant, rules=tuple(rules or ()) or None,
                    tokenizer=tokenizer, add_bos=add_bos)
  kinds = sorted(set(info["types"].values()))
  return (f"wrote {path} (GGUF, llama.cpp architecture {info['architecture']}, tensors "
          f"{'/'.join(kinds)}, {info['bytes'] / 2**20:.2f} MiB)")
