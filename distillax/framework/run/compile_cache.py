"""JAX's persistent compilation cache in the workdir, so that a resumed run compiles nothing.

A training job keeps every program it compiles (its steps, evals, model creation, optimizer
init) in `<workdir>/compile_cache`, with JAX's thresholds at 0 so that no program is too small
or too quick to keep; the run resumed in that workdir reads them back instead of compiling. JAX
writes entries from process 0 only; every process of a multi-process run reads them.

The user's own cache wins: with JAX_COMPILATION_CACHE_DIR (or jax_compilation_cache_dir) set,
the run uses that one as configured, and with JAX_ENABLE_COMPILATION_CACHE=false none. A
workdir that cannot be written gets no cache (the run fails on it later with its own message).

`plan --target` compiles for a TPU or GPU on this host's compile-only client: those compiles use
no persistent cache (`disabled`). They must not fill a cache meant for the host, and the
compile-only client cannot load an entry back ('PjRtCompiler must be constructed with a
Client'). Entries are keyed by platform, so host compiles never read a TPU entry.

JAX's cache is process-wide: switching it waits for the steps still compiling in the background
(framework/step_program.py), and each context puts back what it found.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from distillax import interrupts
from distillax.framework.step_program import wait_for_pending

CACHE_DIR = "compile_cache"
_SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache",
             "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def _current() -> dict:
  return {name: getattr(jax.config, name) for name in _SETTINGS}


@contextlib.contextmanager
def _switched(**settings) -> Iterator[None]:
  """JAX's cache with `settings` inside, what it was before after (JAX builds its cache object
  once from the settings, so each switch also resets that object)."""
  wait_for_pending()
  before = _current()
  for name, value in settings.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    if not interrupts.pending():  # Ctrl-C leaves at once: a compile may take minutes to end
      wait_for_pending()
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


@contextlib.contextmanager
def in_workdir(workdir: str) -> Iterator[str | None]:
  """Every program compiled inside is kept in (and read from) `<workdir>/compile_cache`; yields
  that path, or None where the user's settings or an unwritable workdir leave the cache as is."""
  settings = _current()
  if settings["jax_compilation_cache_dir"] or not settings["jax_enable_compilation_cache"]:
    yield None
    return
  path = os.path.join(os.path.abspath(workdir), CACHE_DIR)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    logging.info("no compilation cache in %s (%s)", path, e.strerror or e)
    yield None
    return
  with _switched(jax_compilation_cache_dir=path, jax_enable_compilation_cache=True,
                 jax_persistent_cache_min_compile_time_secs=0.0,
                 jax_persistent_cache_min_entry_size_bytes=-1):
    yield path


@contextlib.contextmanager
def disabled() -> Iterator[None]:
  """No persistent compilation cache for what compiles inside (target compiles)."""
  with _switched(jax_enable_compilation_cache=False):
    yield
