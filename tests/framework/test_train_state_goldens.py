"""Golden sharding dumps of a mixture-of-experts train state under the expert-parallel presets.

tests/models/test_sharding_goldens.py pins the parameters; a run also holds the optimizer's
moments, its step counts and the RNG, and those are what a preset multiplies by the number of
experts. Each dump lists every leaf of the `TrainState` that `build_layout` makes for tiny_moe
with the default optimizer (AdamW, clipped), its shape, dtype, mesh spec and bytes per device.
Regenerate deliberately with DISTILLAX_UPDATE_GOLDENS=1 and read the diff before committing.
"""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from distillax import partitioning as pt
from distillax.framework import optim
from distillax.framework.state import build_layout
from distillax.models.init import abstract_model
from distillax.models.presets import get_preset
from tests.models.test_sharding_goldens import _differences, _spec_json, dumps

GOLDEN_DIR = pathlib.Path(__file__).parent / "goldens" / "train_state"
CASES = [("fsdp_ep", 4, 2), ("ep_tp", 4, 2)]


def _layout(strategy, data, model):
  student = abstract_model(get_preset("tiny_moe"))
  tx, _ = optim.make_optimizer(optim.default_optimizer_config(), 100)
  mesh = pt.create_mesh({"data": data, "model": model})
  return build_layout(student, {}, tx, mesh, pt.rules_from_config({"strategy": strategy}))


def train_state_dump(strategy, data, model):
  layout = _layout(strategy, data, model)
  flat = jax.tree_util.tree_flatten_with_path(layout.abstract)[0]
  shardings = jax.tree.leaves(layout.shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  leaves = {}
  for (path, x), sh in zip(flat, shardings, strict=True):
    shape = tuple(int(d) for d in x.shape)
    per_device = int(np.prod(sh.shard_shape(shape))) * np.dtype(x.dtype).itemsize
    spec = tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
    leaves[pt.shard.path_str(path)] = {"shape": list(shape), "dtype": str(np.dtype(x.dtype)),
                                       "mesh": _spec_json(spec), "bytes_per_device": per_device}
  return {"model": "tiny_moe", "strategy": strategy, "mesh": {"data": data, "model": model},
          "bytes_per_device": sum(v["bytes_per_device"] for v in leaves.values()),
          "params": leaves}


@pytest.mark.parametrize("strategy,data,model", CASES)
def test_golden_moe_train_state_dump(strategy, data, model):
  path = GOLDEN_DIR / f"tiny_moe_{strategy}_{data}x{model}.json"
  got = train_state_dump(strategy, data, model)
  if os.environ.get("DISTILLAX_UPDATE_GOLDENS"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(got))
  want = json.loads(path.read_text())
  assert got == want, "\n".join([f"{path} differs:"] + _differences(got, want))


def test_adam_moments_of_the_experts_follow_their_parameters_by_hand():
  """fsdp_ep on 4 x 2: each expert tensor (4, 64, 32) f32 is split 4 ways by expert, so a device
  holds one expert, 64 * 32 * 4 B = 8 KiB, of the parameter and of each moment; ep_tp also
  halves each expert's width over model (4 KiB). The counts and the RNG are replicated."""
  ep, ep_tp = (train_state_dump(s, 4, 2)["params"] for s in ("fsdp_ep", "ep_tp"))
  for prefix in ("params", "opt_state/1/0/mu", "opt_state/1/0/nu"):
    gate = ep[f"{prefix}/layers/0/mlp/gate"]
    assert gate["mesh"] == ["data", None, None] and gate["bytes_per_device"] == 64 * 32 * 4
    down = ep[f"{prefix}/layers/1/mlp/down"]  # (expert 4, mlp 32, embed 64)
    assert down["mesh"] == ["data", None, None] and down["bytes_per_device"] == 32 * 64 * 4
    gate = ep_tp[f"{prefix}/layers/0/mlp/gate"]
    assert gate["mesh"] == ["data", None, "model"] and gate["bytes_per_device"] == 64 * 16 * 4
    # The router (embed 64, expert 4): fsdp_ep gives data to embed first, ep_tp to the experts.
    assert ep[f"{prefix}/layers/0/mlp/router"]["mesh"] == ["data", None]
    assert ep_tp[f"{prefix}/layers/0/mlp/router"]["mesh"] == [None, "data"]
  for dump in (ep, ep_tp):
    assert dump["step"]["mesh"] == [] and dump["rng"]["mesh"] == [None]
    assert dump["opt_state/1/0/count"]["mesh"] == [] and dump["opt_state/1/2/count"]["mesh"] == []
