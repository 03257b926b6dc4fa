"""Scaling over devices: memory, FLOPs, collectives and speed of every preset and model size.

  python benchmarks/scaling.py [--quick]

For each model size and partitioning preset on 1, 2, 4, 8 (and 64) simulated CPU devices, one
child process per device count compiles the framework's train step and reads, per device: memory
from the compiled executable (arguments, temporaries, outputs), model FLOPs per step (analytic),
the collectives XLA inserted and the bytes they move per step (from the compiled HLO, loops
weighted by their trip counts), and, for the sizes that run here, step time, tokens/s per device
and MFU. The Llama shapes are compiled only: their modules are abstract (nnx.eval_shape) and their
batches ShapeDtypeStructs, so no parameter is ever allocated.

Checks, printed as PASS/FAIL: fsdp keeps params + optimizer state per device within 5% of
total/N; tp keeps the weights it shards within 5% of their total / model-axis size; dp moves one
gradient all-reduce per step (all-reduce bytes within [0.99, 1.01] of the fp32 gradient bytes).
Weak scaling: the global batch is `per_device_batch` sequences per device.

Writes benchmarks/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.lib import common, sharding_checks, subproc  # noqa: E402
from distillax.framework import flops as flops_lib  # noqa: E402
from distillax.framework import hlo, throughput  # noqa: E402
from distillax.models import get_preset  # noqa: E402

# name -> (per-device batch, sequence length, overrides)
MEASURED = {"tiny": (1, 128, {}), "demo_student": (1, 128, {}), "demo_teacher": (1, 128, {})}
COMPILE_ONLY = {"llama3.2-1b": (1, 2048, {"remat": "full"}),
                "llama3.1-8b": (1, 2048, {"remat": "full"})}
MEASURED_COUNTS = (1, 2, 4, 8)
COMPILE_COUNTS = {"llama3.2-1b": (1, 2, 4, 8, 64), "llama3.1-8b": (8, 64)}
QUICK_MEASURED = {"tiny": (2, 32, {})}
# --quick checks the script (the smoke test): the compile-only path at one of demo_student's
# six layers compiles in a quarter of the time (0.9 s against 3.9 s here), with the same checks.
QUICK_COMPILE = {"demo_student": (1, 64, {"num_layers": 1})}
QUICK_COUNTS = (2,)
QUICK_COMPILE_STRATEGIES = ("fsdp",)


def plan(quick: bool) -> dict[int, dict[str, list[str]]]:
  """device count -> {'measured': [...], 'compile': [...]} model names."""
  out: dict[int, dict[str, list[str]]] = {}
  if quick:
    for n in QUICK_COUNTS:
      out[n] = {"measured": list(QUICK_MEASURED), "compile": list(QUICK_COMPILE)}
    return out
  for n in MEASURED_COUNTS:
    out.setdefault(n, {"measured": [], "compile": []})["measured"] = list(MEASURED)
  for name, counts in COMPILE_COUNTS.items():
    for n in counts:
      out.setdefault(n, {"measured": [], "compile": []})["compile"].append(name)
  return dict(sorted(out.items()))


def one_config(name, cfg, strategy, shape, per_device_batch, seq_len, measure, reps, peak,
               model=None):
  """Compile (and maybe run) one model x preset x mesh; everything the table and checks need."""
  n = shape[0] * shape[1]
  batch = per_device_batch * n
  built = common.build(cfg, strategy, shape, "jit", batch, seq_len, abstract=not measure,
                       model=model)
  engine = built.engine
  stats = dict(engine.runner.stats)
  coll = hlo.collective_stats(engine.runner.compiled_text())
  sb = sharding_checks.state_bytes(engine)
  grad_bytes = float(sum(a.size * 4 for a in jax.tree.leaves(engine.layout.abstract.params)))
  row = {"model": name, "strategy": strategy, "devices": n, "mesh": f"{shape[0]}x{shape[1]}",
         "mode": "measured" if measure else "compile-only", "global_batch": batch,
         "seq_len": seq_len, "compile_s": engine.runner.compile_seconds,
         "memory": {k: stats.get(k) for k in ("argument_size_in_bytes", "temp_size_in_bytes",
                                              "output_size_in_bytes", "alias_size_in_bytes")},
         "model_flops_per_step": flops_lib.train_step_flops(cfg, batch, seq_len)["total"],
         "xla_flops_per_device": stats.get("flops"), "collectives": coll, "state_bytes": sb,
         "grad_bytes_fp32": grad_bytes}
  m = row["memory"]
  row["memory_per_device"] = ((m["argument_size_in_bytes"] or 0) + (m["temp_size_in_bytes"] or 0)
                              + (m["output_size_in_bytes"] or 0)
                              - (m["alias_size_in_bytes"] or 0))
  checks = []
  if strategy in ("fsdp", "fsdp_tp") and n > 1:
    checks.append(sharding_checks.fsdp_check(sb, n))
  if strategy == "tp" and shape[1] > 1:  # (fsdp_tp: covered by the total/N check above)
    checks.append(sharding_checks.tp_check(sb, shape[1]))
  if strategy == "dp" and n > 1:
    checks.append(sharding_checks.dp_check(coll["all-reduce"]["bytes"], grad_bytes))
  row["checks"] = checks
  if measure:
    data = common.packed_batch(batch, seq_len, cfg.vocab_size, seed=1)
    stepper = common.Stepper(engine, built.model, data)
    times, _ = common.interleaved({"step": stepper}, reps=reps, steps_per_rep=1,
                                  warmup_steps=1)  # compiled ahead of time: no lazy compile
    step_s = common.median(times["step"])
    row.update(step_s=step_s, step_s_all=times["step"],
               tokens_per_s_per_device=batch * seq_len / step_s / n,
               mfu=throughput.mfu(row["model_flops_per_step"], step_s, n, peak),
               final_loss=stepper.losses[-1])
  return row


def child(args) -> dict:
  """Every configuration of this process's device count."""
  n = jax.device_count()
  todo = plan(args.quick)[n]
  peak, peak_source = throughput.peak_flops_per_device()
  measured = QUICK_MEASURED if args.quick else MEASURED
  compiled = QUICK_COMPILE if args.quick else COMPILE_ONLY
  reps = 2 if args.quick else 3
  jobs = [(name, measured[name], True) for name in todo["measured"]]
  jobs += [(name, compiled[name], False) for name in todo["compile"]]
  rows = []
  for name, (per_device_batch, seq_len, overrides), measure in jobs:
    cfg = get_preset(name, **overrides)
    # On one device every preset is the same layout: compile it once, as dp.
    strategies = ("dp",) if n == 1 else common.STRATEGIES
    if args.quick and not measure:
      strategies = QUICK_COMPILE_STRATEGIES
    model = common.host_model(cfg) if measure else None
    for strategy in strategies:
      shape = common.mesh_shape_for(strategy, n, cfg)
      if shape is None:
        continue
      start = time.perf_counter()
      row = one_config(name, cfg, strategy, shape, per_device_batch, seq_len, measure, reps, peak,
                       model)
      rows.append(row)
      timing = f", step {row['step_s'] * 1e3:.1f} ms" if measure else ""
      print(f"{name:13s} {strategy:8s} {row['mesh']:5s} compile {row['compile_s']:.1f}s"
            f"{timing} ({time.perf_counter() - start:.1f}s)", flush=True)
  return {"devices": n, "rows": rows, "peak_flops_per_device": peak, "peak_source": peak_source,
          "machine": common.machine_info()}


