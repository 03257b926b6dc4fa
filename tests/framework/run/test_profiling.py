"""The profiler window (framework/run/profiling.py): traces exactly its steps, or nothing."""

import glob
import os

import jax
import jax.numpy as jnp
import pytest

from distillax.errors import ConfigError
from distillax.framework.run import profiling


def test_profile_window_traces_only_its_steps(tmp_path):
  step = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((32, 32)) / 32
  window = profiling.ProfileWindow(str(tmp_path), start_step=2, num_steps=2)
  started_at = stopped_at = None
  for i in range(1, 6):
    window.step(i, block_on=x)
    if window.active and started_at is None:
      started_at = i
    if window.done and stopped_at is None:
      stopped_at = i
    x = step(x)
  window.close(x)
  assert (started_at, stopped_at) == (2, 4)
  traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_profile_window_off_and_invalid(tmp_path):
  off = profiling.ProfileWindow(str(tmp_path), start_step=1, num_steps=0)
  for i in range(1, 4):
    off.step(i)
  off.close()
  assert not (tmp_path / "profile").exists()
  with pytest.raises(ConfigError, match="num_steps"):
    profiling.ProfileWindow(str(tmp_path), start_step=1, num_steps=-1)
