"""Trainers by name: the `trainer` field of a job config picks one."""

from __future__ import annotations

from distillax.errors import ConfigError


def get_trainer(name: str):
  from distillax.trainers.base import Trainer
  registry = {"lm": Trainer}
  try:
    from distillax.trainers.distill import DistillTrainer
    registry["distill"] = DistillTrainer
  except ImportError:
    pass
  try:
    from distillax.trainers.qat import QATTrainer
    registry["qat"] = QATTrainer
  except ImportError:
    pass
  if name not in registry:
    raise ConfigError(f"trainer={name!r} is unknown; use one of {', '.join(sorted(registry))}")
  return registry[name]
