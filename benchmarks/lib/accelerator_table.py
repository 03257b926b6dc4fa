"""The printed report of benchmarks/accelerator.py: the probe's lines and one table of rows.

Reads only the JSON payload (no JAX), so the table can be printed again from a saved file:
`python benchmarks/lib/accelerator_table.py benchmarks/results/accelerator.json`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

RAN = ("ok", "does_not_fit", "skipped")  # statuses that are a result, not a failure


def _gib(n: float | None) -> str:
  if n is None:
    return "n/a"
  return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(r: dict, key: str, fmt: str) -> str:
  return "" if r.get(key) is None else format(r[key], fmt)


COLUMNS = (
    ("row", lambda r: r.get("name", "?")),
    ("status", lambda r: r.get("status", "?")),
    ("step ms", lambda r: f"{r['step_s'] * 1e3:.1f}" if r.get("step_s") else ""),
    ("tokens/s", lambda r: _num(r, "tokens_per_s", ".0f")),
    ("TFLOP/s", lambda r: _num(r, "tflops_per_s_causal", ".3g")),
    ("MFU causal", lambda r: _pct(r.get("mfu_causal")) if r.get("step_s") else ""),
    ("MFU PaLM", lambda r: _pct(r.get("mfu_palm")) if r.get("step_s") else ""),
    ("peak mem", lambda r: _gib(r.get("peak_bytes_in_use")) if r.get("step_s") else ""),
    ("compiled", lambda r: _gib(r.get("compiled_bytes")) if "compiled_bytes" in r else ""),
    ("compile s", lambda r: _num(r, "compile_s", ".0f")),
    ("attention ran", lambda r: r.get("attention_ran", "")),
    ("final loss", lambda r: _num(r, "final_loss", ".5f")),
)


def table(rows: list[dict]) -> str:
  cells = [[h for h, _ in COLUMNS]] + [[str(f(r)) for _, f in COLUMNS] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def probe_lines(probe: dict | None) -> list[str]:
  if not probe or probe.get("status") != "ok":
    return [f"probe: {(probe or {}).get('status', 'missing')}: {(probe or {}).get('error', '')}"]
  v, m = probe["versions"], probe["matmul"]
  installed = ", ".join(f"{k} {x}" for k, x in v.items() if x)
  return [f"python {probe['python']}; {installed}",
          f"{probe['backend']}: {probe['device_count']} x {probe['device_kind']}; memory limit "
          f"{_gib(probe.get('memory_limit_bytes'))}; MFU against {probe['peak_source']}",
          f"bf16 {m['n']}^3 matmul: best {m['best_flops_per_s'] / 1e12:.1f} TFLOP/s, median "
          f"{m['median_flops_per_s'] / 1e12:.1f} TFLOP/s"]


def report(payload: dict[str, Any]) -> str:
  rows = payload.get("rows", [])
  lines = probe_lines(payload.get("probe")) + ["", table(rows)] if rows else probe_lines(
      payload.get("probe"))
  lines += [f"{r['status'].upper()}  {r.get('name')}: {r['error']}" for r in rows
            if r.get("error")]
  lines.append("MFU causal: half of each T x T attention product counted (the framework's "
               "convention); PaLM: 6N + 12 L H Q T per token (full T x T). peak mem: "
               "memory_stats()['peak_bytes_in_use'] of the row's own process.")
  return "\n".join(lines)


def all_ran(payload: dict[str, Any]) -> bool:
  """The probe and every row produced a result (a step too big for the chip or a row the
  budget skipped is a result; an error, a crash or a timeout is not)."""
  probe = payload.get("probe") or {}
  return probe.get("status") == "ok" and all(r.get("status") in RAN for r in payload["rows"])


if __name__ == "__main__":
  print(report(json.loads(open(sys.argv[1]).read())))
