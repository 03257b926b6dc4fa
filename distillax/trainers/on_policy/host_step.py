"""A train step with the host between sampling and scoring (cross-tokenizer on-policy).

The loop calls `runner(state, runner.place_batch(host_batch))` as for any step. This runner's
call runs three things in turn:

  1. the sampling program on the mesh (distill.cross_tokenizer_on_policy.sample_completions,
     jitted over the global state and prompts; its key is the step's, so resume stays exact),
     whose completions come back to the host (every process gets all rows, keeps its own);
  2. the host work (`host_fn`: the teacher's tokens and the alignment,
     data.cross_tokenizer_samples.SampleAligner);
  3. the compiled train step of the engine on the prompts, the samples and the host's arrays.

Each step's metrics carry `sampling_s` and `host_alignment_s`, the seconds of 1 and 2 on this
host's clock (the host waits for the samples anyway, so timing them costs nothing). The step
blocks on the samples each step: the price of host work between sampling and scoring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from distillax import partitioning as pt
from distillax.distill.cross_tokenizer.on_policy import (COMPLETION_LENGTHS, COMPLETION_TOKENS,
                                                         sample_completions)
from distillax.distill.on_policy.objective import PROMPT_KEYS, PROMPT_LENGTHS, PROMPT_TOKENS, OnPolicySettings
from distillax.distill.student import unwrap_student
from distillax.framework import backends
from distillax.framework.engine import Engine


def sampling_program(engine: Engine, settings: OnPolicySettings,
                     sampling_context: Callable | None = None) -> Callable:
  """(global state, global prompt batch) -> (tokens [B * S, T], lengths [B * S]), replicated."""
  defs, mesh, rules = engine.layout.defs, engine.mesh, engine.rules
  context = sampling_context or contextlib.nullcontext

  def run(state, batch):
    with pt.use_rules(mesh, rules), context():
      student, _ = defs.merge(state.params, state.frozen)
      step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      generated = sample_completions(unwrap_student(student)[0], batch, step_rng, settings)
      return generated.tokens_BxT, generated.lengths_B
  return jax.jit(run, out_shardings=NamedSharding(mesh, P()))


class HostStep:
  """The runner's call and place_batch (see the module doc)."""

  def __init__(self, engine: Engine, settings: OnPolicySettings, host_fn: Callable, *,
               sampling_context: Callable | None = None,
               clock: Callable[[], float] = time.perf_counter):
    self.engine, self.inner, self.host_fn, self.clock = engine, engine.runner, host_fn, clock
    self.num_samples = int(settings.num_samples)
    self.sample = sampling_program(engine, settings, sampling_context)
    self.place_global = backends.global_batch_placer(engine.mesh, engine.rules)

  def place_batch(self, host_batch):
    return host_batch  # placed in __call__, once the host has added the samples' arrays

  def _local_samples(self, state, prompts) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of the step's samples: [B_local, S, T] tokens, [B_local, S]."""
    tokens_NxT, lengths_N = jax.device_get(self.sample(self.engine.global_state(state),
                                                       self.place_global(prompts)))
    local, S = len(prompts[PROMPT_TOKENS]), self.num_samples
    first = jax.process_index() * local * S
    tokens_NxT, lengths_N = tokens_NxT[first:first + local * S], lengths_N[first:first + local * S]
    return tokens_NxT.reshape(local, S, -1), lengths_N.reshape(local, S)

  def __call__(self, state, host_batch):
    prompts = {k: np.asarray(host_batch[k]) for k in PROMPT_KEYS}
    # The previous step may still run (the loop does not block): wait, so the clock times
    # this step's sampling only.
    jax.block_until_ready(state)
    start = self.clock()
    tokens, lengths = self._local_samples(state, prompts)
    sampled = self.clock()
    batch = {**host_batch, COMPLETION_TOKENS: tokens, COMPLETION_LENGTHS: lengths,
             **self.host_fn(prompts[PROMPT_TOKENS], prompts[PROMPT_LENGTHS], tokens, lengths)}
    aligned = self.clock()
    new_state, metrics = self.inner.call(state, self.inner.place_batch(batch))
    return new_state, {**metrics, "sampling_s": np.float32(sampled - start),
                       "host_alignment_s": np.float32(aligned - sampled)}

  def runner(self) -> backends.StepRunner:
    return dataclasses.replace(self.inner, call=self, place_batch=self.place_batch)
