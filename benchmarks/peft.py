"""LoRA and QLoRA against full fine-tuning at sizes where parameters matter: step time, memory.

  python benchmarks/peft.py [--quick] [--model 25m|100m|tiny] [--reps N] [--dropout P]
                            [--remat none|full|save_dots] [--scan-layers]

Every variant is built the way `distillax train` builds it: the recipe of the job's config file
(`recipe_for`) compiles its step (`build_engines`) and makes its student (`build`: adapters,
a quantized base, shardings by the recipe's rules):

  full   distillax/configs/lm.py     fp32, every parameter trains
  lora   distillax/configs/lora.py   rank-8 adapters on the attention and MLP matmuls (as
                                     shipped: alpha 16, no adapter dropout), fp32 base frozen
  qlora  distillax/configs/qlora.py  the same adapters over a frozen nf4 base (tiles of 32)

Models (Llama-shaped: multi-head attention, SwiGLU, tied embeddings, vocab 384):

  25m   embed 512, 8 layers, 8 heads of 64, mlp 2048: 33.8M parameters (the "25M" shape the
        issue measured: its 386 MiB of full fine-tuning arguments are these 33.8M fp32
        parameters with Adam's two moments)
  100m  embed 768, 12 layers, 12 heads of 64, mlp 3072: 113M parameters
  tiny  the configs' tiny shrink with one layer, for --quick (the smoke test)

Each variant warms up, then the rounds go full, lora, qlora, full, ...; a variant's ratio to full
fine-tuning is the median over rounds of (variant / full) in the same round, so a slow moment of
a shared machine hits every variant alike. Memory is XLA's compiled per-device figure for the
step: arguments, temporaries, outputs, and their total less the donated state that the outputs
reuse. The activations kept for the backward are the same in every variant (each adapted
matmul keeps its input, as full fine-tuning does for its weight gradient); `--remat` sets
model.remat in all three, which shrinks them and leaves what the adapters save. On XLA:CPU
remat only takes effect with `--scan-layers` (model.scan_layers): with unrolled layers XLA
schedules every block's recomputation early and keeps the activations anyway (100m full
fine-tuning: 3.16 GiB of temporaries without remat, 2.91 with, 0.85 with scanned layers).
One CPU device by default (--devices). Writes benchmarks/results/peft[_MODEL][_remat_R][_scan].json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402

from benchmarks.lib import common, subproc, variants  # noqa: E402

# name -> (config module in distillax/configs, what it is)
VARIANTS = {
    "full": ("lm", "full fine-tuning, fp32"),
    "lora": ("lora", "LoRA r8 attn+mlp, fp32 base frozen"),
    "qlora": ("qlora", "QLoRA r8, nf4 base frozen"),
}
REFERENCE = "full"
MODELS = {
    "25m": dict(embed_dim=512, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64,
                mlp_dim=2048),
    "100m": dict(embed_dim=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_dim=3072),
    "tiny": dict(num_layers=1),  # the configs' own :tiny shrink, one layer (--quick)
}
# The done-when targets: (variant, figure, bound), figures as ratios to full fine-tuning.
TARGETS = (("lora", "ratio_to_full", 1.0), ("lora", "temp_ratio_to_full", 1.0),
           ("qlora", "ratio_to_full", 1.2), ("lora", "memory_ratio_to_full", 0.6))


def settings(args) -> dict:
  if args.quick:
    s = {"model": "tiny", "batch": 8, "seq_len": 32, "reps": 2, "steps_per_rep": 1}
  else:
    s = {"model": "25m", "batch": 8, "seq_len": 256, "reps": 5, "steps_per_rep": 1}
  for key in ("model", "batch", "seq_len", "reps", "steps_per_rep"):
    if getattr(args, key) is not None:
      s[key] = getattr(args, key)
  s["dropout"] = args.dropout
  s["remat"] = args.remat
  s["scan_layers"] = args.scan_layers
  s["variants"] = list(VARIANTS)
  return s


def variant_config(name: str, s: dict):
  """The job config a user would run for this variant, sized for the benchmark."""
  c = variants.job_config(VARIANTS[name][0], tiny=s["model"] == "tiny", batch=s["batch"],
                          seq_len=s["seq_len"])
  for key, value in (MODELS[s["model"]] or {}).items():
    c.model[key] = value
  c.model.max_seq_len = max(int(c.model.max_seq_len), s["seq_len"])
  if s["remat"] is not None:
    c.model.remat = s["remat"]
  if s["scan_layers"]:
    c.model.scan_layers = True
  if s["dropout"] is not None and c.lora.module_regex:
    c.lora.dropout = s["dropout"]
  return c


def time_variants(steppers: dict, rows: dict, s: dict) -> None:
  """Adds timings, losses and the ratios to full fine-tuning (time, memory) to each row."""
  variants.time_against(steppers, rows, REFERENCE, reps=s["reps"],
                        steps_per_rep=s["steps_per_rep"], warmup_steps=1,
                        tokens_per_step=s["batch"] * s["seq_len"])


def run_checks(rows: dict) -> list[dict]:
  """What must hold whatever the timings."""
  return variants.shared_checks(rows, REFERENCE, lora="lora", qlora="qlora")


def targets(rows: dict) -> list[dict]:
  """The issue's done-when bounds beside what this run measured (timings: one run, noisy)."""
  return [{"variant": v, "figure": f, "bound": b, "measured": rows[v][f],
           "met": rows[v][f] <= b} for v, f, b in TARGETS if v in rows]


