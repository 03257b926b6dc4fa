"""A window of training steps traced with jax.profiler into `<workdir>/profile/`.

Tracing every step would slow the run and produce gigabytes; one short window after warm-up
(compilation done, caches hot) shows what a steady step costs. Open the result with TensorBoard's
profile plugin or xprof (`<workdir>/profile/plugins/profile/<run>/*.xplane.pb`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
from absl import logging

from distillax.errors import ConfigError

PROFILE_DIR = "profile"


class ProfileWindow:
  """Traces steps [start_step, start_step + num_steps); num_steps=0 disables it.

  Call `step(step, block_on=...)` at the top of every step, before dispatching it. The trace
  starts when `step == start_step` and stops when `step == start_step + num_steps`, after waiting
  for `block_on` (e.g. the previous step's outputs) so the traced steps' device work is captured,
  not just their dispatch. `close()` stops a window the run ended inside.
  """

  def __init__(self, workdir: str, start_step: int, num_steps: int, *, enabled: bool = True):
    if num_steps < 0 or start_step < 0:
      raise ConfigError(f"profile window start_step={start_step}, num_steps={num_steps}: both "
                        "must be >= 0 (num_steps=0 turns profiling off)")
    self.logdir = os.path.join(workdir, PROFILE_DIR)
    self.start_step = start_step
    self.stop_step = start_step + num_steps
    self.enabled = enabled and num_steps > 0
    self.active = False
    self.done = False

  def step(self, step: int, block_on: Any = None):
    if not self.enabled or self.done:
      return
    if not self.active and self.start_step <= step < self.stop_step:
      os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self.logdir)
      self.active = True
      logging.info("Profiling steps %d..%d into %s", step, self.stop_step - 1, self.logdir)
    elif self.active and step >= self.stop_step:
      self._stop(block_on)

  def _stop(self, block_on: Any = None):
    if block_on is not None:
      jax.block_until_ready(block_on)
    jax.profiler.stop_trace()
    self.active = False
    self.done = True
    logging.info("Profile written to %s", self.logdir)

  def close(self, block_on: Any = None):
    if self.active:
      self._stop(block_on)
