"""`distillax plan`: size a run on a laptop. Compiles the real step for N simulated devices
without materialising a single parameter, then prints where every array lives, what each device
holds, the compiled memory, FLOPs and collectives per step, and whether it fits a memory budget.
`plan --target` (target.py) compiles the same step with a TPU's or GPU's own compiler.

Exit status: 0, or DOES_NOT_FIT_EXIT_CODE when the step does not fit the memory it is checked
against (--memory_gb, or a target's chip), so scripts can tell a plan that fits from one that
does not; 2 for a command line or config to fix.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.framework import flops, vocab_slices
from distillax.framework.hlo import collective_stats
from distillax.framework.hlo_flops import matmul_flops
from distillax.framework.state import STUDENT
from distillax.models.attention.layer import kv_cache_bytes_per_token
from distillax.trainers import Recipe, recipe_for

fmt = pt.shard.format_bytes
DOES_NOT_FIT_EXIT_CODE = 3
# Compiled matmul FLOPs per device over what the step should run (`flops_check`): a ratio
# outside this range says a figure is wrong (a loop counted the wrong number of times, a
# collective matmul or fused kernel misread, or the analytic model missing a layer).
FLOPS_CHECK_RANGE = (0.9, 1.2)


def _tree_bytes(abstract, shardings) -> tuple[int, int]:
  """(total bytes, bytes per device) of a tree of ShapeDtypeStructs under its shardings."""
  total = per_device = 0
  for x, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    itemsize = np.dtype(x.dtype).itemsize
    total += int(np.prod(x.shape)) * itemsize
    per_device += int(np.prod(sh.shard_shape(x.shape))) * itemsize
  return total, per_device


def flops_check(recipe: Recipe, engine, compiled_per_device: float,
                fused: tuple[str, ...] = (), unchecked: str | None = None,
                recompute_merged: bool = False, platform: str = "cpu") -> dict:
  """The compiled step's matmul FLOPs per device against the analytic model's: `ratio` to the
  job's model FLOPs (`recipe.step_flops`, the MFU convention), and `expected_ratio` to what the
  step should run as HLO matmuls (those plus `flops.hlo_matmul_adjustment`: remat's
  recomputation, a frozen base's missing weight gradients, the `fused` parts kernels hide),
  which must lie in FLOPS_CHECK_RANGE (`within`); `warning` is the line to print when it does
  not.
  `unchecked`: why the compiled figure cannot be judged (`within` is then None).
  `recompute_merged`: the compiler merged the vocabulary slices' backward recompute of the
  logits with the forward's (`one_slice_merged`). `platform`: the compiler's (plan_report's)."""
  devices = int(engine.mesh.devices.size)
  cfg = recipe.model_config
  frozen_base = jax.tree.leaves(engine.layout.abstract.frozen.get(STUDENT, {}))
  trained = jax.tree.leaves(engine.layout.abstract.params)
  # A LoRA or QLoRA student: its frozen base outweighs what trains (the adapters).
  base_trains = sum(x.size for x in frozen_base) <= sum(x.size for x in trained)
  model_flops = recipe.step_flops() - recipe.step_flops_elsewhere
  expected = (model_flops + flops.hlo_matmul_adjustment(
      cfg, recipe.batch_size, recipe.seq_len, recipe.teacher_model_config,
      remat=str(getattr(cfg, "remat", "none")), fused=fused,
      sliced=getattr(recipe, "loss_impl", "") == "sliced" and not recompute_merged,
      sliced_shape=getattr(recipe, "loss_shape", None),
      weights_train=base_trains,
      adapter_params=0 if base_trains else sum(x.size for x in trained))) / devices
  if platform == "tpu":  # the compiler's; attention turns RoPE over whole heads there
    expected += flops.rope_swap_adjustment(
        cfg, recipe.batch_size, recipe.seq_len, recipe.teacher_model_config,
        str(getattr(cfg, "remat", "none"))) / devices
  expected_ratio = compiled_per_device / expected
  low, high = FLOPS_CHECK_RANGE
  within = None if unchecked else low <= expected_ratio <= high
  warning = None if within in (None, True) else (
      f"WARNING: the compiled matmuls are {expected_ratio:.2f}x the FLOPs this step should run "
      f"({expected:.4g} per device: the analytic model with remat, frozen weights and fused "
      f"kernels accounted for), outside {low}-{high}x: the HLO reader or the analytic model "
      f"misses part of this step")
  return {"ratio": compiled_per_device * devices / model_flops, "expected_per_device": expected,
          "expected_ratio": expected_ratio, "range": list(FLOPS_CHECK_RANGE), "within": within,
          "warning": warning, "unchecked": unchecked}


def analytic_report(recipe: Recipe, engine) -> dict:
  """The figures of `recipe`'s step that need no compile: where the arrays live and what each
  device holds, the model FLOPs, the KV cache and the vocabularies (what `plan --target`
  still prints when the compiler runs out of memory)."""
  layout = engine.layout
  a, sh = layout.abstract, layout.shardings
  params = _tree_bytes(a.params, sh.params)
  frozen = _tree_bytes(a.frozen, sh.frozen)
  opt = _tree_bytes(a.opt_state, sh.opt_state)
  stored = _tree_bytes(layout.stored_abstract, layout.stored_shardings)[0]
  whole = _tree_bytes(a, sh)[0]
  return {
      # The mesh's devices, not jax.device_count(): a target compile's host sees 1.
      "devices": int(engine.mesh.devices.size), "mesh": pt.mesh_shape_str(engine.mesh),
      "strategy": engine.rules.name, "backend": engine.runner.backend,
      "gradient_reduction": engine.runner.gradient_reduction,
      "params_total_bytes": params[0], "params_bytes_per_device": params[1],
      "frozen_total_bytes": frozen[0], "frozen_bytes_per_device": frozen[1],
      # Each frozen extra model (a teacher; several teachers one by one): (total, per device).
      "frozen_models": {name: _tree_bytes(a.frozen[name], sh.frozen[name])
                        for name in a.frozen if name != STUDENT},
      "optimizer_total_bytes": opt[0], "optimizer_bytes_per_device": opt[1],
      # One checkpoint step's arrays: what the run changes; the frozen models that came from a
      # source (teacher, LoRA base) are reloaded from it on resume, never written.
      "checkpoint_bytes": stored, "reloaded_bytes": whole - stored,
      "model_flops_per_step": recipe.step_flops(),
      "kv_cache_bytes_per_token": _kv_cache_per_token(recipe),
      "vocabulary": _vocabularies(recipe),
  }


def one_slice_merged(recipe: Recipe, platform: str) -> bool:
  """Whether the TPU compiler merges the sliced losses' backward recompute of the logits with
  the forward's: it does where there is one slice (the tiny lm step's TPU matmuls are then
  exactly the analytic model's without the recompute; XLA:CPU keeps it)."""
  return platform == "tpu" and getattr(recipe, "loss_impl", "") == "sliced" and (
      vocab_slices.slice_count(recipe.batch_size // max(1, recipe.accum_steps) * recipe.seq_len,
                               recipe.model_config.vocab_size) == 1)


def no_slice_recompute(recipe: Recipe, platform: str, losses=None) -> bool:
  """Whether a step of train.loss_impl='sliced' recomputes no slice's logits: one slice on a
  TPU (`one_slice_merged`), or token losses that all ran elsewhere (`losses`: the traced step's
  token_loss_impl choices; a live teacher's KD takes the chunk engine on a TPU,
  distill/tpu_chunks.py)."""
  return one_slice_merged(recipe, platform) or bool(
      losses and not any(choice.startswith("sliced") for choice in losses))


def plan_report(recipe: Recipe, engine, fused: tuple[str, ...] = (),
                unchecked: str | None = None, platform: str = "cpu", losses=None) -> dict:
  """Figures of `recipe`'s compiled `engine` (also used by tests and benchmarks): the analytic
  ones and the compiler's. `fused`: the parts of the step a target compile ran in kernels
  (flops.FUSIBLE: splash attention, a fused cross-entropy), whose matmuls the compiled HLO does
  not show; `unchecked`: why its matmul FLOPs cannot be checked (`flops_check`); `platform`:
  the compiler's; `losses`: how its token losses ran (token_loss_impl's choices)."""
  runner = engine.runner
  stats = dict(runner.stats)
  hlo = runner.compiled_text()
  compiled_flops = matmul_flops(hlo)["flops"]
  peak = (stats.get("argument_size_in_bytes", 0) + stats.get("temp_size_in_bytes", 0) +
          stats.get("output_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))
  return {
      **analytic_report(recipe, engine),
      "compiled": stats, "peak_bytes_per_device": peak, "collectives": collective_stats(hlo),
      # Dots and convolutions, each times its loops' trip counts (XLA's own figure counts a
      # loop body once).
      "hlo_matmul_flops_per_device": compiled_flops,
      "flops_check": flops_check(recipe, engine, compiled_flops, fused, unchecked,
                                 no_slice_recompute(recipe, platform, losses), platform),
      "compile_seconds": runner.compile_seconds,
  }


def _vocabularies(recipe: Recipe) -> dict[str, int]:
  """Rows of each model's output layer and the tokenizer's ids (the rows the losses count)."""
  out = {"student": int(recipe.model_config.vocab_size)}
  if recipe.teacher_model_config is not None:
    out["teacher"] = int(recipe.teacher_model_config.vocab_size)
  out["tokenizer"] = int(recipe.tokenizer.vocab_size)
  return out


def _kv_cache_per_token(recipe: Recipe) -> dict[str, int]:
  """Bytes the sampler's KV cache holds per token (every layer, compute dtype) of the student
  and of the teacher that runs in the step: what each generated token of sampling (on-policy
  distillation, sequence KD, generate) costs per sequence. DeepSeek's latent attention caches
  its latent and RoPE key, not keys and values."""
  configs = {"student": recipe.model_config}
  if recipe.sources.step_teacher is not None:
    configs["teacher"] = recipe.sources.step_teacher.model_config()
  return {name: kv_cache_bytes_per_token(cfg) for name, cfg in configs.items()}


def _attention_on_cpu(config):
  """plan compiles on CPU, which has no fused attention kernel: a config that asks for cuDNN or
  splash (for the student, or the teacher's own teacher.attention_impl) is sized with blockwise
  attention, the same class of memory (no (L, S) scores; the kernels' own workspace aside)."""
  if jax.default_backend() != "cpu":
    return config
  fields = [(section, config[section].get("attention_impl", "auto"))
            for section in ("model", "teacher") if section in config]
  fused = [(section, impl) for section, impl in fields if impl in ("cudnn", "splash")]
  if not fused:
    return config
  config = config.copy_and_resolve_references()
  for section, impl in fused:
    print(f"note: plan compiles on CPU; {section}.attention_impl={impl!r} is sized as "
          f"'blockwise'")
    config[section].attention_impl = "blockwise"
  return config


def run_plan(config, devices: int | None = None, memory_gb: float | None = None, *,
             model_overrides=None) -> int:
  if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
    raise UserError(f"--memory_gb={memory_gb:g} must be a positive number of GiB per device "
                    f"to check the plan against, e.g. --memory_gb 16")
  if devices is not None and jax.device_count() != devices:
    raise UserError(f"--devices={devices} but JAX sees {jax.device_count()} devices; plan runs "
                    f"on simulated CPU devices, so leave JAX_PLATFORMS unset or set it to cpu")
  recipe = recipe_for(_attention_on_cpu(config), model_overrides=model_overrides)
  engine = recipe.build_engines().main
  layout = engine.layout
  rows = pt.describe(layout.abstract.params, layout.logical.params, recipe.mesh, recipe.rules)
  print(pt.format_plan(rows, f"trainable parameters ({recipe.model_config.__class__.__name__})"))
  r = plan_report(recipe, engine, unchecked=_experts_on_cpu(recipe))
  print_figures(recipe, r)
  if memory_gb is None:
    return 0
  return print_verdict(r["peak_bytes_per_device"], memory_gb * 2**30, f"{memory_gb:g} GiB")


def print_analytic(recipe: Recipe, r: dict) -> None:
  """The figures of an analytic report (or a whole plan report) that need no compile."""
  print(f"\nplan: {r['devices']} devices, mesh {r['mesh']} (data x model), strategy "
        f"{r['strategy']}, backend {r['backend']}, batch {recipe.batch_size} x "
        f"{recipe.seq_len}, gradients reduced {r['gradient_reduction'].replace('_', ' ')}")
  vocab = r["vocabulary"]
  models = ", ".join(f"{name} {n:,} rows" for name, n in vocab.items() if name != "tokenizer")
  print(f"  vocabulary     {models}; the tokenizer's {vocab['tokenizer']:,} ids (the losses' "
        f"softmax)")
  print(f"  parameters     {fmt(r['params_total_bytes']):>12} total, "
        f"{fmt(r['params_bytes_per_device']):>12} per device")
  if r["frozen_total_bytes"]:
    print(f"  frozen         {fmt(r['frozen_total_bytes']):>12} total, "
          f"{fmt(r['frozen_bytes_per_device']):>12} per device")
    for name, (total, per_device) in r["frozen_models"].items():
      print(f"    {name:<12} {fmt(total):>12} total, {fmt(per_device):>12} per device")
  print(f"  optimizer      {fmt(r['optimizer_total_bytes']):>12} total, "
        f"{fmt(r['optimizer_bytes_per_device']):>12} per device")
  reloaded = (f" (+{fmt(r['reloaded_bytes'])} of frozen models reloaded from their sources, not "
              f"stored)" if r["reloaded_bytes"] else "")
  print(f"  checkpoint     {fmt(r['checkpoint_bytes']):>12} per save{reloaded}")
  print("  KV cache per sampled token (every layer, per sequence): " + ", ".join(
      f"{name} {fmt(n)}" for name, n in r["kv_cache_bytes_per_token"].items()))
  print(f"  model FLOPs per step {r['model_flops_per_step']:.4g} (analytic)")


def print_figures(recipe: Recipe, r: dict) -> None:
  """The per-device figures of a plan report, as `plan` and `plan --target` print them."""
  print_analytic(recipe, r)
  c = r["compiled"]
  print(f"  compiled step per device: arguments {fmt(c.get('argument_size_in_bytes', 0))}, "
        f"temporaries/activations {fmt(c.get('temp_size_in_bytes', 0))}, outputs "
        f"{fmt(c.get('output_size_in_bytes', 0))} (aliased {fmt(c.get('alias_size_in_bytes', 0))})")
  print(f"  peak per device ~ {fmt(r['peak_bytes_per_device'])}")
  for line in recipe.plan_lines(r) if recipe.plan_lines else ():
    print(f"  {line}")
  check = r["flops_check"]
  judged = (f"not checked: {check['unchecked']}" if check["unchecked"] else
            f"{check['expected_ratio']:.2f}x with remat and fused kernels")
  xla = c.get("flops")
  xla = (f"XLA's count {xla:.4g} (loop bodies once)" if xla is not None and math.isfinite(xla)
         and xla >= 0 else "XLA gives no count of its own for this target")
  print(f"  compiled matmul FLOPs per device {r['hlo_matmul_flops_per_device']:.4g} "
        f"({check['ratio']:.2f}x the analytic, {judged}), {xla}")
  if check["warning"]:
    print(f"  {check['warning']}")
  coll = r["collectives"]
  parts = ", ".join(f"{k} x{v['count']} ({fmt(v['bytes'])})" for k, v in coll.items()
                    if isinstance(v, dict) and k != "total" and v["count"])
  print(f"  collectives per step per device: {parts or 'none'}; total "
        f"{fmt(coll['total']['bytes'])}"
        + (" (a loop's trip count is unknown: counted once)" if coll["trip_count_unknown"] else ""))
  if coll.get("all-to-all", {}).get("count") and _has_experts(recipe):
    print("  all-to-all: the experts' token exchange, fixed-size dropless buffers padded by "
          "design to the rows any routing could send (models/moe/parallel.py), not the rows "
          "a balanced routing moves")
  print(f"  compiled in {r['compile_seconds']:.1f}s")


def _experts_on_cpu(recipe: Recipe) -> str | None:
  """Why the CPU plan's FLOPs of a mixture of experts are not judged: XLA:CPU has no grouped
  matmul, and jax lowers the experts' ragged dots there as dense ones (every expert over every
  routed row, masked), E / k times the work the model's FLOPs count. None: judged."""
  if jax.default_backend() != "cpu" or not _has_experts(recipe):
    return None
  return ("the CPU lowers the experts' grouped matmuls densely (every expert over every routed "
          "row), more work than the model's FLOPs count")


def _has_experts(recipe: Recipe) -> bool:
  """Whether the student or the teacher in the step is a mixture of experts."""
  teacher = recipe.teacher_model_config
  return bool(recipe.model_config.num_experts or (teacher is not None and teacher.num_experts))


def print_verdict(peak: float, budget: float, what: str) -> int:
  """FITS (exit 0) or DOES NOT FIT (DOES_NOT_FIT_EXIT_CODE) in `budget` bytes per device."""
  fits = peak <= budget
  print(f"  {'FITS' if fits else 'DOES NOT FIT'} in {what} per device ({peak / budget:.0%} of it)")
  return 0 if fits else DOES_NOT_FIT_EXIT_CODE
