"""One row of benchmarks/accelerator.py, in its own process: the probe, or one train/KD step.

  python benchmarks/accelerator_row.py --spec '{"kind": "train", ...}' --out ROW.json

accelerator.py starts one of these per row, under a time limit, so that a row that compiles for
too long, runs out of memory or crashes costs that row alone, and every row starts on an empty
chip: its `peak_bytes_in_use` is its own. The row's result is written to --out after each phase
(compiled, then timed), so a row killed at its limit still leaves what it had measured.

Kinds (the spec's "kind"):
- probe: Python/JAX/plugin versions, the devices, and a bf16 matmul rate (the chip's practical
  peak, next to the datasheet figure MFU is reported against).
- train / distill: the trainer's step (`build_engine`) for one preset, attention
  implementation, remat policy and batch, on a 1x1 mesh (dp). distill adds a frozen teacher of
  about twice the student's parameters and LogitKD on chunked logits (the trainer's objective).

Exit status 3 (and {"status": "refused"}) when --expect names a platform JAX is not running on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import subproc  # noqa: E402

REFUSED_EXIT = 3  # --expect-gpu/--expect-tpu, and JAX runs elsewhere
MEMORY_HEADROOM = 0.95  # a compiled step needing more of the chip's bytes_limit is not run
# Distributions whose versions the probe reports (absent ones are reported as None).
VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                    "jax-cuda12-pjrt", "libtpu", "flax", "optax", "orbax-checkpoint", "grain",
                    "qwix", "ml-collections", "clu", "numpy")
EXPECT_PLATFORMS = {"gpu": "gpu", "tpu": "tpu"}  # --expect value -> jax.default_backend()


class RowFile:
  """The row's result, rewritten whole after every phase (atomic: write then rename)."""

  def __init__(self, path: str, spec: dict):
    self.path = Path(path)
    self.data = {"name": spec.get("name", spec["kind"]), "spec": spec, "status": "started"}

  def update(self, **fields) -> None:
    self.data.update(fields)
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.data, default=_json_default) + "\n")
    os.replace(tmp, self.path)


def _json_default(x):
  if hasattr(x, "item"):
    return x.item()
  if isinstance(x, tuple):
    return list(x)
  return str(x)


def package_versions() -> dict[str, str | None]:
  from importlib import metadata

  out = {}
  for name in VERSION_PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def check_platform(expect: str | None) -> dict:
  """The backend JAX runs on; with `expect`, a one-line refusal if it is not that platform."""
  import jax

  try:
    devices = jax.devices()
    backend = jax.default_backend()
  except Exception as e:  # noqa: BLE001 - a plugin that fails to start: report it in one line
    return {"backend": None, "refused": f"JAX could not start a backend: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")}
  out = {"backend": backend, "devices": [str(d) for d in devices],
         "device_kind": devices[0].device_kind}
  if expect and backend != EXPECT_PLATFORMS[expect]:
    plugins = {k: v for k, v in package_versions().items()
               if v and ("cuda" in k or k == "libtpu")}
    out["refused"] = (f"--expect-{expect}, but JAX {jax.__version__} runs on {backend!r} "
                      f"(devices {out['devices']}; accelerator plugins installed: "
                      f"{plugins or 'none'}): it fell back to CPU, so no figure would be "
                      f"an accelerator's")
  return out


def matmul_probe(backend: str) -> dict:
  """Best and median bf16 n x n x n matmul rate (2 n^3 FLOPs each), the first call untimed."""
  import jax
  import jax.numpy as jnp

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


