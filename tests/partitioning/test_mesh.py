import pytest

from distillax.errors import ConfigError
from distillax.partitioning import create_mesh, resolve_axis_sizes
from jax.sharding import AxisType


@pytest.mark.parametrize("data,model,expect", [(-1, 1, (8, 1)), (-1, 2, (4, 2)), (2, -1, (2, 4)),
                                               (8, 1, (8, 1)), (1, 8, (1, 8))])
def test_axis_sizes_fill_and_match(data, model, expect):
  assert resolve_axis_sizes(data, model, 8) == expect
  mesh = create_mesh({"data": data, "model": model})
  assert (mesh.shape["data"], mesh.shape["model"]) == expect
  assert mesh.axis_names == ("data", "model")
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("data,model,needle", [
    (4, 4, "needs 16 devices but 8 are available"),
    (2, 2, "devices left unused"),
    (-1, -1, "at most one axis may be -1"),
    (-1, 3, "does not divide the 8 available devices"),
    (0, 8, "not a valid axis size"),
])
def test_axis_size_errors_are_precise(data, model, needle):
  with pytest.raises(ConfigError, match=needle):
    create_mesh({"data": data, "model": model})


def test_a_mesh_larger_than_the_cpu_devices_suggests_simulating_them():
  """On CPU devices the fix that keeps the config's layout is --devices N (issue 55: the line
  suggested only a mesh of the devices at hand, e.g. 1x1)."""
  with pytest.raises(ConfigError) as e:
    create_mesh({"data": 4, "model": 4})
  assert ("mesh 4x4 (data x model) needs 16 devices but 8 are available; on this CPU host add "
          "--devices 16 (16 simulated CPU devices: the layout the config sets), or set "
          "--config.mesh.data and --config.mesh.model so their product is 8") == str(e.value)


def test_explicit_axis_type_is_passed_through():
  mesh = create_mesh({"data": 4, "model": 2}, axis_type=AxisType.Explicit)
  assert all(t == AxisType.Explicit for t in mesh.axis_types)


def test_hybrid_mesh_keeps_model_axis_inside_a_slice():
  # 2 slices of 4 devices over DCN on the data axis: every model group stays in one slice.
  mesh = create_mesh({"data": 2, "model": 2, "dcn_data": 2})
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  slice_of = lambda d: d.id // 4
  for row in mesh.devices:
    assert len({slice_of(d) for d in row}) == 1
  # The data axis crosses slices: both slices appear along it.
  assert {slice_of(d) for d in mesh.devices[:, 0]} == {0, 1}


def test_hybrid_mesh_over_model_axis_and_bad_slice_count():
  mesh = create_mesh({"data": 2, "model": 2, "dcn_model": 2})
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  with pytest.raises(ConfigError, match="3 slices does not divide the 8"):
    create_mesh({"data": 2, "model": 1, "dcn_data": 3})
