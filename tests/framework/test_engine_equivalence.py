"""Every backend and preset computes the same training run (fp32, 10 steps, same data)."""

import jax
import numpy as np
import pytest

from tests.framework.engine_fixtures import packed_batches, run_training

BATCHES = packed_batches(10)


@pytest.fixture(scope="module")
def reference():
  return run_training("jit", "dp", (8, 1), BATCHES)


def _assert_same(run, reference, what):
  losses, params, _ = run
  ref_losses, ref_params, _ = reference
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"{what} {path}")


def test_reference_run_learns(reference):
  losses = reference[0]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05


JIT_GRID = [(s, m) for s in ("dp", "fsdp", "tp", "fsdp_tp") for m in ((8, 1), (4, 2), (2, 4))
            if (s, m) != ("dp", (8, 1))]  # that one is the reference


@pytest.mark.parametrize("strategy,mesh_shape", JIT_GRID)
def test_jit_presets_and_meshes_agree(strategy, mesh_shape, reference):
  run = run_training("jit", strategy, mesh_shape, BATCHES)
  _assert_same(run, reference, f"jit/{strategy}/{mesh_shape}")


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "vmap"])
def test_collective_backends_agree_with_jit(backend, reference):
  run = run_training(backend, "dp", (8, 1), BATCHES)
  _assert_same(run, reference, backend)


def test_gradient_accumulation_4x2_equals_one_batch_of_8():
  """4 micro-batches of 2 rows inside the step == one step on all 8 rows (data=2 x model=4)."""
  one = run_training("jit", "fsdp_tp", (2, 4), BATCHES[:4])
  acc = run_training("jit", "fsdp_tp", (2, 4), BATCHES[:4], accum_steps=4)
  _assert_same(acc, one, "jit accumulation")
  # The collective path accumulates identically: 2 vmap workers x 4 micro-batches of 1 row.
  acc_vmap = run_training("vmap", "dp", (2, 4), BATCHES[:4], accum_steps=4)
  _assert_same(acc_vmap, one, "vmap accumulation")
