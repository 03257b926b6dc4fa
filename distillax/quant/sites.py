"""Which weights feed which matmuls: found by tracing the model once, abstractly.

Quantized export, PTQ and LoRA need per weight what only the forward knows: the module whose
matmul uses it (rules match module paths), and which of its axes are contracted with the input
(scales are per output channel; LoRA's A spans the contracted axes, B the others). Every
`nnx.Param` of a copy is swapped for a probe that notes its reads; the forward is traced with
`jax.eval_shape` (no FLOPs, no memory) under an interceptor that records each einsum /
dot_general fed by a probe, with the dimension numbers `lax.dot_general` receives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError, UserError
from distillax.models import layer_scope
from distillax.quant import intercept
from distillax.quant.fakequant import WeightQuant
from distillax.quant.graph import get_path, path_name, set_path


@dataclasses.dataclass(frozen=True)
class MatmulSite:
  """One weight and the matmul it feeds (shapes and axes per call: one layer under scan)."""

  module_path: str  # the module whose code runs the matmul: what quant rules match
  weight_path: tuple  # where the weight lives in the model, e.g. ('layers', 0, 'attn', 'q')
  shape: tuple[int, ...]  # the weight as the matmul sees it
  stacked: int  # leading axes of the stored variable not seen by the matmul (1 under scan)
  contract_axes: tuple[int, ...]  # weight axes contracted, in dot_general order
  # Weight axes that pick one matrix per index: dot_general batch axes, or the group axis of a
  # grouped matmul (`ragged_dot`, an MoE's experts: (E, D, F) is E matmuls of (D, F)).
  batch_axes: tuple[int, ...]

  @property
  def name(self) -> str:
    return path_name(self.weight_path)

  @property
  def is_router(self) -> bool:
    """An MoE router (models/moe.MoE.router): its top-k picks the experts, so rounding that
    moves one logit past another sends tokens elsewhere. QAT, PTQ and QLoRA bases keep it in
    full precision (llama.cpp's converter keeps ffn_gate_inp in f32 too). So is a shared
    expert's output gate (models/moe/shared.py), one logit per token (ffn_gate_inp_shexp)."""
    return (self.weight_path[-1] == "router"
            or tuple(self.weight_path[-2:]) == ("shared_expert", "output_gate"))

  @property
  def free_axes(self) -> tuple[int, ...]:
    """Weight axes that reach the output (its output channels)."""
    skip = set(self.contract_axes) | set(self.batch_axes)
    return tuple(i for i in range(len(self.shape)) if i not in skip)

  def quant(self, qtype: str, tile_size: int | None, compute_dtype, act_qtype=None):
    """The WeightQuant of this weight under a rule; checks that tiles divide."""
    if tile_size:
      dim = self.shape[self.contract_axes[-1]]
      if dim % tile_size:
        raise ConfigError(f"tile_size={tile_size} does not divide axis {self.contract_axes[-1]} "
                          f"(size {dim}) of {self.name} {self.shape}; pick a divisor of {dim}")
    return WeightQuant(qtype, self.contract_axes, len(self.shape), tile_size,
                       str(jnp.dtype(compute_dtype)), act_qtype)


class _ProbeParam(nnx.Param):
  """A Param that notes each read (its path is metadata, so it survives split/merge)."""

  def __getitem__(self, index):
    value = super().__getitem__(index)
    intercept.note_read(self, value)
    return value


class _SiteRecorder(intercept.Interceptor):
  """Records probe-fed matmuls; computes them plainly."""

  def __init__(self):
    super().__init__()
    self.records: list[dict[str, Any]] = []

  def _record(self, read, dimension_numbers, weight_side: int, ndim: int):
    (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
    contract = lhs_ca if weight_side == 0 else rhs_ca
    batch = lhs_ba if weight_side == 0 else rhs_ba
    self.records.append(dict(module_path=intercept.current_module_path(),
                             weight_path=tuple(read.owner.get_metadata()["probe_path"]),
                             shape=tuple(read.value.shape), ndim=ndim,
                             contract_axes=tuple(int(a) for a in contract),
                             batch_axes=tuple(int(a) for a in batch)))

  def einsum(self, einsum_str, *operands, **kwargs):
    taken = intercept.take_read(operands)
    if taken is None or not isinstance(taken[0].owner, _ProbeParam):
      return jnp.einsum(einsum_str, *operands, **kwargs)
    read, index = taken
    weight = operands[index]

    def recording_dot_general(lhs, rhs, dimension_numbers, precision=None,
                              preferred_element_type=None, **kw):
      if lhs is weight or rhs is weight:
        side = 0 if lhs is weight else 1
      else:  # einsum handed over a different object of the same shape
        side = 0 if lhs.shape == weight.shape else 1
      self._record(read, dimension_numbers, side, weight.ndim)
      return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type, **kw)

    with jax.disable_jit():  # a fresh _dot_general closure would otherwise retrace einsum's jit
      return jnp.einsum(einsum_str, *operands, _dot_general=recording_dot_general, **kwargs)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, out_sharding=None):
    taken = intercept.take_read((lhs, rhs))
    if taken is not None and isinstance(taken[0].owner, _ProbeParam):
      self._record(taken[0], dimension_numbers, taken[1], (lhs, rhs)[taken[1]].ndim)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type,
                               out_sharding=out_sharding)

  def grouped(self, dot, lhs, rhs, group_sizes, kwargs):
    """rhs (G, K, N): K contracted with the rows' K, G the group axis."""
    taken = intercept.take_read((lhs, rhs), sides=(1,))
    if taken is not None and isinstance(taken[0].owner, _ProbeParam):
      self._record(taken[0], (((1,), (1,)), ((), (0,))), 1, rhs.ndim)
    return dot(lhs, rhs, group_sizes, **kwargs)


