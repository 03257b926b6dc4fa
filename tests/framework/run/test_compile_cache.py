"""JAX's persistent compilation cache in the workdir (framework/run/compile_cache.py): programs
compiled inside `in_workdir` land in <workdir>/compile_cache, nothing compiled inside `disabled`
is written or read, the user's own cache wins, and each context puts back what it found. The
trainer's use of it (a resumed run compiles nothing) is tested in
tests/trainers/test_first_step.py."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from distillax.framework.run import compile_cache


@pytest.fixture
def no_user_cache():
  """The session's cache (tests/conftest.py) set aside: the process as a user starts it."""
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  jax_cache.reset_cache()
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  jax_cache.reset_cache()


def _compile_fresh(tag: float):
  """A program no earlier test compiled (its constant is new)."""
  jax.jit(lambda x: x * tag + 1.0).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).compile()


def _entries(path) -> list[str]:
  return sorted(p for p in os.listdir(path) if p.endswith("-cache"))


def test_in_workdir_keeps_every_program_and_restores_the_settings(tmp_path, no_user_cache):
  before = {k: getattr(jax.config, k) for k in compile_cache._SETTINGS}
  with compile_cache.in_workdir(str(tmp_path)) as path:
    assert path == str(tmp_path / "compile_cache")
    _compile_fresh(0.125)  # compiled in microseconds: the thresholds are 0
    assert len(_entries(path)) == 1
    with compile_cache.disabled():
      _compile_fresh(0.25)
    assert len(_entries(path)) == 1  # nothing written from inside `disabled`
  assert {k: getattr(jax.config, k) for k in compile_cache._SETTINGS} == before
  _compile_fresh(0.5)  # outside: no cache at all again
  assert len(_entries(tmp_path / "compile_cache")) == 1


def test_the_users_own_cache_wins(tmp_path):
  mine = jax.config.jax_compilation_cache_dir  # the session's, set through the environment
  assert mine
  with compile_cache.in_workdir(str(tmp_path)) as path:
    assert path is None and jax.config.jax_compilation_cache_dir == mine
  assert not (tmp_path / "compile_cache").exists()


def test_an_unwritable_workdir_gets_no_cache(no_user_cache):
  with compile_cache.in_workdir("/proc/distillax_wd") as path:
    assert path is None and jax.config.jax_compilation_cache_dir is None
