"""Logical axis names -> ('data', 'model') mesh: the partitioning core of distillax."""

from distillax.partitioning.mesh import AXES, create_mesh, mesh_shape_str, resolve_axis_sizes
from distillax.partitioning.rules import (BUILTIN_PRESETS, LOGICAL_AXES, RuleSet, axes_tuple,
                                          preset, preset_names, register_preset, rules_from_config)
from distillax.partitioning.shard import (LOGICAL_AXES_KEY, ActiveRules, ManualAxes, PlanRow,
                                          active_rules, check_sufficiency, constrain, describe,
                                          format_plan, logical_tree, no_rules,
                                          optimizer_shardings, pure_values, split_over,
                                          tree_shardings, tree_specs, use_rules)
