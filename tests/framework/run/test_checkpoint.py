"""Checkpoints: bit-exact round trips across meshes, retention, corrupt-step fallback, preemption.

The reference is a host-side numpy TrainState built here over a small real Transformer (random
params, two real AdamW updates so moments and count are non-trivial, a bf16 copy of the model as
frozen "teacher"); every restore is compared leaf by
leaf against it with np.array_equal, and the restored shardings against the requested ones.
"""

import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from distillax import partitioning as pt
from distillax.errors import UserError
from distillax.framework.run.checkpoint import Checkpointer, CorruptCheckpointError
from distillax.framework.run.preemption import PreemptionGuard
from distillax.framework.state import TrainState, build_layout, init_state
from tests.models.sharding import param_tree

# 8 query and 8 kv heads, so every strategy below splits on any mesh of 8 without fallbacks.
SHAPES = dict(vocab_size=64, embed_dim=16, num_layers=1, num_heads=8, num_kv_heads=8, head_dim=4,
              mlp_dim=32)
TX = optax.adamw(1e-2)
DATA_STATE = {"next_index": 123, "epoch": 1, "window": [3, 1, 2], "source": "stdlib"}


def _random_tree(abstract, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)


@jax.jit
def _two_adamw_steps(params, grads):
  opt_state = TX.init(params)
  for g in grads:
    updates, opt_state = TX.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state


def reference_state(step: int = 5, seed: int = 0) -> TrainState:
  """All leaves numpy: the independent expectation every restore is compared with."""
  abs_params, _ = param_tree("tiny", **SHAPES)
  abs_teacher, _ = param_tree("tiny", **SHAPES, param_dtype="bfloat16")
  params, opt_state = _two_adamw_steps(_random_tree(abs_params, seed),
                                       [_random_tree(abs_params, seed + 100 + i) for i in range(2)])
  rng = np.asarray(jax.random.key_data(jax.random.key(seed + step)), np.uint32)
  state = TrainState(step=np.int32(step), params=params,
                     frozen={"student": {}, "teacher": _random_tree(abs_teacher, seed + 7)},
                     opt_state=opt_state, rng=rng)
  return jax.tree.map(np.asarray, state)


def abstract_of(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)


def state_shardings(mesh, strategy) -> TrainState:
  abs_params, logical = param_tree("tiny", **SHAPES)
  rules = pt.rules_from_config({"strategy": strategy})
  params = pt.tree_shardings(abs_params, logical, mesh, rules)
  teacher = pt.tree_shardings(abs_params, logical, mesh, rules)
  abs_opt = jax.eval_shape(TX.init, abs_params)
  rep = NamedSharding(mesh, P())
  return TrainState(step=rep, params=params, frozen={"student": {}, "teacher": teacher},
                    opt_state=pt.optimizer_shardings(TX, abs_opt, params, mesh), rng=rep)


def assert_same_values(restored, expected):
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                               jax.tree.leaves(expected)):
    got = np.asarray(got)
    assert got.dtype == want.dtype, jax.tree_util.keystr(path)
    assert np.array_equal(got, want), jax.tree_util.keystr(path)


def assert_shardings(restored, shardings):
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings)):
    assert got.sharding == want, (got.sharding, want)


@pytest.fixture(scope="module")
def mesh_4x2():
  return pt.create_mesh({"data": 4, "model": 2})


@pytest.fixture(scope="module")
def saved_fsdp_tp(tmp_path_factory, mesh_4x2):
  """Steps 1, 2, 3 saved under a 4x2 mesh with 'fsdp_tp'; step s holds reference_state(s, s)."""
  directory = tmp_path_factory.mktemp("fsdp_tp") / "checkpoints"
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  with Checkpointer(directory, every_steps=1, keep_last=None) as ckpt:
    for s in (1, 2, 3):
      state = jax.device_put(reference_state(s, s), shardings)
      assert ckpt.save(s, state, data_state={**DATA_STATE, "at": s}, metrics={"loss": s / 2})
  return directory


