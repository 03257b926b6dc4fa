"""Quantized export: integer weights + scales in safetensors, a JSON of the config, a loader.

A directory holds

    model.safetensors   '<weight>:qvalue' (int8; int4 and nf4 packed two per byte as uint8,
                        low nibble first; float8_e4m3fn as its uint8 bit pattern),
                        '<weight>:scale' (the compute dtype), every other variable as is
    quant_config.json   format, model config, quant rules, and per quantized weight its
                        qtype, shape and how it was quantized

The weights are quantized exactly as the fake-quant forward rounds them (same function), so
`load_quantized` (dequantize on load, then the PTQ forward: activations rounded where the rules
say) reproduces `quantize_for_training(model, qcfg)` bit for bit on the same weights, up to the
ordering of float ops XLA picks (the tests hold it to 1e-5 relative).

Export of the merged full-precision student stays with `models.hf.save` (after `merge_lora`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.sharding import Mesh

from distillax.errors import UserError
from distillax import jsonio
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, model_shardings, param_count
from distillax.quant import qat
from distillax.quant.config import QuantConfig
from distillax.quant.fakequant import WeightQuant, dequantize, quantize_weight
from distillax.quant.graph import flat_pure_dict
from distillax.quant.sites import find_matmul_sites, has_wrapped_weights

FORMAT = "distillax-quantized/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "quant_config.json"
_PACKED = ("int4", "nf4")


# ---- packing -----------------------------------------------------------------------------------

def pack_nibbles(codes: np.ndarray) -> np.ndarray:
  """4-bit codes (int4 two's complement or nf4 indices, any integer dtype) -> uint8, two per
  byte: element 2i in the low nibble, 2i+1 in the high one; odd counts padded with 0."""
  flat = (np.asarray(codes).astype(np.int16).reshape(-1) & 0xF).astype(np.uint8)
  if flat.size % 2:
    flat = np.concatenate([flat, np.zeros(1, np.uint8)])
  return flat[0::2] | (flat[1::2] << 4)


def unpack_nibbles(packed: np.ndarray, size: int, signed: bool) -> np.ndarray:
  nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)[:size].astype(np.int8)
  return ((nibbles ^ 8) - 8).astype(np.int8) if signed else nibbles


def _encode(qvalue: jax.Array, qtype: str) -> np.ndarray:
  q = np.asarray(jax.device_get(qvalue))
  if qtype in _PACKED:
    return pack_nibbles(q)
  if qtype == "float8_e4m3fn":
    return q.view(np.uint8)
  return q.astype(np.int8)


def _decode(stored: np.ndarray, qtype: str, shape) -> jax.Array:
  size = math.prod(shape)
  if qtype == "int4":
    return jnp.asarray(unpack_nibbles(stored, size, True).reshape(shape), jnp.int4)
  if qtype == "nf4":
    return jnp.asarray(unpack_nibbles(stored, size, False).reshape(shape), jnp.uint4)
  if qtype == "float8_e4m3fn":
    return jnp.asarray(stored.view(ml_dtypes.float8_e4m3fn).reshape(shape))
  return jnp.asarray(stored.reshape(shape), jnp.int8)


# ---- export ------------------------------------------------------------------------------------

def _as_numpy(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def export_quantized(model: nnx.Module, qcfg: QuantConfig | Mapping[str, Any], path: str,
                     sample_tokens: jax.Array | None = None) -> dict[str, Any]:
  """Writes `model` (full precision or QAT-trained) quantized by `qcfg` into directory `path`.

  Returns the JSON written. Merge LoRA adapters first (`merge_lora`). Pass the model before
  PTQ, not `quantize_post_training`'s output: rounding is not idempotent for int4 (scales are
  absmax / 7.5), so rounding rounded weights again moves them.
  """
  if has_wrapped_weights(model):
    raise UserError("export_quantized needs a model without adapters; merge_lora(model) first")
  plain = qat.full_precision(model)
  qcfg, plans = qat._prepare(plain, qcfg, sample_tokens)  # pylint: disable=protected-access
  values = flat_pure_dict(nnx.to_pure_dict(nnx.state(plain)))
  tensors, weights = {}, {}
  for name, value in values.items():
    if name not in plans:
      tensors[name] = _as_numpy(value)
      continue
    _, wq = plans[name]
    qvalue, scale = jax.jit(quantize_weight, static_argnums=1)(value, wq)
    tensors[f"{name}:qvalue"] = _encode(qvalue, wq.qtype)
    tensors[f"{name}:scale"] = _as_numpy(scale)
    weights[name] = {"qtype": wq.qtype, "shape": list(value.shape),
                     "param_dtype": str(value.dtype), "contract_axes": list(wq.contract_axes),
                     "call_ndim": wq.ndim, "tile_size": wq.tile_size,
                     "compute_dtype": wq.compute_dtype, "act_qtype": wq.act_qtype}
  meta = {"format": FORMAT, "model_config": plain.config.to_dict(),
          "quant_config": qcfg.to_dict(), "quantized": weights}
  os.makedirs(path, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(path, WEIGHTS_FILE))
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    jsonio.dump(meta, f, indent=1)
  return meta


def read_meta(path: str) -> dict[str, Any]:
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(file):
    raise UserError(f"{path} has no {CONFIG_FILE}; point at a directory export_quantized wrote")
  with open(file) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise UserError(f"{file} has format {meta.get('format')!r}, expected {FORMAT!r}")
  return meta


def load_quantized(path: str, *, mesh: Mesh | None = None, rules: Any = None,
                   sample_tokens: jax.Array | None = None) -> nnx.Module:
  """The model stored in `path`, weights dequantized on load (placed by `rules` on `mesh` when
  given), activations rounded where the stored rules say: the PTQ forward of those integers."""
  meta = read_meta(path)
  config = TransformerConfig.from_dict(meta["model_config"])
  tensors = safetensors.numpy.load_file(os.path.join(path, WEIGHTS_FILE))
  graphdef, abstract = nnx.split(abstract_model(config))
  shardings = flat_pure_dict(model_shardings(abstract_model(config), mesh, rules)) if mesh else {}
  values = {}
  for name, like in flat_pure_dict(nnx.to_pure_dict(abstract)).items():
    info = meta["quantized"].get(name)
    if info is None:
      if name not in tensors:
        raise UserError(f"{path}/{WEIGHTS_FILE} lacks tensor {name!r}")
      value = jnp.asarray(tensors[name])
    else:
      qvalue = _decode(tensors[f"{name}:qvalue"], info["qtype"], tuple(info["shape"]))
      value = dequantize(qvalue, jnp.asarray(tensors[f"{name}:scale"]), info["qtype"])
    value = value.astype(like.dtype)
    values[name] = jax.device_put(value, shardings[name]) if name in shardings else value
  state = nnx.to_pure_dict(abstract)
  _fill(state, values, "")
  nnx.replace_by_pure_dict(abstract, state)
  model = nnx.merge(graphdef, abstract)
  quantized = {name: WeightQuant(i["qtype"], tuple(i["contract_axes"]), i["call_ndim"],
                                 i["tile_size"], i["compute_dtype"], i["act_qtype"])
               for name, i in meta["quantized"].items()}
  return _with_activation_rounding(model, quantized, sample_tokens)


def _fill(tree: dict, values: Mapping[str, Any], prefix: str) -> None:
  for key, sub in tree.items():
    name = f"{prefix}{key}"
    if isinstance(sub, dict):
      _fill(sub, values, name + "/")
    else:
      tree[key] = values[name]


def _with_activation_rounding(model: nnx.Module, quantized: Mapping[str, WeightQuant],
                              sample_tokens) -> nnx.Module:
  if not any(wq.act_qtype for wq in quantized.values()):
    return model
  sites = {s.name: s for s in find_matmul_sites(model, sample_tokens)}
  plans = {name: (sites[name], wq) for name, wq in quantized.items()}
  return qat._mark(model, plans, round_on_read=False)  # pylint: disable=protected-access


# ---- size --------------------------------------------------------------------------------------

def size_report(path: str) -> dict[str, Any]:
  """Bytes on disk against the same model in fp32 and bf16.

  `quantized_tensors_*` compare the quantized weights alone (codes + scales) with those weights
  in fp32: ~4x for int8, ~8x for int4/nf4 minus the scales. The whole-file ratios include what
  stays in full precision (embeddings, norms, unmatched modules) and the safetensors header.
  """
  meta = read_meta(path)
  config = TransformerConfig.from_dict(meta["model_config"])
  file_bytes = os.path.getsize(os.path.join(path, WEIGHTS_FILE))
  json_bytes = os.path.getsize(os.path.join(path, CONFIG_FILE))
  tensors = safetensors.numpy.load_file(os.path.join(path, WEIGHTS_FILE))
  q_bytes = sum(tensors[f"{n}:qvalue"].nbytes + tensors[f"{n}:scale"].nbytes
                for n in meta["quantized"])
  q_params = sum(math.prod(i["shape"]) for i in meta["quantized"].values())
  n_params = param_count(config)
  total = file_bytes + json_bytes
  return {
      "bytes_on_disk": total, "safetensors_bytes": file_bytes, "json_bytes": json_bytes,
      "params": n_params, "fp32_bytes": 4 * n_params, "bf16_bytes": 2 * n_params,
      "ratio_vs_fp32": 4 * n_params / total, "ratio_vs_bf16": 2 * n_params / total,
      "quantized_params": q_params, "quantized_tensors_bytes": q_bytes,
      "quantized_tensors_ratio_vs_fp32": 4 * q_params / max(q_bytes, 1),
      "qtypes": sorted({i["qtype"] for i in meta["quantized"].values()}),
  }


def format_size_report(report: Mapping[str, Any]) -> str:
  mib = lambda b: f"{b / 2**20:.3f} MiB"
  return (f"on disk {mib(report['bytes_on_disk'])} ({'/'.join(report['qtypes']) or 'fp'}) | "
          f"fp32 {mib(report['fp32_bytes'])} ({report['ratio_vs_fp32']:.2f}x smaller) | "
          f"bf16 {mib(report['bf16_bytes'])} ({report['ratio_vs_bf16']:.2f}x smaller) | "
          f"quantized weights alone {report['quantized_tensors_ratio_vs_fp32']:.2f}x vs fp32")