def check_cell(row) -> str:
  if not row["checks"]:
    return "-"
  return " ".join(f"{'PASS' if c['pass'] else 'FAIL'}({c['ratio']:.3f})" for c in row["checks"])


def print_tables(rows) -> None:
  def mfu_cell(r):
    return "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"

  for model in dict.fromkeys(r["model"] for r in rows):
    sub = [r for r in rows if r["model"] == model]
    per_device = sub[0]["global_batch"] // sub[0]["devices"]
    print(f"\n{model} ({sub[0]['mode']}, global batch = {per_device} x devices, "
          f"seq {sub[0]['seq_len']})")
    print(common.format_table(sub, [
        ("N", lambda r: r["devices"]), ("preset", lambda r: r["strategy"]),
        ("mesh", lambda r: r["mesh"]),
        ("args", lambda r: common.fmt_bytes(r["memory"]["argument_size_in_bytes"])),
        ("temp", lambda r: common.fmt_bytes(r["memory"]["temp_size_in_bytes"])),
        ("out", lambda r: common.fmt_bytes(r["memory"]["output_size_in_bytes"])),
        ("params+opt/dev", lambda r: common.fmt_bytes(r["state_bytes"]["params_per_device"] +
                                                      r["state_bytes"]["opt_per_device"])),
        ("GFLOP/step", lambda r: f"{r['model_flops_per_step'] / 1e9:.3g}"),
        ("collectives count/MiB per step", lambda r: hlo.summarize(r["collectives"])),
        ("compile s", lambda r: f"{r['compile_s']:.1f}"),
        ("step ms", lambda r: common.fmt_ms(r.get("step_s"))),
        ("tok/s/dev", lambda r: f"{r['tokens_per_s_per_device']:.0f}"
         if r.get("step_s") else "n/a"),
        ("MFU", mfu_cell), ("checks", check_cell)]))


