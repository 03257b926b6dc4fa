"""Collective operations and the bytes they move, read from a compiled step's HLO text.

`compiled.as_text()` is the optimised, partitioned HLO module that actually runs: every
all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute the SPMD partitioner
inserted is there with its shapes. Static counts are not per-step counts, though: a collective
inside a `while` body (layers under `lax.scan`, gradient accumulation) runs once per iteration,
so each computation is weighted by the trip counts of the loops that call it. XLA:CPU and GPU
record them as `known_trip_count` in the while op's backend config; the TPU compiler does not, so
there the count is read from the loop itself: a condition `counter < N` (or <=, >, >=) whose
counter starts at a constant S and steps by a constant the body adds (1 for `lax.scan` and
`fori_loop`, 2 for the TPU's collective-matmul loops, `windowed_dot_general`, unrolled twice):
ceil((N - S) / step) trips. Without either, a loop is counted once and `trip_count_unknown`
says so.

What runs once may be written several times. An async pair (`all-gather-start` and
`all-gather-done`) is one collective. So is a TPU async collective, written as a start fusion,
continuation fusions and a done fusion that each hold the collective with one `channel_id`: it is
counted once per channel, as often as its least frequent piece runs. The TPU compiler also fuses
an all-reduce with the slice each device keeps into an "all-reduce-scatter" fusion (its FSDP
gradient reduction): the all-reduce inside is counted as the reduce-scatter it is, with the
fusion's (sharded) output as its result.

Bytes are logical buffer sizes from the HLO shapes, per device: `operand_bytes` (what each device
contributes) and `result_bytes` (what each device ends up with). `bytes` is the larger of the two,
the size of the full buffer the collective assembles or reduces; the bytes on the wire depend on
the algorithm (a ring all-reduce sends about 2(N-1)/N of it per device). The matmul FLOPs of a
module, with the same trip counts, are `hlo_flops.matmul_flops`.
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

ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_RE = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP_RE = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_OPERAND_RE = re.compile(r"%([\w.\-]+)")


def shape_bytes(shape: str) -> float:
  """Bytes of every array in an HLO shape string (a tuple sums its elements)."""
  total = 0.0
  for dtype, dims in ARRAY_RE.findall(shape):
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
  args: str = ""  # the text inside the call's parentheses (a constant's literal)


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
        Instruction(m.group(1), shape, opcode, _OPERAND_RE.findall(args), attrs, args))
  if not entry and computations:
    entry = list(computations)[-1]
  return Module(computations, entry)


_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")
_DIRECTION_RE = re.compile(r"direction=(LT|LE|GT|GE)")
_CONDITION_RE = re.compile(r"\bcondition=%([\w.\-]+)")
_INDEX_RE = re.compile(r"\bindex=(\d+)")


def _constant(name: str, by_name: dict[str, Instruction]) -> int | None:
  """The integer a scalar `constant(N)` holds, seen through copies and converts."""
  for _ in range(8):
    ins = by_name.get(name)
    if ins is None:
      return None
    if ins.opcode == "constant":
      try:
        return int(ins.args.strip())
      except ValueError:
        return None
    if ins.opcode not in _PASS_THROUGH or len(ins.operands) != 1:
      return None
    name = ins.operands[0]
  return None


def _tuple_index(name: str, by_name: dict[str, Instruction]) -> int | None:
  """k when `name` is get-tuple-element(parameter, index=k) (through copies)."""
  ins = by_name.get(name)
  while ins is not None and ins.opcode in _PASS_THROUGH and len(ins.operands) == 1:
    ins = by_name.get(ins.operands[0])
  if ins is None or ins.opcode != "get-tuple-element":
    return None
  found = _INDEX_RE.search(ins.attrs)
  return int(found.group(1)) if found else None


_FLIPPED = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}
_BODY_RE = re.compile(r"\bbody=%([\w.\-]+)")


def _unwrapped(module: Module, ins: Instruction) -> tuple[Instruction, list[str]]:
  """(the op, its operands in the caller): `ins` itself, or the ROOT of the computation a fusion
  calls when that ROOT reads only the fusion's parameters (XLA:CPU's `wrapped_compare`,
  `wrapped_add`), with each parameter replaced by the fusion's operand."""
  if ins.opcode != "fusion":
    return ins, list(ins.operands)
  called = _OPERAND_RE.findall(" ".join(t for k, t in _CALLEE_RE.findall(ins.attrs)
                                        if k == "calls"))
  inner = module.computations.get(called[0]) if called else None
  if not inner:
    return ins, list(ins.operands)
  params = {i.name: int(i.args.strip()) for i in inner if i.opcode == "parameter"}
  picks = [params.get(o) for o in inner[-1].operands]
  if None in picks or any(p >= len(ins.operands) for p in picks):
    return ins, list(ins.operands)
  return inner[-1], [ins.operands[p] for p in picks]


