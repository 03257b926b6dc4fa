"""Every backend and preset computes the same training run (fp32, 10 steps, same data)."""

import logging

import jax
import numpy as np
import pytest

from tests.support.engines import packed_batches, run_training

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
JIT_GRID += [("tp_sp", (4, 2)), ("fsdp_tp_sp", (2, 4))]  # sequence parallelism: same numbers


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


def test_pmap_compiles_its_step_once(caplog):
  """The state is placed the way pmap lays out its outputs, so step 2 reuses step 1's program."""
  from distillax.models.init import create_model
  from tests.support.engines import mesh_and_rules, tiny_engine
  from tests.support.models import TINY

  mesh, rules = mesh_and_rules("dp", 8)
  model = create_model(TINY, mesh=mesh, rules=rules, seed=0)
  engine = tiny_engine(model, BATCHES[0], mesh, rules, "pmap", steps=3)
  state = engine.init_state(model, {}, seed=0)
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    for b in BATCHES[:3]:
      state, metrics = engine.runner(state, engine.runner.place_batch(b))
    jax.block_until_ready(metrics)
  # The step is the compiled program whose arguments include the stacked rng key data.
  step_compiles = [r for r in caplog.records
                   if r.getMessage().startswith("Compiling") and "uint32[8,2]" in r.getMessage()]
  assert len(step_compiles) == 1, [r.getMessage()[:120] for r in step_compiles]


def test_the_compile_log_line_gives_flops_only_when_the_compiler_does(caplog):
  """The GPU compiler's cost analysis has no 'flops': the line says so, not `nan FLOPs`."""
  from distillax.framework.backends import log_compiled_stats
  with caplog.at_level(logging.INFO):
    log_compiled_stats("jit", {"argument_size_in_bytes": 2048.0})
    log_compiled_stats("jit", {"argument_size_in_bytes": 2048.0, "flops": 2.5e9})
  lines = [r.getMessage() for r in caplog.records if "compiled jit step" in r.getMessage()]
  assert len(lines) == 2 and "arguments 2.00 KiB" in lines[0], lines
  assert lines[0].endswith("; no FLOPs figure from this compiler") and "nan" not in lines[0]
  assert lines[1].endswith("; 2.5e+09 FLOPs"), lines[1]
