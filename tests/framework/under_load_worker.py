"""The loaded half of test_under_load, in its own process: pmap and shard_map training runs on 8
simulated devices while the parent keeps the host busy. Their losses and final params go to an
.npz file (plain float arrays; read back with allow_pickle=False).

A child, because a collective that aborts XLA:CPU takes its whole process with it: here that is
one failed test with XLA's own message in its report, never a lost pytest-xdist worker."""

import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")


def main(out_path: str) -> None:
  import numpy as np

  from distillax.models.init import create_model
  from tests.support.engines import mesh_and_rules, packed_batches, train_copy
  from tests.support.models import TINY

  assert jax.device_count() == 8, "the parent passes XLA_FLAGS with 8 simulated devices"
  mesh, rules = mesh_and_rules("dp", 8)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=0)
  arrays = {}
  for backend in ("pmap", "shard_map"):
    losses, params = train_copy(backend, model, mesh, rules, packed_batches(3))
    arrays[f"{backend}/losses"] = losses
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      arrays[f"{backend}/params{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
  np.savez(out_path, **arrays)


if __name__ == "__main__":
  main(sys.argv[1])
