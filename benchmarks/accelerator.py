"""One chip: a ~1B model's train step and a distillation step, tokens/s and MFU against the peak.

  python benchmarks/accelerator.py [--quick]

On a GPU or TPU (jax.default_backend() in gpu/tpu): Llama 3.2 1B shapes in bf16 (random weights),
on one chip, where every partitioning preset is the same layout (dp on a 1x1 mesh): the largest
batch of `--seq-len` tokens per sequence whose compiled step fits the chip's memory, with full
rematerialisation; step time, tokens/s and MFU against the chip's datasheet peak
(distillax.framework.throughput). Then the same for a distillation step (LogitKD, chunked logits)
with a frozen teacher of twice the student's parameters (the student's shapes with more layers).
On CPU it runs the demo pair (demo_student, demo_teacher) instead, with MFU against the host's
measured matmul peak. One command, well under 8 minutes on an H200 including compilation.

Writes benchmarks/results/accelerator.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import subproc  # noqa: E402

MEMORY_HEADROOM = 0.85  # use at most this fraction of the chip's memory for the compiled step


def teacher_twice(student_cfg):
  """The student's shapes with as many layers as make about twice its parameters."""
  from distillax.models import param_count

  total = param_count(student_cfg)
  per_layer = (param_count(student_cfg.replace(num_layers=2)) -
               param_count(student_cfg.replace(num_layers=1)))
  rest = total - per_layer * student_cfg.num_layers
  layers = max(student_cfg.num_layers + 1, round((2 * total - rest) / per_layer))
  return student_cfg.replace(num_layers=layers)


def settings(backend: str, quick: bool) -> dict:
  from distillax.models import get_preset

  if quick:
    student = get_preset("tiny")
    return {"student": student, "teacher": teacher_twice(student), "batches": (4,),
            "seq_len": 32, "steps": 2, "reps": 2, "chunk_size": None}
  if backend in ("gpu", "tpu"):
    student = get_preset("llama3.2-1b", remat="full")
    return {"student": student, "teacher": teacher_twice(student), "batches": (8, 4, 2, 1),
            "seq_len": 2048, "steps": 5, "reps": 3, "chunk_size": 4096}
  return {"student": get_preset("demo_student"), "teacher": get_preset("demo_teacher"),
          "batches": (8,), "seq_len": 256, "steps": 2, "reps": 3, "chunk_size": None}


def memory_limit() -> float | None:
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - CPU and some runtimes have none
    return None
  return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


def numpy_matmul_flops(n: int = 512, repeats: int = 3) -> float:
  """numpy's BLAS on one n x n fp32 matmul, best of `repeats`: a second opinion on the CPU
  probe's peak (distillax.framework.throughput). Two timings compared, so it is reported here
  rather than asserted in a test; on a busy host the two can differ by several times."""
  import numpy as np

  a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
  best = 0.0
  for _ in range(repeats):
    start = time.perf_counter()
    a @ a
    best = max(best, 2 * n ** 3 / max(time.perf_counter() - start, 1e-9))
  return best


