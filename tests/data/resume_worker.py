"""Run as a fresh process by test_state and test_records (`python -m tests.data.resume_worker`
from the repository root): rebuild the train iterator, restore its state from an orbax checkpoint
and from a JSON file, and write the next batches of each to .npz files."""

import json
import sys

import numpy as np


def main():
  spec = json.loads(sys.argv[1])
  import orbax.checkpoint as ocp
  from distillax import data
  from tests.data.data_testing import load_iterator_state, orbax_restore_args

  def fresh():
    cfg = data.default_data_config()
    cfg.update(spec["data"])
    return data.make_train_iterator(cfg, **spec["iterator"])

  def write(iterator, path):
    batches = [next(iterator) for _ in range(spec["count"])]
    np.savez(path, **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})

  from_orbax = fresh()
  with ocp.CheckpointManager(spec["checkpoint_dir"]) as manager:
    manager.restore(spec["step"], args=ocp.args.Composite(data=orbax_restore_args(from_orbax)))
  write(from_orbax, spec["out"] + "_orbax.npz")

  from_json = fresh()
  load_iterator_state(from_json, spec["state_json"])
  write(from_json, spec["out"] + "_json.npz")


if __name__ == "__main__":
  main()