def test_roundtrip_same_mesh_async_bit_identical(tmp_path, mesh_4x2):
  ref = reference_state()
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  ckpt = Checkpointer(tmp_path / "ckpt", every_steps=5, async_save=True)
  live = jax.device_put(ref, shardings)
  assert ckpt.save(5, live, data_state=DATA_STATE, metrics={"loss": jnp.float32(2.5)},
                   extra={"config_hash": "abc"})
  for x in jax.tree.leaves(live):
    x.delete()  # what donation to the next step does: the async save must not need them
  ckpt.wait()  # restore right after an async save has committed
  state, data_state, meta = ckpt.restore(abstract_state=abstract_of(ref), shardings=shardings)
  assert_same_values(state, ref)
  assert_shardings(state, shardings)
  assert isinstance(state, TrainState) and isinstance(state.opt_state[0], optax.ScaleByAdamState)
  assert data_state == DATA_STATE
  assert meta["step"] == 5 and meta["metrics"] == {"loss": 2.5}
  assert meta["extra"] == {"config_hash": "abc"} and meta["mesh"] == {"data": 4, "model": 2}
  ckpt.close()
  # A fresh manager (a new run) reads the same thing from disk.
  with Checkpointer(tmp_path / "ckpt", every_steps=5) as again:
    assert again.all_steps() == [5] and again.latest_step() == 5
    state2, data2, _ = again.restore(5, abstract_state=abstract_of(ref), shardings=shardings)
    assert_same_values(state2, ref)
    assert data2 == DATA_STATE


@pytest.mark.parametrize("target", ["8x1 fsdp", "1x8 tp", "one device"])
def test_restore_onto_another_topology(saved_fsdp_tp, target):
  ref = reference_state(3, 3)
  if target == "one device":
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), ref)
    single = SingleDeviceSharding(jax.devices()[0])
  else:
    shape, strategy = target.split()
    data, model = map(int, shape.split("x"))
    shardings = state_shardings(pt.create_mesh({"data": data, "model": model}), strategy)
    single = None
  with Checkpointer(saved_fsdp_tp, every_steps=1) as ckpt:
    state, data_state, meta = ckpt.restore(abstract_state=abstract_of(ref),
                                           shardings=single or shardings)
  assert_same_values(state, ref)
  assert_shardings(state, shardings)
  assert data_state == {**DATA_STATE, "at": 3} and meta["mesh"] == {"data": 4, "model": 2}
  # The layout really changed: under fsdp_tp 4x2 lm_head was split over both axes.
  kernel = state.params["lm_head"]
  expected_shard = {"8x1 fsdp": (2, 64), "1x8 tp": (16, 8), "one device": (16, 64)}[target]
  assert kernel.addressable_shards[0].data.shape == expected_shard


def test_abstract_mesh_shardings_are_made_concrete(saved_fsdp_tp):
  """nnx.eval_shape under jax.set_mesh gives AbstractMesh shardings; orbax needs real devices."""
  ref = reference_state(3, 3)
  mesh = pt.create_mesh({"data": 2, "model": 4})
  concrete = state_shardings(mesh, "fsdp_tp")
  abstract = jax.tree.map(lambda s: NamedSharding(mesh.abstract_mesh, s.spec), concrete)
  with Checkpointer(saved_fsdp_tp, every_steps=1) as ckpt:
    with pytest.raises(UserError, match="AbstractMesh"):
      ckpt.restore(abstract_state=abstract_of(ref), shardings=abstract)
    with jax.set_mesh(mesh):
      state, _, _ = ckpt.restore(abstract_state=abstract_of(ref), shardings=abstract)
  assert_same_values(state, ref)
  assert_shardings(state, concrete)


def test_should_save_every_steps(tmp_path):
  ref = reference_state()
  with Checkpointer(tmp_path, every_steps=3, async_save=False) as ckpt:
    assert [s for s in range(10) if ckpt.should_save(s)] == [3, 6, 9]
    assert not ckpt.save(4, ref)  # not due
    assert ckpt.save(4, ref, force=True)  # e.g. at preemption
    assert ckpt.save(6, ref)
    assert not ckpt.should_save(6) and not ckpt.save(6, ref, force=True)  # never twice
    assert ckpt.all_steps() == [4, 6]


def test_retention_keep_last(tmp_path):
  ref = reference_state()
  with Checkpointer(tmp_path, every_steps=1, keep_last=2) as ckpt:
    for s in range(1, 6):
      ckpt.save(s, ref)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def test_retention_keep_best_lower_is_better_survives_restart(tmp_path):
  ref = reference_state()
  losses = {1: 0.5, 2: 0.3, 3: 0.9, 4: 0.7}
  with Checkpointer(tmp_path, every_steps=1, keep_last=1, keep_best=1) as ckpt:
    for s, loss in losses.items():
      ckpt.save(s, ref, metrics={"eval_loss": loss, "loss": 10.0 - loss})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]  # best (0.3) and latest
    assert ckpt.best_step() == 2
  # A new run reads the metrics back from the steps' metadata and still keeps step 2.
  with Checkpointer(tmp_path, every_steps=1, keep_last=1, keep_best=1) as ckpt:
    ckpt.save(5, ref, metrics={"eval_loss": 0.8})
    ckpt.save(6, ref)  # no metric: kept only as the latest
    ckpt.wait()
    assert ckpt.all_steps() == [2, 6] and ckpt.best_step() == 2
    ckpt.save(7, ref, metrics={"eval_loss": 0.1})
    ckpt.wait()
    assert ckpt.all_steps() == [7]  # the new best is also the latest
  assert sorted(os.listdir(tmp_path)) == ["7"]


