"""Where a profiled train step's time goes, by part of the model: the output layer and vocabulary
loss, the attention kernel, the attention projections, the MLP matmuls, norms and other
elementwise work, the optimizer.

  python scripts/profile_ops.py PROFILE_DIR_OR_TGZ [--steps 2] [--json OUT.json]

Reads a jax.profiler trace (benchmarks/tpu_levers.py --profile writes one per variant, tarred)
with xprof's converter (`pip install xprof`, not a distillax dependency: run it in its own
environment) into per-HLO-op self times, and sorts every op into a part by the source line JAX
recorded for it (framework/losses.py and vocab_slices.py: the loss; models/attention: the
projections, or the Pallas kernel; models/layers.py's matmuls: the MLP; distillax/quant: QAT's
rounding, int8 matmuls, QLoRA's dequantization and adapted matmuls, LoRA's dropout masks;
optax: the optimizer),
and into forward, recomputation (remat) and backward by its name scope.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tarfile
import tempfile


def hlo_stats(trace_dir: str) -> list[dict]:
  from xprof.convert import raw_to_tool_data  # noqa: PLC0415 - an optional, heavy tool

  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise SystemExit(f"profile_ops.py: no *.xplane.pb under {trace_dir}")
  data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "hlo_stats", {})
  table = json.loads(data)
  table = table[0] if isinstance(table, list) else table
  labels = [c["label"] for c in table["cols"]]
  return [dict(zip(labels, [c.get("v") if c else None for c in row["c"]]))
          for row in table["rows"]]


def _frame(source: str) -> str:
  """The innermost source file:line JAX recorded (the last one of the op's stack)."""
  frames = re.findall(r"([\w./-]+\.py):\d+", source)
  return frames[-1].lower() if frames else ""


def part_of(op: dict) -> tuple[str, str]:
  """(part of the model, phase) of one HLO op."""
  name = op.get("Framework op name") or ""
  frame = _frame(op.get("Source Info") or "")
  phase = ("remat" if "rematted" in name else "backward" if "transpose(" in name
           else "forward")
  matmul = "dot_general" in name
  if "optax" in frame:
    return "optimizer", "update"
  if any(f in frame for f in ("losses.py", "vocab_slices", "vocab_chunks", "token_loss",
                              "linear_softmax")) or (matmul and "transformer.py" in frame):
    return "output layer + vocabulary loss", phase
  if "pallas" in name or "splash" in frame or "tokamax" in frame:
    return "Pallas/Mosaic kernels (attention, grouped matmul)", phase
  if "keep_mask" in frame:  # LoRA's dropout: Threefry blocks, the mask packed for the backward
    return "LoRA dropout keep masks (quant/keep_mask.py)", phase
  if "/quant/" in frame:  # QAT's rounding, int8 matmuls, nf4 dequantization, LoRA's matmuls
    return ("quantized / adapted matmuls (quant/)" if matmul
            else "quantization: rounding, int8 codes, nf4 dequantization (quant/)"), phase
  if "moe" in frame or "ragged" in name:
    return "experts (grouped matmul, routing)", phase
  if "attention" in frame and matmul:
    return "attention projections (q, k, v, o)", phase
  if "layers.py" in frame and matmul:
    return "MLP matmuls", phase
  if matmul:
    return "other matmuls", phase
  if "layers.py" in frame or "attention" in frame:
    return "norms, activations, RoPE (elementwise)", phase
  return f"other ({op.get('HLO op category')})", phase


def summarise(ops: list[dict], steps: float) -> dict:
  total = sum(op["Total self time (us)"] for op in ops)
  parts, phases = collections.Counter(), collections.Counter()
  for op in ops:
    part, phase = part_of(op)
    parts[part] += op["Total self time (us)"]
    phases[(part, phase)] += op["Total self time (us)"]
  return {"step_ms": total / steps / 1e3,
          "parts": [{"part": p, "ms": t / steps / 1e3, "share": t / total,
                     "by_phase_ms": {ph: phases[(p, ph)] / steps / 1e3
                                     for ph in ("forward", "remat", "backward", "update")
                                     if phases[(p, ph)]}}
                    for p, t in parts.most_common()]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("profile", help="a trace folder, or the .tgz tpu_levers.py wrote")
  parser.add_argument("--steps", type=float, default=2, help="steps the trace holds")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    folder = args.profile
    if folder.endswith(".tgz"):
      with tarfile.open(folder) as tar:
        tar.extractall(tmp, filter="data")
      folder = tmp
    result = summarise(hlo_stats(folder), args.steps)
  print(f"step {result['step_ms']:.1f} ms")
  for p in result["parts"]:
    phases = ", ".join(f"{k} {v:.0f}" for k, v in p["by_phase_ms"].items())
    print(f"  {p['part']:<52} {p['ms']:7.1f} ms {100 * p['share']:5.1f}%  ({phases})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"profile": os.path.basename(args.profile), **result}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
