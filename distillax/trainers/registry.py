"""Recipes by name. Recipe modules register themselves; `distillax.trainers` imports them all,
so anything that imports this package (or any module inside it) sees the full registry. Kept
apart from the recipes so that loading an earlier run (runs.py), which may need any recipe, does
not import them: no module inside trainers/ imports the package that lists them all."""

from __future__ import annotations

from distillax.errors import ConfigError, UserError

_RECIPES: dict[str, type] = {}
# Recipes a job gets from its fields, not from `trainer` alone (recipe_kind): name -> the fields.
CHOSEN_BY_FIELDS = {
    "distill_cached": "trainer='distill' with teacher.cache_dir set",
    "distill_cross_tokenizer": "trainer='distill' with distill.objective='cross_tokenizer'",
    "on_policy_cross_tokenizer": "trainer='on_policy' with distill.objective='cross_tokenizer'"}
DISTILL_OBJECTIVES = ("strategies", "cross_tokenizer")


def register(name: str):
  """Class decorator: `@register("lm")` makes the class the recipe of `trainer='lm'`."""
  def add(cls):
    _RECIPES[name] = cls
    cls.name = name
    return cls
  return add


def registered() -> dict[str, type]:
  """Every registered recipe by name (all of them once `distillax.trainers` is imported)."""
  return dict(_RECIPES)


def recipe_kind(config) -> str:
  """The registered name for a job config: its `trainer` field, except that a distillation job
  with a teacher cache is the cached-distillation recipe (no teacher in the step), and one with
  distill.objective='cross_tokenizer' the cross-tokenizer recipe (off-policy, or on-policy with
  trainer='on_policy')."""
  if "job" in config and config.job == "demo":
    raise ConfigError("this is the demo's config; run it with `distillax demo --config "
                      "distillax/configs/demo.py --workdir runs/demo --devices 8`")
  kind = str(config.get("trainer", ""))
  objective = config.distill.get("objective", "strategies") if config.get("distill") else None
  if objective is not None and objective not in DISTILL_OBJECTIVES:
    raise ConfigError(f"distill.objective={objective!r} is not one of {DISTILL_OBJECTIVES}; "
                      f"e.g. --config.distill.objective=cross_tokenizer")
  cached = "teacher" in config and config.teacher.get("cache_dir")
  if objective == "cross_tokenizer" and kind not in ("distill", "on_policy"):
    raise ConfigError(f"distill.objective='cross_tokenizer' is built for trainer='distill' "
                      f"(off-policy) and trainer='on_policy' only, not trainer={kind!r} yet; "
                      f"use --config.distill.objective=strategies")
  if objective == "cross_tokenizer":
    if cached:
      raise ConfigError("distill.objective='cross_tokenizer' runs the teacher on its own tokens "
                        "in the step, but teacher.cache_dir is set; clear "
                        "--config.teacher.cache_dir")
    if kind == "on_policy" and "on_policy" not in config:
      raise ConfigError("trainer='on_policy' with distill.objective='cross_tokenizer' needs the "
                        "on_policy section; use distillax/configs/distill_cross_tokenizer.py:"
                        "on_policy")
    return f"{kind}_cross_tokenizer"
  if kind == "distill" and cached:
    return "distill_cached"
  return kind


def recipe_class(config) -> type:
  kind = recipe_kind(config)
  if kind not in _RECIPES:
    names = ", ".join(sorted(k for k in _RECIPES if k not in CHOSEN_BY_FIELDS))
    raise ConfigError(f"trainer={kind!r} is unknown; use one of {names}")
  return _RECIPES[kind]


def recipe_for(config, **kwargs):
  """The recipe that builds `config`'s job (keyword arguments: see `Recipe`)."""
  return recipe_class(config)(config, **kwargs)


def hf_checkpoint_recipe(config, model_dir: str, *, purpose: str, model_overrides=None):
  """The recipe of `config`'s job with the Hugging Face checkpoint `model_dir` as its student
  (what `eval` and `expert-load` run a checkpoint under): the job's data, the checkpoint's
  weights, no student of its own. `purpose` completes the error's "pass a --config ...". """
  if config is None:
    raise UserError(f"--model {model_dir} is a Hugging Face directory: pass a --config {purpose}, "
                    f"e.g. --config distillax/configs/lm.py --config.data.tokenizer=hf:{model_dir}")
  cfg = config.copy_and_resolve_references()
  cfg.train.init_from = model_dir
  if "student" in cfg:
    cfg.student.hf_path, cfg.student.from_teacher.layers = "", ()
    cfg.student.from_teacher.experts = ()
  return recipe_for(cfg, model_overrides=model_overrides)
