"""`distillax plan --target tpu:v5p-128|gpu:h100x8 ...`: the job's real step compiled by the
target's own compiler on this CPU host (libtpu for TPU slices, the CUDA plugin for GPUs), and
what that compiler says of it per device: memory (FITS / DOES NOT FIT the chip), FLOPs,
collectives by kind, the fused kernels that lowered, the attention and experts each layer got,
and the implementation of the token losses.

Why not the CPU plan alone: XLA:CPU runs bf16 collectives in fp32, forms no reduce-scatter,
knows nothing of TPU tiling or HBM, and cannot compile a Pallas TPU or cuDNN kernel, so its
peak and its collectives are another program's. A step the target compiler refuses for memory
(a TPU compile fails when HBM or a kernel's VMEM runs out) is reported DOES NOT FIT, not raised.

`--search` compiles the step several times to find the largest per-device batch that fits, and
then the cheapest rematerialisation policy that fits at that batch, starting from the config's
own batch.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import threading
import time

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.framework import flops, targets, token_loss_impl
from distillax.framework.hlo import parse_module
from distillax.framework.run import compile_cache
from distillax.models import layer_scope
from distillax.models.attention import impl as attention_impl
from distillax.models.moe import kernels as moe_kernels
from distillax.plan.local import (DOES_NOT_FIT_EXIT_CODE, analytic_report, fmt, plan_report,
                                  print_analytic, print_figures, print_verdict)
from distillax.trainers import recipe_for

# Custom calls that are the compiler's own bookkeeping, not kernels.
_BOOKKEEPING = ("AsyncCollectiveStart", "AsyncCollectiveDone", "AssumeGatherIndicesInBound",
                "GatherScatterIndicesBitpacked", "ConcatBitcast", "Sharding", "SPMDFullToShardShape",
                "SPMDShardToFullShape", "AllocateBuffer", "MoveToHost", "MoveToDevice")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_GPU_FUSION_RE = re.compile(r'"kind":"(__(?:triton|cudnn|cublas)[\w$]*)"')
# How a compile that ran out of memory says so (HBM, or a kernel's VMEM on TPU).
_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Ran out of memory", "VmemOom", "out of memory")
# Remat policies, cheapest to recompute first (`none` recomputes nothing, `full` everything).
# save_attention_mlp / _up keep two / one of each MLP's three products, save_attention_qkv the
# q, k, v projections: for Qwen3-0.6B a q, k, v projection is 1.3x one MLP product.
REMAT_BY_COST = ("none", "save_dots", "save_dots_no_batch", "save_attention_mlp",
                 "save_attention_qkv", "save_attention_up", "save_attention", "full")
MAX_PER_DEVICE = 1024  # sequences per data-parallel device: where --search stops doubling
PROGRESS_EVERY_S = 30.0  # a "still compiling" line this often while a target compile runs


def fused_kernels(hlo_text: str) -> dict[str, int]:
  """Kernels the compiled step calls, by name, with how many call sites: Mosaic (Pallas TPU)
  kernels by their instruction names (splash_mqa_fwd...), cuDNN and other custom calls by
  target, Triton / cuBLAS GPU fusions by kind."""
  found: collections.Counter[str] = collections.Counter()
  for comp in parse_module(hlo_text).computations.values():
    for ins in comp:
      if ins.opcode == "custom-call":
        target = _TARGET_RE.search(ins.attrs)
        name = target.group(1) if target else "?"
        if name == "tpu_custom_call":
          name = "mosaic:" + re.sub(r"(\.\d+)+$", "", ins.name)
        if name not in _BOOKKEEPING:
          found[name] += 1
      elif ins.opcode == "fusion" and (kind := _GPU_FUSION_RE.search(ins.attrs)):
        found[kind.group(1)] += 1
  return dict(sorted(found.items()))


def _fused_parts(attention: list) -> tuple[str, ...]:
  """The parts of the step that ran inside kernels (flops.FUSIBLE), whose matmuls the HLO does
  not show: attention when every traced call took a fused kernel."""
  fused = []
  if attention and all(impl in flops.FUSED_ATTENTION for _, impl, _ in attention):
    fused.append("attention")
  return tuple(fused)


def _experts_in_kernels(experts: dict, kernels: dict[str, int]) -> str | None:
  """Why the FLOPs check cannot judge a step whose experts' grouped matmuls lowered to kernels
  (Mosaic's ragged-dot, tokamax's Triton calls): part of their work is hidden in the kernels,
  part runs as HLO over the dropless buffers' padded rows; None otherwise."""
  if experts and any("ragged" in k or ("triton" in k and "$" in k) for k in kernels):
    return "the experts' grouped matmuls run partly in kernels, partly over padded buffers"
  return None


def _out_of_memory(error: Exception) -> str | None:
  """The compiler's line when `error` is a compile that ran out of memory, else None."""
  text = str(error)
  if not any(word in text for word in _OUT_OF_MEMORY):
    return None
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  pick = next((line for line in lines if any(word in line for word in _OUT_OF_MEMORY)), text)
  return pick[:400]


