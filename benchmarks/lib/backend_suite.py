"""One model, one batch, every backend and preset: step time, compile time, memory, ratios.

Shared by `step.py` (step times on 8 simulated devices) and `backends.py` (the full comparison).
All runs start from the same seed and take the same steps on the same batch, so besides timing
them side by side we can check that they computed the same losses.
"""

from __future__ import annotations

from typing import Any

import jax

from benchmarks.lib import common
from distillax.models import TransformerConfig

REFERENCE = "jit/dp"
WARMUP_STEPS = 2


def variants(cfg: TransformerConfig, n: int) -> list[tuple[str, str, str, tuple[int, int]]]:
  """(name, backend, strategy, mesh shape) of every backend/preset pair that runs on n devices."""
  out = []
  for strategy in common.STRATEGIES:
    shape = common.mesh_shape_for(strategy, n, cfg)
    if shape is not None:
      out.append((f"jit/{strategy}", "jit", strategy, shape))
  for backend in ("shard_map", "pmap", "vmap"):
    out.append((backend, backend, "dp", (n, 1)))
  return out


def run(cfg: TransformerConfig, *, batch: int, seq_len: int, reps: int, steps_per_rep: int,
        only: tuple[str, ...] | None = None, log=print) -> dict[str, Any]:
  """Times every variant (or those named in `only`) round-robin; rows + the loss check."""
  n = jax.device_count()
  data = common.packed_batch(batch, seq_len, cfg.vocab_size, seed=1)
  steppers, rows = {}, {}
  model = common.host_model(cfg)
  for name, backend, strategy, shape in variants(cfg, n):
    if only and name not in only:
      continue
    built = common.build(cfg, strategy, shape, backend, batch, seq_len, model=model)
    stats = built.engine.runner.stats
    rows[name] = {
        "variant": name, "backend": backend, "strategy": strategy,
        "mesh": f"{shape[0]}x{shape[1]}", "compile_s": built.engine.runner.compile_seconds,
        "build_s": built.build_seconds,
        "argument_bytes": stats.get("argument_size_in_bytes"),
        "temp_bytes": stats.get("temp_size_in_bytes"),
        "output_bytes": stats.get("output_size_in_bytes"),
    }
    steppers[name] = common.Stepper(built.engine, built.model, data)
    log(f"  built {name:14s} mesh {shape[0]}x{shape[1]}  compile "
        f"{built.engine.runner.compile_seconds:.1f}s")
  times, warmup = common.interleaved(steppers, reps=reps, steps_per_rep=steps_per_rep,
                                     warmup_steps=WARMUP_STEPS)
  reference = REFERENCE if REFERENCE in times else next(iter(times))
  tokens = batch * seq_len
  for name, row in rows.items():
    row["step_s"] = common.median(times[name])
    row["step_s_all"] = times[name]
    row["ratio_to_" + reference.replace("/", "_")] = common.paired_ratio(times, name, reference)
    row["tokens_per_s"] = tokens / row["step_s"]
    row["final_loss"] = steppers[name].losses[-1]
    row["warmup_s"] = warmup[name]
    if row["backend"] == "pmap":  # compiled lazily by its first calls, not ahead of time
      row["compile_s"] = max(0.0, warmup[name] - WARMUP_STEPS * row["step_s"])
      row["compile_s_estimated"] = True
  ref_loss = rows[reference]["final_loss"]
  worst = max(abs(r["final_loss"] - ref_loss) / max(abs(ref_loss), 1e-12) for r in rows.values())
  check = {"check": "every backend/preset reaches the same loss after the same steps",
           "max_rel_diff": worst, "tolerance": 1e-4, "pass": bool(worst <= 1e-4)}
  return {"model": common.config_summary(cfg), "devices": n, "batch": batch, "seq_len": seq_len,
          "reps": reps, "steps_per_rep": steps_per_rep,
          "steps_taken": WARMUP_STEPS + reps * steps_per_rep, "reference": reference,
          "rows": list(rows.values()), "loss_check": check}


def ratio_key(result: dict[str, Any]) -> str:
  return "ratio_to_" + result["reference"].replace("/", "_")
