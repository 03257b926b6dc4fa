"""Resume: a restored iterator continues with exactly the batches of an uninterrupted one."""

import json
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.data.data_testing import data_config, orbax_save_args, save_iterator_state
from distillax import data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def take(iterator, count):
  return [next(iterator) for _ in range(count)]


def assert_same_batches(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert sorted(g) == sorted(w)
    for key in w:
      np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_resume_in_a_fresh_process_from_orbax_and_json(tmp_path):
  data_fields = {"shuffle_buffer": 48, "seed": 11}
  iterator_args = {"global_batch_size": 4, "seq_len": 64, "seed": 0, "process_index": 0,
                   "process_count": 1}
  consumed, count, step = 37, 6, 37

  it = data.make_train_iterator(data_config(**data_fields), **iterator_args)
  take(it, consumed)
  state = it.get_state()
  assert state["pos_in_window"] % 48 != 0  # saved mid shuffle window...
  assert json.loads(json.dumps(state)) == state  # ...and the state is plain JSON
  checkpoint_dir = str(tmp_path / "ckpt")
  with ocp.CheckpointManager(checkpoint_dir) as manager:
    manager.save(step, args=ocp.args.Composite(data=orbax_save_args(it)))
    manager.wait_until_finished()
  save_iterator_state(it, str(tmp_path / "state.json"))
  expected = take(it, count)

  uninterrupted = data.make_train_iterator(data_config(**data_fields), **iterator_args)
  assert_same_batches(take(uninterrupted, consumed + count)[consumed:], expected)

  spec = {"data": data_fields, "iterator": iterator_args, "count": count, "step": step,
          "checkpoint_dir": checkpoint_dir, "state_json": str(tmp_path / "state.json"),
          "out": str(tmp_path / "next")}
  subprocess.run([sys.executable, "-m", "tests.data.resume_worker", json.dumps(spec)],
                 check=True, timeout=600, cwd=ROOT)
  for suffix in ("orbax", "json"):
    with np.load(str(tmp_path / f"next_{suffix}.npz")) as f:
      got = [{k: f[f"{i}/{k}"] for k in data.BATCH_KEYS} for i in range(count)]
    assert_same_batches(got, expected)


@pytest.mark.parametrize("consumed", [0, 1, 5, 12])
def test_restore_mid_document_and_across_epochs(corpus, consumed):
  """Small corpus, 3 epochs: save points fall inside documents, windows and epoch boundaries."""
  folder, _ = corpus
  cfg = data_config(source=folder, validation_fraction=0.0, num_epochs=3, shuffle_buffer=48)
  args = dict(global_batch_size=2, seq_len=24, seed=4, process_index=1, process_count=2)
  reference = list(data.make_train_iterator(cfg, **args))
  it = data.make_train_iterator(cfg, **args)
  take(it, consumed)
  state_json = data.iterator_state_json(it)
  fresh = data.make_train_iterator(cfg, **args)
  data.restore_iterator_state(fresh, state_json)
  assert_same_batches(list(fresh), reference[consumed:])
