"""The engine every job runs: state, the one train step, backends, optimizer, checkpoints,
metrics. Most callers need only these names; the modules hold the rest.

    engine = build_engine(student, extras, objective, optimizer_cfg, steps, mesh, rules,
                          backend, batch_shapes)
    state = engine.init_state(student, extras, seed)
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    metrics = evaluate(engine, state, eval_batches)  # exact means over every real token
"""

from distillax.framework.engine import Engine, build_engine
from distillax.framework.evaluation import PerToken, evaluate
from distillax.framework.run.progress import format_count
from distillax.framework.state import STUDENT, TrainState
from distillax.framework.step import Objective, ObjectiveOutput

__all__ = ["Engine", "Objective", "ObjectiveOutput", "PerToken", "STUDENT", "TrainState",
           "build_engine", "evaluate", "format_count"]
