"""Offline teacher cache: round trip through ArrayRecord, and cached == online top-k KD."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import (CachedLogitKD, LogitKD, TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS,
                               make_distill_objective, read_cache_info, read_teacher_cache,
                               write_teacher_cache)
from distillax.distill.teacher_cache import decode_row, encode_row
from distillax.errors import ConfigError, UserError
from tests.distill import helpers as h

K, T = 6, 1.5


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  student, teacher = h.make_models(5)
  batches = [h.make_batch(seed=s) for s in (10, 11)]
  directory = str(tmp_path_factory.mktemp("cache") / "teacher")
  info = write_teacher_cache(teacher, iter(batches), directory, top_k=K, temperature=T,
                             rows_per_file=3)
  return student, teacher, batches, directory, info


def test_round_trip_and_contents(cache):
  _, teacher, batches, directory, info = cache
  assert info.rows == 4 and len(info.files) == 2 and info.top_k == K and info.temperature == T
  assert read_cache_info(directory) == info
  read = list(read_teacher_cache(directory, batch_size=2, temperature=T))
  assert len(read) == 2
  for original, cached in zip(batches, read):
    for key, value in original.items():
      np.testing.assert_array_equal(cached[key], value)
    logits = np.asarray(teacher(jnp.asarray(original["inputs_BxL"]),
                                positions_BxL=jnp.asarray(original["positions_BxL"]),
                                segment_ids_BxL=jnp.asarray(original["segment_ids_BxL"])
                                ).logits_BxLxV)
    logp_T = h.np_log_softmax(logits / T)
    want_ids = np.argsort(-logits, axis=-1, kind="stable")[..., :K]
    np.testing.assert_array_equal(cached[TOPK_IDS], want_ids)
    np.testing.assert_allclose(cached[TOPK_LOGPROBS], np.take_along_axis(logp_T, want_ids, -1),
                               rtol=1e-5, atol=1e-6)
    nll = -np.take_along_axis(h.np_log_softmax(logits), original["targets_BxL"][..., None], -1)
    np.testing.assert_allclose(cached[TEACHER_NLL], nll[..., 0], rtol=1e-5)
    assert cached[TOPK_IDS].dtype == np.int32 and cached[TOPK_LOGPROBS].dtype == np.float32


@pytest.mark.parametrize("kind, chunk", [("forward_kl", None), ("jsd", 5)])
def test_cached_matches_online_top_k(cache, kind, chunk):
  student, teacher, _, directory, info = cache
  cached_batch = next(iter(read_teacher_cache(directory, batch_size=2)))
  batch = h.to_jnp(cached_batch)
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)
  online = make_distill_objective(LogitKD(temperature=T, top_k=K, divergence=kind),
                                  chunk_size=chunk)
  offline = make_distill_objective(CachedLogitKD.from_cache_info(info, divergence=kind),
                                   chunk_size=chunk)

  @jax.jit
  def run(ss, ts):
    def loss(ss, objective, extras):
      out = objective(nnx.merge(sg, ss), extras, batch, None)
      return out.loss_sum, out.sums
    grad = jax.value_and_grad(loss, has_aux=True)
    return (grad(ss, online, {"teacher": nnx.merge(tg, ts)}),
            grad(ss, offline, {}))  # no teacher in memory

  ((on_loss, on_sums), on_grad), ((off_loss, off_sums), off_grad) = run(ss, ts)
  np.testing.assert_allclose(float(off_loss), float(on_loss), rtol=1e-5)
  for name in ("logit_kd", "logit_kd_divergence", "hard_ce", "teacher_ce", "top1_agreement"):
    np.testing.assert_allclose(float(off_sums[name]), float(on_sums[name]), rtol=1e-5,
                               err_msg=name)
  assert "logit_cosine" not in off_sums  # a cache holds no full logits
  for a, b in zip(jax.tree.leaves(off_grad), jax.tree.leaves(on_grad)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_errors(cache, tmp_path):
  _, teacher, batches, directory, _ = cache
  with pytest.raises(ConfigError, match="temperature"):
    read_teacher_cache(directory, temperature=2.0)
  with pytest.raises(UserError, match="not a teacher cache"):
    read_teacher_cache(str(tmp_path))
  with pytest.raises(UserError, match="already holds"):
    write_teacher_cache(teacher, iter(batches), directory, top_k=K, temperature=T)
  with pytest.raises(ConfigError, match="top_k"):
    write_teacher_cache(teacher, iter(batches), str(tmp_path / "x"), top_k=h.VOCAB + 1)


def test_records_are_pickle_free():
  row = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.float32([0.5])}
  raw = encode_row(row)
  with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
    np.testing.assert_array_equal(npz["a"], row["a"])
  decoded = decode_row(raw)
  assert decoded["b"].dtype == np.float32 and decoded["b"][0] == 0.5
  with pytest.raises(ValueError):
    encode_row({"bad": np.array([{"x": 1}], dtype=object)})
