"""Step-time and memory overhead of QAT, LoRA and QLoRA against plain training, in one run.

  python benchmarks/qat.py [--quick] [--model tiny|demo_student] [--strategy fsdp]

Every variant is built the way `distillax train` builds it: the recipe of the job's config file
(distillax/configs/lm.py, qat.py, lora.py, qlora.py; `recipe_for`) compiles its step
(`build_engines`) and makes its student (`build`: LoRA / QLoRA adapters and QAT fake
quantization applied, sharded by the recipe's rules). Variants:

  plain      lm.py: full-precision fp32 training, every parameter trains
  qat_int8   qat.py with int8 weights and int8 activations (embedding kept full precision)
  qat_int4   qat.py as shipped: int4 weights, int8 activations
  lora       lora.py: rank-8 adapters on the attention and MLP matmuls (no dropout)
  qlora_nf4  qlora.py: the same adapters over frozen nf4 base weights (tiles of 32)

Each variant warms up, then the rounds go plain, qat_int8, ..., plain, qat_int8, ...; the ratio
to plain is the median over rounds of (variant / plain) in the same round, so a slow moment of
the shared machine hits every variant alike. Memory is XLA's compiled per-device figure for the
step (arguments, temporaries, outputs), beside the trainable parameter count and the optimizer
state it implies. Writes benchmarks/results/qat.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=8)

import jax  # noqa: E402

from benchmarks.lib import common, subproc, variants  # noqa: E402

# name -> (config module in distillax/configs, what it measures)
VARIANTS = {
    "plain": ("lm", "fp32, all params train"),
    "qat_int8": ("qat", "QAT int8 weights + int8 acts"),
    "qat_int4": ("qat", "QAT int4 weights + int8 acts"),
    "lora": ("lora", "LoRA r8 attn+mlp, fp32 base"),
    "qlora_nf4": ("qlora", "QLoRA r8, nf4 base frozen"),
}
REFERENCE = "plain"
# The embedding stays full precision, as in distillax/configs/qat.py.
QAT_INT8_RULES = (("", None, None, None), (".*", "int8", "int8", None))


def settings(args) -> dict:
  if args.quick:
    s = {"model": "tiny", "batch": 8, "seq_len": 32, "reps": 2, "steps_per_rep": 1}
  else:
    s = {"model": "demo_student", "batch": 16, "seq_len": 128, "reps": 7, "steps_per_rep": 3}
  for key in ("model", "batch", "seq_len", "reps", "steps_per_rep"):
    if getattr(args, key) is not None:
      s[key] = getattr(args, key)
  s["strategy"], s["mesh_model"] = args.strategy, args.mesh_model
  s["variants"] = args.only.split(",") if args.only else list(VARIANTS)
  unknown = sorted(set(s["variants"]) - set(VARIANTS))
  if unknown or REFERENCE not in s["variants"]:
    raise SystemExit(f"--only: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)} "
                     f"and keep {REFERENCE!r} (the reference)")
  s["variants"] = [v for v in VARIANTS if v in s["variants"]]  # canonical order
  return s


def variant_config(name: str, s: dict):
  """The job config a user would run for this variant, sized for the benchmark."""
  c = variants.job_config(VARIANTS[name][0], tiny=s["model"] == "tiny", batch=s["batch"],
                          seq_len=s["seq_len"])
  if s["model"] == "tiny":  # the script check (--quick): one layer compiles in less time
    c.model.num_layers = 1  # (as peft.py's tiny), and every variant's code still runs
  if name == "qat_int8":
    c.qat.rules = QAT_INT8_RULES
  if c.qat.rules:
    c.qat.start_step = 0  # measure the fake-quant step itself (no second, fp32 step compiled)
  c.partitioning.strategy = s["strategy"]
  c.mesh.model = s["mesh_model"]
  return c


def run_checks(rows: dict) -> list[dict]:
  """What must hold whatever the timings: facts of LoRA / QLoRA / QAT the figures show."""
  checks = variants.shared_checks(rows, REFERENCE, lora="lora", qlora="qlora_nf4")
  ref = rows[REFERENCE]
  for name in ("qat_int8", "qat_int4"):
    if name in rows:
      r = rows[name]
      checks.append({"check": f"{name}: same trainable parameters as plain (fake quant adds no "
                              f"state)", "pass": r["trainable_params"] == ref["trainable_params"]})
      checks.append({"check": f"{name}: the forward is fake-quantized (first loss differs from "
                              f"plain)", "pass": r["first_loss"] != ref["first_loss"],
                     "rel_diff": abs(r["first_loss"] - ref["first_loss"]) / ref["first_loss"]})
  return checks


def parse_args():
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("tiny", "demo_student"), default=None,
                      help="model preset (default demo_student; with --quick, tiny: one layer)")
  parser.add_argument("--batch", type=int, default=None, help="global batch (sequences)")
  parser.add_argument("--seq-len", dest="seq_len", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None, help="interleaved rounds")
  parser.add_argument("--steps-per-rep", dest="steps_per_rep", type=int, default=None)
  parser.add_argument("--strategy", default="fsdp", help="partitioning preset")
  parser.add_argument("--mesh-model", dest="mesh_model", type=int, default=1,
                      help="devices on the 'model' axis (the rest go to 'data')")
  parser.add_argument("--only", default="", help=f"comma list from {','.join(VARIANTS)}")
  return subproc.parse_args(parser)


def time_variants(steppers: dict, rows: dict, s: dict) -> None:
  """Adds each variant's timings, losses and ratios to plain (time and memory) to its row."""
  variants.time_against(steppers, rows, REFERENCE, reps=s["reps"],
                        steps_per_rep=s["steps_per_rep"], warmup_steps=2,
                        tokens_per_step=s["batch"] * s["seq_len"])