def _comparison(module: Module, root: Instruction) -> tuple[str, list[str]] | None:
  """(direction, [lhs, rhs]) of a loop condition's ROOT: a compare, or a fusion wrapping one."""
  op, operands = _unwrapped(module, root)
  direction = _DIRECTION_RE.search(op.attrs)
  if op.opcode != "compare" or len(operands) != 2 or direction is None:
    return None
  return direction.group(1), operands


def _through(name: str, local: dict[str, Instruction]) -> Instruction | None:
  ins = local.get(name)
  while ins is not None and ins.opcode in _PASS_THROUGH and len(ins.operands) == 1:
    ins = local.get(ins.operands[0])
  return ins


def counter_step(module: Module, loop: Instruction, index: int) -> int | None:
  """What one iteration adds to element `index` of a while loop's tuple: the body's ROOT tuple
  holds add(element, constant s) (either order), or subtract(element, constant s) for -s.
  lax.scan and fori_loop step by 1; the TPU compiler's collective-matmul loops
  (`windowed_dot_general`, unrolled twice) by 2. None for any other update."""
  found = _BODY_RE.search(loop.attrs)
  body = module.computations.get(found.group(1)) if found else None
  if not body or body[-1].opcode != "tuple" or index >= len(body[-1].operands):
    return None
  local = {ins.name: ins for ins in body}
  update = _through(body[-1].operands[index], local)
  if update is None:
    return None
  op, operands = _unwrapped(module, update)
  if op.opcode not in ("add", "subtract") or len(operands) != 2:
    return None
  a, b = operands
  if _tuple_index(a, local) == index and (step := _constant(b, local)) is not None:
    return step if op.opcode == "add" else -step
  if op.opcode == "add" and _tuple_index(b, local) == index:
    return _constant(a, local)
  return None


