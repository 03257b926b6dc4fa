"""Golden dumps of the whole train state's layout, per job config and mesh.

Beside the model dumps (tests/models/test_sharding_goldens.py), these record, for every array of
a job's TrainState (trainable params, frozen models, optimizer state, step and RNG): its shape,
dtype and mesh spec, and whether a checkpoint stores it (a teacher and a LoRA base are reloaded
from their sources instead); and the sharding of every batch array. A change that moves an array
to another device layout, makes the optimizer state stop mirroring the parameters, or starts
writing a frozen model into checkpoints fails here with the paths that moved. Built abstractly
(nothing is compiled or allocated). Regenerate deliberately with DISTILLAX_UPDATE_GOLDENS=1 and
read the diff before committing it.
"""

import json
import os
import pathlib

import jax
import pytest

from distillax.configs import distill, lm, lora, qlora
from distillax.framework.backends import batch_sharding
from distillax.trainers import recipe_for
from tests.models.test_sharding_goldens import _differences, _spec_json, dumps

GOLDEN_DIR = pathlib.Path(__file__).parent / "goldens"
CONFIGS = {"lm": lm, "distill": distill, "lora": lora, "qlora": qlora}
LAYOUTS = [("fsdp", 8, 1), ("fsdp_tp", 4, 2)]
# lm.py:tiny with tiny_moe's experts (4 of width 32, top-2) under the expert-parallel presets.
MOE_FIELDS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_mlp_dim": 32}
MOE_LAYOUTS = [("fsdp_ep", 4, 2), ("ep_tp", 4, 2)]


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def state_dump(name: str, strategy: str, data: int, model: int, **model_fields) -> dict:
  config = CONFIGS[name].get_config("tiny")
  config.mesh.data, config.mesh.model = data, model
  config.model.update(model_fields)
  config.partitioning.strategy = strategy
  recipe = recipe_for(config)
  layout = recipe.build_engines(compile_now=False).main.layout
  stored = set(_paths(layout.stored_abstract))
  flat = jax.tree_util.tree_flatten_with_path(layout.abstract)[0]
  arrays = {}
  for (path, x), sh in zip(flat, jax.tree.leaves(layout.shardings)):
    key = jax.tree_util.keystr(path)
    arrays[key] = {"shape": list(x.shape), "dtype": str(x.dtype), "mesh": _spec_json(sh.spec),
                   "stored": key in stored}
  batch = {k: {"shape": list(v.shape), "dtype": str(v.dtype),
               "mesh": _spec_json(batch_sharding(recipe.mesh, recipe.rules, len(v.shape),
                                                 v.shape).spec)}
           for k, v in recipe.batch_shapes().items()}
  fields = "".join(f" --config.model.{k}={v}" for k, v in model_fields.items())
  return {"config": f"{name}.py:tiny{fields}", "strategy": strategy, "mesh": {"data": data, "model": model},
          "batch": batch, "stored_arrays": sum(a["stored"] for a in arrays.values()),
          "reloaded_arrays": sum(not a["stored"] for a in arrays.values()), "params": arrays}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("strategy,data,model", LAYOUTS)
def test_train_state_layout_matches_golden(name, strategy, data, model):
  got = state_dump(name, strategy, data, model)
  path = GOLDEN_DIR / name / f"{strategy}_{data}x{model}.json"
  if os.environ.get("DISTILLAX_UPDATE_GOLDENS"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(got))
  assert path.exists(), f"no golden {path}; run with DISTILLAX_UPDATE_GOLDENS=1 and read it"
  want = json.loads(path.read_text())
  assert json.loads(json.dumps(got)) == want, "\n".join(_differences(got, want)[:40])


@pytest.mark.parametrize("strategy,data,model", MOE_LAYOUTS)
def test_moe_train_state_layout_matches_golden(strategy, data, model):
  got = state_dump("lm", strategy, data, model, **MOE_FIELDS)
  path = GOLDEN_DIR / "lm_moe" / f"{strategy}_{data}x{model}.json"
  if os.environ.get("DISTILLAX_UPDATE_GOLDENS"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(got))
  assert path.exists(), f"no golden {path}; run with DISTILLAX_UPDATE_GOLDENS=1 and read it"
  want = json.loads(path.read_text())
  assert json.loads(json.dumps(got)) == want, "\n".join(_differences(got, want)[:40])


def test_moe_experts_and_their_adam_moments_by_hand():
  """fsdp_ep on 4 x 2: every expert tensor (4, 64, 32) is split by expert over data, whole (its
  embed cannot take data as well); ep_tp also splits each expert's width over model. The Adam
  moments mirror them; the router (embed, expert) gives data to embed under fsdp_ep (first dim
  first) and to its experts under ep_tp."""
  ep, ep_tp = (state_dump("lm", s, 4, 2, **MOE_FIELDS)["params"] for s in ("fsdp_ep", "ep_tp"))
  for tree in (".params", ".opt_state[1][0].mu", ".opt_state[1][0].nu"):
    mlp = lambda dump, i, name: dump[f"{tree}['layers'][{i}]['mlp']['{name}']"]
    assert mlp(ep, 0, "gate")["shape"] == [4, 64, 32]
    assert mlp(ep, 0, "gate")["mesh"] == ["data", None, None]
    assert mlp(ep, 1, "down")["mesh"] == ["data", None, None]  # (expert, mlp, embed)
    assert mlp(ep_tp, 0, "up")["mesh"] == ["data", None, "model"]
    assert mlp(ep_tp, 1, "down")["mesh"] == ["data", "model", None]
    assert mlp(ep, 0, "router")["mesh"] == ["data", None]
    assert mlp(ep_tp, 0, "router")["mesh"] == [None, "data"]
  for dump in (ep, ep_tp):
    assert dump[".step"]["mesh"] == [] and dump[".opt_state[1][0].count"]["mesh"] == []


def test_a_distillation_state_stores_no_teacher_and_a_lora_state_no_base():
  kd = state_dump("distill", "fsdp", 8, 1)["params"]
  assert [p for p, a in kd.items() if "'teacher'" in p] and not [
      p for p, a in kd.items() if "'teacher'" in p and a["stored"]]
  adapted = state_dump("lora", "fsdp", 8, 1)["params"]
  frozen = [p for p in adapted if p.startswith(".frozen")]
  assert frozen and not [p for p in frozen if adapted[p]["stored"]]
  assert all(a["stored"] for p, a in adapted.items() if not p.startswith(".frozen"))