def test_rollback_sets_newer_steps_aside_without_deleting(tmp_path):
  with Checkpointer(tmp_path, every_steps=1, keep_last=None, async_save=False) as ckpt:
    for s in range(1, 5):
      ckpt.save(s, reference_state(s, s), metrics={"eval_loss": abs(s - 2)})
    assert ckpt.best_step() == 2
    assert ckpt.set_aside_steps_after(2) == [3, 4]
    assert ckpt.all_steps() == [1, 2] and ckpt.should_save(3)
    ckpt.save(3, reference_state(3, 33))  # the new trajectory takes the step number again
    state, _, meta = ckpt.restore_latest_valid(abstract_state=abstract_of(reference_state()),
                                               shardings=SingleDeviceSharding(jax.devices()[0]))
  assert meta["step"] == 3
  assert_same_values(state, reference_state(3, 33))
  for s in (3, 4):
    assert len(glob.glob(f"{tmp_path}/{s}.rolled-back-*/state")) == 1


def _truncate_data_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "d", "*"))
  assert files, "no OCDBT data file: orbax's layout changed"
  for f in files:
    os.truncate(f, os.path.getsize(f) // 2)
  return "OUT_OF_RANGE"


def _delete_data_item(step_dir):
  shutil.rmtree(os.path.join(step_dir, "data"))
  return "item 'data' is missing"


def _delete_state_item(step_dir):
  shutil.rmtree(os.path.join(step_dir, "state"))
  return "item 'state' is missing"


def _truncate_tree_metadata(step_dir):
  os.truncate(os.path.join(step_dir, "state", "_METADATA"), 7)
  return "unreadable tree metadata"


def _truncate_meta_json(step_dir):
  os.truncate(os.path.join(step_dir, "meta", "meta.json"), 3)
  return "JSONDecodeError"


# When a tensorstore read fails, orbax leaves callbacks aimed at an event loop it already closed;
# Python reports them as unraisable exceptions. They are noise, not a failure of the fallback.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", [_truncate_data_file, _delete_data_item, _delete_state_item,
                                     _truncate_tree_metadata, _truncate_meta_json])
