"""Trainers by name: the `trainer` field of a job config picks one."""

from __future__ import annotations

from distillax.errors import ConfigError


def get_trainer(name: str):
  from distillax.trainers.base import Trainer
  registry = {"lm": Trainer}
  from distillax.trainers.distill import DistillTrainer
  registry["distill"] = DistillTrainer
  from distillax.distill.sequence_kd import SequenceKDTrainer
  registry["sequence_kd"] = SequenceKDTrainer
  from distillax.demo import DemoPipeline
  registry["demo"] = DemoPipeline
  if name not in registry:
    raise ConfigError(f"trainer={name!r} is unknown; use one of {', '.join(sorted(registry))}")
  return registry[name]
