"""The printed report of benchmarks/accelerator.py: the probe's lines, one line per row (its
fastest candidate) and one per candidate.

Reads only the JSON payload (no JAX), so the report can be printed again from a saved file:
`python benchmarks/lib/accelerator_table.py benchmarks/results/accelerator.json`.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _gb(n: float | None) -> str:
  return "" if n is None else f"{n / 1e9:.1f} GB"


def _pct(x: float | None) -> str:
  return "" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
  return "" if x is None else f"{x * 1e3:.0f}"


COLUMNS = (
    ("row", lambda r: r["row"]),
    ("status", lambda r: r.get("status", "?")),
    ("step ms", lambda r: _ms(r.get("step_s"))),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else ""),
    ("TFLOP/s", lambda r: f"{r['tflops_per_s']:.1f}" if r.get("tflops_per_s") else ""),
    ("MFU", lambda r: _pct(r.get("mfu_causal"))),
    ("compiled peak", lambda r: _gb(r.get("compiled_peak"))),
    ("compile s", lambda r: f"{r['compile_s']:.0f}" if r.get("compile_s") else ""),
)


def table(rows: list[dict]) -> str:
  cells = [[h for h, _ in COLUMNS]] + [[str(f(r)) for _, f in COLUMNS] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def probe_lines(probe: dict | None) -> list[str]:
  if not probe:
    return ["probe: missing"]
  m = probe["matmul"]
  installed = ", ".join(f"{k} {v}" for k, v in (probe.get("versions") or {}).items() if v)
  return [f"python {probe.get('python', '?')}; {installed}",
          f"{probe['backend']}: {probe['device_kind']}; memory limit "
          f"{_gb(probe.get('memory_limit'))}; MFU against {probe['peak_source']}",
          f"bf16 {m['n']}^3 matmul: best {m['best_flops_per_s'] / 1e12:.1f} TFLOP/s, median "
          f"{m['median_flops_per_s'] / 1e12:.1f} TFLOP/s"]


def report(payload: dict[str, Any]) -> str:
  lines = probe_lines(payload.get("probe")) + [""]
  best = [dict(r["best"], row=f"{r['name']} ({r['pair']})") for r in payload["rows"]
          if r["best"]]
  missing = [r["name"] for r in payload["rows"] if not r["best"]]
  lines += ["Each row at its fastest candidate:", table(best)]
  if missing:
    lines.append(f"no candidate ran: {', '.join(missing)}")
  if payload.get("qat_kd_over_kd") is not None:
    lines.append(f"q4_0 QAT KD step / bf16 KD step (same batch): "
                 f"{payload['qat_kd_over_kd']:.3f}")
  lines += ["", "Every candidate:", table([c for r in payload["rows"] for c in r["candidates"]])]
  lines += [f"{c['status'].upper()} {c['row']}: {c['error'][:300]}" for r in payload["rows"]
            for c in r["candidates"] if c.get("error")]
  lines.append("MFU: model FLOPs (causal: half of each T x T attention product) over the "
               "datasheet peak; compiled peak: arguments + temporaries + outputs - aliased.")
  return "\n".join(lines)


if __name__ == "__main__":
  print(report(json.loads(open(sys.argv[1]).read())))
