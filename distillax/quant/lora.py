"""LoRA and QLoRA adapters on selected matmul weights, trained alone (`trainable=LoRAParam`).

`apply_lora` replaces each selected weight's `nnx.Param` by a `LoRAWeight` holding the frozen
base (the original Param, or for QLoRA a `QuantizedWeight` of codes + scales) and two adapters
A (input dims x rank) and B (rank x output dims), `LoRAParam`s with logical axes taken from the
dims of the weight they span (None for the rank dim) and placed like it. The matmul becomes

    y = x @ W + (alpha / rank) * (dropout(x) @ A) @ B

computed in activation space by the interceptor (no full-size weight update is formed, and
dropout acts on the adapter input as in the LoRA paper). Reading the wrapper directly (`w[...]`)
gives the merged weight W + (alpha / rank) * A @ B, so code outside the interceptor still sees
the adapted model. B starts at zero: the adapted model starts equal to the base model.

What it costs is `lora_matmul.adapted_matmul`'s business (a custom VJP): the forward is one
matmul of [x | (alpha / rank) * h] and [W ; B], h = dropout(x) @ A; the backward computes no
gradient for the frozen base and keeps from the forward only x (which every site reading it
shares), h, the adapters, the keep mask at one bit per element and the base as stored (a QLoRA
base is dequantized again, never kept in full precision). Keep masks follow
`jax.random.bernoulli`'s rule, drawn two elements per Threefry block (`keep_mask`).

qwix has a LoraProvider, but it creates adapters lazily inside the intercepted call, which our
Transformer runs on per-block copies (split/merge, scan), so they would never reach the model;
its QLoRA also stores bases as qwix arrays without our `logical_axes`. Hence our own wrapper.

Dropout needs a key per step: wrap the *training* objective with `with_lora_dropout(objective)`
(it uses the step's rng); without a key (eval, inference) dropout is off. Under scan_layers
every layer draws the same mask per site (the layers share one traced body).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from distillax.errors import ConfigError, UserError
from distillax.framework.step import Objective, as_objective
from distillax.quant import intercept, keep_mask, lora_matmul
from distillax.quant.config import WEIGHT_QTYPES
from distillax.quant.fakequant import QuantSiteParam, einsum_parts
from distillax.quant.graph import flat_pure_dict, get_path, place_like, set_path
from distillax.quant.qat import compute_dtype_of
from distillax.quant.sites import find_matmul_sites, has_wrapped_weights
from distillax.quant.weights import QuantizedWeight

ADAPTER_FORMAT = "distillax-lora/1"
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class LoRAParam(nnx.LoRAParam):
  """Adapter matrices (an nnx.Param): `trainable=LoRAParam` trains these and nothing else."""


# ---- dropout key ---------------------------------------------------------------------------------

_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "distillax_lora_dropout_key", default=None)


@contextlib.contextmanager
def lora_dropout(key: jax.Array | None):
  """Adapter dropout is active (with this key) for forwards traced inside."""
  token = _DROPOUT_KEY.set(key)
  try:
    yield
  finally:
    _DROPOUT_KEY.reset(token)


def with_lora_dropout(objective: Objective | Callable) -> Objective:
  """The objective with adapter dropout keyed by the step's rng (use for training only); its
  flags (rng_per_worker) are kept."""

  def wrap(fn):
    def objective_with_dropout(student, extras, batch, rng):
      with lora_dropout(jax.random.fold_in(rng, 0x10A)):
        return fn(student, extras, batch, rng)
    return objective_with_dropout

  return as_objective(objective).wrapped(wrap)


# ---- the wrapper -------------------------------------------------------------------------------

class LoRAWeight(nnx.Module):
  """A frozen base weight plus trainable low-rank adapters."""

  is_weight_wrapper = True

  def __init__(self, base: nnx.Param | QuantizedWeight, lora_a: LoRAParam, lora_b: LoRAParam, *,
               contract_axes, ndim: int, scaling: float, dropout: float, name: str,
               group_axes=()):
    self.base = base
    self.lora_a = lora_a  # (*stacked, *group dims, *contracted dims, rank)
    self.lora_b = lora_b  # (*stacked, *group dims, rank, *output dims)
    self.contract_axes = tuple(sorted(contract_axes))  # of the weight as its matmul sees it
    # Axes with one matrix per index (an MoE's experts): each gets its own A and B.
    self.group_axes = tuple(sorted(group_axes))
    self.call_ndim = ndim
    self.scaling = float(scaling)
    self.dropout = float(dropout)
    self.site_name = name

  @property
  def logical_axes(self) -> tuple:
    if isinstance(self.base, QuantizedWeight):
      return self.base.logical_axes
    return tuple(self.base.get_metadata().get("logical_axes") or ())

  @property
  def param_dtype(self):
    if isinstance(self.base, QuantizedWeight):
      return self.base.param_dtype
    return self.base.get_raw_value().dtype

  @property
  def base_shape(self) -> tuple[int, ...]:
    if isinstance(self.base, QuantizedWeight):
      return self.base.shape
    return tuple(self.base.get_raw_value().shape)

  @property
  def shape(self) -> tuple[int, ...]:
    """The weight's shape, as model code reads it off a Param (`self.router.shape`)."""
    return self.base_shape

  def base_value(self) -> jax.Array:
    return self.base[...]

  def delta(self) -> jax.Array:
    """(alpha / rank) * A @ B laid out like the weight (stacked axes included), float32."""
    n = self.call_ndim
    letters = _LETTERS[:n]
    rank_letter = _LETTERS[n]
    group = "".join(letters[a] for a in self.group_axes)
    contract = "".join(letters[a] for a in self.contract_axes)
    free = "".join(letters[i] for i in range(n)
                   if i not in self.contract_axes and i not in self.group_axes)
    a = self.lora_a[...].astype(jnp.float32)
    b = self.lora_b[...].astype(jnp.float32)
    return self.scaling * jnp.einsum(f"...{group}{contract}{rank_letter},"
                                     f"...{group}{rank_letter}{free}->...{letters}", a, b)

  def merged(self) -> jax.Array:
    """W + (alpha / rank) * A @ B in the base parameter's dtype."""
    base = self.base_value()
    return (base.astype(jnp.float32) + self.delta()).astype(self.param_dtype)

  def __getitem__(self, index) -> jax.Array:
    value = self.merged()[index]
    intercept.note_read(self, value)
    return value

  def output_operands(self, h_xD: jax.Array, vocab_axis: int) -> list:
    """The output layer's matmuls as `intercepted_einsum` runs them (a loss over vocabulary
    slices reads these, models/transformer.py): the frozen base (a QLoRA base dequantized) fed
    h, and the adapter's B (rank, V) fed scaling * dropout(h) @ A (the same keep mask)."""
    if self.group_axes or self.call_ndim != 2 or len(self.base_shape) != 2:
      raise UserError(f"LoRA on {self.site_name}: an output layer is one 2-D weight")
    base = self.base_value().astype(h_xD.dtype)
    keep_bits = self._keep_bits(h_xD)
    x = h_xD
    if keep_bits is not None:
      keep = keep_mask.unpack_keep_mask(keep_bits, x.shape[-1])
      x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
    u_xR = self.scaling * jnp.einsum("...D,DR->...R", x, self.lora_a[...].astype(x.dtype))
    return [(h_xD, base, vocab_axis), (u_xR, self.lora_b[...], 1)]

  def _keep_bits(self, x: jax.Array) -> jax.Array | None:
    """This site's packed dropout keep mask for input `x` (None: dropout off)."""
    key = _DROPOUT_KEY.get()
    if key is None or self.dropout <= 0.0:
      return None
    key = jax.random.fold_in(key, zlib.crc32(self.site_name.encode()) & 0x7FFFFFFF)
    return keep_mask.keep_mask_bits(key, x.shape, 1.0 - self.dropout)

  def intercepted_einsum(self, spec, operands, index, kwargs):
    terms = spec.replace(" ", "").split("->")[0].split(",")
    parts, out = einsum_parts(spec, [o.ndim for o in operands])
    x = operands[1 - index]
    w_letters, x_term = parts[index], terms[1 - index]
    if None in w_letters or len(w_letters) != self.call_ndim:
      raise UserError(f"LoRA on {self.site_name}: unsupported einsum {spec!r}")
    contract = [w_letters[a] for a in self.contract_axes]
    free = [c for i, c in enumerate(w_letters) if i not in self.contract_axes]
    if any(c not in x_term or c in out for c in contract) or any(c not in out or c in x_term
                                                                  for c in free):
      raise UserError(f"LoRA on {self.site_name}: einsum {spec!r} has batch dims on the weight; "
                      f"only plain projections can be adapted")
    base, base_arrays = self._base_parts(operands[index].dtype)
    m = lora_matmul.for_einsum(
        x_term, "".join(w_letters), out, "".join(contract), x.ndim, base=base,
        layout=self._matmul_layout(x.shape[0]), scaling=self.scaling, keep=1.0 - self.dropout,
        kwargs=tuple(kwargs.items()))
    return lora_matmul.adapted_matmul(m, x, base_arrays, self.lora_a[...], self.lora_b[...],
                                      self._keep_bits(x))

  def _matmul_layout(self, batch_size: int) -> tuple[bool, tuple | None]:
    """(one matmul?, the weight's layout for it): `lora_matmul.matmul_layout`."""
    lead = len(self.logical_axes) - self.call_ndim
    names = self.logical_axes[lead:] if self.logical_axes else (None,) * self.call_ndim
    return lora_matmul.matmul_layout(names, self.base_shape[-self.call_ndim:],
                                     self.contract_axes, batch_size, self.site_name)

  def _base_parts(self, dtype) -> tuple[Any, tuple]:
    """(callable, its arrays) giving the frozen base weight in the matmul's dtype."""
    if isinstance(self.base, QuantizedWeight):
      return self.base.dequantizer(dtype), self.base.stored()
    return lora_matmul.PlainBase(jnp.dtype(dtype).name), (self.base[...],)

  def intercepted_ragged_dot(self, x_MxK, w_GxKxN, group_sizes_G, kwargs, dot):
    """An MoE's grouped matmul `dot`, y = x @ W_g + (alpha / rank) * (dropout(x) @ A_g) @ B_g
    for the rows of group g, in three grouped matmuls (autodiff's backward: no gradient for the
    frozen base, which is not differentiated). Inside the expert-parallel exchange w holds this
    device's experts (the merged weight read): it is used as is (no adapter dropout there)."""
    if tuple(w_GxKxN.shape) != self.base_shape[-w_GxKxN.ndim:]:
      return dot(x_MxK, w_GxKxN, group_sizes_G, **kwargs)
    base = self.base_value().astype(w_GxKxN.dtype)
    y_MxN = dot(x_MxK, base, group_sizes_G, **kwargs)
    keep_bits = self._keep_bits(x_MxK)
    if keep_bits is not None:
      keep = keep_mask.unpack_keep_mask(keep_bits, x_MxK.shape[-1])
      x_MxK = jnp.where(keep, x_MxK / (1.0 - self.dropout), jnp.zeros_like(x_MxK))
    h_MxR = dot(x_MxK, self.lora_a[...].astype(x_MxK.dtype), group_sizes_G, **kwargs)
    delta_MxN = dot(h_MxR, self.lora_b[...].astype(h_MxR.dtype), group_sizes_G, **kwargs)
    return y_MxN + (self.scaling * delta_MxN).astype(y_MxN.dtype)

  def intercepted_dot_general(self, lhs, rhs, dimension_numbers, index, kwargs):
    """Direct dot_generals use the merged weight (no adapter dropout there)."""
    w = (lhs, rhs)[index]
    merged = self.merged().astype(w.dtype)
    lhs, rhs = (merged, rhs) if index == 0 else (lhs, merged)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)


