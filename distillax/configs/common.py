"""Sections every job config shares. Each field has a default and a one-line comment.

A config file builds on `base_config(model_preset)` and changes what its job needs; the CLI then
applies `--config.a.b=value` overrides, which are type-checked against these defaults.
"""

from __future__ import annotations

import dataclasses

import ml_collections
from ml_collections import config_dict

from distillax.data import default_data_config
from distillax.framework.optim import default_optimizer_config
from distillax.models.config import get_preset


def model_config(preset: str, **overrides) -> ml_collections.ConfigDict:
  """Every TransformerConfig field of a preset, so any one is overridable from the CLI.

  vocab_size 0 means "take it from the tokenizer" (rounded up to a multiple of 128).
  """
  cfg = dataclasses.asdict(get_preset(preset))
  cfg.update(overrides)
  cfg.setdefault("vocab_size", 0)
  out = ml_collections.ConfigDict(cfg)
  for key in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
              "rope_scaling_factor"):
    if out[key] is None:
      out[key] = config_dict.placeholder(float)
  if out["sliding_window"] is None:
    out["sliding_window"] = config_dict.placeholder(int)
  return out


def base_config(model_preset: str = "tiny") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.trainer = "lm"  # which trainer runs the job: lm | distill | qat
  c.seed = 0  # seeds parameters, data order and dropout
  c.backend = "jit"  # jit | shard_map | pmap | vmap (the last three: data parallel only)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel axis size; -1 = whatever the model axis leaves
  c.mesh.model = 1  # tensor-parallel axis size
  c.mesh.dcn_data = 1  # slices along data over DCN (multi-slice pods)
  c.mesh.dcn_model = 1  # slices along model over DCN (rarely useful)

  c.partitioning = ml_collections.ConfigDict()
  c.partitioning.strategy = "fsdp"  # dp | fsdp | tp | fsdp_tp | a registered preset
  c.partitioning.rules = ()  # extra (logical, mesh axes) rules placed before the preset's
  c.partitioning.replicate_indivisible = False  # replicate dims a mesh axis does not divide
  # auto | per_step | per_use. With parameters replicated over data (dp, tp): per_step sums
  # micro-batches and tied weights locally and all-reduces once per step; per_use lets the
  # compiler reduce each contribution where it is made (overlappable with backward). auto picks
  # per_step under accumulation or tied embeddings. fsdp/fsdp_tp always reduce per use.
  c.partitioning.gradient_reduction = "auto"

  c.model = model_config(model_preset, vocab_size=0)
  c.optimizer = default_optimizer_config()
  c.data = default_data_config()

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200  # optimizer steps in the run
  c.train.batch_size = 16  # global batch, in sequences
  c.train.seq_len = 128  # tokens per sequence
  c.train.accum_steps = 1  # micro-batches per step (gradient accumulation inside the step)
  c.train.log_every = 10  # steps between metric rows
  c.train.eval_every = 50  # steps between evals (0 = only at the end)
  c.train.eval_batches = 8  # batches per eval
  c.train.rollback_threshold = 0.05  # roll back when eval perplexity rises this much over best
  c.train.rollback_lr_factor = 0.5  # learning-rate scale after a rollback
  c.train.max_rollbacks = 2  # rollbacks allowed before the run fails
  c.train.progress = True  # progress bar with ETA on the console
  c.train.init_from = ""  # workdir of an earlier run whose final weights start this one

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 100  # steps between checkpoints (0 = only at the end)
  c.checkpoint.keep = 2  # newest checkpoints kept
  c.checkpoint.keep_best = 1  # best-by-eval-loss checkpoints kept besides the newest
  c.checkpoint.async_save = True  # write checkpoints in the background

  c.qat = ml_collections.ConfigDict()
  # Fake-quant rules, first match wins: (module path regex, weight qtype int8|int4|nf4|
  # float8_e4m3fn, activation qtype int8|float8_e4m3fn|None, tile size or None = per channel).
  # Empty = no quantization-aware training.
  c.qat.rules = ()
  c.qat.start_step = 0  # full-precision steps before fake quantization starts

  c.lora = ml_collections.ConfigDict()
  c.lora.module_regex = ""  # matmul weights that get adapters, e.g. 'layers/.*/attn/.*'; '' = off
  c.lora.rank = 8  # adapter rank
  c.lora.alpha = 16.0  # adapter scaling numerator (scale = alpha / rank)
  c.lora.dropout = 0.1  # dropout on the adapter input during training
  c.lora.base_qtype = ""  # QLoRA: store frozen base weights as nf4 | int4 ('' = full precision)
  c.lora.base_tile_size = 64  # QLoRA: inputs per quantization scale tile

  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = -1  # first step traced with jax.profiler (-1 = off)
  c.profile.num_steps = 3  # steps in the traced window

  c.runtime = ml_collections.ConfigDict()
  c.runtime.coordinator_address = ""  # HOST:PORT of process 0 for multi-process runs
  c.runtime.num_processes = 0  # processes in the job (0 = single process or auto)
  c.runtime.process_id = -1  # this process's index (-1 = from the environment)
  c.runtime.auto_detect = False  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  return c


def shrink_for_tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `:tiny` argument: a seconds-long run on the embedded corpus (smoke tests use it)."""
  for key, value in dataclasses.asdict(get_preset("tiny")).items():
    if key in c.model and key != "vocab_size":
      c.model[key] = value
  c.train.steps = 6
  c.train.batch_size = 8
  c.train.seq_len = 32
  c.train.log_every = 2
  c.train.eval_every = 3
  c.train.eval_batches = 2
  c.train.progress = False
  c.checkpoint.every_steps = 3
  c.optimizer.warmup_steps = 2
  c.data.shuffle_buffer = 64
  return c
