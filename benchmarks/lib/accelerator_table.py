"""The printed report of benchmarks/accelerator.py: the probe's lines, one line per row (its
fastest candidate) and one per candidate, and the on-policy candidates' sampling against the
decode roofline.

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


def _rate(x: float | None) -> str:
  return "" if x is None else f"{x:,.0f}"


# The on-policy step apart: the sampler alone, the update (the step less its sampling), and
# the sampler's completion tokens/s against the decode roofline of the chip's HBM bandwidth.
ON_POLICY_COLUMNS = (
    ("row", lambda r: r["row"]),
    # Issue 53's two batches: completions sampled at once / per update micro-batch (a JSON
    # from before them sampled and learned the same rows).
    ("sampled / micro", lambda r: f"{r.get('sampling_batch', r['batch'])} / "
                                  f"{r.get('micro_batch', r['batch'])}"),
    ("sampler peak GiB", lambda r: f"{r['sampler_memory']['peak_bytes'] / 2**30:.2f}"
                                   if r.get("sampler_memory") else "-"),
    ("sampling ms", lambda r: _ms(r.get("sampling_s"))),
    ("update ms", lambda r: _ms(r.get("update_s"))),
    ("step ms", lambda r: _ms(r.get("step_s"))),
    ("sampled tokens", lambda r: f"{r['sampled_tokens']:,}"),
    ("sampling tokens/s", lambda r: _rate(r.get("sampled_tokens_per_s"))),
    ("roofline tokens/s", lambda r: _rate(r.get("roofline_tokens_per_s"))),
    ("of roofline", lambda r: _pct(r.get("roofline_fraction"))),
    ("decode GB/step", lambda r: f"{r['decode_bytes_per_step'] / 1e9:.2f}"),
    ("learned tokens/s", lambda r: _rate(r.get("tokens_per_s"))),
)


def table(rows: list[dict], columns=COLUMNS) -> str:
  cells = [[h for h, _ in columns]] + [[str(f(r)) for _, f in columns] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
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
          f"{_gb(probe.get('memory_limit'))}; MFU against {probe['peak_source']}"
          + (f"; decode roofline against {probe['hbm_source']}" if probe.get("hbm_source")
             else ""),
          f"bf16 {m['n']}^3 matmul: best {m['best_flops_per_s'] / 1e12:.1f} TFLOP/s, median "
          f"{m['median_flops_per_s'] / 1e12:.1f} TFLOP/s"]


def readme_table(payload: dict[str, Any]) -> str:
  """The README's performance table: each row's fastest candidate, in markdown (the README
  carries exactly this text for the committed chip run; tests/benchmarks check it)."""
  probe = payload["probe"]
  lines = [f"| step ({probe['device_kind']}, {probe['backend']}) | batch x tokens, remat | "
           "step ms | tokens/s | MFU | compiled peak |", "|---|---|---|---|---|---|"]
  for r in payload["rows"]:
    b = r["best"]
    # A row carried from an earlier chip call says the commit it was measured at.
    label = f"{r['name']} ({r['pair']}" + (f"; at {r['commit']}" if r.get("stale") else "") + ")"
    if b:
      extra = "".join(f", {k}={v}" for k, v in b["options"].items()
                      if k not in ("pair", "loss_impl"))
      lines.append(f"| {label} | {b['batch']} x {b['seq_len']}, {b['remat']}"
                   f"{extra} | {_ms(b['step_s'])} | {b['tokens_per_s']:,.0f} | "
                   f"{_pct(b['mfu_causal'])} | {_gb(b['compiled_peak'])} |")
    else:
      lines.append(f"| {label} | nothing that fits ran | | | | |")
  return "\n".join(lines)


# accelerator.summary's ratios between rows (issue 54's targets: QAT KD <= 1.15x the KD step,
# QLoRA >= 1.0x and int8 training >= 1.1x the train row's tokens/s).
RATIOS = (("qat_kd_over_kd", "q4_0 QAT KD step / bf16 KD step (same batch)"),
          ("qat_kd_weights_over_kd", "q4_0 weights-only QAT KD step / bf16 KD step (same batch)"),
          ("qlora_over_train", "QLoRA tokens/s / train tokens/s (each at its best batch)"),
          ("lora_over_train", "LoRA tokens/s / train tokens/s (each at its best batch)"),
          ("train_int8_over_train", "int8 QAT (int8 matmuls) tokens/s / train tokens/s"))


def ratio_lines(payload: dict[str, Any]) -> list[str]:
  return [f"{label}: {payload[key]:.3f}" for key, label in RATIOS
          if payload.get(key) is not None]


def report(payload: dict[str, Any]) -> str:
  lines = probe_lines(payload.get("probe")) + [""]
  best = [dict(r["best"], row=f"{r['name']} ({r['pair']})") for r in payload["rows"]
          if r["best"]]
  missing = [r["name"] for r in payload["rows"] if not r["best"]]
  lines += ["Each row at its fastest candidate:", table(best)]
  if missing:
    lines.append(f"no candidate ran: {', '.join(missing)}")
  lines += ratio_lines(payload)
  lines += ["", "Every candidate:", table([c for r in payload["rows"] for c in r["candidates"]])]
  sampled = [c for r in payload["rows"] for c in r["candidates"] if "sampling_s" in c]
  if sampled:
    bandwidth = next((c["hbm_source"] for c in sampled), "")
    lines += ["", f"On-policy: sampling and the update apart; decode roofline at {bandwidth} "
              f"(weights + KV cache read per decode step, benchmarks/lib/on_policy_lever.py):",
              table(sampled, ON_POLICY_COLUMNS)]
  lines += [f"{c['status'].upper()} {c['row']}: {c['error'][:300]}" for r in payload["rows"]
            for c in r["candidates"] if c.get("error")]
  lines.append("MFU: model FLOPs (causal: half of each T x T attention product) over the "
               "datasheet peak; compiled peak: arguments + temporaries + outputs - aliased.")
  return "\n".join(lines)


if __name__ == "__main__":
  print(report(json.loads(open(sys.argv[1]).read())))
