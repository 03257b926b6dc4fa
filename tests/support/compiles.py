"""What XLA compiled while a block ran, from JAX's monitoring events (no clock): the programs by
name, in the thread that compiled each, and the persistent cache's hits and misses."""

from __future__ import annotations

import threading

import jax

COMPILE = "/jax/core/compile/backend_compile_duration"  # every compile request, hit or not
HIT, MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class Compiles:
  """`names`: the programs compiled while inside (every thread); `main_names`: those the main
  thread compiled (not a background compile's); `events`: every other event seen."""

  def __enter__(self):
    self.names, self.main_names, self.events = [], [], []
    self._on_event = lambda event, **kw: self.events.append(event)
    self._on_duration = lambda event, seconds, **kw: (
        self._compiled(kw.get("fun_name")) if event == COMPILE else None)
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def _compiled(self, name) -> None:
    self.names.append(name)
    if threading.current_thread() is threading.main_thread():
      self.main_names.append(name)

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
