"""What the on-policy recipe adds around the loop's usual pieces, each apart from the recipe:

  OnPolicyIterator  the distill recipe's packed batches plus each step's prompts, resumable
  SamplingClock     times a sampling-only program once per log interval (metrics)

Why a separate sampling-only program for the timing: sampling runs inside the one compiled
train step, whose parts no host clock can see. Once per log interval the clock runs the same
decode (same arrays, same key, same prompts) compiled on its own, blocks on it, then runs the
train step and blocks on that; `sampling_share` is the first time over the second and
`sampled_tokens_per_s` the completion tokens it sampled over its time. Both are measured, not
modelled; the share is an estimate, since XLA schedules the decode inside the step together
with the rest, and it is capped at 1. On the other steps nothing blocks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax
import numpy as np

from distillax import partitioning as pt
from distillax.distill.on_policy.objective import OnPolicySettings, sample_rollout
from distillax.distill.on_policy.eval import prompt_arrays
from distillax.distill.student import unwrap_student
from distillax.framework import backends
from distillax.framework.engine import Engine

SAMPLES_DIR = "on_policy_samples"


class OnPolicyIterator:
  """Packed batches (the lmbda < 1 share and the distill objective's keys) plus this process's
  rows of the step's prompts, which cycle through `prompts` in order. Its state is the packed
  iterator's and the number of prompt batches taken, so a resumed run continues exactly."""

  def __init__(self, packed, prompts, *, global_batch: int, width: int, pad_id: int,
               process_index: int = 0, process_count: int = 1):
    self.packed, self.prompts = packed, list(prompts)
    self.global_batch, self.width, self.pad_id = int(global_batch), int(width), int(pad_id)
    self.local = self.global_batch // int(process_count)
    self.first = int(process_index) * self.local
    self.position = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self.packed))
    start = self.position * self.global_batch + self.first
    rows = [self.prompts[(start + i) % len(self.prompts)] for i in range(self.local)]
    batch.update(prompt_arrays(rows, self.width, self.pad_id, first_row=self.first))
    self.position += 1
    return batch

  def get_state(self) -> dict:
    return {"packed": self.packed.get_state(), "prompt_batches": self.position}

  def set_state(self, state: dict) -> None:
    self.packed.set_state(state["packed"])
    self.position = int(state["prompt_batches"])


def sampling_program(engine: Engine, settings: OnPolicySettings) -> Callable:
  """(global state, global batch) -> completion lengths: the step's decode alone, with the
  step's sampling key (the objective's fold_in(step key, 1))."""
  defs, mesh, rules = engine.layout.defs, engine.mesh, engine.rules

  def run(state, batch):
    with pt.use_rules(mesh, rules):
      student, _ = defs.merge(state.params, state.frozen)
      key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      rollout = sample_rollout(unwrap_student(student)[0], batch, jax.random.fold_in(key, 1),
                               settings)
      return rollout.generated.lengths_B
  return jax.jit(run)


class SamplingClock:
  """A runner's call and place_batch, timing the sampling every `every` steps (see the module
  doc); every step's metrics carry the last measured `sampled_tokens_per_s` and
  `sampling_share`."""

  def __init__(self, engine: Engine, settings: OnPolicySettings, every: int, *,
               clock: Callable[[], float] = time.perf_counter):
    self.engine, self.every, self.clock = engine, int(every), clock
    self.inner = engine.runner
    self.sample = sampling_program(engine, settings)
    self.place_global = backends.global_batch_placer(engine.mesh, engine.rules)
    self.calls, self.host_batch, self.figures = 0, None, {}

  def place_batch(self, batch):
    self.host_batch = batch
    return self.inner.place_batch(batch)

  def _timed_sampling(self, state, batch) -> tuple[float, int]:
    # The state may be the output of a step still running (nothing blocks between steps): wait
    # for it, and for the step's placed batch, before the clock starts, so that the time is the
    # decode's alone and not the tail of the previous step's.
    args = jax.block_until_ready((self.engine.global_state(state),
                                  self.place_global(self.host_batch)))
    jax.block_until_ready(batch)
    if not self.figures:
      jax.block_until_ready(self.sample(*args))  # compiles; not timed
    start = self.clock()
    lengths = jax.block_until_ready(self.sample(*args))
    return self.clock() - start, int(np.sum(jax.device_get(lengths)))

  def __call__(self, state, batch):
    measure = self.every > 0 and self.calls % self.every == 0 and self.host_batch is not None
    self.calls += 1
    if not measure:
      new_state, metrics = self.inner.call(state, batch)
    else:
      sample_s, sampled = self._timed_sampling(state, batch)
      start = self.clock()
      new_state, metrics = jax.block_until_ready(self.inner.call(state, batch))
      step_s = self.clock() - start
      # The two are timed apart, a few milliseconds each on a small model, so load on the
      # machine during one and not the other can put the decode alone above the whole step
      # that holds it (issue 31 saw 1.79 on on_policy.py:tiny): a share is at most 1.
      self.figures = {"sampled_tokens_per_s": np.float32(sampled / max(sample_s, 1e-9)),
                      "sampling_share": np.float32(min(sample_s / max(step_s, 1e-9), 1.0))}
    return new_state, {**metrics, **self.figures}

  def runner(self) -> backends.StepRunner:
    return dataclasses.replace(self.inner, call=self, place_batch=self.place_batch)


def write_samples(workdir: str, step: int, records: list[dict]) -> str:
  """<workdir>/on_policy_samples/step_<N>.jsonl, one record per prompt. A file of the same step
  with other completions (the step's eval before a rollback) is kept as
  step_<N>.superseded-<k>.jsonl, never overwritten; the same completions again (a resumed
  run's eval of the same step) leave one file."""
  folder = os.path.join(workdir, SAMPLES_DIR)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"step_{int(step):06d}.jsonl")
  text = "".join(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
                 for record in records)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      if f.read() == text:
        return path
    k = 1
    while os.path.exists(aside := f"{path[:-len('.jsonl')]}.superseded-{k}.jsonl"):
      k += 1
    os.replace(path, aside)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
  return path
