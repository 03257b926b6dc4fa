"""`distillax plan`: size a run on a laptop. Compiles the real step for N simulated devices
without materialising a single parameter, then prints where every array lives, what each device
holds, the compiled memory, FLOPs and collectives per step, and whether it fits a memory budget.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.framework.hlo import collective_stats
from distillax.trainers import Recipe, recipe_for

fmt = pt.shard.format_bytes


def _tree_bytes(abstract, shardings) -> tuple[int, int]:
  """(total bytes, bytes per device) of a tree of ShapeDtypeStructs under its shardings."""
  total = per_device = 0
  for x, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    itemsize = np.dtype(x.dtype).itemsize
    total += int(np.prod(x.shape)) * itemsize
    per_device += int(np.prod(sh.shard_shape(x.shape))) * itemsize
  return total, per_device


def plan_report(recipe: Recipe, engine) -> dict:
  """Figures of `recipe`'s compiled `engine` (also used by tests and benchmarks)."""
  layout, runner = engine.layout, engine.runner
  a, sh = layout.abstract, layout.shardings
  params = _tree_bytes(a.params, sh.params)
  frozen = _tree_bytes(a.frozen, sh.frozen)
  opt = _tree_bytes(a.opt_state, sh.opt_state)
  stored = _tree_bytes(layout.stored_abstract, layout.stored_shardings)[0]
  whole = _tree_bytes(a, sh)[0]
  stats = dict(runner.stats)
  hlo = runner.compiled_text()
  model_flops = recipe.step_flops()
  peak = (stats.get("argument_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0) +
          stats.get("output_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))
  return {
      "devices": jax.device_count(), "mesh": pt.mesh_shape_str(engine.mesh),
      "strategy": engine.rules.name, "backend": runner.backend,
      "gradient_reduction": runner.gradient_reduction,
      "params_total_bytes": params[0], "params_bytes_per_device": params[1],
      "frozen_total_bytes": frozen[0], "frozen_bytes_per_device": frozen[1],
      "optimizer_total_bytes": opt[0], "optimizer_bytes_per_device": opt[1],
      # One checkpoint step's arrays: what the run changes; the frozen models that came from a
      # source (teacher, LoRA base) are reloaded from it on resume, never written.
      "checkpoint_bytes": stored, "reloaded_bytes": whole - stored,
      "compiled": stats, "peak_bytes_per_device": peak,
      "model_flops_per_step": model_flops, "collectives": collective_stats(hlo),
      "compile_seconds": runner.compile_seconds,
  }


def _attention_on_cpu(config):
  """plan compiles on CPU, which has no fused attention kernel: a config that asks for cuDNN or
  splash is sized with blockwise attention, the same class of memory (no (L, S) scores; the
  kernels' own workspace aside)."""
  impl = config.model.get("attention_impl", "auto")
  if impl not in ("cudnn", "splash") or jax.default_backend() != "cpu":
    return config
  print(f"note: plan compiles on CPU; model.attention_impl={impl!r} is sized as 'blockwise'")
  config = config.copy_and_resolve_references()
  config.model.attention_impl = "blockwise"
  return config


def run_plan(config, devices: int | None = None, memory_gb: float | None = None) -> int:
  if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
    raise UserError(f"--memory_gb={memory_gb:g} must be a positive number of GiB per device "
                    f"to check the plan against, e.g. --memory_gb 16")
  if devices is not None and jax.device_count() != devices:
    raise UserError(f"--devices={devices} but JAX sees {jax.device_count()} devices; plan runs "
                    f"on simulated CPU devices, so leave JAX_PLATFORMS unset or set it to cpu")
  recipe = recipe_for(_attention_on_cpu(config))
  engine = recipe.build_engines().main
  layout = engine.layout
  rows = pt.describe(layout.abstract.params, layout.logical.params, recipe.mesh, recipe.rules)
  print(pt.format_plan(rows, f"trainable parameters ({recipe.model_config.__class__.__name__})"))
  r = plan_report(recipe, engine)
  c = r["compiled"]
  print(f"\nplan: {r['devices']} devices, mesh {r['mesh']} (data x model), strategy "
        f"{r['strategy']}, backend {r['backend']}, batch {recipe.batch_size} x "
        f"{recipe.seq_len}, gradients reduced {r['gradient_reduction'].replace('_', ' ')}")
  print(f"  parameters     {fmt(r['params_total_bytes']):>12} total, "
        f"{fmt(r['params_bytes_per_device']):>12} per device")
  if r["frozen_total_bytes"]:
    print(f"  frozen         {fmt(r['frozen_total_bytes']):>12} total, "
          f"{fmt(r['frozen_bytes_per_device']):>12} per device")
  print(f"  optimizer      {fmt(r['optimizer_total_bytes']):>12} total, "
        f"{fmt(r['optimizer_bytes_per_device']):>12} per device")
  reloaded = (f" (+{fmt(r['reloaded_bytes'])} of frozen models reloaded from their sources, not "
              f"stored)" if r["reloaded_bytes"] else "")
  print(f"  checkpoint     {fmt(r['checkpoint_bytes']):>12} per save{reloaded}")
  print(f"  compiled step per device: arguments {fmt(c.get('argument_size_in_bytes', 0))}, "
        f"temporaries/activations {fmt(c.get('temp_size_in_bytes', 0))}, outputs "
        f"{fmt(c.get('output_size_in_bytes', 0))} (aliased {fmt(c.get('alias_size_in_bytes', 0))})")
  print(f"  peak per device ~ {fmt(r['peak_bytes_per_device'])}")
  print(f"  model FLOPs per step {r['model_flops_per_step']:.4g} (analytic); XLA per device "
        f"{c.get('flops', float('nan')):.4g}")
  coll = r["collectives"]
  parts = ", ".join(f"{k} x{v['count']} ({fmt(v['bytes'])})" for k, v in coll.items()
                    if isinstance(v, dict) and k != "total" and v["count"])
  print(f"  collectives per step per device: {parts or 'none'}; total "
        f"{fmt(coll['total']['bytes'])}"
        + (" (a loop's trip count is unknown: counted once)" if coll["trip_count_unknown"] else ""))
  print(f"  compiled in {r['compile_seconds']:.1f}s")
  if memory_gb is not None:
    budget = memory_gb * 2**30
    verdict = "FITS" if r["peak_bytes_per_device"] <= budget else "DOES NOT FIT"
    print(f"  {verdict} in {memory_gb:g} GiB per device "
          f"({r['peak_bytes_per_device'] / budget:.0%} of it)")
  return 0