def print_results(rows: dict, checks: list[dict], met: list[dict]) -> None:
  fb = common.fmt_bytes
  print()
  print(common.format_table(list(rows.values()), [
      ("variant", lambda r: r["variant"]), ("what", lambda r: r["what"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("vs full", lambda r: common.fmt_ratio(r["ratio_to_full"])),
      ("args", lambda r: fb(r["argument_bytes"])), ("temp", lambda r: fb(r["temp_bytes"])),
      ("temp vs full", lambda r: common.fmt_ratio(r["temp_ratio_to_full"])),
      ("total", lambda r: fb(r["compiled_total_bytes"])),
      ("total vs full", lambda r: common.fmt_ratio(r["memory_ratio_to_full"])),
      ("trainable", lambda r: f"{r['trainable_params']:,}"),
      ("opt state", lambda r: fb(r["opt_state_bytes"])),
      ("loss 1st->last", lambda r: f"{r['first_loss']:.4f}->{r['final_loss']:.4f}")]))
  print("step ms: median step time; vs full: median over rounds of the per-round ratio; args, "
        "temp: XLA's compiled per-device bytes of the step; total: arguments + outputs + temp - "
        "donated; opt state: optimizer state in all devices")
  for c in checks:
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']}")
  for t in met:
    print(f"target {t['variant']} {t['figure']} <= {t['bound']}: {t['measured']:.3f} "
          f"({'met' if t['met'] else 'not met'})")


def parse_args():
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--model", choices=tuple(MODELS), default=None,
                      help="model shape (default 25m; tiny with --quick)")
  parser.add_argument("--batch", type=int, default=None, help="global batch (sequences)")
  parser.add_argument("--seq-len", dest="seq_len", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None, help="interleaved rounds")
  parser.add_argument("--steps-per-rep", dest="steps_per_rep", type=int, default=None)
  parser.add_argument("--dropout", type=float, default=None,
                      help="adapter dropout (default: the configs' 0)")
  parser.add_argument("--remat", default=None, choices=("none", "full", "save_dots"),
                      help="model.remat of every variant (default: the configs', none)")
  parser.add_argument("--scan-layers", dest="scan_layers", action="store_true",
                      help="model.scan_layers=True in every variant (what makes remat work)")
  return subproc.parse_args(parser)


def main() -> int:
  args = parse_args()
  s = settings(args)
  print(f"{s['model']}: batch {s['batch']} x {s['seq_len']}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), {s['reps']} rounds x {s['steps_per_rep']} "
        f"steps, remat {s['remat'] or 'as configured'}"
        f"{', scanned layers' if s['scan_layers'] else ''}", flush=True)
  steppers, rows = {}, {}
  for name in s["variants"]:
    steppers[name], rows[name] = variants.build_variant(
        name, VARIANTS[name][1], VARIANTS[name][0], variant_config(name, s))
    print(f"  built {name} in {rows[name]['build_s']:.1f} s", flush=True)
  load_before = os.getloadavg()
  time_variants(steppers, rows, s)
  checks, met = run_checks(rows), targets(rows)
  print_results(rows, checks, met)
  load = {"before_timing": load_before, "after_timing": os.getloadavg()}
  print(f"load averages (1, 5, 15 min): before timing {load_before}, after {load['after_timing']}")

  model = [r.pop("model") for r in rows.values()][0]  # one model config for every variant
  payload = {"benchmark": "peft", "quick": args.quick, "machine": common.machine_info(),
             "load_average": load, "settings": s, "model": model, "reference": REFERENCE,
             "rows": list(rows.values()), "checks": checks,
             "checks_passed": sum(c["pass"] for c in checks), "checks_total": len(checks),
             "targets": met}
  name = "peft" if s["model"] == "25m" else f"peft_{s['model']}"
  name += f"_remat_{s['remat']}" if s["remat"] not in (None, "none") else ""
  name += "_scan" if s["scan_layers"] else ""
  path = common.write_json(args.out, name, payload)
  print(f"\nwrote {path}")
  return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