def _attention_fields(config) -> str:
  """model.attention_impl, and the teacher's when it has its own, as the config sets them."""
  out = f"model.attention_impl={config.model.get('attention_impl', 'auto')!r}"
  own = config.teacher.get("attention_impl") if "teacher" in config else None
  return out + (f", teacher.attention_impl={own!r}" if own else "")


@contextlib.contextmanager
def compile_progress(what: str, every_s: float = PROGRESS_EVERY_S, say=None):
  """Says `what` is compiling, then a line every `every_s` seconds until the block ends: a
  large model's target compile takes minutes, and a silent terminal looks hung. `say` prints
  one line (default: stdout, flushed)."""
  say = say or (lambda line: print(line, flush=True))
  say(f"  compiling the step for {what} (a line every {every_s:g} s until it is done)")
  done, start = threading.Event(), time.monotonic()

  def tick():
    while not done.wait(every_s):
      say(f"  still compiling for {what}: {time.monotonic() - start:.0f} s")

  ticker = threading.Thread(target=tick, name="compile-progress", daemon=True)
  ticker.start()
  try:
    yield
  finally:
    done.set()
    ticker.join()


def compile_on(config, target: targets.Target, devices: list, model_overrides=None) -> dict:
  """Compiles `config`'s train step for `target`; the plan report, plus the target, the kernels
  and the attention and MoE choices, or {'out_of_memory': <compiler's line>} when it does not compile.
  `model_overrides`: the --config.* values the user set (checked against the student's
  source, as every job does)."""
  config = config.copy_and_resolve_references()
  mesh_cfg = config.mesh
  if target.slices > 1 and int(mesh_cfg.get("dcn_data", 1) or 1) * int(
      mesh_cfg.get("dcn_model", 1) or 1) == 1:
    mesh_cfg.dcn_data = target.slices  # data parallel across slices (DCN), the rest inside one
  mesh = pt.create_mesh(mesh_cfg, devices=devices)
  recipe = recipe_for(config, mesh=mesh, model_overrides=model_overrides)
  # The target's compile-only client neither fills nor reads a persistent cache (see there).
  with attention_impl.recorded_choices() as choices, moe_kernels.recorded_choices() as experts, \
      token_loss_impl.recorded_choices() as token_losses, \
      layer_scope.recorded_by_layer() as by_layer, compile_cache.disabled():
    try:
      # Compiled before it returns: an out-of-memory compile is this plan's answer.
      with compile_progress(f"{target.name} with the {target.platform.upper()} compiler"):
        engine = recipe.build_engines(compile_now=True).main
    except Exception as e:  # noqa: BLE001 - only an out-of-memory compile is a plan's answer
      if "cuDNN" in str(e) and ("not found" in str(e) or "not detected" in str(e)):
        raise UserError(
            f"{target.name}: attention runs cuDNN ({_attention_fields(config)}; 'auto' picks "
            f"cuDNN on a GPU), whose lowering needs NVIDIA's cuDNN library: pip install "
            f"nvidia-cudnn-cu12 beside the aot-gpu extra, or set "
            f"--config.model.attention_impl=blockwise (a teacher follows it unless "
            f"teacher.attention_impl says otherwise)") from None
      line = _out_of_memory(e)
      if line is None:
        raise
      return {"recipe": recipe, "out_of_memory": line}
  kernels = fused_kernels(engine.runner.compiled_text())
  report = plan_report(recipe, engine, fused=_fused_parts(choices),
                       unchecked=_experts_in_kernels(experts, kernels), platform=target.platform,
                       losses=token_losses)
  report.update(recipe=recipe, target=target.name, platform=target.platform,
                memory_bytes_per_device=target.memory_bytes, kernels=kernels,
                attention=dict(collections.Counter(f"{impl} ({why})"
                                                   for _, impl, why in choices)),
                moe=experts, loss=token_losses, by_layer=by_layer)
  return report


def _budget(target: targets.Target, memory_gb: float | None) -> tuple[float, str]:
  if memory_gb is not None:
    return memory_gb * 2**30, f"{memory_gb:g} GiB (--memory_gb)"
  return float(target.memory_bytes), f"{fmt(target.memory_bytes)} ({target.chip})"


def _print_target(report: dict) -> None:
  kernels = ", ".join(f"{k} x{n}" for k, n in report["kernels"].items()) or "none"
  print(f"  fused kernels in the compiled step: {kernels}")
  for choice, n in report["attention"].items():
    print(f"  attention: {choice}, {n} traced call(s)")
  for choice, n in report["moe"].items():
    print(f"  experts: {choice}, {n} traced call(s)")
  for layers, choices in report["by_layer"].items():
    print(f"  {layers}: " + "; ".join(f"{kind} {choice}" for kind, choice in choices.items()))
  for choice, n in report["loss"].items():
    print(f"  token loss: {choice}, {n} traced call(s)")


