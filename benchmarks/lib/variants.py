"""Job variants as `distillax train` builds them, side by side: what peft.py and qat.py share.

A variant is a job config file of distillax/configs (lm.py, qat.py, lora.py, qlora.py) sized for
the benchmark. Its recipe (`recipe_for`) compiles the step (`build_engines`) and makes the
student (`build`: QAT fake quantization, LoRA / QLoRA adapters, shardings from the recipe's
rules), so the figures are those of the step that job trains with. This module imports JAX: a
script imports it after its prologue.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib import common
from distillax.framework import STUDENT
from distillax.models import param_count
from distillax.trainers import recipe_for

LORA_KEYS = ("module_regex", "rank", "alpha", "dropout", "base_qtype", "base_tile_size")


def job_config(config_module: str, *, tiny: bool, batch: int, seq_len: int):
  """distillax/configs/<config_module>.py as shipped (its `tiny` shrink when asked), on the jit
  backend, one micro-batch of `batch` x `seq_len`."""
  c = importlib.import_module(f"distillax.configs.{config_module}").get_config(
      "tiny" if tiny else None)
  c.backend = "jit"
  c.train.batch_size, c.train.seq_len = batch, seq_len
  c.train.steps = 1000  # the schedule's horizon only; keeps the learning rate off zero
  c.train.accum_steps = 1
  return c


def _bits(dtype) -> int:
  dtype = jnp.dtype(dtype)
  return 4 if dtype.name in ("int4", "uint4") else dtype.itemsize * 8


def tree_bytes(abstract, shardings=None) -> int:
  """Bytes of a tree of ShapeDtypeStructs: in all, or on one device given its shardings."""
  leaves = jax.tree.leaves(abstract)
  if shardings is None:
    return sum(int(np.prod(x.shape)) * _bits(x.dtype) // 8 for x in leaves)
  total = 0
  for x, sh in zip(leaves, jax.tree.leaves(shardings)):
    total += int(np.prod(sh.shard_shape(x.shape))) * _bits(x.dtype) // 8
  return total


def build_variant(name: str, what: str, config_module: str, c):
  """(stepper on a packed batch, row of static figures) for the job config `c`, through the
  job's own recipe."""
  start = time.perf_counter()
  recipe = recipe_for(c)  # mesh, rules, model config
  engine = recipe.build_engines().main  # the compiled step (QAT from step 0: the only engine)
  student, extras = recipe.build(abstract=False)
  # Ids the job's tokenizer makes: the losses take their softmax over its rows only
  # (framework/token_rows.py), so a target past them would be an impossible token.
  token_rows = min(recipe.model_config.vocab_size, int(recipe.tokenizer.vocab_size))
  batch = common.packed_batch(c.train.batch_size, c.train.seq_len, token_rows, seed=1)
  stepper = common.Stepper(engine, student, batch, extras, seed=int(c.seed))
  jax.block_until_ready(stepper.state)
  row = {"variant": name, "what": what, "config": config_module + ".py",
         "qat_rules": [list(r) for r in c.qat.rules],
         "lora": {k: c.lora[k] for k in LORA_KEYS} if c.lora.module_regex else None,
         "mesh": dict(recipe.mesh.shape), "strategy": recipe.rules.name,
         "model_params": param_count(recipe.model_config),
         **_memory(engine, stepper.batch), "build_s": time.perf_counter() - start,
         "model": common.config_summary(recipe.model_config)
         | {"tie_embeddings": recipe.model_config.tie_embeddings}}
  return stepper, row


def _memory(engine, placed_batch) -> dict[str, Any]:
  """Parameters and bytes of the state (from the engine's layout) and of the compiled step."""
  layout, stats = engine.layout, engine.runner.stats
  abstract, sh = layout.abstract, layout.shardings
  mem = {k: int(stats.get(f"{k}_size_in_bytes", 0)) for k in ("argument", "temp", "output",
                                                               "alias")}
  return {
      "trainable_params": sum(int(x.size) for x in jax.tree.leaves(abstract.params)),
      "param_bytes": tree_bytes(abstract.params),
      "frozen_bytes": tree_bytes(abstract.frozen[STUDENT]),
      "opt_state_bytes": tree_bytes(abstract.opt_state),
      "opt_state_bytes_per_device": tree_bytes(abstract.opt_state, sh.opt_state),
      "state_bytes_per_device": tree_bytes(abstract, sh),
      "batch_bytes_per_device": sum(int(np.prod(x.sharding.shard_shape(x.shape)))
                                    * x.dtype.itemsize for x in jax.tree.leaves(placed_batch)),
      **{f"{k}_bytes": v for k, v in mem.items()},
      # XLA's usual peak estimate for one call: inputs + outputs + scratch, less the donated
      # buffers the outputs reuse.
      "compiled_total_bytes": mem["argument"] + mem["output"] + mem["temp"] - mem["alias"],
      "flops": stats.get("flops")}


def time_against(steppers: dict, rows: dict, reference: str, *, reps: int, steps_per_rep: int,
                 warmup_steps: int, tokens_per_step: int) -> None:
  """Times the variants in interleaved rounds (common.timed_rounds) and adds to each row its
  ratios to `reference`: time (`ratio_to_R`, the median of per-round ratios), temporaries
  (`temp_ratio_to_R`) and the compiled total (`memory_ratio_to_R`)."""
  common.timed_rounds(steppers, rows, reps=reps, steps_per_rep=steps_per_rep,
                      warmup_steps=warmup_steps, tokens_per_step=tokens_per_step,
                      reference=reference)
  ref = rows[reference]
  for r in rows.values():
    r[f"ratio_to_{reference}"] = r.pop("ratio")
    r[f"temp_ratio_to_{reference}"] = r["temp_bytes"] / ref["temp_bytes"]
    r[f"memory_ratio_to_{reference}"] = r["compiled_total_bytes"] / ref["compiled_total_bytes"]


def shared_checks(rows: dict, reference: str, lora: str, qlora: str) -> list[dict]:
  """What must hold whatever the timings, in every variant and for the adapters."""
  checks = []

  def check(ok: bool, text: str, **extra):
    checks.append({"check": text, "pass": bool(ok), **extra})

  ref = rows[reference]
  for name, r in rows.items():
    expected = r["state_bytes_per_device"] + r["batch_bytes_per_device"]
    check(r["argument_bytes"] == expected,
          f"{name}: XLA's per-device argument bytes = state + batch shards from the rules",
          xla=r["argument_bytes"], from_shardings=expected)
    check(r["final_loss"] < r["first_loss"] and r["first_loss"] == r["first_loss"],
          f"{name}: the loss falls on the repeated batch", first=r["first_loss"],
          final=r["final_loss"])
  if lora in rows:
    rel = abs(rows[lora]["first_loss"] - ref["first_loss"]) / ref["first_loss"]
    check(rel <= 1e-5, f"{lora}: first loss equals {reference}'s (B starts at zero)",
          rel_diff=rel)
    check(rows[lora]["trainable_params"] < ref["trainable_params"] / 4,
          f"{lora}: adapters are a small part of the parameters")
  if lora in rows and qlora in rows:
    check(rows[qlora]["trainable_params"] == rows[lora]["trainable_params"],
          f"{qlora}: same adapters as {lora}")
    check(rows[qlora]["frozen_bytes"] < rows[lora]["frozen_bytes"],
          f"{qlora}: frozen nf4 base stored smaller than {lora}'s fp32 base")
  return checks
