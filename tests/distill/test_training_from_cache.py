"""`distillax cache-teacher` and distillation from its cache, through the CLI (in-process).

The cached run must see the same batches as the online run and, with the same teacher and k,
the same first-step loss as online LogitKD(top_k=k): the second code path is the online teacher.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import main as cli
from distillax.data import make_train_iterator, restore_iterator_state
from distillax.distill import LogitKD, read_cache_info, read_teacher_cache
from distillax.distill.training_from_cache import cached_objective, cached_train_iterator
from distillax.trainers import lm_objective
from distillax.trainers import recipe_for
from tests.distill import helpers as h
from tests.distill.on_policy.test_objective import MOE_STUDENT
from tests.support.models import NORMS_NEAR_ONE, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "distillax/configs/distill_cached.py") + ":tiny"
ROWS, K, BATCH, SEQ = 32, 16, 8, 32  # the :tiny settings: 4 batches of 8 x 32, top-16


def _cli(command, *args):
  return cli.main(["distillax", command, "--config", CONFIG, *args])


def _rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("cache_job")
  cache, cached, online = (str(root / n) for n in ("cache", "cached", "online"))
  assert _cli("cache-teacher", "--workdir", cache) == 0
  assert _cli("train", "--workdir", cached, f"--config.teacher.cache_dir={cache}",
              "--config.train.log_every=1") == 0
  # One online step (the first step's metrics are taken before any update, so the shorter
  # schedule without warmup changes nothing they depend on).
  assert _cli("train", "--workdir", online, "--config.train.steps=1",
              "--config.optimizer.warmup_steps=0", "--config.train.log_every=1") == 0
  return cache, cached, online


def test_cache_holds_the_train_pipeline_batches(runs):
  cache, _, _ = runs
  info = read_cache_info(cache)
  # 259 byte-tokenizer ids padded to a multiple of 128
  assert (info.rows, info.top_k, info.temperature, info.vocab_size) == (ROWS, K, 2.0, 384)
  provenance = json.load(open(os.path.join(cache, "cache_job.json")))
  assert provenance["teacher"]["preset"] == "tiny" and provenance["num_batches"] == 4
  # The rows are the first batches of the train pipeline built independently from the config.
  from distillax.configs import distill_cached
  config = distill_cached.get_config("tiny")
  pipeline = make_train_iterator(config.data, global_batch_size=BATCH, seq_len=SEQ, seed=0)
  cached = list(read_teacher_cache(cache, batch_size=BATCH))
  assert len(cached) == ROWS // BATCH
  for batch in cached:
    want = next(pipeline)
    for key, value in want.items():
      np.testing.assert_array_equal(batch[key], value, err_msg=key)
    assert batch["teacher_topk_ids_BxLxK"].shape == (BATCH, SEQ, K)


def test_cached_training_through_the_cli(runs):
  _, cached, _ = runs
  rows = _rows(cached)
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train] == list(range(1, 7))
  assert all(math.isfinite(r["loss"]) for r in train)
  assert {"logit_kd", "logit_kd_divergence", "hard_ce", "teacher_ce",
          "top1_agreement"} <= set(train[0])
  assert "logit_cosine" not in train[0]  # a cache holds no full logits
  assert [r["step"] for r in evals] == [3, 6]
  for r in evals:  # eval: hard CE on the validation split, nothing that needs the teacher
    assert r["eval_loss"] == pytest.approx(r["eval_hard_ce"], rel=1e-6)
    assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_hard_ce"]), rel=1e-6)
    assert not any(k.startswith(("eval_teacher", "eval_logit", "eval_top1")) for k in r)
  summary = json.load(open(os.path.join(cached, "summary.json")))
  assert summary["finished"] and summary["step"] == 6
  assert sorted(os.listdir(os.path.join(cached, "checkpoints")))[-1] == "6"


def test_online_top_k_and_cached_agree_on_the_first_step(runs):
  _, cached, online = runs
  first_cached = next(r for r in _rows(cached) if r.get("step") == 1 and "loss" in r)
  first_online = next(r for r in _rows(online) if r.get("step") == 1 and "loss" in r)
  # An online train step reports what its loss needs: teacher_ce and top1_agreement cost passes
  # over the vocabulary and are eval metrics there (test_teacher_cache.py compares them with the
  # cached ones objective to objective); a cached train step reads them from the cache.
  assert not {"teacher_ce", "top1_agreement", "logit_cosine"} & set(first_online)
  for name in ("loss", "logit_kd", "logit_kd_divergence", "hard_ce", "grad_norm"):
    assert first_cached[name] == pytest.approx(first_online[name], rel=1e-5, abs=1e-7), name


def test_cached_iterator_replays_reshuffles_and_resumes(runs):
  cache, _, _ = runs
  written = [b["inputs_BxL"] for b in read_teacher_cache(cache, batch_size=BATCH)]
  it = cached_train_iterator(cache, global_batch_size=BATCH, seq_len=SEQ, seed=0)
  first_epoch = [next(it)["inputs_BxL"] for _ in range(len(written))]
  np.testing.assert_array_equal(np.concatenate(first_epoch), np.concatenate(written))
  state = it.get_state()
  second_epoch = np.concatenate([next(it)["inputs_BxL"] for _ in range(len(written))])
  as_set = lambda rows: sorted(map(bytes, rows))
  assert as_set(second_epoch) == as_set(np.concatenate(written))  # every row once
  assert not np.array_equal(second_epoch, np.concatenate(written))  # in another order
  fresh = cached_train_iterator(cache, global_batch_size=BATCH, seq_len=SEQ, seed=0)
  restore_iterator_state(fresh, json.dumps(state))
  np.testing.assert_array_equal(next(fresh)["inputs_BxL"], second_epoch[:BATCH])


def test_an_moe_students_router_losses_enter_the_cached_objective(runs):
  """The recipe's train objective on a cached batch is its eval objective there (the same
  distillation terms, router losses unweighted) plus train.moe_aux_loss and
  train.router_z_loss times the router losses both report (per token)."""
  from distillax.configs import distill_cached
  config = distill_cached.get_config("tiny")
  config.model.num_experts, config.model.num_experts_per_tok = 4, 2
  config.train.moe_aux_loss, config.train.router_z_loss = 0.5, 0.25
  config.teacher.cache_dir = runs[0]
  recipe = recipe_for(config)
  batch = {k: jnp.asarray(v) for k, v in next(recipe.train_iterator()).items()}
  student, _ = recipe.build(abstract=False)
  graph, state = nnx.split(student)
  train, plain = recipe.objective(train=True), recipe.objective(train=False)

  @jax.jit
  def both(state):
    model = nnx.merge(graph, state)
    return train(model, {}, batch, jax.random.key(0)), plain(model, {}, batch, jax.random.key(0))

  got, want = jax.device_get(both(state))
  assert set(got.sums) == set(want.sums) and {"logit_kd", "moe_aux_loss"} <= set(got.sums)
  for name in ("logit_kd", "moe_aux_loss", "router_z_loss"):
    np.testing.assert_allclose(got.sums[name], want.sums[name], rtol=1e-6, err_msg=name)
  aux, z = float(got.sums["moe_aux_loss"]), float(got.sums["router_z_loss"])
  assert aux >= float(got.tokens) * (1 - 1e-6) and z > 0  # the Switch loss is >= 1 per token
  np.testing.assert_allclose(float(got.loss_sum), float(want.loss_sum) + 0.5 * aux + 0.25 * z,
                             rtol=1e-6)
  assert float(got.ratios["expert_tokens_dropped_l0"][0]) == 0.0  # dropless


@pytest.mark.parametrize("extra, message", [
    (["--config.distill.logit.temperature=1.5"], "temperature"),
    (["--config.distill.attention.weight=1"], "attention"),
    (["--config.train.seq_len=16"], "seq_len"),
    (["--config.distill.logit.top_k=8"], "top_k"),
])
def test_cache_mismatch_is_one_clear_error(runs, tmp_path, capsys, extra, message):
  cache, _, _ = runs
  rc = _cli("train", "--workdir", str(tmp_path / "w"), f"--config.teacher.cache_dir={cache}",
            *extra)
  errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("distillax train")]
  assert rc == 2 and len(errors) == 1 and message in errors[0], errors
  assert not (tmp_path / "w").exists()  # nothing written before the config validated


def test_cache_teacher_refuses_an_existing_cache(runs, capsys):
  cache, _, _ = runs
  assert _cli("cache-teacher", "--workdir", cache) == 2
  assert "already holds a teacher cache" in capsys.readouterr().err


@pytest.mark.parametrize("chunk,sliced", [(None, False), (5, False), (5, True)])
def test_eval_objective_is_the_lm_cross_entropy(chunk, sliced):
  """Without the cached arrays (validation batches) the objective is plain next-token CE, its
  value the LM objective's (the chunk engine's): through whole logits, token chunks, or
  vocabulary slices (`sliced`, 1e-5 relative: another order of the same sums; its gradient the
  LM objective's too, where the other two report the CE as a metric, with none)."""
  student, _ = h.make_models(3)
  batch = h.to_jnp(h.make_batch(seed=4))
  graph, state = nnx.split(student)
  objective = cached_objective(LogitKD(top_k=4), chunk_size=chunk, sliced=sliced)
  rtol = 1e-5 if sliced else 1e-6

  @jax.jit
  def both(state):
    run = lambda fn: jax.value_and_grad(
        lambda s: (lambda o: (o.loss_sum, o))(fn(nnx.merge(graph, s), {}, batch, None)),
        has_aux=True)(state)
    return run(objective), run(lm_objective)

  ((_, got), got_grads), ((_, want), want_grads) = both(state)
  np.testing.assert_allclose(float(got.loss_sum), float(want.loss_sum), rtol=rtol)
  np.testing.assert_allclose(float(got.sums["hard_ce"]), float(want.loss_sum), rtol=rtol)
  assert float(got.tokens) == float(jnp.sum(batch["loss_mask_BxL"]))
  assert set(got.sums) == {"hard_ce"}
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    if sliced:
      np.testing.assert_allclose(g, w, atol=1e-5 * max(float(jnp.max(jnp.abs(w))), 1e-6))
    else:
      assert not np.any(g)


def test_eval_of_an_moe_student_reports_its_router_losses_and_loads():
  """Validation batches (no cached arrays): the next-token objective's router losses and
  expert loads, unweighted (eval_objective stays the CE), as the LM objective reports them."""
  student = random_model(MOE_STUDENT, 5, NORMS_NEAR_ONE)
  batch = h.to_jnp(h.make_batch(seed=4))
  graph, state = nnx.split(student)
  objective = cached_objective(LogitKD(top_k=4), router_loss_weights=(0.5, 0.25))

  @jax.jit
  def both(state):
    model = nnx.merge(graph, state)
    return objective(model, {}, batch, None), lm_objective(model, {}, batch, None)

  got, want = both(state)
  np.testing.assert_allclose(float(got.loss_sum), float(want.loss_sum), rtol=1e-6)
  assert set(got.sums) == {"hard_ce", "moe_aux_loss", "router_z_loss"}
  for name in ("moe_aux_loss", "router_z_loss"):
    np.testing.assert_allclose(float(got.sums[name]), float(want.sums[name]), rtol=1e-6)
  assert sorted(got.ratios) == sorted(want.ratios) == [
      "expert_load_max_over_mean_l0", "expert_load_max_over_mean_l1", "expert_tokens_dropped_l0",
      "expert_tokens_dropped_l1"]
  for name, (n, d) in want.ratios.items():
    np.testing.assert_allclose([float(x) for x in got.ratios[name]], [float(n), float(d)])