def test_corrupt_latest_falls_back_and_is_kept(saved_fsdp_tp, tmp_path, mesh_4x2, caplog,
                                               corrupt):
  directory = tmp_path / "checkpoints"
  shutil.copytree(saved_fsdp_tp, directory)
  problem = corrupt(str(directory / "3"))
  before = sorted(os.path.relpath(p, directory) for p in glob.glob(f"{directory}/3/**",
                                                                   recursive=True))
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  abstract = abstract_of(reference_state(2, 2))
  with Checkpointer(directory, every_steps=1, keep_last=1) as ckpt:
    assert ckpt.latest_step() == 3
    with pytest.raises(CorruptCheckpointError, match=problem):
      ckpt.restore(3, abstract_state=abstract, shardings=shardings)
    with caplog.at_level(logging.WARNING, logger="distillax.framework.run.checkpoint"):
      state, data_state, meta = ckpt.restore_latest_valid(abstract_state=abstract,
                                                          shardings=shardings)
    assert_same_values(state, reference_state(2, 2))
    assert data_state == {**DATA_STATE, "at": 2} and meta["step"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3" in w and problem in w for w in warnings), warnings
    # Retention (keep_last=1) removes old valid steps but never the corrupt one.
    ckpt.save(4, jax.device_put(reference_state(4, 4), shardings))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
  after = sorted(os.path.relpath(p, directory) for p in glob.glob(f"{directory}/3/**",
                                                                  recursive=True))
  assert after == before  # the corrupt step is untouched


def test_leftover_temp_dir_of_a_killed_save_is_ignored_and_kept(saved_fsdp_tp, tmp_path,
                                                                  mesh_4x2):
  directory = tmp_path / "checkpoints"
  shutil.copytree(saved_fsdp_tp, directory)
  partial = directory / "4.orbax-checkpoint-tmp-1234567"
  shutil.copytree(directory / "3", partial)
  _delete_data_item(str(partial))
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  with Checkpointer(directory, every_steps=1, keep_last=1) as ckpt:
    assert ckpt.all_steps() == [1, 2, 3]
    _, _, meta = ckpt.restore_latest_valid(abstract_state=abstract_of(reference_state(3, 3)),
                                           shardings=shardings)
    assert meta["step"] == 3
    ckpt.save(4, jax.device_put(reference_state(4, 4), shardings))
    ckpt.wait()
    assert ckpt.all_steps() == [4]
  assert partial.is_dir()


def test_resaving_a_corrupt_step_moves_it_aside(saved_fsdp_tp, tmp_path, mesh_4x2):
  directory = tmp_path / "checkpoints"
  shutil.copytree(saved_fsdp_tp, directory)
  _delete_data_item(str(directory / "3"))
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  ref = reference_state(3, 30)
  with Checkpointer(directory, every_steps=1) as ckpt:
    restored = ckpt.restore_latest_valid(abstract_state=abstract_of(ref), shardings=shardings)
    assert restored[2]["step"] == 2
    assert ckpt.save(3, jax.device_put(ref, shardings), data_state={"retrained": True})
    ckpt.wait()
    state, data_state, _ = ckpt.restore(3, abstract_state=abstract_of(ref), shardings=shardings)
  assert_same_values(state, ref)
  assert data_state == {"retrained": True}
  moved = glob.glob(f"{directory}/3.corrupt-*")
  assert len(moved) == 1 and not os.path.exists(os.path.join(moved[0], "data"))
  assert os.path.isdir(os.path.join(moved[0], "state"))


def test_different_model_raises_instead_of_falling_back(saved_fsdp_tp, mesh_4x2):
  ref = reference_state(3, 3)
  shardings = state_shardings(mesh_4x2, "fsdp_tp")
  abstract = abstract_of(ref)
  bigger = abstract.replace(rng=jax.ShapeDtypeStruct((4,), np.uint32))
  renamed = abstract.replace(frozen={"student": {}, "other": abstract.frozen["teacher"]})
  with Checkpointer(saved_fsdp_tp, every_steps=1) as ckpt:
    with pytest.raises(UserError, match=r"different model.*rng \(2,\) != \(4,\)"):
      ckpt.restore_latest_valid(abstract_state=bigger, shardings=shardings)
    other = shardings.replace(frozen={"student": {}, "other": shardings.frozen["teacher"]})
    with pytest.raises(UserError, match="missing in checkpoint: frozen.other"):
      ckpt.restore_latest_valid(abstract_state=renamed, shardings=other)


def test_data_state_of_another_process_count_is_dropped_with_warning(saved_fsdp_tp, tmp_path,
                                                                     mesh_4x2, caplog):
  directory = tmp_path / "checkpoints"
  shutil.copytree(saved_fsdp_tp, directory)
  data_dir = directory / "3" / "data"
  payload = (data_dir / "process_0-of-1.json").read_text()
  assert json.loads(payload)["at"] == 3
  os.remove(data_dir / "process_0-of-1.json")
  for i in range(2):
    (data_dir / f"process_{i}-of-2.json").write_text(payload)
  ref = reference_state(3, 3)
  with Checkpointer(directory, every_steps=1) as ckpt, caplog.at_level(logging.WARNING):
    state, data_state, _ = ckpt.restore(abstract_state=abstract_of(ref),
                                        shardings=state_shardings(mesh_4x2, "fsdp_tp"))
  assert data_state is None
  assert_same_values(state, ref)
  assert any("process_0-of-2.json" in r.getMessage() for r in caplog.records)


def test_sigterm_sets_should_stop_and_previous_handler_is_restored():
  calls = []
  previous = signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
  try:
    sentinel = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
      assert not guard.should_stop(1)
      os.kill(os.getpid(), signal.SIGTERM)  # the process must survive this
      assert guard.received and guard.should_stop(2) and guard.should_stop(3)
      assert guard.stop_step == 2
    assert signal.getsignal(signal.SIGTERM) is sentinel and calls == []
  finally:
    signal.signal(signal.SIGTERM, previous)


class _TinyMLP(nnx.Module):
  """Parameters that name their logical axes, as distillax models do."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(1.0)
    self.up = nnx.Param(init(rngs.params(), (16, 32)), logical_axes=("embed", "mlp"))
    self.down = nnx.Param(init(rngs.params(), (32, 16)), logical_axes=("mlp", "embed"))
    self.scale = nnx.Param(jnp.ones((16,)), logical_axes=("embed",))


def test_train_state_layout_restores_onto_another_layout(tmp_path):
  """The loop's own objects: build_layout/init_state under 4x2 fsdp_tp, restore under 1x8 tp
  from a layout built on an abstract model (no parameters materialised)."""
  save_mesh, load_mesh = (pt.create_mesh({"data": 4, "model": 2}),
                          pt.create_mesh({"data": 1, "model": 8}))
  model = _TinyMLP(nnx.Rngs(0))
  layout = build_layout(model, {}, TX, save_mesh, pt.rules_from_config({"strategy": "fsdp_tp"}))
  state = init_state(model, {}, TX, layout, seed=3)
  expected = jax.tree.map(np.asarray, state)
  with Checkpointer(tmp_path, every_steps=1) as ckpt:
    ckpt.save(1, state)
  abstract_model = nnx.eval_shape(lambda: _TinyMLP(nnx.Rngs(0)))
  load = build_layout(abstract_model, {}, TX, load_mesh, pt.rules_from_config({"strategy": "tp"}))
  with Checkpointer(tmp_path, every_steps=1) as ckpt:
    restored, data_state, _ = ckpt.restore(abstract_state=load.abstract, shardings=load.shardings)
  assert_same_values(restored, expected)
  assert_shardings(restored, load.shardings)
  assert data_state is None
  assert restored.params["up"].sharding.spec == P(None, "model")


# ---- two real processes: per-process data state, primary-only metadata, preemption sync ------

def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker(process_id: int, port: int, directory: str) -> None:
  """One of two processes (4 CPU devices each) forming one 8-device mesh."""
  jax.config.update("jax_num_cpu_devices", 4)
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                             initialization_timeout=300)
  ref = reference_state(6, 6)
  save_sh = state_shardings(pt.create_mesh({"data": 4, "model": 2}), "fsdp_tp")
  state = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                       ref, save_sh)
  guard = PreemptionGuard()
  stop = None
  # The loop: SIGTERM on process 1 only; both must agree on a step. Its length only bounds a
  # hang: process 0 may be far ahead of process 1 on a loaded machine.
  for step in range(1, 100_000):
    if process_id == 1 and step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    if guard.should_stop(step):
      stop = step
      break
    jax.block_until_ready(jnp.zeros(()) + step)
    __import__("time").sleep(0.02)
  guard.close()
  with Checkpointer(directory, every_steps=100) as ckpt:
    assert ckpt.save(stop, state, data_state={"process": process_id, "stop": stop}, force=True)
    ckpt.wait()
    restore_sh = state_shardings(pt.create_mesh({"data": 8, "model": 1}), "fsdp")
    restored, data_state, meta = ckpt.restore_latest_valid(abstract_state=abstract_of(ref),
                                                           shardings=restore_sh)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(ref)):
    for shard in got.addressable_shards:
      assert np.array_equal(np.asarray(shard.data), want[shard.index])
  assert data_state == {"process": process_id, "stop": stop}, data_state
  assert meta["process_count"] == 2 and meta["step"] == stop
  print(json.dumps({"process": process_id, "stop": stop}), flush=True)
  jax.distributed.shutdown()


def test_two_processes_save_restore_and_agree_on_preemption_step(tmp_path):
  port, directory = _free_port(), str(tmp_path / "checkpoints")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", str(i),
                             str(port), directory], env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=600)
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert outs[0]["stop"] == outs[1]["stop"] >= 3
  data_files = sorted(os.listdir(os.path.join(directory, str(outs[0]["stop"]), "data")))
  assert [f for f in data_files if f.endswith(".json")] == ["process_0-of-2.json",
                                                            "process_1-of-2.json"]


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
  _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])


def test_an_unreadable_steps_problem_is_one_line_without_tensorstores_specs():
  """Issue 55: the warning for an unreadable step ended in a piece of tensorstore's JSON spec
  ("[tensorstore_spec[1]='{ ..."): every numbered spec is cut, not only the first form."""
  from distillax.framework.run.checkpoint_items import short_problem
  problem = ('OUT_OF_RANGE: Error reading "params.lm_head/.zarray": Requested byte range '
             '[0, 99481) is not valid for value of size 10')
  for specs in (""" [tensorstore_spec='{"driver":"zarr"}'] [tensorstore_spec[1]='{"a":1}']""",
                """ [tensorstore_spec[1]='{"base":{"driver":"zarr"}}']"""):
    assert short_problem(ValueError(problem + specs)) == f"ValueError: {problem}"
