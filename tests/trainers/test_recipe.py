"""Recipes: each trainer name is its recipe, every job config compiles under every preset, and
cached distillation builds its engine exactly as every other recipe does (LoRA dropout in
training, not in eval).

tests/test_main.py trains every config for a few steps under its default preset (fsdp); here each
of these configs compiles its step, with real shardings, under the other presets: compiling is
where a preset that cannot place a parameter or an activation fails. (That every preset then
computes the same numbers is tests/framework/test_backends.py.)
"""

import importlib
import os

import jax
import numpy as np
import pytest
from flax import nnx

from distillax import main as cli
from distillax.configs import distill, distill_cached, lm, sequence_kd
from distillax.distill import read_teacher_cache
from distillax.framework.evaluation import evaluate
from distillax.quant import LoRAParam
from distillax.trainers import (CachedDistillRecipe, DistillRecipe, LMRecipe, Recipe,
                                SequenceKDRecipe, lm_objective, recipe_class, recipe_for)

CONFIGS = ("distill_features", "qat_distill", "lora", "qlora")
PRESETS = {"dp": (8, 1), "tp": (4, 2), "fsdp_tp": (4, 2)}  # fsdp: trained in test_main
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_each_trainer_name_is_its_recipe():
  assert recipe_class(lm.get_config("tiny")) is LMRecipe
  assert recipe_class(distill.get_config("tiny")) is DistillRecipe
  assert recipe_class(sequence_kd.get_config("tiny")) is SequenceKDRecipe
  assert issubclass(SequenceKDRecipe, LMRecipe)  # next-token training on the teacher's text
  recipe = recipe_for(lm.get_config("tiny"))
  assert recipe.name == "lm"
  train = recipe.objective(train=True)  # no LoRA dropout in this config; the default
  assert train.func is lm_objective and train.keywords == {"loss_impl": "sliced"}  # loss: auto
  evaluate = recipe.objective()  # the eval objective runs the engine training runs
  assert evaluate.func is lm_objective and evaluate.keywords == {"loss_impl": "sliced"}
  config = lm.get_config("tiny")
  config.train.loss_impl = "chunked"
  assert recipe_for(config).objective() is lm_objective


def test_auto_runs_a_distill_jobs_logit_terms_or_their_absence_over_vocabulary_slices():
  """train.loss_impl='auto': one LogitKD, or feature distillation alone (its hard_ce metric),
  is the slices' (framework/vocab_slices.py)."""
  for logit, features in ((1.0, 0.0), (0.0, 0.5)):
    config = distill.get_config("tiny")
    config.distill.logit.weight, config.distill.feature_pooling.weight = logit, features
    recipe = recipe_for(config)
    assert recipe.loss_impl == "sliced" and recipe.sliced_strategy()


def test_auto_runs_several_logit_terms_over_vocabulary_slices(monkeypatch):
  """train.loss_impl='auto' with a Composite of two LogitKDs (two temperatures, a jsd): the
  slices' (framework/slice_terms.py), the traced train objective's token loss too; with a top-k
  among them the chunk engine's, and an explicit 'sliced' then refused in one line."""
  from distillax.distill import LogitKD
  from distillax.errors import ConfigError
  from distillax.framework import token_loss_impl
  from tests.distill import helpers as h
  two = (LogitKD(temperature=2.0, alpha=0.7, name="a")
         + LogitKD(temperature=1.0, alpha=0.5, divergence="jsd", beta=0.3, name="b"))
  monkeypatch.setattr(DistillRecipe, "strategy", lambda self: two)
  recipe = recipe_for(distill.get_config("tiny"))
  assert recipe.loss_impl == "sliced" and recipe.sliced_strategy()
  student, teacher = h.make_models()
  with token_loss_impl.recorded_choices() as ran:
    jax.eval_shape(recipe.objective(train=True), student, {"teacher": teacher},
                   h.to_jnp(h.make_batch()), jax.random.key(0))
  assert [k.split(" (")[0] for k in ran] == ["sliced"]
  top = two + LogitKD(top_k=8, name="c")
  monkeypatch.setattr(DistillRecipe, "strategy", lambda self: top)
  assert not recipe_for(distill.get_config("tiny")).sliced_strategy()
  config = distill.get_config("tiny")
  config.train.loss_impl = "sliced"
  with pytest.raises(ConfigError, match="no top_k, no cache"):
    recipe_for(config).objective(train=True)


