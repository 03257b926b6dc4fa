"""The eval's programs compiled ahead of the first eval (framework/eval_programs.py): that eval
compiles nothing and gives, to the last digit, the numbers of an eval that compiles its own
programs; batches of another shape still evaluate (compiling theirs); and a failure ahead of the
eval is left to the eval."""

import numpy as np
import pytest

from distillax.framework import eval_programs, evaluation, step_program
from distillax.models.init import create_model
from tests.support.compiles import Compiles
from tests.support.engines import mesh_and_rules, packed_batches, tiny_engine
from tests.support.models import TINY


def _engines_and_state(n: int = 2):
  """(n engines of one layout, a state they all take, 3 eval batches)."""
  mesh, rules = mesh_and_rules("fsdp_tp", 4, 2)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=3)
  batches = packed_batches(3, seed=5)
  batches[1]["loss_mask_BxL"][3:] = 0.0  # batches of unequal weight, as test_evaluation's
  engines = [tiny_engine(model, batches[0], mesh, rules, compile_now=False) for _ in range(n)]
  return engines, engines[0].init_state(model, {}, seed=0), batches


def test_the_eval_compiled_ahead_compiles_nothing_and_gives_the_same_numbers():
  (ahead, plain), state, batches = _engines_and_state()
  eval_programs.compile_ahead(ahead, lambda: iter(batches))
  step_program.wait_for_pending()  # what compiles in the background is not the eval's
  with Compiles() as during:
    got = evaluation.evaluate(ahead, state, batches)  # the sums and their adds, 3 batches
  assert during.names == [], during.names
  with Compiles() as own:
    want = evaluation.evaluate(plain, state, batches)
  assert own.main_names, "the plain engine's eval compiles its sums"
  assert got == want


def test_batches_of_another_shape_compile_their_own_program():
  (ahead, plain), state, batches = _engines_and_state()
  eval_programs.compile_ahead(ahead, lambda: iter(batches))
  shorter = [{k: v[:, :8].copy() for k, v in b.items()} for b in batches]
  with Compiles() as during:
    got = evaluation.evaluate(ahead, state, shorter)
  assert any(name and "traced" in name for name in during.main_names), during.main_names
  assert got == evaluation.evaluate(plain, state, shorter)
  # The first shape still runs what was compiled for it.
  with Compiles() as again:
    evaluation.evaluate(ahead, state, batches)
  assert again.names == [], again.names


def test_a_failure_ahead_of_the_eval_is_the_evals_to_raise():
  (ahead, plain), state, batches = _engines_and_state()

  def unreadable():
    raise OSError("the eval split is unreadable now")
  eval_programs.compile_ahead(ahead, unreadable)
  # The eval reads its batches itself: it evaluates as one that never compiled ahead.
  assert evaluation.evaluate(ahead, state, batches) == evaluation.evaluate(plain, state, batches)
  with pytest.raises(OSError, match="unreadable"):
    evaluation.evaluate(ahead, state, (b for b in unreadable()))


def test_signature_tells_apart_what_selects_another_executable():
  (engine,), state, batches = _engines_and_state(1)
  placed = engine.runner.place_batch(batches[0])
  same = eval_programs.signature((state, placed))
  assert same == eval_programs.signature((state, engine.runner.place_batch(batches[1])))
  other = {**placed, "loss_mask_BxL": placed["loss_mask_BxL"].astype(np.float16)}
  assert same != eval_programs.signature((state, other))
