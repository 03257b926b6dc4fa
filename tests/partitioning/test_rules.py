import pytest
from jax.sharding import PartitionSpec as P

from distillax.errors import PartitioningError
from distillax.partitioning import RuleSet, create_mesh, preset, register_preset, rules_from_config
from distillax.partitioning import rules as rules_mod


@pytest.fixture(scope="module")
def mesh42():
  return create_mesh({"data": 4, "model": 2})


def test_first_free_rule_wins_and_later_rules_are_fallbacks(mesh42):
  rs = RuleSet((("embed", "data"), ("mlp", "data"), ("mlp", "model"), ("mlp", None)))
  # embed takes 'data', so mlp's first rule is blocked and its fallback 'model' is used.
  assert rs.resolve(("embed", "mlp"), (8, 4), mesh42) == P("data", "model")
  # Alone, mlp gets its first choice.
  assert rs.resolve(("mlp",), (8,), mesh42) == P("data")
  # Order of dims matters: the first dim claims first.
  with pytest.raises(PartitioningError, match="used twice"):
    RuleSet(rs.rules[:1] + rs.rules[1:2]).resolve(("mlp", "embed"), (8, 8), mesh42)


def test_blocked_dim_without_free_fallback_is_an_error(mesh42):
  rs = RuleSet((("embed", "data"), ("mlp", "data")))
  with pytest.raises(PartitioningError, match=r"used twice in one spec.*\('mlp', None\)"):
    rs.resolve(("embed", "mlp"), (8, 8), mesh42, "layer/w")


def test_none_replicates_and_none_name_is_replicated(mesh42):
  rs = RuleSet((("embed", None), ("mlp", "model")))
  assert rs.resolve(("embed", None, "mlp"), (3, 5, 4), mesh42) == P(None, None, "model")


def test_tuple_rule_uses_both_axes(mesh42):
  rs = RuleSet((("batch", ("data", "model")), ("batch", "data"), ("embed", "model"),
                ("embed", None)))
  assert rs.resolve(("batch", "embed"), (16, 6), mesh42) == P(("data", "model"), None)
  # A tuple whose axes are partly taken falls back as a whole.
  assert rs.resolve(("embed", "batch"), (6, 16), mesh42) == P("model", "data")


def test_unknown_logical_name(mesh42):
  rs = RuleSet((("embed", "data"),))
  with pytest.raises(PartitioningError) as e:
    rs.resolve(("embed", "mlpp"), (8, 8), mesh42, "layer_0/mlp/up")
  msg = str(e.value)
  for part in ("layer_0/mlp/up", "(8, 8)", "'mlpp'", "add a rule"):
    assert part in msg


def test_unknown_mesh_axis(mesh42):
  rs = RuleSet((("embed", "fsdp"),))
  with pytest.raises(PartitioningError, match=r"w \(shape \(8,\).*mesh axis 'fsdp'.*only \('data', 'model'\)"):
    rs.resolve(("embed",), (8,), mesh42, "w")
  with pytest.raises(PartitioningError, match="names mesh axis 'fsdp'"):
    rs.check_mesh(mesh42)


def test_indivisible_dim_errors_or_replicates_by_option(mesh42):
  rules = (("kv_heads", "model"), ("kv_heads", None))
  with pytest.raises(PartitioningError, match=r"kv.*size 1\) is not divisible by mesh axes \('model',\) \(size 2\)"):
    RuleSet(rules).resolve(("kv_heads",), (1,), mesh42, "attn/k")
  assert RuleSet(rules, replicate_indivisible=True).resolve(("kv_heads",), (1,), mesh42) == P(None)


def test_mesh_axis_twice_in_a_tuple_rule(mesh42):
  with pytest.raises(PartitioningError, match="uses a mesh axis twice"):
    RuleSet((("batch", ("data", "data")),)).resolve(("batch",), (8,), mesh42)