def test_auto_takes_the_chunk_engine_for_a_live_teachers_kd_on_a_tpu_only(monkeypatch):
  """distill/tpu_chunks.py: under 'auto' the tiny distill job's traced train objective runs the
  chunk engine where the step compiles for a TPU, the slices for a CPU and for its eval
  objective; an explicit 'sliced' keeps the slices."""
  from distillax.framework import token_loss_impl
  from distillax.models.attention import impl
  from tests.distill import helpers as h
  student, teacher = h.make_models()

  def engines(recipe, train=True):
    with token_loss_impl.recorded_choices() as ran:
      jax.eval_shape(recipe.objective(train=train), student, {"teacher": teacher},
                     h.to_jnp(h.make_batch()), jax.random.key(0))
    return [k.split(" (")[0] for k in ran]

  recipe = recipe_for(distill.get_config("tiny"))
  monkeypatch.setattr(impl, "compile_platform", lambda: "cpu")
  assert engines(recipe) == ["sliced"]
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  assert engines(recipe) == ["chunked"] and engines(recipe, train=False) == ["sliced"]
  config = distill.get_config("tiny")
  config.train.loss_impl = "sliced"
  by_hand = recipe_for(config)
  assert engines(by_hand) == ["sliced"]


def test_a_recipe_that_names_no_objective_says_so():
  class NoObjective(Recipe):
    pass

  with pytest.raises(NotImplementedError, match="NoObjective names no objective"):
    NoObjective(lm.get_config("tiny")).objective()


@pytest.mark.parametrize("strategy", PRESETS)
@pytest.mark.parametrize("config", CONFIGS)
def test_config_compiles_under_preset(config, strategy):
  c = importlib.import_module(f"distillax.configs.{config}").get_config("tiny")
  assert c.partitioning.strategy == "fsdp"  # the default that test_main trains under
  c.partitioning.strategy = strategy
  c.mesh.data, c.mesh.model = PRESETS[strategy]
  engine = recipe_for(c).build_engines().main
  specs = [s.spec for s in jax.tree.leaves(engine.layout.shardings.params)]
  if strategy == "dp":
    assert all(all(a is None for a in spec) for spec in specs)
  else:
    assert any("model" in [a for a in spec] for spec in specs)
  assert engine.runner.stats.get("flops", 0) > 0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("recipe_cache") / "cache")
  config = os.path.join(ROOT, "distillax/configs/distill_cached.py") + ":tiny"
  assert cli.main(["distillax", "cache-teacher", "--config", config, "--workdir", cache]) == 0
  return cache


def _first_step_vs_eval(cache: str, dropout: float) -> tuple[float, float]:
  """(loss of the first train step, eval objective of the same state on the same batch) of a
  cached distillation run with LoRA adapters whose dropout is `dropout`."""
  c = distill_cached.get_config("tiny")
  c.teacher.cache_dir = cache
  c.lora.module_regex, c.lora.dropout = r"layers/.*/(attn|mlp)/.*", dropout
  recipe = recipe_for(c)
  assert isinstance(recipe, CachedDistillRecipe)
  engine = recipe.build_engines().main
  student, extras = recipe.build(abstract=False)
  # LoRA's B starts at zero, where dropout on the adapter input cannot change the forward: move
  # every B off zero so that a dropped input shows in the loss.
  adapters = nnx.state(student, LoRAParam)
  values = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x,
      nnx.to_pure_dict(adapters))
  nnx.replace_by_pure_dict(adapters, values)
  nnx.update(student, adapters)
  state = engine.init_state(student, extras, int(c.seed))
  batch = next(iter(read_teacher_cache(cache, batch_size=recipe.batch_size)))
  eval_objective = evaluate(engine, state, [batch])["eval_objective"]  # the train loss's figure
  _, metrics = engine.runner(state, engine.runner.place_batch(batch))
  return float(np.asarray(jax.device_get(metrics["loss"]))), eval_objective


def test_cached_lora_run_drops_adapter_inputs_in_training_only(cache_dir):
  """The same state and batch: the train step's loss equals eval's without dropout and differs
  with it, so dropout reaches the cached run's training step and never its eval."""
  train, evaluated = _first_step_vs_eval(cache_dir, dropout=0.0)
  assert train == pytest.approx(evaluated, rel=1e-6)
  train_d, evaluated_d = _first_step_vs_eval(cache_dir, dropout=0.5)
  assert evaluated_d == pytest.approx(evaluated, rel=1e-6)  # eval never drops
  assert train_d != pytest.approx(evaluated_d, rel=1e-6)