# ---- applying, merging, saving -----------------------------------------------------------------

def _check_args(rank, alpha, dropout, base_qtype, base_tile_size):
  if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
    raise ConfigError(f"lora.rank={rank!r} must be a positive integer")
  if not alpha > 0:
    raise ConfigError(f"lora.alpha={alpha!r} must be positive")
  if not 0.0 <= dropout < 1.0:
    raise ConfigError(f"lora.dropout={dropout!r} must be in [0, 1)")
  if base_qtype is not None and base_qtype not in WEIGHT_QTYPES:
    raise ConfigError(f"lora.base_qtype={base_qtype!r}; choose one of {', '.join(WEIGHT_QTYPES)}"
                      f" (QLoRA uses nf4 or int4) or None")
  if base_tile_size is not None and base_qtype is None:
    raise ConfigError("lora.base_tile_size is set but lora.base_qtype is None; set both (QLoRA)")


def apply_lora(model: nnx.Module, *, module_regex: str, rank: int = 8, alpha: float = 16.0,
               dropout: float = 0.0, base_qtype: str | None = None,
               base_tile_size: int | None = None, adapter_dtype: Any = None, seed: int = 0,
               sample_tokens: jax.Array | None = None) -> nnx.Module:
  """A copy of `model` with adapters on every matmul weight whose path fullmatches
  `module_regex` (paths like 'layers/0/attn/q', 'layers/1/mlp/down', 'lm_head'; under
  scan_layers 'layers/attn/q'): e.g. r'layers/(.*/)?attn/.*' (either layout) or r'.*/(q|v)'.
  An MoE's experts (mlp/gate, mlp/up, mlp/down, stacked (E, D, F)) get one A (E, D, rank) and
  one B (E, rank, F) per expert; its router (mlp/router), when matched, gets adapters over a
  full-precision base even in QLoRA (`MatmulSite.is_router`).

  QLoRA: `base_qtype` ('nf4' or 'int4', tiled by `base_tile_size` along the last contracted
  axis) stores those base weights as frozen codes + scales. Adapters use `adapter_dtype`
  (default: the weight's dtype).
  """
  _check_args(rank, alpha, dropout, base_qtype, base_tile_size)
  if has_wrapped_weights(model):
    raise UserError("the model already has LoRA adapters; apply_lora once (merge_lora first to "
                    "stack another round)")
  if any(isinstance(v, QuantSiteParam) for _, v in nnx.iter_graph(model)):
    raise ConfigError("apply_lora on a fake-quant model is not supported; use the "
                      "full-precision model, with base_qtype for a quantized base (QLoRA)")
  try:
    pattern = re.compile(module_regex)
  except re.error as e:
    raise ConfigError(f"lora.module_regex={module_regex!r} is not a valid regex ({e})") from None
  sites = find_matmul_sites(model, sample_tokens)
  chosen = [s for s in sites if pattern.fullmatch(s.name)]
  if not chosen:
    raise ConfigError(f"lora.module_regex={module_regex!r} matches no matmul weight; weights are "
                      f"{[s.name for s in sites]}")
  adapted = intercept.strip(model)
  compute_dtype = compute_dtype_of(model)
  key = jax.random.key(seed)
  for i, site in enumerate(chosen):
    var = get_path(adapted, site.weight_path)
    w = var.get_raw_value()
    logical = tuple(var.get_metadata().get("logical_axes") or (None,) * w.ndim)
    lead = site.stacked
    contract = sorted(site.contract_axes)
    group = list(range(lead)) + [lead + g for g in sorted(site.batch_axes)]
    a_axes = group + [lead + c for c in contract] + [None]
    b_axes = group + [None] + [lead + f for f in site.free_axes]
    dims = lambda axes: tuple(rank if a is None else w.shape[a] for a in axes)
    names = lambda axes: tuple(None if a is None else logical[a] for a in axes)
    dtype = jnp.dtype(adapter_dtype) if adapter_dtype is not None else w.dtype
    bound = 1.0 / math.sqrt(math.prod(site.shape[c] for c in contract))
    a = jax.random.uniform(jax.random.fold_in(key, i), dims(a_axes), jnp.float32, -bound, bound)
    lora_a = LoRAParam(place_like(a.astype(dtype), w, a_axes), logical_axes=names(a_axes))
    lora_b = LoRAParam(place_like(jnp.zeros(dims(b_axes), dtype), w, b_axes),
                       logical_axes=names(b_axes))
    base = var
    if base_qtype is not None and not site.is_router:
      base = QuantizedWeight.from_array(
          w, site.quant(base_qtype, base_tile_size, compute_dtype), logical_axes=logical)
    set_path(adapted, site.weight_path, LoRAWeight(
        base, lora_a, lora_b, contract_axes=contract, ndim=len(site.shape),
        scaling=alpha / rank, dropout=dropout, name=site.name, group_axes=site.batch_axes))
  return intercept.install(adapted, intercept.Interceptor(), sample_tokens)


