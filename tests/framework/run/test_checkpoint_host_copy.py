"""Checkpointer.copy_to_host_early: the device-to-host copies a save waits for, started before
the save (the loop starts them before the eval of a step it then saves). What orbax then copies
is what was started: its own requests (jax.Array.copy_to_host_async, watched here) land on the
very arrays whose copies are under way; for a one-device state all of them, on 4 x 2 devices
those of the arrays no two devices share (orbax splits a replicated array over its replicas,
and those are left to it). The save restores to the same values either way."""

import jax
import pytest
from jax._src import array as jax_array

from distillax import partitioning as pt
from distillax.framework.run.checkpoint import Checkpointer
from tests.framework.run.test_checkpoint import (abstract_of, assert_same_values,
                                                 reference_state, state_shardings)


@pytest.mark.parametrize("data, model", [(1, 1), (4, 2)])
def test_the_save_copies_the_arrays_whose_copies_started_before_it(tmp_path, monkeypatch, data,
                                                                   model):
  mesh = pt.create_mesh({"data": data, "model": model}, devices=jax.devices()[:data * model])
  shardings = state_shardings(mesh, "fsdp_tp")
  state = jax.device_put(reference_state(), shardings)
  asked, copy = [], jax_array.ArrayImpl.copy_to_host_async

  def watched(self):
    asked.append(self)
    return copy(self)
  monkeypatch.setattr(jax_array.ArrayImpl, "copy_to_host_async", watched)

  with Checkpointer(tmp_path / "checkpoints", every_steps=1, async_save=False) as ckpt:
    started = ckpt.copy_to_host_early(state)
    early, asked[:] = list(asked), []
    assert ckpt.save(5, state, force=True)
  by_save = {id(x) for x in asked}
  assert started == len(early) > 0
  assert all(id(x) in by_save for x in early)  # every early copy is one the save reads
  if data * model == 1:  # one device: the save asks for no copy that did not start early
    assert len(by_save) == len(early) == len(jax.tree.leaves(state))
  else:  # the replicated arrays (the step, the RNG, ...) are left to the save
    assert len(by_save) > len(early)

  with Checkpointer(tmp_path / "checkpoints", every_steps=1) as ckpt:
    restored, _, _ = ckpt.restore(5, abstract_state=abstract_of(reference_state()),
                                  shardings=shardings)
  assert_same_values(restored, reference_state())
