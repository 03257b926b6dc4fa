"""Expert parallelism is placement only: the tiny MoE trains to the same numbers with its experts
split over data (fsdp_ep, ep_tp) as with every parameter replicated (dp), on 8 devices; and the
shard_map backend (each worker routes its own tokens) gives the numbers of jit."""

import jax
import numpy as np
import pytest

from tests.support.engines import packed_batches, run_training
from tests.support.models import TINY

# One layer of 4 experts of width 16, top-2: one expert per data group on a (4, 2) mesh.
MOE = TINY.replace(num_layers=1, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16)
BATCHES = packed_batches(3)


@pytest.fixture(scope="module")
def replicated():
  return run_training("jit", "dp", (8, 1), BATCHES, model_cfg=MOE)


@pytest.mark.parametrize("backend,strategy,mesh", [("jit", "fsdp_ep", (4, 2)),
                                                   ("jit", "ep_tp", (4, 2)),
                                                   ("shard_map", "dp", (8, 1))])
def test_expert_parallel_presets_train_like_replicated(backend, strategy, mesh, replicated):
  losses, params, engine = run_training(backend, strategy, mesh, BATCHES, model_cfg=MOE)
  ref_losses, ref_params, _ = replicated
  gate_spec = engine.layout.shardings.params["layers"][0]["mlp"]["gate"].spec
  assert (tuple(gate_spec)[:1] == ("data",)) == (strategy != "dp")  # experts split over data
  assert ref_losses[-1] < ref_losses[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=f"{strategy} {path}")