def probe(row: RowFile, platform_info: dict) -> None:
  import jax

  from distillax.framework import throughput

  peak, source = throughput.peak_flops_per_device()
  stats = _memory_stats()
  row.update(status="probing", python=platform.python_version(), versions=package_versions(),
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
  import jax
  try:
    return dict(jax.devices()[0].memory_stats() or {})
  except Exception:  # noqa: BLE001 - CPU and some runtimes have none
    return {}


def model_configs(spec: dict):
  """(student, teacher or None): the preset with remat, attention and overrides applied."""
  from distillax.models import get_preset

  fields = {"remat": spec["remat"], "attention_impl": spec.get("attention_impl", "auto"),
            **spec.get("overrides", {})}  # --model FIELD=VALUE wins
  cfg = get_preset(spec["preset"], **fields)
  return cfg, (teacher_twice(cfg) if spec["kind"] == "distill" else None)


def attention_choice(cfg, seq_len: int) -> dict:
  """What `model.attention_impl` runs for the student's training attention on this platform
  (packed documents, so with segment ids), and why: 'auto' rows say which kernel they timed."""
  import jax

  from distillax.models import attention_impl

  needs = attention_impl.AttentionNeeds(
      query_len=seq_len, key_len=seq_len, segments=True, window=cfg.sliding_window is not None,
      softcap=cfg.attn_logit_softcap is not None, dtype=cfg.dtype, head_dim=cfg.head_dim)
  impl, why = attention_impl.choose(cfg.attention_impl, jax.default_backend(), needs)
  return {"attention_ran": impl, "attention_why": why}


def teacher_twice(student_cfg):
  """The student's shapes with as many layers as make about twice its parameters."""
  from distillax.models import param_count

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
  from distillax.framework import flops
  from distillax.models import param_count

  return {"batch": batch, "seq_len": seq_len, "tokens_per_step": batch * seq_len,
          "params": param_count(cfg),
          "teacher_params": param_count(teacher_cfg) if teacher_cfg else None,
          "flops_causal": flops.train_step_flops(cfg, batch, seq_len, teacher_cfg)["total"],
          "flops_palm": flops.train_step_flops(cfg, batch, seq_len, teacher_cfg,
                                               causal=False)["total"]}


def compiled_bytes(stats: dict) -> float:
  return (stats.get("argument_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0) +
          stats.get("output_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))


def step_row(row: RowFile, spec: dict) -> None:
  """Compiles the step, runs it if it fits the chip, and records times, MFU and memory."""
  from benchmarks import common
  from distillax.distill import LogitKD, make_distill_objective
  from distillax.framework.vocab_chunks import AUTO
  from distillax.framework import throughput
  from distillax.models import abstract_model, create_model
  from distillax.trainers import lm_objective

  cfg, teacher_cfg = model_configs(spec)
  batch, seq_len = spec["batch"], spec["seq_len"]
  objective = (make_distill_objective(LogitKD(temperature=2.0, alpha=0.7), chunk_size=AUTO,
                                      metrics=False) if teacher_cfg else lm_objective)
  built = common.build(cfg, "dp", (1, 1), "jit", batch, seq_len, abstract=True,
                       objective=objective,
                       extras={"teacher": abstract_model(teacher_cfg)} if teacher_cfg else {})
  stats, limit = built.engine.runner.stats, _memory_stats().get("bytes_limit")
  need = compiled_bytes(stats)
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--spec", required=True, help="the row, as JSON")
  parser.add_argument("--out", required=True, help="where the row's JSON goes")
  parser.add_argument("--expect", choices=sorted(EXPECT_PLATFORMS), default=None)
  args = parser.parse_args(argv)
  subproc.ensure_repo_on_path()
  subproc.force_host_devices(1)  # one chip; on CPU, one host device
  spec = json.loads(args.spec)
  row = RowFile(args.out, spec)
  platform_info = check_platform(args.expect)
  if "refused" in platform_info:
    row.update(status="refused", **platform_info)
    return REFUSED_EXIT
  start = time.perf_counter()
  try:
    probe(row, platform_info) if spec["kind"] == "probe" else step_row(row, spec)
  except Exception as e:  # noqa: BLE001 - one row's failure is that row's result
    row.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    print(f"row {row.data['name']} failed: {type(e).__name__}: {e}"[:2000], flush=True)
  row.update(row_s=time.perf_counter() - start)
  return 0


if __name__ == "__main__":
  sys.exit(main())
