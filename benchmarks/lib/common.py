"""What every benchmark script shares: synthetic batches, engines, timing, tables, JSON.

This module imports JAX: a script imports it after its prologue (prologue.start). Every step
measured here is built by `distillax.framework.engine.build_engine`, the function the trainer
uses, so the figures are those of the step users run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax.data import batch as batch_spec
from distillax.framework import Engine, build_engine, optim
from distillax.models import TransformerConfig, abstract_model, create_model
from distillax.trainers import lm_objective

STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")


# ---- batches ------------------------------------------------------------------------------

def packed_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of two packed documents and a padded tail: segments, positions and a loss mask, the
  layout the data pipeline produces, so attention masking costs what it costs in training."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, vocab, (batch, seq_len)).astype(np.int32)
  targets = rng.integers(1, vocab, (batch, seq_len)).astype(np.int32)
  seg = np.zeros((batch, seq_len), np.int32)
  pos = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    cut = int(rng.integers(1, max(2, seq_len // 2)))
    end = int(rng.integers(max(cut + 1, seq_len - seq_len // 8), seq_len + 1))
    seg[b, :cut], seg[b, cut:end] = 1, 2
    pos[b, :cut], pos[b, cut:end] = np.arange(cut), np.arange(end - cut)
  return {batch_spec.INPUTS: inputs, batch_spec.TARGETS: targets,
          batch_spec.SEGMENT_IDS: seg, batch_spec.POSITIONS: pos,
          batch_spec.LOSS_MASK: (seg > 0).astype(np.float32)}


def batch_shapes(batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """Global batch shapes for compile-only runs (no data is ever created)."""
  ints = (batch_spec.INPUTS, batch_spec.TARGETS, batch_spec.SEGMENT_IDS,
          batch_spec.POSITIONS)
  out = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.int32) for k in ints}
  out[batch_spec.LOSS_MASK] = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)
  return out


# ---- meshes and engines -------------------------------------------------------------------

def _model_axis_ok(cfg: TransformerConfig, m: int) -> bool:
  return all(d % m == 0 for d in (cfg.num_heads, cfg.num_kv_heads, cfg.mlp_dim, cfg.vocab_size))


def mesh_shape_for(strategy: str, n: int, cfg: TransformerConfig) -> tuple[int, int] | None:
  """(data, model) for a preset on n devices, or None where it would only repeat another preset.

  dp and fsdp put every device on data. tp puts as many as the heads allow on model (the rest on
  data). fsdp_tp splits both ways, model = the largest power of two <= sqrt(n) the heads allow;
  with one axis left at 1 it is fsdp or tp again, so it is skipped.
  """
  if strategy in ("dp", "fsdp"):
    return (n, 1)
  candidates = [m for m in range(n, 0, -1) if n % m == 0 and _model_axis_ok(cfg, m)]
  if strategy == "tp":
    return (n // candidates[0], candidates[0])
  if strategy == "fsdp_tp":
    m = max([c for c in candidates if c * c <= n and c & (c - 1) == 0] or [1])
    return (n // m, m) if m > 1 and n // m > 1 else None
  raise ValueError(f"unknown strategy {strategy!r}")


def benchmark_optimizer():
  """The default AdamW config (clipping, masked decay, warmup-cosine): what users train with."""
  cfg = optim.default_optimizer_config()
  cfg.warmup_steps = 2
  return cfg


def host_model(cfg: TransformerConfig, seed: int = 0) -> nnx.Module:
  """The model with numpy parameters: initialised once, then placed by each engine's
  `init_state` onto its own mesh (one init compile per size instead of one per configuration,
  and no device buffer shared between configurations, so donation cannot delete another's)."""
  graphdef, state = nnx.split(create_model(cfg, seed=seed))
  return nnx.merge(graphdef, jax.device_get(state))


@dataclasses.dataclass
class Built:
  engine: Engine
  model: nnx.Module | None  # None when compile-only (abstract)
  mesh_shape: tuple[int, int]
  build_seconds: float


def build(cfg: TransformerConfig, strategy: str, mesh_shape: tuple[int, int], backend: str,
          batch: int, seq_len: int, *, abstract: bool = False,
          devices: Sequence[jax.Device] | None = None, objective=lm_objective,
          extras: Mapping[str, nnx.Module] | None = None, total_steps: int = 1000,
          model: nnx.Module | None = None) -> Built:
  """A compiled engine (and its real model unless `abstract`) for one configuration; `model`
  (e.g. from `host_model`) is used instead of creating one on the mesh."""
  start = time.perf_counter()
  devices = list(devices) if devices is not None else jax.devices()[:mesh_shape[0] * mesh_shape[1]]
  mesh = pt.create_mesh({"data": mesh_shape[0], "model": mesh_shape[1]}, devices=devices)
  rules = pt.rules_from_config({"strategy": strategy})
  if model is None:
    model = abstract_model(cfg) if abstract else create_model(cfg, mesh=mesh, rules=rules, seed=0)
  engine = build_engine(model, dict(extras or {}), objective, benchmark_optimizer(), total_steps,
                        mesh, rules, backend, batch_shapes(batch, seq_len))
  return Built(engine, None if abstract else model, mesh_shape, time.perf_counter() - start)


def peak_bytes(stats: Mapping[str, float]) -> int:
  """Bytes live while a compiled program runs (XLA's usual peak estimate for one call):
  arguments + temporaries + outputs, less the donated buffers the outputs reuse."""
  return int(stats.get("argument_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0)
             + stats.get("output_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))


# ---- timing -------------------------------------------------------------------------------

class Stepper:
  """Runs an engine's step on one placed batch, keeping the (donated) state between calls."""

  def __init__(self, engine: Engine, model: nnx.Module, batch: Mapping[str, np.ndarray],
               extras: Mapping[str, nnx.Module] | None = None, seed: int = 0):
    self.engine = engine
    self.state = engine.init_state(model, dict(extras or {}), seed)
    self.batch = engine.runner.place_batch(batch)
    self.losses: list[float] = []

  def __call__(self, steps: int) -> None:
    state, metrics = self.state, None
    for _ in range(steps):
      state, metrics = self.engine.runner(state, self.batch)
    jax.block_until_ready((state, metrics))
    self.state = state
    self.losses.append(float(metrics["loss"]))


def interleaved(runs: Mapping[str, Callable[[int], None]], *, reps: int, steps_per_rep: int,
                warmup_steps: int = 2) -> tuple[dict[str, list[float]], dict[str, float]]:
  """(per-step seconds of each run over `reps` rounds, seconds of each run's warm-up).

  The rounds go A, B, C, A, B, C, ...: interleaving puts the machine's slow moments (other
  processes on shared cores) on every run alike, so ratios between runs are steadier than the
  absolute times. Two warm-up steps, because a lazily compiled backend (pmap) may compile again
  on its second call, once its inputs are its own outputs.
  """
  warmup: dict[str, float] = {}
  for name, run in runs.items():
    start = time.perf_counter()
    run(warmup_steps)
    warmup[name] = time.perf_counter() - start
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(reps):
    for name, run in runs.items():
      start = time.perf_counter()
      run(steps_per_rep)
      times[name].append((time.perf_counter() - start) / steps_per_rep)
  return times, warmup


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def median_call_seconds(fn: Callable, args: tuple, reps: int) -> float:
  """Median seconds of `reps` calls of fn(*args) after one untimed call (the compile)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return median(times)


def timed_rounds(steppers: Mapping[str, Callable], rows: Mapping[str, dict], *, reps: int,
                 steps_per_rep: int, warmup_steps: int, tokens_per_step: int,
                 reference: str) -> None:
  """Times the variants in interleaved rounds and adds to each row its step time (median and
  every round), the paired ratio to `reference` (`ratio`), tokens/s, warm-up and losses. Each
  stepper first takes one step at the initial weights, out of the timed rounds."""
  for stepper in steppers.values():
    stepper(1)
  times, warmup = interleaved(steppers, reps=reps, steps_per_rep=steps_per_rep,
                              warmup_steps=warmup_steps)
  for name, r in rows.items():
    r["step_s"] = median(times[name])
    r["step_s_all"] = times[name]
    r["ratio"] = paired_ratio(times, name, reference)
    r["tokens_per_s"] = tokens_per_step / r["step_s"]
    r["warmup_s"] = warmup[name]
    r["losses"] = steppers[name].losses
    r["first_loss"], r["final_loss"] = r["losses"][0], r["losses"][-1]


def emit_row(row: Mapping[str, Any], jsonl: str | Path | None = None) -> None:
  """Prints a finished row as one JSON line and appends it to `jsonl` when given: a chip call
  cut short keeps the rows it finished."""
  line = json.dumps(row, default=_json_default)
  print(line, flush=True)
  if jsonl is not None:
    with open(jsonl, "a") as f:
      f.write(line + "\n")


def paired_ratio(times: Mapping[str, list[float]], name: str, reference: str) -> float:
  """Median over rounds of time[name] / time[reference] (same round = same machine noise)."""
  return median([a / b for a, b in zip(times[name], times[reference])])


def compiled_side_by_side(compiled: Mapping[str, tuple[Any, tuple]], *, reps: int):
  """Rows of compiled variants of one function (name -> (compiled, args)): each one's compiled
  temporaries, arguments and FLOPs, its median step time over interleaved rounds, its loss (the
  first output of `value_and_grad`), plus the paired times and the outputs of each, so a script
  can compare their values. What moe.py and linear_attention.py both measure of a layer."""
  rows, calls, results = {}, {}, {}
  for name, (fn, args) in compiled.items():
    mem, cost = fn.memory_analysis(), fn.cost_analysis()
    rows[name] = {"impl": name, "temp_bytes": int(mem.temp_size_in_bytes),
                  "argument_bytes": int(mem.argument_size_in_bytes),
                  "flops": float(cost.get("flops", float("nan")))}

    def call(steps, fn=fn, args=args, name=name):
      for _ in range(steps):
        results[name] = jax.block_until_ready(fn(*args))
    calls[name] = call
  times, _ = interleaved(calls, reps=reps, steps_per_rep=1, warmup_steps=1)
  for name, r in rows.items():
    r.update(step_s=median(times[name]), step_s_all=times[name], loss=float(results[name][0]))
  return rows, times, results


def value_and_grad_gaps(result, reference) -> tuple[float, float]:
  """(relative loss gap, largest gradient gap relative to the reference's largest entry) of two
  `value_and_grad` outputs."""
  (loss, grads), (loss_ref, grads_ref) = result, reference
  grad_gap = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                 for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)))
  return abs(float(loss) - float(loss_ref)) / abs(float(loss_ref)), grad_gap


# ---- reporting ----------------------------------------------------------------------------

def fmt_bytes(n: float | None) -> str:
  if n is None or (isinstance(n, float) and math.isnan(n)):
    return "n/a"
  return pt.shard.format_bytes(n)


def fmt_ms(seconds: float | None) -> str:
  return "n/a" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def fmt_ratio(x: float | None) -> str:
  return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, Callable]]
                 ) -> str:
  """Plain-text table: columns are (header, row -> cell string)."""
  cells = [[h for h, _ in columns]] + [[str(f(r)) for _, f in columns] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def machine_info() -> dict[str, Any]:
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind,
          "device_count": jax.device_count(), "host_cpus": os.cpu_count(),
          "machine": platform.machine(), "python": platform.python_version(),
          "jax": jax.__version__}


REPO = Path(__file__).resolve().parents[2]


def script_sha256(script: str | Path) -> str:
  """The SHA-256 of a script's text: which version of it wrote a results file."""
  return hashlib.sha256(Path(script).read_bytes()).hexdigest()


def provenance(script: str | Path) -> dict[str, str]:
  """{'script': its path from the repository root, 'script_sha256'}: what the docs compare with
  the script as it is when the site is built, to show a results file its script has changed
  since as stale (docs/gen/results_pages.py)."""
  script = Path(script).resolve()
  return {"script": script.relative_to(REPO).as_posix(), "script_sha256": script_sha256(script)}


def _running_script() -> Path | None:
  """The benchmark script this process runs (`python benchmarks/x.py`), else None."""
  main = getattr(sys.modules.get("__main__"), "__file__", None)
  if main and Path(main).resolve().parent == REPO / "benchmarks":
    return Path(main).resolve()
  return None


def write_json(out_dir: str | Path, name: str, payload: Mapping[str, Any],
               script: str | Path | None = None) -> Path:
  """Writes `<out_dir>/<name>.json` with the `provenance` of the script that measured it
  (`script`, default the benchmark script this process runs)."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{name}.json"
  script = script or _running_script()
  if script is not None and "provenance" not in payload:
    payload = {**payload, "provenance": provenance(script)}
  path.write_text(json.dumps(payload, indent=1, sort_keys=False, default=_json_default) + "\n")
  return path


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, tuple):
    return list(x)
  raise TypeError(f"not JSON serialisable: {type(x)}")


def config_summary(cfg: TransformerConfig) -> dict[str, Any]:
  keys = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim", "param_dtype", "dtype", "scan_layers", "remat")
  return {k: getattr(cfg, k) for k in keys}
