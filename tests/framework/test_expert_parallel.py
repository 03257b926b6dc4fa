"""Expert parallelism is a rule set: the tiny MoE trains to the numbers of every parameter
replicated (dp) under every other partitioning preset on 8 devices, the EP ones (fsdp_ep, ep_tp)
exchanging tokens in their shard_map region; and the data-parallel backends shard_map and pmap
give jit's numbers or refuse the EP presets in one line.

Run with -s to print the README's "EP vs replicated" table."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.models.init import create_model
from tests.support.engines import mesh_and_rules, packed_batches, run_steps, tiny_engine
from tests.support.models import TINY

# One layer of 4 experts of width 16, top-2: one expert per data group on a (4, 2) mesh.
MOE = TINY.replace(num_layers=1, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16)
BATCHES = packed_batches(3)
MESH = (4, 2)
EP_PRESETS = ("fsdp_ep", "ep_tp")


@pytest.fixture(scope="module")
def model():
  """One initialised model for every run (each places a copy by its own rules)."""
  mesh, rules = mesh_and_rules("dp", *MESH)
  return create_model(MOE, mesh=mesh, rules=rules, seed=0)


def _train(model, backend, strategy, mesh_shape, devices=None):
  """(losses, final params on the host, engine) of 3 steps from a copy of `model`."""
  mesh, rules = mesh_and_rules(strategy, *mesh_shape, devices=devices)
  graphdef, weights = nnx.split(model)
  copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, weights))
  engine = tiny_engine(copy, BATCHES[0], mesh, rules, backend, steps=len(BATCHES))
  state, losses = run_steps(engine, engine.init_state(copy, {}, seed=0), BATCHES)
  return losses, jax.device_get(engine.runner.fetch_state(state).params), engine


@pytest.fixture(scope="module")
def replicated(model):
  return _train(model, "jit", "dp", MESH)


def _max_param_delta(params, ref_params) -> float:
  return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))


def test_every_preset_trains_the_moe_like_replicated(model, replicated):
  ref_losses, ref_params, _ = replicated
  # The reference trains: its parameters move by far more than the agreement asked below (its
  # losses are of three different random batches, too noisy to order after three steps).
  initial = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert np.all(np.isfinite(ref_losses)) and _max_param_delta(ref_params, initial) > 1e-3
  rows = []
  for strategy in pt.BUILTIN_PRESETS[1:]:
    losses, params, engine = _train(model, "jit", strategy, MESH)
    gate_spec = tuple(engine.layout.shardings.params["layers"][0]["mlp"]["gate"].spec)
    exchanges = len(re.findall(r"all-to-all\(", engine.runner.compiled_text()))
    # Experts split over data exactly under the EP presets, which exchange tokens (GSPMD's own
    # reshards may use all-to-alls too: fsdp has some).
    assert (gate_spec[:1] == ("data",)) == (strategy in EP_PRESETS), (strategy, gate_spec)
    assert exchanges > 0 or strategy not in EP_PRESETS, (strategy, exchanges)
    d_loss = float(np.max(np.abs(losses - ref_losses)))
    d_param = _max_param_delta(params, ref_params)
    rows.append((strategy, "x".join(map(str, MESH)), str(gate_spec), exchanges, d_loss, d_param))
    assert d_loss < 2e-5 and d_param < 2e-5, rows[-1]
  assert pt.BUILTIN_PRESETS[0] == "dp"  # the reference, replicated
  print("\npreset      mesh  experts (gate spec)        all-to-alls  max|dloss|  max|dparam|")
  for r in rows:
    print(f"{r[0]:<11} {r[1]:<5} {r[2]:<26} {r[3]:>11}  {r[4]:.1e}     {r[5]:.1e}")


def test_data_parallel_backends_give_jits_numbers_or_refuse_in_one_line(model, replicated):
  ref_losses, ref_params, _ = replicated
  # vmap cannot batch ragged_dot: a job says so in one line (tests/trainers/test_lm.py).
  for backend in ("shard_map", "pmap"):
    losses, params, _ = _train(model, backend, "dp", (8, 1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=backend)
    assert _max_param_delta(params, ref_params) < 2e-5, backend
  for backend in ("shard_map", "pmap"):  # 4 experts over a data axis of 4
    with pytest.raises(ConfigError, match=f"backend={backend} keeps parameters replicated, but "
                                          f"partitioning.strategy shards them"):
      _train(model, backend, "fsdp_ep", (4, 1), devices=jax.devices()[:4])
