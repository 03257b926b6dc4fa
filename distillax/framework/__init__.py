"""The engine every job runs: state, the one train step, backends, optimizer, checkpoints,
metrics. Most callers need only these names; the modules hold the rest.

    engine = build_engine(student, extras, objective, optimizer_cfg, steps, mesh, rules,
                          backend, batch_shapes)
    state = engine.init_state(student, extras, seed)
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    metrics = evaluate(engine, state, eval_batches)  # exact means over every real token

The names are looked up when first used, so importing a light module of this package (the
CLI's `run.logs` and `run.runtime`, before the job's imports) does not load flax, optax, orbax
and grain: the CLI opens the accelerator while those imports run (distillax/main.py).
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_WHERE = {"Engine": "engine", "build_engine": "engine", "PerToken": "evaluation",
          "evaluate": "evaluation", "format_count": "run.progress", "STUDENT": "state",
          "TrainState": "state", "Objective": "step", "ObjectiveOutput": "step"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
  if name in _WHERE:
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
