"""Collective operations and the bytes they move, read from a compiled step's HLO text.

`compiled.as_text()` is the optimised, partitioned HLO module that actually runs: every
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute the SPMD partitioner
inserted is there with its shapes. Static counts are not per-step counts, though: a collective
inside a `while` body (layers under `lax.scan`, gradient accumulation) runs once per iteration,
so each computation is weighted by the trip counts of the loops that call it (XLA records them as
`known_trip_count` in the while op's backend config).

Bytes are logical buffer sizes from the HLO shapes, per device: `operand_bytes` (what each device
contributes) and `result_bytes` (what each device ends up with). `bytes` is the larger of the two,
the size of the full buffer the collective assembles or reduces; the bytes on the wire depend on
the algorithm (a ring all-reduce sends about 2(N-1)/N of it per device).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1,
}

_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_RE = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP_RE = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_OPERAND_RE = re.compile(r"%([\w.\-]+)")


def shape_bytes(shape: str) -> float:
  """Bytes of every array in an HLO shape string (a tuple sums its elements)."""
  total = 0.0
  for dtype, dims in _ARRAY_RE.findall(shape):
    size = DTYPE_BYTES.get(dtype)
    if size is None:
      continue  # token[], opaque types
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) all-reduce(...)' -> ('(f32[2], s32[])', 'all-reduce(...)')."""
  rest = rest.lstrip()
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail.lstrip()


def _call_args(text: str) -> str:
  """The text inside the first balanced parentheses of 'op(args), attr=...'."""
  start = text.find("(")
  if start < 0:
    return ""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return text[start + 1:i]
  return text[start + 1:]


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str

  def shapes(self) -> dict[str, str]:
    return {ins.name: ins.shape for comp in self.computations.values() for ins in comp}


def parse_module(text: str) -> Module:
  """The computations of an HLO module text and their instructions."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION_RE.match(line)
      if m:
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION_RE.match(line)
    if not m:
      continue
    shape, rest = _split_shape(m.group(2))
    opcode = rest.split("(", 1)[0].strip()
    args = _call_args(rest)
    attrs = rest[len(opcode) + len(args) + 2:]
    computations[current].append(
        Instruction(m.group(1), shape, opcode, _OPERAND_RE.findall(args), attrs))
  if not entry and computations:
    entry = list(computations)[-1]
  return Module(computations, entry)


def computation_multiplicity(module: Module) -> tuple[dict[str, int], bool]:
  """How many times each computation runs per call of the entry; flag: a trip count was unknown.

  A while body and condition run `known_trip_count` times per execution of the while (the
  condition once more, which does not matter for collectives); any other callee once per call.
  Counts propagate down the call graph (a DAG) in topological order, so a computation called from
  several places gets the sum over its callers.
  """
  edges: dict[str, list[tuple[str, int]]] = {}
  unknown = False
  for comp, instructions in module.computations.items():
    for ins in instructions:
      trips = 1
      if ins.opcode == "while":
        found = _TRIP_RE.search(ins.attrs)
        trips = int(found.group(1)) if found else 1
        unknown = unknown or not found
      for kind, target in _CALLEE_RE.findall(ins.attrs):
        weight = trips if kind in ("body", "condition") else 1
        for callee in _OPERAND_RE.findall(target):
          edges.setdefault(comp, []).append((callee, weight))
  post: list[str] = []
  visited: set[str] = set()
  stack = [(module.entry, False)]
  while stack:  # iterative DFS post-order (call graphs can be deep)
    comp, done = stack.pop()
    if done:
      post.append(comp)
      continue
    if comp in visited:
      continue
    visited.add(comp)
    stack.append((comp, True))
    stack.extend((callee, False) for callee, _ in edges.get(comp, ()) if callee not in visited)
  mult = {comp: 0 for comp in post}
  mult[module.entry] = 1
  for comp in reversed(post):  # callers before callees
    for callee, weight in edges.get(comp, ()):
      mult[callee] += mult[comp] * weight
  return mult, unknown


def _kind(opcode: str) -> tuple[str | None, str]:
  """('all-gather', 'start'|'done'|'') for collective opcodes, (None, '') otherwise."""
  for kind in COLLECTIVES:
    if opcode == kind:
      return kind, ""
    if opcode in (kind + "-start", kind + "-done"):
      return kind, opcode[len(kind) + 1:]
  return None, ""


def collective_stats(hlo_text: str) -> dict:
  """Per-step collectives of a compiled module: {kind: {count, operand_bytes, result_bytes,
  bytes}} plus 'total' and 'trip_count_unknown'. Async pairs (-start/-done) count once."""
  module = parse_module(hlo_text)
  shapes = module.shapes()
  mult, unknown = computation_multiplicity(module)
  out = {k: {"count": 0, "operand_bytes": 0.0, "result_bytes": 0.0, "bytes": 0.0}
         for k in COLLECTIVES}
  starts: dict[str, float] = {}
  for comp, instructions in module.computations.items():
    times = mult.get(comp, 0)
    for ins in instructions:
      kind, phase = _kind(ins.opcode)
      if kind is None:
        continue
      operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
      if phase == "start":
        starts[ins.name] = operand_bytes
        continue
      result_bytes = shape_bytes(ins.shape)
      if phase == "done":
        operand_bytes = starts.get(ins.operands[0], result_bytes) if ins.operands else result_bytes
      row = out[kind]
      row["count"] += times
      row["operand_bytes"] += times * operand_bytes
      row["result_bytes"] += times * result_bytes
      row["bytes"] += times * max(operand_bytes, result_bytes)
  out["total"] = {key: sum(out[k][key] for k in COLLECTIVES)
                  for key in ("count", "operand_bytes", "result_bytes", "bytes")}
  out["trip_count_unknown"] = unknown
  return out


def summarize(stats: dict, kinds: Iterable[str] = COLLECTIVES) -> str:
  """'AG 12/96.0MiB AR 3/4.0MiB' for a table cell (only kinds that occur)."""
  short = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
           "collective-permute": "CP"}
  parts = [f"{short[k]} {stats[k]['count']}/{stats[k]['bytes'] / 2**20:.1f}M"
           for k in kinds if stats[k]["count"]]
  return " ".join(parts) or "-"