def lora_weights(model: nnx.Module) -> list[tuple[tuple, LoRAWeight]]:
  return [(tuple(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, LoRAWeight)]


def merge_lora(model: nnx.Module) -> nnx.Module:
  """A plain model (its own class, plain Params) with adapters folded into the weights;
  QLoRA bases are dequantized. Placement of each weight is kept."""
  merged = intercept.strip(model)
  for path, wrapper in lora_weights(merged):
    like = wrapper.base.qvalue[...] if isinstance(wrapper.base, QuantizedWeight) else (
        wrapper.base.get_raw_value())
    value = place_like(wrapper.merged(), like, range(like.ndim))
    set_path(merged, path, nnx.Param(value, logical_axes=wrapper.logical_axes))
  return merged


def _adapter_arrays(model: nnx.Module) -> dict[str, Any]:
  return flat_pure_dict(nnx.to_pure_dict(nnx.state(model, LoRAParam)))


def _adapter_info(model: nnx.Module) -> dict[str, Any]:
  return {"format": ADAPTER_FORMAT,
          "adapters": {w.site_name: {"scaling": w.scaling, "dropout": w.dropout,
                                     "rank": int(w.lora_a.get_raw_value().shape[-1])}
                       for _, w in lora_weights(model)}}


def save_adapters(model: nnx.Module, path: str) -> dict[str, Any]:
  """Writes the adapters alone (safetensors, their dtype) with rank/scaling as metadata.
  Returns the metadata written. (Single-process: arrays are gathered to this host.)"""
  arrays = {k: np.asarray(jax.device_get(v)) for k, v in _adapter_arrays(model).items()}
  if not arrays:
    raise UserError("the model has no LoRA adapters to save; apply_lora first")
  info = _adapter_info(model)
  safetensors.numpy.save_file(arrays, path, metadata={"distillax": json.dumps(info)})
  return info


def load_adapters(model: nnx.Module, path: str) -> nnx.Module:
  """A copy of `model` (which must carry the same adapters) with adapter values from `path`."""
  with safetensors.safe_open(path, framework="numpy") as f:
    info = json.loads((f.metadata() or {}).get("distillax", "{}"))
  if info.get("format") != ADAPTER_FORMAT:
    raise UserError(f"{path} is not a distillax adapter file (format {info.get('format')!r})")
  if info["adapters"] != _adapter_info(model)["adapters"]:
    raise UserError(f"{path} holds adapters {info['adapters']} but the model has "
                    f"{_adapter_info(model)['adapters']}; apply_lora with the same regex, rank "
                    f"and alpha before loading")
  loaded = safetensors.numpy.load_file(path)
  copy = nnx.clone(model)
  current = flat_pure_dict(nnx.to_pure_dict(nnx.state(copy, LoRAParam)))
  if set(loaded) != set(current):
    raise UserError(f"{path} holds adapters {sorted(loaded)} but the model has {sorted(current)}")
  for var_path, var in list(nnx.iter_graph(copy)):
    if not isinstance(var, LoRAParam):
      continue
    name = "/".join(str(k) for k in var_path)
    old, new = var.get_raw_value(), loaded[name]
    if new.shape != old.shape:
      raise UserError(f"adapter {name} has shape {new.shape} in {path}, {old.shape} in the model")
    var.set_value(place_like(jnp.asarray(new, old.dtype), old, range(old.ndim)))
  return copy
