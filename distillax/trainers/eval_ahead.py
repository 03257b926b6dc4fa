"""The session's first eval compiled while the run starts (framework/eval_programs.py).

A run evaluates every `train.eval_every` steps and at `train.steps`; its first eval used to
compile the eval's programs there, after the train step's compile and the models' creation
(on the lent TPU v5e, 21 s to the end of distill_qwen3.py's eval at step 2). Started with the
step's background compile, they compile beside it and the first eval runs them. After it instead
(chip call 45), the step compiled in 23.0 s rather than 24.7 (17.6 alone: the models' init
compiles beside it too), but the eval at step 2 then waited 8 s for its own compile: beside it
stays.
"""

from __future__ import annotations

from distillax.framework.eval_programs import compile_ahead


def first_eval_step(config, start_step: int) -> int | None:
  """The step of the first eval of a session that starts at `start_step` (None: it evaluates
  nothing, being at train.steps already)."""
  total, every = int(config.train.steps), int(config.train.eval_every)
  if start_step >= total:
    return None
  return min(total, (start_step // every + 1) * every) if every > 0 else total


def compile_first_eval(recipe, engines, start_step: int) -> None:
  """Starts compiling the programs of the session's first eval (on the engine that serves that
  step, with the recipe's eval batches) in the background; returns at once. `start_step`: the
  newest checkpoint's step (0 for a fresh run); should the session start elsewhere (an unreadable
  newest checkpoint, a rollback), an eval that finds nothing compiled for it compiles as before."""
  at = first_eval_step(recipe.config, start_step)
  if at is not None:
    compile_ahead(engines.at(at), recipe.eval_iterator)