def print_results(rows: dict, checks: list[dict]) -> None:
  """The table and the checks for the console; the JSON carries the same figures in full."""
  fb = common.fmt_bytes
  print()
  print(common.format_table(list(rows.values()), [
      ("variant", lambda r: r["variant"]), ("what", lambda r: r["what"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("vs plain", lambda r: common.fmt_ratio(r["ratio_to_plain"])),
      ("args/dev", lambda r: fb(r["argument_bytes"])),
      ("temp/dev", lambda r: fb(r["temp_bytes"])),
      ("total/dev", lambda r: fb(r["compiled_total_bytes"])),
      ("mem vs plain", lambda r: common.fmt_ratio(r["memory_ratio_to_plain"])),
      ("trainable", lambda r: f"{r['trainable_params']:,}"),
      ("opt state", lambda r: fb(r["opt_state_bytes"])),
      ("frozen", lambda r: fb(r["frozen_bytes"])),
      ("loss 1st->last", lambda r: f"{r['first_loss']:.4f}->{r['final_loss']:.4f}")]))
  print("step ms: median step time; vs plain: median over rounds of the per-round ratio; "
        "args/temp/dev: XLA's compiled per-device bytes of the step (arguments, scratch); "
        "total/dev: arguments + outputs + scratch - donated; opt state: optimizer state in all "
        "devices; frozen: the student's non-trainable storage in all devices")
  for c in checks:
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']}")


def main() -> int:
  args = parse_args()
  s = settings(args)
  print(f"{s['model']}: global batch {s['batch']} x {s['seq_len']}, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, strategy {s['strategy']}, "
        f"{s['reps']} rounds x {s['steps_per_rep']} steps", flush=True)
  steppers, rows = {}, {}
  for name in s["variants"]:
    steppers[name], rows[name] = variants.build_variant(
        name, VARIANTS[name][1], VARIANTS[name][0], variant_config(name, s))
    print(f"  built {name} in {rows[name]['build_s']:.1f} s", flush=True)
  time_variants(steppers, rows, s)
  checks = run_checks(rows)
  print_results(rows, checks)

  model = [r.pop("model") for r in rows.values()][0]  # one model config for every variant
  payload = {"benchmark": "qat", "quick": args.quick, "machine": common.machine_info(),
             "settings": s, "model": model, "reference": REFERENCE, "rows": list(rows.values()),
             "checks": checks, "checks_passed": sum(c["pass"] for c in checks),
             "checks_total": len(checks)}
  path = common.write_json(args.out, "qat", payload)
  print(f"\nwrote {path}")
  return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