def plot(rows, path: Path) -> None:
  """Memory per device and step time vs devices, one line per preset, one row per model."""
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.2 * len(models)), squeeze=False)
  for i, model in enumerate(models):
    sub = [r for r in rows if r["model"] == model]
    unit, scale = ("GiB", 2**30) if max(r["memory_per_device"] for r in sub) > 4 * 2**30 else (
        "MiB", 2**20)
    single = [r for r in sub if r["devices"] == 1]  # one layout on one device: every line's start
    for strategy in ("dp", "fsdp", "tp", "fsdp_tp"):
      pts = sorted(single + [r for r in sub if r["strategy"] == strategy and r["devices"] > 1],
                   key=lambda r: r["devices"])
      if len(pts) < 1 or not any(r["strategy"] == strategy for r in pts):
        continue
      xs = [r["devices"] for r in pts]
      axes[i, 0].plot(xs, [r["memory_per_device"] / scale for r in pts], marker="o",
                      label=strategy)
      timed = [r for r in pts if r.get("step_s")]
      if timed:
        axes[i, 1].plot([r["devices"] for r in timed], [r["step_s"] * 1e3 for r in timed],
                        marker="o", label=strategy)
    axes[i, 0].set_title(f"{model}: memory per device ({sub[0]['mode']})")
    axes[i, 0].set_ylabel(unit)
    axes[i, 1].set_title(f"{model}: step time")
    axes[i, 1].set_ylabel("ms")
    if not any(r.get("step_s") for r in sub):
      axes[i, 1].text(0.5, 0.5, "compile only", ha="center", va="center",
                      transform=axes[i, 1].transAxes)
    for ax in axes[i]:
      ax.set_xscale("log", base=2)
      ax.set_xlabel("devices")
      if ax.lines:
        ax.legend(fontsize=8)
  fig.suptitle("distillax scaling (simulated CPU devices; weak scaling, batch per device fixed)")
  fig.tight_layout(rect=(0, 0, 1, 0.98))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--replot", action="store_true",
                      help="only redraw the tables and scaling.png from an existing scaling.json")
  args = subproc.parse_args(parser)
  if args.child_out:
    subproc.write_child_result(args.child_out, child(args))
    return 0

  if args.replot:
    rows = json.loads((Path(args.out) / "scaling.json").read_text())["rows"]
    print_tables(rows)
    png = Path(args.out) / "scaling.png"
    plot(rows, png)
    print(f"wrote {png}")
    return 0

  start = time.perf_counter()
  todo = plan(args.quick)
  children = []
  for n, parts in todo.items():
    print(f"== {n} device(s): measured {parts['measured'] or '-'}, compile-only "
          f"{parts['compile'] or '-'} ==", flush=True)
    children.append(subproc.run_child(Path(__file__), n, ["--quick"] if args.quick else []))
  rows = [r for c in children for r in c["rows"]]
  print_tables(rows)

  checks = [(r, c) for r in rows for c in r["checks"]]
  print("\nchecks")
  for r, c in checks:
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {r['model']} {r['strategy']} {r['mesh']}: "
          f"{c['check']}: ratio {c['ratio']:.3f}")
  failed = [c for _, c in checks if not c["pass"]]
  print(f"{len(checks) - len(failed)}/{len(checks)} checks pass")
  cut = None if args.quick else (
      "cut to fit ~10 minutes on 2 cores: llama3.1-8b compiled at 8 and 64 devices only; "
      "Llama shapes with remat='full', 1 sequence of 2048 tokens per device")
  if cut:
    print(f"note: {cut}")
  notes = ("CPU: simulated devices share the host's cores, so step time grows with devices "
           "(weak scaling on fixed hardware); MFU is against the host's measured fp32 matmul "
           "peak shared by the simulated devices. Collective bytes are logical buffer sizes per "
           "device from the HLO shapes (bytes = max(operand, result)), per step.")
  payload = {"benchmark": "scaling", "quick": args.quick, "machine": children[0]["machine"],
             "peak_flops_per_device": {str(c["devices"]): c["peak_flops_per_device"]
                                       for c in children},
             "peak_source": children[0]["peak_source"], "cut": cut, "notes": notes,
             "wall_s": time.perf_counter() - start, "rows": rows,
             "checks_passed": len(checks) - len(failed), "checks_total": len(checks)}
  path = common.write_json(args.out, "scaling", payload)
  print(f"wrote {path}")
  png = Path(args.out) / "scaling.png"
  plot(rows, png)
  print(f"wrote {png}")
  print(f"total {time.perf_counter() - start:.0f}s")
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
