"""Step-time and memory overhead of QAT, LoRA and QLoRA against plain training, in one run.

  python benchmarks/qat.py [--quick] [--model tiny|demo_student] [--strategy fsdp]

Every variant is built the way `distillax train` builds it: the recipe of the job's config file
(distillax/configs/lm.py, qat.py, lora.py, qlora.py; `recipe_for`) compiles its step
(`build_engines`) and makes its student (`build`: LoRA / QLoRA adapters and QAT fake
quantization applied, sharded by the recipe's rules). Variants:

  plain      lm.py: full-precision fp32 training, every parameter trains
  qat_int8   qat.py with int8 weights and int8 activations (embedding kept full precision)
  qat_int4   qat.py as shipped: int4 weights, int8 activations
  lora       lora.py: rank-8 adapters on the attention and MLP matmuls (dropout 0.1)
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import subproc  # noqa: E402

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
  import importlib

  module = importlib.import_module(f"distillax.configs.{VARIANTS[name][0]}")
  c = module.get_config("tiny" if s["model"] == "tiny" else None)
  if name == "qat_int8":
    c.qat.rules = QAT_INT8_RULES
  if c.qat.rules:
    c.qat.start_step = 0  # measure the fake-quant step itself (no second, fp32 step compiled)
  c.backend = "jit"
  c.partitioning.strategy = s["strategy"]
  c.mesh.model = s["mesh_model"]
  c.train.batch_size, c.train.seq_len = s["batch"], s["seq_len"]
  c.train.steps = 1000  # the schedule's horizon only; keeps the learning rate off zero
  c.train.accum_steps = 1
  return c


def _bits(dtype) -> int:
  import jax.numpy as jnp
  dtype = jnp.dtype(dtype)
  return 4 if dtype.name in ("int4", "uint4") else dtype.itemsize * 8


def tree_bytes(abstract, shardings=None) -> int:
  """Bytes of a tree of ShapeDtypeStructs: in all, or on one device given its shardings."""
  import jax
  import numpy as np

  leaves = jax.tree.leaves(abstract)
  if shardings is None:
    return sum(int(np.prod(x.shape)) * _bits(x.dtype) // 8 for x in leaves)
  total = 0
  for x, sh in zip(leaves, jax.tree.leaves(shardings)):
    total += int(np.prod(sh.shard_shape(x.shape))) * _bits(x.dtype) // 8
  return total


def build_variant(name: str, s: dict):
  """(stepper, row of static figures) for one variant, through the job's own recipe."""
  import time

  import jax
  import numpy as np

  from benchmarks import common
  from distillax.framework import STUDENT
  from distillax.trainers import recipe_for

  c = variant_config(name, s)
  start = time.perf_counter()
  recipe = recipe_for(c)  # mesh, rules, model config
  engine = recipe.build_engines().main  # compiled step (QAT from step 0: the only engine)
  student, extras = recipe.build(abstract=False)
  batch = common.packed_batch(s["batch"], s["seq_len"], recipe.model_config.vocab_size, seed=1)
  stepper = common.Stepper(engine, student, batch, extras, seed=int(c.seed))
  jax.block_until_ready(stepper.state)
  build_s = time.perf_counter() - start
  batch_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                    for x in jax.tree.leaves(stepper.batch))
  layout, stats = engine.layout, engine.runner.stats
  sh = layout.shardings
  mem = {k: int(stats.get(f"{k}_size_in_bytes", 0)) for k in ("argument", "temp", "output",
                                                               "alias")}
  row = {
      "variant": name, "what": VARIANTS[name][1], "config": VARIANTS[name][0] + ".py",
      "qat_rules": [list(r) for r in c.qat.rules],
      "lora": ({k: c.lora[k] for k in ("module_regex", "rank", "alpha", "dropout", "base_qtype",
                                        "base_tile_size")} if c.lora.module_regex else None),
      "mesh": dict(recipe.mesh.shape), "strategy": recipe.rules.name,
      "trainable_params": sum(int(x.size) for x in jax.tree.leaves(layout.abstract.params)),
      "param_bytes": tree_bytes(layout.abstract.params),
      "frozen_bytes": tree_bytes(layout.abstract.frozen[STUDENT]),
      "opt_state_bytes": tree_bytes(layout.abstract.opt_state),
      "opt_state_bytes_per_device": tree_bytes(layout.abstract.opt_state, sh.opt_state),
      "state_bytes_per_device": tree_bytes(layout.abstract, sh),
      "batch_bytes_per_device": batch_bytes,
      **{f"{k}_bytes": v for k, v in mem.items()},
      # XLA's usual peak estimate for one call: live inputs + outputs + scratch, less donated
      # buffers reused for outputs.
      "compiled_total_bytes": mem["argument"] + mem["output"] + mem["temp"] - mem["alias"],
      "flops": stats.get("flops"), "build_s": build_s,
      "model": common.config_summary(recipe.model_config)
      | {"tie_embeddings": recipe.model_config.tie_embeddings},
  }
  return stepper, row


