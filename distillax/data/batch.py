"""The batch contract, in one place: its keys, their dtypes, and the one batch-size check.

Every producer of batches (the packed pipeline, the teacher cache, tests, benchmarks) and every
consumer (objectives, the compiled step's input shapes) reads the keys and dtypes from here, so
a batch built anywhere has the shape the step was compiled for.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from distillax.errors import ConfigError

INPUTS = "inputs_BxL"
TARGETS = "targets_BxL"
SEGMENT_IDS = "segment_ids_BxL"
POSITIONS = "positions_BxL"
LOSS_MASK = "loss_mask_BxL"

# key -> dtype of every packed batch (see distillax.data's module doc for what each holds).
BATCH_DTYPES = {INPUTS: np.dtype(np.int32), TARGETS: np.dtype(np.int32),
                SEGMENT_IDS: np.dtype(np.int32), POSITIONS: np.dtype(np.int32),
                LOSS_MASK: np.dtype(np.float32)}
BATCH_KEYS = tuple(BATCH_DTYPES)


def batch_shapes(global_batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """Global shapes of one packed batch: what a step is compiled for."""
  return {k: jax.ShapeDtypeStruct((global_batch_size, seq_len), v)
          for k, v in BATCH_DTYPES.items()}


def padding_rows(num_rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rows that hold nothing: pad tokens, segment 0, loss mask 0."""
  rows = {k: np.zeros((num_rows, seq_len), v) for k, v in BATCH_DTYPES.items()}
  rows[INPUTS][:] = pad_id
  rows[TARGETS][:] = pad_id
  return rows


def check_batch_size(global_batch: int, *, data_parallel: int = 1, accum_steps: int = 1,
                     process_count: int = 1, field: str = "train.batch_size") -> int:
  """The rows each process loads per step, after checking `global_batch` splits evenly over
  processes, data-parallel workers and accumulation steps (one clear line when it does not)."""
  if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or \
      global_batch < 1:
    raise ConfigError(f"{field}={global_batch!r} must be a positive number of sequences, "
                      f"e.g. --config.{field}=16")
  unit = math.lcm(int(data_parallel) * int(accum_steps), int(process_count))
  if global_batch % unit:
    lo = max(unit, global_batch - global_batch % unit)
    over = []
    if int(data_parallel) * int(accum_steps) > 1:
      over.append(f"{data_parallel} data-parallel workers x {accum_steps} accumulation steps")
    if int(process_count) > 1:
      over.append(f"{process_count} JAX processes")
    raise ConfigError(f"{field}={global_batch} cannot be split evenly over {' and '.join(over)}; "
                      f"it must be a multiple of {unit}, e.g. {lo} or {lo + unit}")
  return int(global_batch) // int(process_count)
