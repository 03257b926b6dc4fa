"""Per-device bytes of the train state, read from the shardings the compiled step was built with.

The shardings come from `compiled.input_shardings` (what XLA will actually expect on each device),
not from the rules that asked for them, so the checks below test the whole chain: logical axes ->
rules -> state shardings -> compiled executable.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding

from distillax.framework import Engine


def _leaf_bytes(abstract, sharding) -> tuple[float, float]:
  """(global bytes, bytes of one device's shard) of one array."""
  itemsize = abstract.dtype.itemsize
  total = math.prod(abstract.shape) * itemsize
  shard = math.prod(sharding.shard_shape(abstract.shape)) * itemsize
  return float(total), float(shard)


def _uses_axis(sharding, axis: str) -> bool:
  if not isinstance(sharding, NamedSharding):
    return False
  for entry in sharding.spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    if axis in names:
      return True
  return False


def state_shardings(engine: Engine) -> Any:
  """The compiled step's state shardings when it is compiled (jit), else the layout's."""
  compiled = engine.runner.compiled
  if compiled is not None and engine.runner.backend == "jit":
    return compiled.input_shardings[0][0]
  return engine.layout.shardings


def state_bytes(engine: Engine) -> dict[str, float]:
  """Global and per-device bytes of params, optimizer state and frozen models; also the params
  whose sharding uses the 'model' axis (the tensor-parallel weights) and those using 'data'."""
  shardings = state_shardings(engine)
  abstract = engine.layout.abstract
  out = {k: 0.0 for k in ("params_total", "params_per_device", "opt_total", "opt_per_device",
                          "frozen_total", "frozen_per_device", "model_sharded_total",
                          "model_sharded_per_device", "data_sharded_total",
                          "data_sharded_per_device")}
  for part in ("params", "opt_state", "frozen"):
    key = "opt" if part == "opt_state" else part
    leaves_a = jax.tree.leaves(getattr(abstract, part))
    leaves_s = jax.tree.leaves(getattr(shardings, part),
                               is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    for a, s in zip(leaves_a, leaves_s, strict=True):
      total, shard = _leaf_bytes(a, s)
      out[f"{key}_total"] += total
      out[f"{key}_per_device"] += shard
      if part == "params":
        for axis in ("model", "data"):
          if _uses_axis(s, axis):
            out[f"{axis}_sharded_total"] += total
            out[f"{axis}_sharded_per_device"] += shard
  return out


def fsdp_check(sb: dict[str, float], data: int, tolerance: float = 0.05) -> dict[str, Any]:
  """Params + optimizer state per device within `tolerance` of their total / data."""
  ideal = (sb["params_total"] + sb["opt_total"]) / data
  actual = sb["params_per_device"] + sb["opt_per_device"]
  ratio = actual / ideal if ideal else float("nan")
  return {"check": "fsdp params+opt per device ~ total/N", "actual": actual, "ideal": ideal,
          "ratio": ratio, "tolerance": tolerance, "pass": abs(ratio - 1.0) <= tolerance}


def tp_check(sb: dict[str, float], model: int, tolerance: float = 0.05) -> dict[str, Any]:
  """The tensor-parallel weights per device within `tolerance` of their total / model, and
  they must be most of the parameters (else tp shards nothing that matters)."""
  ideal = sb["model_sharded_total"] / model
  actual = sb["model_sharded_per_device"]
  ratio = actual / ideal if ideal else float("nan")
  fraction = sb["model_sharded_total"] / sb["params_total"] if sb["params_total"] else 0.0
  return {"check": "tp sharded weights per device ~ their total/model", "actual": actual,
          "ideal": ideal, "ratio": ratio, "tolerance": tolerance,
          "sharded_fraction_of_params": fraction,
          "pass": abs(ratio - 1.0) <= tolerance and fraction >= 0.5}


def dp_check(all_reduce_bytes: float, grad_bytes: float, low: float = 0.99,
             high: float = 1.01) -> dict[str, Any]:
  """One gradient all-reduce per step: all-reduce bytes in [low, high] x the fp32 gradient bytes
  (the slack above 1 covers the scalar metrics: loss, token counts, metric sums).

  It fails if any gradient is reduced twice: per micro-batch under accumulation, or the two parts
  of a tied embedding's gradient (lookup and output projection) reduced separately.
  """
  ratio = all_reduce_bytes / grad_bytes if grad_bytes else float("nan")
  return {"check": f"dp all-reduce bytes / fp32 grad bytes in [{low}, {high}]",
          "actual": all_reduce_bytes, "ideal": grad_bytes, "ratio": ratio,
          "pass": low <= ratio <= high}