def _trips(direction: str, start: int, bound: int, step: int) -> int | None:
  """Iterations of `for (i = start; i <direction> bound; i += step)`; None if it never ends."""
  if direction in ("LT", "LE"):
    if step <= 0:
      return None if start < bound or (direction == "LE" and start == bound) else 0
    span = bound - start if direction == "LT" else bound - start + 1
  else:
    if step >= 0:
      return None if start > bound or (direction == "GE" and start == bound) else 0
    span = start - bound if direction == "GT" else start - bound + 1
  return max(0, -(-span // abs(step)))


def inferred_trip_count(module: Module, loop: Instruction,
                        by_name: dict[str, Instruction]) -> int | None:
  """The trip count of a while loop without `known_trip_count`: its condition's ROOT compares
  tuple element k with a constant bound N, element k of the loop's initial tuple is a constant
  S, and the body adds a constant step to it (`counter_step`): ceil((N - S) / step) for `<`.
  None when the loop has another shape."""
  cond = _CONDITION_RE.search(loop.attrs)
  body = module.computations.get(cond.group(1)) if cond else None
  found = _comparison(module, body[-1]) if body else None
  if found is None:
    return None
  direction, (a, b) = found
  local = {ins.name: ins for ins in body}
  index, bound = _tuple_index(a, local), _constant(b, local)
  if index is None and bound is None:  # `N > counter`: the same test written the other way
    direction = _FLIPPED[direction]
    index, bound = _tuple_index(b, local), _constant(a, local)
  if index is None or bound is None:
    return None
  init = by_name.get(loop.operands[0]) if loop.operands else None
  if init is None or init.opcode != "tuple" or index >= len(init.operands):
    return None
  start = _constant(init.operands[index], by_name)
  step = counter_step(module, loop, index)
  if start is None or step is None:
    return None
  return _trips(direction, start, bound, step)


def _while_trips(module: Module, ins: Instruction,
                 by_name: dict[str, Instruction]) -> int | None:
  found = _TRIP_RE.search(ins.attrs)
  return int(found.group(1)) if found else inferred_trip_count(module, ins, by_name)


def computation_multiplicity(module: Module) -> tuple[dict[str, int], bool]:
  """How many times each computation runs per call of the entry; flag: a trip count was unknown.

  A while body and condition run its trip count times per execution of the while (the
  condition once more, which does not matter for collectives): `known_trip_count` where XLA
  records it, else `inferred_trip_count`. Any other callee runs once per call. Counts propagate
  down the call graph (a DAG) in topological order, so a computation called from several places
  gets the sum over its callers.
  """
  edges: dict[str, list[tuple[str, int]]] = {}
  unknown = False
  by_name = {ins.name: ins for comp in module.computations.values() for ins in comp}
  for comp, instructions in module.computations.items():
    for ins in instructions:
      trips = 1
      if ins.opcode == "while":
        found = _while_trips(module, ins, by_name)
        trips = found if found is not None else 1
        unknown = unknown or found is None
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


_SCATTER_FUSION_RE = re.compile(r'"emitter"\s*:\s*"AllReduceScatterFusion"')


def reduce_scatter_fusions(module: Module) -> set[str]:
  """The computations of TPU all-reduce-scatter fusions: an all-reduce whose result each device
  slices to its own shard, i.e. a reduce-scatter (what FSDP's gradient reduction becomes)."""
  found = {name for name in module.computations if name.startswith("all-reduce-scatter")}
  for instructions in module.computations.values():
    for ins in instructions:
      if ins.opcode == "fusion" and _SCATTER_FUSION_RE.search(ins.attrs):
        found.update(_OPERAND_RE.findall(" ".join(t for k, t in _CALLEE_RE.findall(ins.attrs)
                                                  if k == "calls")))
  return found


_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")


@dataclasses.dataclass
class _Piece:
  """One collective instruction as the text holds it, with how often its computation runs."""
  comp: str
  ins: Instruction
  kind: str
  phase: str
  times: int


def _pieces(module: Module, mult: dict[str, int]) -> list[_Piece]:
  return [_Piece(comp, ins, kind, phase, mult.get(comp, 0))
          for comp, instructions in module.computations.items() for ins in instructions
          for kind, phase in [_kind(ins.opcode)] if kind is not None]


def _fused_computations(module: Module) -> set[str]:
  """The computations fusion instructions call."""
  return {callee for comp in module.computations.values() for ins in comp
          if ins.opcode == "fusion" for kind, target in _CALLEE_RE.findall(ins.attrs)
          if kind == "calls" for callee in _OPERAND_RE.findall(target)}


def _runs(module: Module, pieces: list[_Piece]) -> list[list[_Piece]]:
  """The pieces grouped into the collectives that run. A TPU async collective is a start, one
  or more continuation and a done fusion, each holding the collective with the same kind and
  channel_id: one collective. Any other collective is its own group (XLA:CPU gives unrelated
  collectives one channel_id, outside fusions); -start ops are left in (their -done counts)."""
  fused = _fused_computations(module)
  groups: dict[tuple[str, str], list[_Piece]] = {}
  alone: list[list[_Piece]] = []
  for piece in pieces:
    channel = _CHANNEL_RE.search(piece.ins.attrs)
    if channel is None or piece.phase or piece.comp not in fused:
      alone.append([piece])
    else:
      groups.setdefault((piece.kind, channel.group(1)), []).append(piece)
  return alone + list(groups.values())


def collective_stats(hlo_text: str) -> dict:
  """Per-step collectives of a compiled module: {kind: {count, operand_bytes, result_bytes,
  bytes}} plus 'total' and 'trip_count_unknown'. Async pairs (-start/-done) count once, and so
  do the start, continuation and done fusions of a TPU async collective (one channel_id): as
  often as the least frequent of them runs (its start and done; continuation pieces may sit in
  a loop the collective overlaps, such as a collective matmul's)."""
  module = parse_module(hlo_text)
  shapes = module.shapes()
  mult, unknown = computation_multiplicity(module)
  scatters = reduce_scatter_fusions(module)
  out = {k: {"count": 0, "operand_bytes": 0.0, "result_bytes": 0.0, "bytes": 0.0}
         for k in COLLECTIVES}
  starts = {}
  for group in _runs(module, _pieces(module, mult)):
    running = [p for p in group if p.times > 0] or group
    times = min(p.times for p in running)
    piece = next((p for p in running if p.comp in scatters),
                 next(p for p in running if p.times == times))
    kind, ins = piece.kind, piece.ins
    operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
    if piece.phase == "start":
      starts[ins.name] = operand_bytes
      continue
    result_bytes = shape_bytes(ins.shape)
    if kind == "all-reduce" and piece.comp in scatters:
      kind = "reduce-scatter"
      result_bytes = shape_bytes(module.computations[piece.comp][-1].shape)
    if piece.phase == "done":
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