def compiled_bytes(stats: dict) -> float:
  return (stats.get("argument_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0) +
          stats.get("output_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))


def prepare(label, cfg, teacher_cfg, objective, s, limit) -> dict:
  """Compiles the step for the largest batch that fits and places a fresh state for it."""
  from benchmarks import common
  from distillax.models import abstract_model, create_model

  extras_abstract = {"teacher": abstract_model(teacher_cfg)} if teacher_cfg else {}
  tried = []
  for batch in s["batches"]:
    start = time.perf_counter()
    built = common.build(cfg, "dp", (1, 1), "jit", batch, s["seq_len"], abstract=True,
                         objective=objective, extras=extras_abstract)
    need = compiled_bytes(built.engine.runner.stats)
    tried.append({"batch": batch, "compiled_bytes": need,
                  "compile_s": built.engine.runner.compile_seconds})
    print(f"  {label}: batch {batch} x {s['seq_len']} compiled in "
          f"{time.perf_counter() - start:.0f}s, needs {common.fmt_bytes(need)} per chip"
          + (f" of {common.fmt_bytes(limit)}" if limit else ""), flush=True)
    if limit is None or need <= MEMORY_HEADROOM * limit:
      break
  else:
    return {"label": label, "error": "no batch fits in memory", "tried": tried}
  mesh, rules = built.engine.mesh, built.engine.rules
  student = create_model(cfg, mesh=mesh, rules=rules, seed=0)
  extras = ({"teacher": create_model(teacher_cfg, mesh=mesh, rules=rules, seed=1)}
            if teacher_cfg else {})
  data = common.packed_batch(batch, s["seq_len"], cfg.vocab_size, seed=1)
  return {"label": label, "cfg": cfg, "teacher_cfg": teacher_cfg, "batch": batch,
          "tried": tried, "stepper": common.Stepper(built.engine, student, data, extras=extras)}


def time_steps(prepared: list[dict], s, peak) -> list[dict]:
  """Times the prepared steps round-robin (one or several) and returns their result rows."""
  from benchmarks import common
  from distillax.framework import flops as flops_lib
  from distillax.framework import throughput

  ready = [p for p in prepared if "error" not in p]
  times, warmup = common.interleaved({p["label"]: p["stepper"] for p in ready}, reps=s["reps"],
                                     steps_per_rep=s["steps"])
  rows = []
  for p in prepared:
    if "error" in p:
      rows.append(p)
      continue
    label, cfg, teacher_cfg, batch = p["label"], p["cfg"], p["teacher_cfg"], p["batch"]
    step_s = common.median(times[label])
    flops = flops_lib.train_step_flops(cfg, batch, s["seq_len"], teacher_cfg)["total"]
    tokens = batch * s["seq_len"]
    rows.append({
        "label": label, "batch": batch, "seq_len": s["seq_len"], "tokens_per_step": tokens,
        "step_s": step_s, "step_s_all": times[label], "tokens_per_s": tokens / step_s,
        "model_flops_per_step": flops, "tflops_per_s": flops / step_s / 1e12,
        "mfu": throughput.mfu(flops, step_s, 1, peak), "compile_s": p["tried"][-1]["compile_s"],
        "compiled_bytes": p["tried"][-1]["compiled_bytes"], "warmup_s": warmup[label],
        "final_loss": p["stepper"].losses[-1], "tried": p["tried"], "params": _params(cfg),
        "teacher_params": _params(teacher_cfg) if teacher_cfg else None})
  return rows


def _params(cfg) -> int:
  from distillax.models import param_count
  return param_count(cfg)


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0], default_devices=1)
  args = subproc.parse_args_before_jax(parser)
  start = time.perf_counter()

  import jax

  from benchmarks import common
  from distillax.distill import LogitKD, make_distill_objective
  from distillax.framework import format_count, throughput
  from distillax.trainers import lm_objective

  backend = jax.default_backend()
  s = settings(backend, args.quick)
  peak, peak_source = throughput.peak_flops_per_device()
  limit = memory_limit()
  print(f"{backend}: {jax.devices()[0].device_kind}; peak {peak_source}", flush=True)
  numpy_flops = numpy_matmul_flops() if backend == "cpu" else None
  if numpy_flops is not None:
    print(f"cpu cross-check: numpy BLAS fp32 matmul {numpy_flops / 1e9:.1f} GFLOP/s, the probe "
          f"{throughput.cpu_peak_flops() / 1e9:.1f} GFLOP/s per host", flush=True)
  if args.quick:
    print("quick: tiny student, teacher with twice its parameters", flush=True)
  elif backend not in ("gpu", "tpu"):
    print("no accelerator: running the CPU demo sizes instead", flush=True)
  kd = make_distill_objective(LogitKD(temperature=2.0, alpha=0.7), chunk_size=s["chunk_size"])
  jobs = [("train", s["student"], None, lm_objective),
          ("distill", s["student"], s["teacher"], kd)]
  if limit is None:  # host memory: both steps stay resident and are timed round-robin
    rows = time_steps([prepare(*job, s, limit) for job in jobs], s, peak)
  else:  # one chip's memory: one step resident at a time, its buffers freed before the next
    rows = []
    for job in jobs:
      rows += time_steps([prepare(*job, s, limit)], s, peak)

  print(f"\none {jax.devices()[0].device_kind}, dp on a 1x1 mesh, "
        f"{s['student'].param_dtype} params, {s['student'].dtype} compute, "
        f"remat {s['student'].remat}")
  ok_rows = [r for r in rows if "error" not in r]
  print(common.format_table(ok_rows, [
      ("step", lambda r: r["label"]),
      ("student", lambda r: format_count(r["params"])),
      ("teacher", lambda r: format_count(r["teacher_params"]) if r["teacher_params"] else "-"),
      ("batch", lambda r: f"{r['batch']}x{r['seq_len']}"),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
      ("TFLOP/s", lambda r: f"{r['tflops_per_s']:.3g}"),
      ("MFU", lambda r: "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"),
      ("compile s", lambda r: f"{r['compile_s']:.0f}"),
      ("memory", lambda r: common.fmt_bytes(r["compiled_bytes"]))]))
  for r in rows:
    if "error" in r:
      print(f"FAIL  {r['label']}: {r['error']}")
  payload = {"benchmark": "accelerator", "quick": args.quick, "machine": common.machine_info(),
             "backend": backend, "peak_flops_per_device": peak, "peak_source": peak_source,
             "numpy_matmul_flops": numpy_flops,
             "memory_limit_bytes": limit, "student": common.config_summary(s["student"]),
             "teacher": common.config_summary(s["teacher"]), "rows": rows,
             "wall_s": time.perf_counter() - start}
  path = common.write_json(args.out, "accelerator", payload)
  print(f"wrote {path} ({time.perf_counter() - start:.0f}s)")
  return 0 if len(ok_rows) == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