def run_checks(rows: dict) -> list[dict]:
  """What must hold whatever the timings: facts of LoRA / QLoRA / QAT the figures show."""
  checks = []

  def check(ok: bool, text: str, **extra):
    checks.append({"check": text, "pass": bool(ok), **extra})

  ref = rows[REFERENCE]
  for name, r in rows.items():
    expected = r["state_bytes_per_device"] + r["batch_bytes_per_device"]
    check(r["argument_bytes"] == expected,
          f"{name}: XLA's per-device argument bytes = state + batch shards from the rules",
          xla=r["argument_bytes"], from_shardings=expected)
    check(r["final_loss"] < r["first_loss"] and r["first_loss"] == r["first_loss"],
          f"{name}: the loss falls on the repeated batch", first=r["first_loss"],
          final=r["final_loss"])
  for name in ("qat_int8", "qat_int4"):
    if name in rows:
      r = rows[name]
      check(r["trainable_params"] == ref["trainable_params"],
            f"{name}: same trainable parameters as plain (fake quant adds no state)")
      check(r["first_loss"] != ref["first_loss"],
            f"{name}: the forward is fake-quantized (first loss differs from plain)",
            rel_diff=abs(r["first_loss"] - ref["first_loss"]) / ref["first_loss"])
  if "lora" in rows:
    r = rows["lora"]
    rel = abs(r["first_loss"] - ref["first_loss"]) / ref["first_loss"]
    check(rel <= 1e-5, "lora: first loss equals plain's (B starts at zero)", rel_diff=rel)
    check(r["trainable_params"] < ref["trainable_params"] / 4,
          "lora: adapters are a small part of the parameters")
  if "lora" in rows and "qlora_nf4" in rows:
    check(rows["qlora_nf4"]["trainable_params"] == rows["lora"]["trainable_params"],
          "qlora_nf4: same adapters as lora")
    check(rows["qlora_nf4"]["frozen_bytes"] < rows["lora"]["frozen_bytes"],
          "qlora_nf4: frozen base stored smaller than lora's fp32 base")
  return checks


def parse_args():
  """Parsed before JAX is imported: `--devices` sets how many CPU devices it simulates."""
  parser = subproc.base_parser(__doc__.splitlines()[0], default_devices=8)
  parser.add_argument("--model", choices=("tiny", "demo_student"), default=None,
                      help="model preset (default demo_student; tiny with --quick)")
  parser.add_argument("--batch", type=int, default=None, help="global batch (sequences)")
  parser.add_argument("--seq-len", dest="seq_len", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None, help="interleaved rounds")
  parser.add_argument("--steps-per-rep", dest="steps_per_rep", type=int, default=None)
  parser.add_argument("--strategy", default="fsdp", help="partitioning preset")
  parser.add_argument("--mesh-model", dest="mesh_model", type=int, default=1,
                      help="devices on the 'model' axis (the rest go to 'data')")
  parser.add_argument("--only", default="", help=f"comma list from {','.join(VARIANTS)}")
  return subproc.parse_args_before_jax(parser)


def time_variants(steppers: dict, rows: dict, s: dict) -> None:
  """Adds each variant's timings, losses and ratios to plain (time and memory) to its row."""
  from benchmarks import common

  common.timed_rounds(steppers, rows, reps=s["reps"], steps_per_rep=s["steps_per_rep"],
                      warmup_steps=2, tokens_per_step=s["batch"] * s["seq_len"],
                      reference=REFERENCE)
  for r in rows.values():
    r["ratio_to_plain"] = r.pop("ratio")
    r["memory_ratio_to_plain"] = (r["compiled_total_bytes"]
                                  / rows[REFERENCE]["compiled_total_bytes"])


def print_results(rows: dict, checks: list[dict]) -> None:
  """The table and the checks for the console; the JSON carries the same figures in full."""
  from benchmarks import common

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

  import jax

  from benchmarks import common

  print(f"{s['model']}: global batch {s['batch']} x {s['seq_len']}, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, strategy {s['strategy']}, "
        f"{s['reps']} rounds x {s['steps_per_rep']} steps", flush=True)
  steppers, rows = {}, {}
  for name in s["variants"]:
    steppers[name], rows[name] = build_variant(name, s)
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
