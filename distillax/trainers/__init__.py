"""Recipes (what a job builds from its config), where their models come from, and the loop.

    from distillax.trainers import Trainer, recipe_for
    summary = Trainer(recipe_for(config), workdir).run()

`recipe_for` picks the recipe by the config's `trainer` field: lm (lm.py), distill
(distill/recipe.py; with `teacher.cache_dir`, distill/cached.py; with
distill.objective='cross_tokenizer', distill/cross_tokenizer.py), sequence_kd (sequence_kd.py),
on_policy (on_policy/recipe.py; with distill.objective='cross_tokenizer',
on_policy/cross_tokenizer.py), draft (draft.py: an EAGLE-3 speculative-decoding head), distill_multi_teacher and on_policy_multi_teacher (several
teachers). Importing this package registers them all. Every model's weights
come from `sources` (one room).
"""

from distillax.trainers.base import Trainer
from distillax.trainers.distill.recipe import DistillRecipe, strategy_from_config
from distillax.trainers.distill.cached import CachedDistillRecipe
from distillax.trainers.distill.cross_tokenizer import CrossTokenizerDistillRecipe
from distillax.trainers.distill.multi_teacher import MultiTeacherDistillRecipe
from distillax.trainers.draft import DraftRecipe
from distillax.trainers.lm import LMRecipe, lm_objective
from distillax.trainers.recipe import Engines, Recipe, check_recipe_data
from distillax.trainers.on_policy.recipe import OnPolicyRecipe
from distillax.trainers.on_policy.cross_tokenizer import CrossTokenizerOnPolicyRecipe
from distillax.trainers.on_policy.multi_teacher import MultiTeacherOnPolicyRecipe
from distillax.trainers.registry import hf_checkpoint_recipe, recipe_class, recipe_for
from distillax.trainers.sequence_kd import SequenceKDRecipe
from distillax.trainers.sources import (is_hf_checkpoint, load_run_config, resolve_model_config,
                                        RunSource)
from distillax.trainers.saved import load_as_trained, load_trained_model, restore_run_state

__all__ = ["CachedDistillRecipe", "CrossTokenizerDistillRecipe", "CrossTokenizerOnPolicyRecipe",
           "DistillRecipe", "DraftRecipe", "Engines", "MultiTeacherDistillRecipe", "MultiTeacherOnPolicyRecipe",
           "LMRecipe", "OnPolicyRecipe", "Recipe", "RunSource", "SequenceKDRecipe", "Trainer",
           "check_recipe_data", "is_hf_checkpoint", "load_run_config", "load_as_trained",
           "load_trained_model", "lm_objective", "hf_checkpoint_recipe", "recipe_class",
           "recipe_for", "resolve_model_config", "restore_run_state", "strategy_from_config"]
