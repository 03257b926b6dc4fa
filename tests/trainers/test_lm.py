"""The next-token objective of a mixture-of-experts student: router losses weighted by
train.moe_aux_loss / train.router_z_loss, expert-load metrics per layer, and the weights refused
in one line where no router or no objective takes them."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.main import main
from distillax.models.moe import layer as moe
from distillax.models.presets import get_preset
from distillax.trainers.lm import lm_objective
from distillax.trainers.recipe import check_router_losses
from distillax.trainers.registry import recipe_class
from tests.support.engines import packed_batches
from tests.support.models import Normal, random_model
from tests.test_main import LM, ROOT


def _objective(model, batch, **weights):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, batch):
    m = nnx.merge(graphdef, state)
    out = lm_objective(m, {}, batch, jax.random.key(0), **weights)
    stats = m(batch["inputs_BxL"], segment_ids_BxL=batch["segment_ids_BxL"],
              positions_BxL=batch["positions_BxL"], return_logits=False).router_stats
    return out, stats

  return run(state, batch)


def test_lm_objective_adds_the_weighted_router_losses_and_reports_the_load_per_layer():
  batch = {k: jnp.asarray(v) for k, v in packed_batches(1, batch=2, seq_len=8)[0].items()}
  model = random_model(get_preset("tiny_moe"), init=Normal(0.1))
  plain, stats = _objective(model, batch)
  weighted, _ = _objective(model, batch, moe_aux_loss=0.5, router_z_loss=0.25)
  terms = moe.router_losses(stats)
  tokens = float(plain.tokens)
  aux, z = float(jnp.mean(terms["aux_N"])), float(jnp.mean(terms["z_N"]))
  assert aux >= 1.0 - 1e-6 and z > 0  # Switch loss is 1 at best; the z-loss is positive
  np.testing.assert_allclose(plain.sums["moe_aux_loss"], tokens * aux, rtol=1e-5)
  np.testing.assert_allclose(plain.sums["router_z_loss"], tokens * z, rtol=1e-5)
  np.testing.assert_allclose(weighted.loss_sum, plain.loss_sum + tokens * (0.5 * aux + 0.25 * z),
                             rtol=1e-5)
  # Every real token (segment id > 0) sends k = 2 assignments; padding sends none.
  real = int(np.sum(np.asarray(batch["segment_ids_BxL"]) > 0))
  np.testing.assert_allclose(np.sum(stats.load_E, axis=-1), [2 * real] * 2)
  for i in range(2):
    top, mean = plain.ratios[f"expert_load_max_over_mean_l{i}"]
    assert float(mean) == pytest.approx(2 * real / 4) and float(top) >= float(mean)
  dense, _ = _objective(random_model(get_preset("tiny")), batch)
  assert set(dense.sums) == {"accuracy"} and dense.ratios == {}


@pytest.mark.parametrize("config,flags,says", [
    (f"{LM}:tiny", [], "train.moe_aux_loss=0.01 weighs a router loss, but the student is dense "
                       "(model.num_experts=0); set --config.train.moe_aux_loss=0"),
])
def test_router_loss_weights_are_refused_where_nothing_takes_them(capsys, tmp_path, config, flags,
                                                                   says):
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), "--config", config,
               "--config.train.moe_aux_loss=0.01", *flags])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].endswith(says), err
  assert not (tmp_path / "wd").exists()


def test_every_registered_job_takes_router_losses_and_a_recipe_that_does_not_says_so():
  """Every job's objective adds the router losses of an MoE student (the on-policy and cached
  ones: tests/trainers/on_policy/test_recipe.py, tests/distill/test_training_from_cache.py); a recipe
  whose objective does not refuses the weights in one line."""
  for kind in ("lm", "sequence_kd", "distill", "on_policy"):
    assert recipe_class(ml_collections.ConfigDict({"trainer": kind})).router_losses, kind
  cached = ml_collections.ConfigDict({"trainer": "distill", "teacher": {"cache_dir": "/c"}})
  assert recipe_class(cached).name == "distill_cached" and recipe_class(cached).router_losses
  train = ml_collections.ConfigDict({"moe_aux_loss": 0.0, "router_z_loss": 0.01})
  with pytest.raises(ConfigError) as e:
    check_router_losses(train, get_preset("tiny_moe"), "custom", supported=False)
  assert str(e.value) == ("train.router_z_loss=0.01: the custom job's objective adds no router "
                          "losses (lm, sequence_kd, distill, distill_cached and on_policy do); "
                          "set --config.train.router_z_loss=0")


def test_the_vmap_backend_refuses_ragged_experts_in_one_line(capsys, tmp_path):
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), "--config", f"{LM}:tiny",
               "--config.backend=vmap", "--config.model.num_experts=4"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].endswith("backend='vmap' cannot batch the model's ragged expert matmul "
                         "(jax.lax.ragged_dot); use --config.backend=shard_map or pmap or "
                         "--config.model.moe_impl=dense"), err
  assert not (tmp_path / "wd").exists()
