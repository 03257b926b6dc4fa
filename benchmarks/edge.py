"""llama.cpp speed and memory of the GGUF formats distillax exports, as ratios to f32.

  python benchmarks/edge.py [--quick] [--rounds 3] [--threads 1] [--models tiny,llama_100m]

Models (random weights: speed and memory do not depend on their values): the demo's student
(distillax/configs/demo.py, byte vocabulary of 384) and a ~100M-parameter Llama (768 wide, 12
layers, 32000-token vocabulary, tied embedding); --quick: the `tiny` preset only. Each is
written by `write_gguf` as f32, f16, q8_0 and q4_0 (every matmul weight in the format, the tied
embedding included, as `distillax export --format gguf --quant q4_0` does without qat.rules).

Each round runs every format once, each in a fresh child process
(distillax.edge.measurements.interleaved_rounds: numpy + llama_cpp only, no JAX): one warm-up,
then --inner timed rounds of a prompt (one batch of --prompt tokens) and --decode one-token decode
steps (their median is the child's figure), and the child's peak RSS (its own high-water
mark: llama.cpp's buffers plus the mapped weights it touched). Rounds go f32, f16, q8_0,
q4_0, f32, ...; a ratio to f32 is the median over rounds of (format / f32) in the same round,
so a slow moment of the shared machine hits every format alike. llama.cpp runs as deployed:
its default float16 KV cache and the kernels it picks for this CPU
(gguf_runtime.deployment_kernels(): "repack" where its build has REPACK and the CPU no AMX,
else "reference"; each row names them and llama.cpp's system info), with --threads threads
(default 1: on a shared 2-core machine a descheduled worker thread stalls the others).
Writes benchmarks/results/edge.json.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import numpy as np  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.configs import demo  # noqa: E402
from distillax.edge import measurements
from distillax.edge import runtime as gguf_runtime  # noqa: E402
from distillax.edge.export import write_gguf  # noqa: E402
from distillax.models import TransformerConfig, get_preset, param_count  # noqa: E402

FORMATS = ("f32", "f16", "q8_0", "q4_0")
REFERENCE = "f32"
BYTE_VOCAB = 384  # the byte tokenizer's 259 ids padded to a multiple of 128, as training pads


def model_configs(names):
  """{name: TransformerConfig} of the benchmarked models."""
  student = dict(demo.get_config().student_model)
  student["vocab_size"] = BYTE_VOCAB
  known = {
      "tiny": get_preset("tiny", vocab_size=BYTE_VOCAB),
      "demo_student": TransformerConfig(**{k: v for k, v in student.items()
                                           if k in TransformerConfig.__dataclass_fields__}),
      "llama_100m": TransformerConfig(vocab_size=32000, embed_dim=768, num_layers=12,
                                      num_heads=12, num_kv_heads=4, head_dim=64, mlp_dim=2048,
                                      tie_embeddings=True, max_seq_len=512),
  }
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(known)}")
  return {n: known[n] for n in names}


def settings(args) -> dict:
  s = ({"models": ["tiny"], "rounds": 2, "inner": 2, "prompt": 32, "decode": 8} if args.quick
       else {"models": ["demo_student", "llama_100m"], "rounds": 3, "inner": 3, "prompt": 128,
             "decode": 32})
  for key in ("rounds", "inner", "prompt", "decode"):
    if getattr(args, key) is not None:
      s[key] = getattr(args, key)
  if args.models:
    s["models"] = args.models.split(",")
  s["threads"] = args.threads
  return s


def export_formats(name: str, cfg, folder: str) -> dict:
  """Writes the model as every format; returns {format: {'path', 'file_bytes', 'types'}}."""
  model = common.host_model(cfg, seed=0)
  out = {}
  for fmt in FORMATS:
    info = write_gguf(model, os.path.join(folder, f"{name}-{fmt}.gguf"), quant=fmt)
    out[fmt] = {"path": info["path"], "file_bytes": info["bytes"],
                "types": sorted(set(info["types"].values()))}
  return out


def time_formats(files: dict, s: dict) -> dict:
  """{format: {'prompt_s': [...], 'decode_s': [...], 'peak_rss_bytes': [...], ...}} over
  interleaved rounds, one child process per (round, format): measurements.interleaved_rounds
  on the kernels and KV cache a deployment gets."""
  ids = np.random.default_rng(0).integers(3, 259, s["prompt"] + s["decode"]).tolist()
  speed = {"prompt": ids[:s["prompt"]], "decode": ids[s["prompt"]:], "rounds": s["inner"]}

  def progress(r, runs):
    print(f"  round {r + 1}/{s['rounds']}: " + ", ".join(
        f"{f} {s['decode'] / runs[f]['decode_s'][-1]:.0f} tok/s" for f in FORMATS), flush=True)

  return measurements.interleaved_rounds(
      {fmt: files[fmt]["path"] for fmt in FORMATS}, speed, rounds=s["rounds"],
      n_threads=s["threads"], exact_cache=False, kernels=gguf_runtime.deployment_kernels(),
      on_round=progress)


def model_rows(name: str, cfg, files: dict, runs: dict, s: dict) -> list[dict]:
  """One row per format: medians, per-round figures and ratios to f32 (paired by round)."""
  ref = runs[REFERENCE]
  rows = []
  for fmt in FORMATS:
    run, f = runs[fmt], files[fmt]
    rows.append({
        "model": name, "format": fmt, "params": param_count(cfg), "tensor_types": f["types"],
        "kernels": run["kernels"], "kv_cache": "f16", "system_info": run["system_info"],
        "file_bytes": f["file_bytes"],
        "file_ratio_to_f32": f["file_bytes"] / files[REFERENCE]["file_bytes"],
        "prompt_tokens_per_s": s["prompt"] / common.median(run["prompt_s"]),
        "decode_tokens_per_s": s["decode"] / common.median(run["decode_s"]),
        # time ratio f32 / format = speed-up over f32, paired within each round
        "prompt_speedup_vs_f32": common.paired_ratio(
            {"a": ref["prompt_s"], "b": run["prompt_s"]}, "a", "b"),
        "decode_speedup_vs_f32": common.paired_ratio(
            {"a": ref["decode_s"], "b": run["decode_s"]}, "a", "b"),
        "peak_rss_bytes": int(common.median(run["peak_rss_bytes"])),
        "peak_rss_ratio_to_f32": common.paired_ratio(
            {"b": run["peak_rss_bytes"], "a": ref["peak_rss_bytes"]}, "b", "a"),
        "rss_before_load_bytes": int(common.median(run["rss_before_load_bytes"])),
        **{k: run[k] for k in ("prompt_s", "decode_s")},
        "peak_rss_bytes_all": run["peak_rss_bytes"],
    })
  return rows


def run_checks(rows: list[dict]) -> list[dict]:
  """What must hold whatever the timings: smaller formats make smaller files."""
  checks = []
  for name in dict.fromkeys(r["model"] for r in rows):
    size = {r["format"]: r["file_bytes"] for r in rows if r["model"] == name}
    ok = size["f32"] > size["f16"] > size["q8_0"] > size["q4_0"]
    checks.append({"check": f"{name}: file bytes f32 > f16 > q8_0 > q4_0", "pass": bool(ok),
                   **size})
  return checks


def print_results(rows: list[dict], checks: list[dict]) -> None:
  fb = common.fmt_bytes
  print()
  print(common.format_table(rows, [
      ("model", lambda r: r["model"]), ("format", lambda r: r["format"]),
      ("params", lambda r: f"{r['params']:,}"), ("file", lambda r: fb(r["file_bytes"])),
      ("prompt tok/s", lambda r: f"{r['prompt_tokens_per_s']:,.0f}"),
      ("x f32", lambda r: common.fmt_ratio(r["prompt_speedup_vs_f32"])),
      ("decode tok/s", lambda r: f"{r['decode_tokens_per_s']:,.0f}"),
      ("x f32 ", lambda r: common.fmt_ratio(r["decode_speedup_vs_f32"])),
      ("peak RSS", lambda r: fb(r["peak_rss_bytes"])),
      ("RSS vs f32", lambda r: common.fmt_ratio(r["peak_rss_ratio_to_f32"]))]))
  print("x f32: speed-up over f32 (median over rounds of f32 time / format time, same round); "
        "peak RSS: the llama.cpp child's own high-water mark (interpreter + llama_cpp alone: "
        f"{fb(rows[0]['rss_before_load_bytes'])})")
  for c in checks:
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']}")


def parse_args():
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--models", default="", help="comma list: tiny, demo_student, llama_100m")
  parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
  parser.add_argument("--inner", type=int, default=None, help="timed rounds in each child")
  parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (one batch)")
  parser.add_argument("--decode", type=int, default=None, help="one-token decode steps")
  parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
  return subproc.parse_args(parser)


def main() -> int:
  args = parse_args()
  s = settings(args)

  rows = []
  with tempfile.TemporaryDirectory() as folder:
    for name, cfg in model_configs(s["models"]).items():
      start = time.perf_counter()
      files = export_formats(name, cfg, folder)
      print(f"{name}: wrote {', '.join(FORMATS)} in {time.perf_counter() - start:.1f} s; "
            f"{s['rounds']} rounds, prompt {s['prompt']}, decode {s['decode']}, "
            f"{s['threads']} thread(s)", flush=True)
      rows += model_rows(name, cfg, files, time_formats(files, s), s)
      for fmt in FORMATS:
        os.remove(files[fmt]["path"])
  checks = run_checks(rows)
  print_results(rows, checks)
  payload = {"benchmark": "edge", "quick": args.quick, "machine": common.machine_info(),
             "settings": s, "reference": REFERENCE,
             "models": {n: common.config_summary(c) | {"tie_embeddings": c.tie_embeddings}
                        for n, c in model_configs(s["models"]).items()},
             "rows": rows, "checks": checks, "checks_passed": sum(c["pass"] for c in checks),
             "checks_total": len(checks)}
  path = common.write_json(args.out, "edge", payload)
  print(f"\nwrote {path}")
  return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
