"""Recipes by name. Recipe modules register themselves; `distillax.trainers` imports them all,
so anything that imports this package (or any module inside it) sees the full registry. Kept
apart from the recipes so that loading an earlier run (runs.py), which may need any recipe, does
not import them: no module inside trainers/ imports the package that lists them all."""

from __future__ import annotations

from distillax.errors import ConfigError

_RECIPES: dict[str, type] = {}


def register(name: str):
  """Class decorator: `@register("lm")` makes the class the recipe of `trainer='lm'`."""
  def add(cls):
    _RECIPES[name] = cls
    cls.name = name
    return cls
  return add


def recipe_kind(config) -> str:
  """The registered name for a job config: its `trainer` field, except that a distillation job
  with a teacher cache is the cached-distillation recipe (no teacher in the step)."""
  if "job" in config and config.job == "demo":
    raise ConfigError("this is the demo's config; run it with `distillax demo --config "
                      "distillax/configs/demo.py --workdir runs/demo --devices 8`")
  kind = str(config.get("trainer", ""))
  if kind == "distill" and "teacher" in config and config.teacher.get("cache_dir"):
    return "distill_cached"
  return kind


def recipe_class(config) -> type:
  kind = recipe_kind(config)
  if kind not in _RECIPES:
    names = ", ".join(sorted(k for k in _RECIPES if k != "distill_cached"))
    raise ConfigError(f"trainer={kind!r} is unknown; use one of {names}")
  return _RECIPES[kind]


def recipe_for(config, **kwargs):
  """The recipe that builds `config`'s job (keyword arguments: see `Recipe`)."""
  return recipe_class(config)(config, **kwargs)
