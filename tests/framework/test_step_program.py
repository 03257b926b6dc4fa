"""A step compiled in the background (framework/step_program.py): what waits for it gets the
program a plain compile gives, and a compile error is raised there with its own type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.framework import step_program


def _lowered():
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  return jax.jit(lambda a, b: (a @ b).sum(axis=0)).lower(x, x)


def test_background_compile_gives_the_program_and_figures_of_a_plain_one():
  seen = []
  step = step_program.AotStep(_lowered(), on_ready=seen.append)
  plain = _lowered().compile()
  step_program.wait_for_pending()
  assert step.done()
  assert step.stats == step_program.compiled_stats(plain)
  assert step.stats["flops"] == pytest.approx(2 * 64**3 + 63 * 64, rel=0.01)
  a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
  np.testing.assert_allclose(np.asarray(step(a, a)), (a @ a).sum(axis=0), rtol=1e-5)
  assert seen == [step.stats]  # announced once, whatever read it first


class _Refused:
  """A lowered program whose compiler runs out of memory."""

  def compile(self):
    raise MemoryError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")


def test_a_compile_error_is_raised_where_the_step_is_used():
  step = step_program.AotStep(_Refused())
  step_program.wait_for_pending()
  for read in (lambda: step.stats, lambda: step.executable, lambda: step(1, 2)):
    with pytest.raises(MemoryError, match="RESOURCE_EXHAUSTED"):
      read()
  with pytest.raises(MemoryError, match="RESOURCE_EXHAUSTED"):  # compiled here: raised here
    step_program.AotStep(_Refused(), background=False)
