"""What the training loop runs beside its steps (trainers/base.py): the metrics logger with its
throughput and MFU, the preemption guard, the profile window and the progress bar, made and
closed together; and the line that says where the time to a session's first step went."""

from __future__ import annotations

import dataclasses

import jax
from absl import logging

from distillax.framework.run.checkpoint import Checkpointer
from distillax.framework.run.metrics import MetricLogger
from distillax.framework.run.preemption import PreemptionGuard
from distillax.framework.run.profiling import ProfileWindow
from distillax.framework.run.progress import ProgressBar
from distillax.framework.run.writers import create_writers
from distillax.framework.throughput import Throughput, peak_flops_per_device


@dataclasses.dataclass
class Tools:
  """What the loop runs beside the steps, closed together at the session's end."""

  logger: MetricLogger
  guard: PreemptionGuard
  profile: ProfileWindow
  progress: ProgressBar

  def close(self, state, ckpt: Checkpointer, *, finished: bool) -> None:
    """The signal handlers go last: a Ctrl-C while the last save completes is still caught."""
    self.profile.close(block_on=state)
    self.logger.close(log_partial=finished)
    self.progress.close()
    ckpt.close()
    self.guard.close()


def make_tools(recipe, workdir: str, primary: bool, step: int, window) -> Tools:
  """The tools of a session that starts at `step` with the open metrics window `window`."""
  c = recipe.config
  tools = Tools(
      MetricLogger(create_writers(workdir, is_primary=primary, resume_step=step,
                                  console=not c.train.progress),
                   log_every=int(c.train.log_every), throughput=_throughput(recipe)),
      PreemptionGuard(),
      ProfileWindow(workdir, max(int(c.profile.start_step), 0),
                    int(c.profile.num_steps) if int(c.profile.start_step) >= 0 else 0,
                    enabled=primary),
      ProgressBar(int(c.train.steps), desc=recipe.name, initial=step,
                  enabled=bool(c.train.progress) and primary))
  tools.logger.restore_window(window)
  return tools


def _throughput(recipe) -> Throughput:
  peak, source = peak_flops_per_device()
  logging.info("MFU peak per device: %s", source)
  return Throughput(recipe.batch_size * recipe.seq_len, recipe.step_flops(), jax.device_count(),
                    peak)


def log_first_step(recipe, runner, metrics, step: int, primary: bool) -> None:
  """The line that says where the time to this session's first step went (waits for it)."""
  jax.block_until_ready(metrics)
  recipe.startup.mark("first step")
  if primary:
    program = runner.program
    logging.info("%s", recipe.startup.line(step, None if program is None
                                            else program.compile_seconds))
