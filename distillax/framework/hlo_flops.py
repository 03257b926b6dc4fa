"""Matmul FLOPs of a compiled step, read from its HLO text: every dot and convolution, each
weighted by how often its computation runs (the loop trip counts of `hlo`).

Why not `cost_analysis()['flops']` alone: XLA counts a while body once whatever its trip count,
so a scanned layer stack or accumulated micro-batches are undercounted by their count (and the
GPU compiler reports no FLOPs at all deviceless). Kernels in custom calls (Pallas splash, cuDNN)
are not counted here either: their FLOPs are opaque to the HLO.
"""

from __future__ import annotations

import math
import re

from distillax.framework.hlo import (ARRAY_RE, Instruction, computation_multiplicity,
                                     parse_module)

_CONTRACTING_RE = re.compile(r"\blhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS_RE = re.compile(r"\bdim_labels=([0-9a-z]+)_([0-9a-z]+)->")


def _dims(shape: str) -> list[int]:
  found = ARRAY_RE.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _conv_contraction(ins: Instruction, shapes: dict[str, str]) -> float:
  """Input elements each output of a convolution sums: input features x the kernel positions
  that can overlap the input. The TPU compiler writes some dots as convolutions over a size-1
  spatial dim padded to the kernel's width, where one kernel position per output is real."""
  labels = _DIM_LABELS_RE.search(ins.attrs)
  lhs, rhs = (_dims(shapes.get(o, "")) for o in ins.operands)
  if not labels:
    return 0.0
  lhs_l, rhs_l = labels.groups()
  if len(lhs) != len(lhs_l) or len(rhs) != len(rhs_l) or "i" not in rhs_l:
    return 0.0
  spatial = [c for c in rhs_l if c.isdigit()]
  return rhs[rhs_l.index("i")] * math.prod(
      min(rhs[rhs_l.index(c)], lhs[lhs_l.index(c)]) for c in spatial if c in lhs_l)


def _matmul_flops(ins: Instruction, shapes: dict[str, str]) -> float:
  """2 x output elements x contracted elements of one dot or convolution (0 for anything else)."""
  if ins.opcode == "dot" and ins.operands:
    contracting = _CONTRACTING_RE.search(ins.attrs)
    lhs = _dims(shapes.get(ins.operands[0], ""))
    picked = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2.0 * math.prod(_dims(ins.shape)) * math.prod(lhs[d] for d in picked if d < len(lhs))
  if ins.opcode == "convolution" and len(ins.operands) == 2:
    return 2.0 * math.prod(_dims(ins.shape)) * _conv_contraction(ins, shapes)
  return 0.0


def matmul_flops(hlo_text: str) -> dict:
  """Per-device FLOPs of every dot and convolution in a compiled module, each weighted by how
  often its computation runs (trip counts as in `collective_stats`): {'flops',
  'trip_count_unknown'}.

  Why not `cost_analysis()['flops']` alone: XLA counts a while body once whatever its trip
  count, so a scanned layer stack or accumulated micro-batches are undercounted by their count
  (and the GPU compiler reports no FLOPs at all deviceless). Kernels in custom calls (Pallas
  splash, cuDNN) are not counted here either: their FLOPs are opaque to the HLO."""
  module = parse_module(hlo_text)
  shapes = module.shapes()
  mult, unknown = computation_multiplicity(module)
  total = sum(mult.get(comp, 0) * _matmul_flops(ins, shapes)
              for comp, instructions in module.computations.items() for ins in instructions)
  return {"flops": total, "trip_count_unknown": unknown}
