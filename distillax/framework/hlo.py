"""Collectives read from compiled HLO: how many, and how many bytes each step moves.

Counted on the per-device program XLA compiled (after SPMD partitioning), so the numbers are what
one device sends or receives per step. An async pair (`-start`/`-done`) counts once.
"""

from __future__ import annotations

import collections
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(?P<result>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) +
                   r")(?:-start)?\((?P<operands>.*)$")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|"
                    r"f8e5m2|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
         "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "f8e4m3fn": 8, "f8e5m2": 8, "c64": 64, "c128": 128}


def _bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * _BITS[dtype] // 8
  return total


def collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
  """{op: {"count": n, "bytes": b}} for each collective kind present, plus a "total" entry.

  Bytes per op are the larger of its result and its operands: the full gathered buffer for an
  all-gather, the full input of a reduce-scatter, the buffer of an all-reduce.
  """
  stats: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m or f"{m.group('op')}-done" in line:
      continue
    operands = m.group("operands").split("),", 1)[0]
    size = max(_bytes(m.group("result")), _bytes(operands))
    entry = stats[m.group("op")]
    entry["count"] += 1
    entry["bytes"] += size
  out = dict(stats)
  out["total"] = {"count": sum(v["count"] for v in stats.values()),
                  "bytes": sum(v["bytes"] for v in stats.values())}
  return out
