"""Recipes (what a job builds from its config) and the loop that runs them.

    from distillax.trainers import Trainer, recipe_for
    summary = Trainer(recipe_for(config), workdir).run()

`recipe_for` picks the recipe by the config's `trainer` field: lm (recipe.py), distill
(distill.py; with `teacher.cache_dir`, cached.py), sequence_kd (sequence_kd.py), on_policy
(on_policy.py). Importing this
package registers them all.
"""

from distillax.trainers.base import Trainer
from distillax.trainers.cached import CachedDistillRecipe
from distillax.trainers.common import resolve_model_config
from distillax.trainers.distill import DistillRecipe, strategy_from_config
from distillax.trainers.lm import lm_objective
from distillax.trainers.on_policy import OnPolicyRecipe
from distillax.trainers.recipe import Engines, Recipe
from distillax.trainers.registry import recipe_class, recipe_for
from distillax.trainers.runs import load_run_config, load_trained_model, trained_model_config
from distillax.trainers.sequence_kd import SequenceKDRecipe
from distillax.trainers.teacher import load_teacher, teacher_config

LMRecipe = Recipe

__all__ = ["CachedDistillRecipe", "DistillRecipe", "Engines", "LMRecipe", "OnPolicyRecipe",
           "Recipe",
           "SequenceKDRecipe", "Trainer", "load_run_config", "load_teacher",
           "load_trained_model", "lm_objective", "recipe_class", "recipe_for", "resolve_model_config",
           "strategy_from_config", "teacher_config", "trained_model_config"]