def run_target_plan(config, target_spec: str, *, slices: int | None = None,
                    nodes: int | None = None, memory_gb: float | None = None,
                    search: bool = False, model_overrides=None) -> int:
  """`plan --target`: 0 when the step fits the target's memory, DOES_NOT_FIT_EXIT_CODE when it
  does not (or the compiler ran out of memory), 2 (a UserError) for a command line to fix."""
  if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
    raise UserError(f"--memory_gb={memory_gb:g} must be a positive number of GiB per device, or "
                    f"left out to check against the target chip's memory")
  target = targets.parse_target(target_spec, slices=slices, nodes=nodes)
  devices = targets.target_devices(target)
  print(f"target {target.describe()}")
  budget, what = _budget(target, memory_gb)
  if search:
    return run_search(config, target, devices, budget, what)
  report = compile_on(config, target, devices, model_overrides)
  if "out_of_memory" in report:
    # What sizing needs without the compiler: the arrays each device holds, FLOPs, vocabularies.
    recipe = report["recipe"]
    print_analytic(recipe, analytic_report(recipe, recipe.build_engines(compile_now=False).main))
    print(f"  DOES NOT FIT: the {target.platform.upper()} compiler ran out of memory: "
          f"{report['out_of_memory']}")
    return DOES_NOT_FIT_EXIT_CODE
  print_figures(report["recipe"], report)
  _print_target(report)
  return print_verdict(report["peak_bytes_per_device"], budget, what)


def _trial(config, target, devices, budget: float, batch: int, remat: str) -> dict:
  """One compile of the search: {'fits', 'peak', 'batch', 'remat', ...}."""
  trial = config.copy_and_resolve_references()
  trial.train.batch_size = batch
  trial.model.remat = remat
  report = compile_on(trial, target, devices)
  peak = report.get("peak_bytes_per_device")
  fits = "out_of_memory" not in report and peak <= budget
  shown = (f"{fmt(peak)} per device" if peak is not None
           else "the compiler ran out of memory")
  print(f"  search: batch {batch}, remat {remat}: {shown}, "
        f"{'fits' if fits else 'does not fit'}", flush=True)
  return {"fits": fits, "peak": peak, "batch": batch, "remat": remat}


def search_fit(config, target, devices, budget: float, *,
               max_per_device: int = MAX_PER_DEVICE) -> dict:
  """The largest per-device batch (a power of two) that fits with the most memory-saving remat
  policy, then the cheapest policy that still fits at that batch. The search starts at the
  config's own per-device batch (fewer compiles of a big model): doubling while it fits, else
  halving until it does. {'batch', 'remat', 'peak', 'per_device_batch', 'trials'}, or
  {'batch': None} when even one sequence per device does not fit. Global batch = per-device
  batch x the data-parallel devices x train.accum_steps."""
  mesh_cfg = config.mesh
  model_axis = int(mesh_cfg.get("model", 1) or 1) * int(mesh_cfg.get("dcn_model", 1) or 1)
  rows_per = len(devices) // model_axis * max(1, int(config.train.accum_steps))
  per = 1 << max(0, (int(config.train.batch_size) // rows_per).bit_length() - 1)
  per = min(per, max_per_device)
  trials, best = [], None

  def try_(per_device: int, remat: str) -> dict:
    trials.append(_trial(config, target, devices, budget, per_device * rows_per, remat))
    return trials[-1]

  if try_(per, REMAT_BY_COST[-1])["fits"]:
    best = trials[-1]
    while per * 2 <= max_per_device and try_(per * 2, REMAT_BY_COST[-1])["fits"]:
      best, per = trials[-1], per * 2
  else:
    while per > 1 and best is None:
      per //= 2
      best = trials[-1] if try_(per, REMAT_BY_COST[-1])["fits"] else None
  if best is None:
    return {"batch": None, "trials": trials}
  for remat in REMAT_BY_COST[:-1]:
    if try_(best["batch"] // rows_per, remat)["fits"]:
      best = trials[-1]
      break
  return dict(best, per_device_batch=best["batch"] // rows_per, trials=trials)


def run_search(config, target, devices, budget: float, what: str) -> int:
  if not config.model.get("remat"):
    raise UserError("--search needs a model section with a remat field (model.remat)")
  print(f"search over per-device batch (doubling) and model.remat, against {what}")
  found = search_fit(config, target, devices, budget)
  if found["batch"] is None:
    print(f"  DOES NOT FIT: one sequence per device of {int(config.train.seq_len)} tokens "
          f"does not fit with model.remat=full")
    return DOES_NOT_FIT_EXIT_CODE
  capped = (" (the most the search tries: a larger batch may fit)"
            if found["per_device_batch"] >= MAX_PER_DEVICE else "")
  print(f"  largest fit: --config.train.batch_size={found['batch']} "
        f"({found['per_device_batch']} per data-parallel device{capped}) "
        f"--config.model.remat={found['remat']}: {fmt(found['peak'])} per device, "
        f"{len(found['trials'])} compiles")
  return 0
