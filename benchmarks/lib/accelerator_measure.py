"""What one row of benchmarks/accelerator.py measures, in the row's own process
(lib/accelerator_row.py): the probe (versions, devices, a bf16 matmul rate) or one train/KD
step, compiled, checked against the chip's memory, run and timed, with its MFU."""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp

from benchmarks.lib import common
from distillax.distill import LogitKD, make_distill_objective
from distillax.framework import flops, throughput
from distillax.framework.vocab_chunks import AUTO
from distillax.models import abstract_model, create_model, get_preset, param_count
from distillax.models.attention import impl as attention_impl
from distillax.trainers import lm_objective

MEMORY_HEADROOM = 0.95  # a compiled step needing more of the chip's bytes_limit is not run


def matmul_probe(backend: str) -> dict:
  """Best and median bf16 n x n x n matmul rate (2 n^3 FLOPs each), the first call untimed."""
  n, reps = (8192, 10) if backend in ("gpu", "tpu") else (256, 5)
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  rates = []
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    rates.append(2.0 * n ** 3 / max(time.perf_counter() - start, 1e-9))
  rates.sort()
  return {"n": n, "reps": reps, "dtype": "bfloat16", "best_flops_per_s": rates[-1],
          "median_flops_per_s": rates[len(rates) // 2]}


def probe(row, platform_info: dict, versions: dict) -> None:
  """The row file `row` (accelerator_row.RowFile) gets the environment, then the matmul rate."""
  peak, source = throughput.peak_flops_per_device()
  stats = _memory_stats()
  row.update(status="probing", python=platform.python_version(), versions=versions,
             jax_version=jax.__version__, **platform_info, device_count=jax.device_count(),
             peak_flops_per_device=peak, peak_source=source,
             memory_limit_bytes=stats.get("bytes_limit"),
             env={k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS",
                                                  "JAX_PLATFORMS", "PYTHONPATH")})
  row.update(status="ok", matmul=matmul_probe(platform_info["backend"]))
  m = row.data["matmul"]
  print(f"bf16 {m['n']}^3 matmul: best {m['best_flops_per_s'] / 1e12:.1f} TFLOP/s, median "
        f"{m['median_flops_per_s'] / 1e12:.1f} (datasheet: {source})", flush=True)


def _memory_stats() -> dict:
  try:
    return dict(jax.devices()[0].memory_stats() or {})
  except Exception:  # noqa: BLE001 - CPU and some runtimes have none
    return {}


def model_configs(spec: dict):
  """(student, teacher or None): the preset with remat, attention and overrides applied."""
  fields = {"remat": spec["remat"], "attention_impl": spec.get("attention_impl", "auto"),
            **spec.get("overrides", {})}  # --model FIELD=VALUE wins
  cfg = get_preset(spec["preset"], **fields)
  return cfg, (teacher_twice(cfg) if spec["kind"] == "distill" else None)


def attention_choice(cfg, seq_len: int) -> dict:
  """What `model.attention_impl` runs for the student's training attention on this platform
  (packed documents, so with segment ids), and why: 'auto' rows say which kernel they timed."""
  needs = attention_impl.AttentionNeeds(
      query_len=seq_len, key_len=seq_len, segments=True, window=cfg.sliding_window is not None,
      softcap=cfg.attn_logit_softcap is not None, dtype=cfg.dtype, head_dim=cfg.head_dim)
  impl, why = attention_impl.choose(cfg.attention_impl, jax.default_backend(), needs)
  return {"attention_ran": impl, "attention_why": why}


def teacher_twice(student_cfg):
  """The student's shapes with as many layers as make about twice its parameters."""
  total = param_count(student_cfg)
  per_layer = (param_count(student_cfg.replace(num_layers=2)) -
               param_count(student_cfg.replace(num_layers=1)))
  rest = total - per_layer * student_cfg.num_layers
  layers = max(student_cfg.num_layers + 1, round((2 * total - rest) / per_layer))
  return student_cfg.replace(num_layers=layers)


def row_flops(cfg, teacher_cfg, batch: int, seq_len: int) -> dict:
  """Model FLOPs of one step in the two conventions MFU is quoted in.

  causal: the matmuls a causal kernel must do (half of each T x T attention product; the
  framework's MFU, as MaxText counts it). PaLM (Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T
  per token, N the matmul weights, attention over the full T x T, which is the same count with
  causal=False; the teacher's forward adds 2N + 4 L H Q T per token. PaLM's is the larger
  figure, so its MFU is the higher one.
  """
  return {"batch": batch, "seq_len": seq_len, "tokens_per_step": batch * seq_len,
          "params": param_count(cfg),
          "teacher_params": param_count(teacher_cfg) if teacher_cfg else None,
          "flops_causal": flops.train_step_flops(cfg, batch, seq_len, teacher_cfg)["total"],
          "flops_palm": flops.train_step_flops(cfg, batch, seq_len, teacher_cfg,
                                               causal=False)["total"]}


def step_row(row, spec: dict) -> None:
  """Compiles the step, runs it if it fits the chip, and records times, MFU and memory."""
  cfg, teacher_cfg = model_configs(spec)
  batch, seq_len = spec["batch"], spec["seq_len"]
  objective = (make_distill_objective(LogitKD(temperature=2.0, alpha=0.7), chunk_size=AUTO,
                                      metrics=False) if teacher_cfg else lm_objective)
  built = common.build(cfg, "dp", (1, 1), "jit", batch, seq_len, abstract=True,
                       objective=objective,
                       extras={"teacher": abstract_model(teacher_cfg)} if teacher_cfg else {})
  stats, limit = built.engine.runner.stats, _memory_stats().get("bytes_limit")
  need = common.peak_bytes(stats)
  row.update(status="compiled", compile_s=built.engine.runner.compile_seconds,
             compiled_bytes=need, temp_bytes=stats.get("temp_size_in_bytes"),
             memory_limit_bytes=limit, student=common.config_summary(cfg),
             teacher=common.config_summary(teacher_cfg) if teacher_cfg else None,
             **row_flops(cfg, teacher_cfg, batch, seq_len), **attention_choice(cfg, seq_len))
  print(f"compiled in {row.data['compile_s']:.0f}s, needs {common.fmt_bytes(need)}"
        + (f" of {common.fmt_bytes(limit)}" if limit else ""), flush=True)
  if limit and need > MEMORY_HEADROOM * limit:
    row.update(status="does_not_fit", error=f"needs {common.fmt_bytes(need)}, more than "
               f"{MEMORY_HEADROOM:.0%} of the chip's {common.fmt_bytes(limit)}")
    return
  mesh, rules = built.engine.mesh, built.engine.rules
  extras = ({"teacher": create_model(teacher_cfg, mesh=mesh, rules=rules, seed=1)}
            if teacher_cfg else {})
  stepper = common.Stepper(built.engine, create_model(cfg, mesh=mesh, rules=rules, seed=0),
                           common.packed_batch(batch, seq_len, cfg.vocab_size, seed=1),
                           extras=extras)
  times, warmup = common.interleaved({"step": stepper}, reps=spec["reps"],
                                     steps_per_rep=spec["steps"])
  step_s = common.median(times["step"])
  peak, _ = throughput.peak_flops_per_device()
  f = row.data
  row.update(status="ok", step_s=step_s, step_s_all=times["step"], warmup_s=warmup["step"],
             tokens_per_s=f["tokens_per_step"] / step_s,
             tflops_per_s_causal=f["flops_causal"] / step_s / 1e12,
             mfu_causal=throughput.mfu(f["flops_causal"], step_s, 1, peak),
             mfu_palm=throughput.mfu(f["flops_palm"], step_s, 1, peak),
             peak_flops_per_device=peak, peak_bytes_in_use=_memory_stats().get(
                 "peak_bytes_in_use"), losses=stepper.losses, final_loss=stepper.losses[-1])