def test_rank_mismatch(mesh42):
  with pytest.raises(PartitioningError, match="2 logical names for a rank-3 array"):
    RuleSet((("embed", None),)).resolve(("embed", "embed"), (2, 2, 2), mesh42)


def test_malformed_rule_is_rejected():
  with pytest.raises(PartitioningError, match="not a .logical_name, mesh_axes. pair"):
    RuleSet((("embed",),))
  with pytest.raises(PartitioningError, match="mesh axes must be"):
    RuleSet((("embed", 3),))


def test_presets_cover_the_vocabulary_and_place_as_documented(mesh42):
  for name in ("dp", "fsdp", "tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp"):
    assert set(rules_mod.LOGICAL_AXES) <= RuleSet(preset(name)).known_names
  resolve = lambda s, logical, shape: rules_from_config({"strategy": s}).resolve(logical, shape,
                                                                                  mesh42)
  q = (("embed", "heads", "head_dim"), (64, 4, 16))
  assert resolve("dp", *q) == P(None, None, None)
  assert resolve("fsdp", *q) == P("data", None, None)
  assert resolve("tp", *q) == P(None, "model", None)
  assert resolve("fsdp_tp", *q) == P("data", "model", None)
  # Activations: batch claims 'data' first, so width stays unsharded under fsdp.
  act = (("batch", "length", "embed"), (8, 32, 64))
  assert resolve("fsdp", *act) == P("data", None, None)
  assert resolve("fsdp_tp", ("batch", "length", "vocab"), (8, 32, 512)) == P("data", None, "model")
  # Sequence parallelism splits only the residual stream's length over model; inside attention
  # and the MLP the length stays whole and heads / mlp take model, as under tp / fsdp_tp.
  residual = (("batch", "residual_length", "embed"), (8, 32, 64))
  assert resolve("fsdp_tp", *residual) == P("data", None, None)
  assert resolve("fsdp_tp_sp", *residual) == P("data", "model", None)
  assert resolve("tp_sp", *residual) == P("data", "model", None)
  heads = (("batch", "length", "heads", "head_dim"), (8, 32, 4, 16))
  assert resolve("fsdp_tp_sp", *heads) == P("data", None, "model", None)
  assert resolve("fsdp_tp_sp", *q) == resolve("fsdp_tp", *q)


def test_config_rules_override_the_preset(mesh42):
  rs = rules_from_config({"strategy": "fsdp", "rules": [("mlp", "model")]})
  assert rs.resolve(("embed", "mlp"), (64, 256), mesh42) == P("data", "model")
  assert rules_from_config({"strategy": "fsdp"}).resolve(("embed", "mlp"), (64, 256),
                                                          mesh42) == P("data", None)


def test_registry_adds_presets_by_name(mesh42):
  register_preset("test_seq_parallel", [("length", "model")] + list(preset("fsdp")),
                  overwrite=True)
  rs = rules_from_config({"strategy": "test_seq_parallel"})
  assert rs.resolve(("batch", "length", "embed"), (8, 32, 64), mesh42) == P("data", "model", None)
  with pytest.raises(PartitioningError, match="already exists"):
    register_preset("fsdp", preset("dp"))
  with pytest.raises(PartitioningError, match="unknown partitioning strategy 'zero3'.*register"):
    rules_from_config({"strategy": "zero3"})


def test_without_mesh_axes_keeps_the_other_axes(mesh42):
  """Inside shard_map over 'data' the activations are already split over it: the rules that
  remain place the rest exactly as before, and a batch of 1 local row resolves."""
  rs = RuleSet((("batch", "data"), ("embed", ("data", "model")), ("heads", "model")))
  inner = rs.without_mesh_axes(["data"])
  assert inner.rules == (("batch", None), ("embed", "model"), ("heads", "model"))
  assert inner.resolve(("batch", "heads"), (1, 4), mesh42) == P(None, "model")
  assert rs.resolve(("batch", "heads"), (4, 4), mesh42) == P("data", "model")
  assert "without data" in inner.name