def has_wrapped_weights(model: nnx.Module) -> bool:
  """Whether LoRA / QLoRA wrappers replace some weights (see quant.lora)."""
  return any(getattr(node, "is_weight_wrapper", False) for _, node in nnx.iter_graph(model))


def find_matmul_sites(model: nnx.Module, sample_tokens: jax.Array | None = None
                      ) -> list[MatmulSite]:
  """Every (weight, matmul) pair of one forward, in call order, one entry per weight.

  Works on real or abstract (`nnx.eval_shape`) models and costs one abstract trace.
  `sample_tokens` is the model's input (a dummy int32 [1, 2] when omitted).
  """
  if has_wrapped_weights(model):
    raise UserError("the model has LoRA adapters; call distillax.quant.merge_lora(model) first")
  probe = intercept.strip(model)
  for path, node in list(nnx.iter_graph(probe)):
    if isinstance(node, nnx.Param):  # fake-quant weights (QuantSiteParam) included
      meta = {k: v for k, v in node.get_metadata().items()
              if k not in ("hijax", "ref", "eager_sharding", "quant", "round_on_read")}
      set_path(probe, path, _ProbeParam(node.get_raw_value(), probe_path=tuple(path), **meta))
  recorder = _SiteRecorder()
  tokens = jnp.zeros((1, 2), jnp.int32) if sample_tokens is None else sample_tokens
  traced = intercept.install(probe, recorder, tokens)
  graphdef, state = nnx.split(traced)

  def forward(s, t):
    out = nnx.merge(graphdef, s)(t)
    return getattr(out, "logits_BxLxV", out)

  with layer_scope.unrecorded():  # a probe, no part of any step
    jax.eval_shape(forward, state, tokens)
  intercept.clear_reads()

  sites, seen = [], {}
  for r in recorder.records:
    stored = get_path(model, r["weight_path"])
    stacked = len(stored.shape) - r["ndim"]
    site = MatmulSite(r["module_path"], r["weight_path"], r["shape"], stacked,
                      r["contract_axes"], r["batch_axes"])
    if site.name in seen:
      if seen[site.name] != site:
        raise UserError(f"weight {site.name} feeds matmuls with different layouts "
                        f"({seen[site.name]} and {site}); it cannot be quantized or adapted")
      continue
    seen[site.name] = site
    sites.append(site)
  return sites
