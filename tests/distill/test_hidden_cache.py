"""Hidden-state teacher caches: the teacher's final hidden states on disk plus its frozen head
give back its logits, so KD from the cache equals KD from the live teacher for every logit
strategy (the second code path is the live teacher, side by side in one step)."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective, read_teacher_cache
from distillax.distill.teacher_cache import read_cache_info, write_teacher_cache
from distillax.distill.teacher_head import (HEAD_FILE, TEACHER_HIDDEN, fingerprint, head_of,
                                            load_head)
from distillax.errors import UserError
from tests.distill import helpers as h

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16_RTOL = 2e-2  # a bfloat16 cache rounds each hidden state to 8 mantissa bits


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
  student, teacher = h.make_models(7)
  batches = [h.make_batch(seed=s) for s in (20, 21)]
  root = tmp_path_factory.mktemp("hidden")
  infos = {dtype: write_teacher_cache(teacher, iter(batches), str(root / dtype), kind="hidden",
                                      hidden_dtype=dtype, rows_per_file=3)
           for dtype in ("float32", "bfloat16")}
  return student, teacher, batches, root, infos


STRATEGIES = {  # every divergence, top-k, several temperatures, whole and chunked logits
    "forward_kl": (LogitKD(temperature=1.0, alpha=0.5, divergence="forward_kl"), None),
    "reverse_kl": (LogitKD(temperature=2.0, alpha=1.0, divergence="reverse_kl"), 5),
    "jsd": (LogitKD(temperature=1.5, alpha=0.7, divergence="jsd", beta=0.3), 5),
    "top_k": (LogitKD(temperature=3.0, alpha=0.7, divergence="forward_kl", top_k=5), 7),
}


@pytest.fixture(scope="module")
def steps(caches):
  """{strategy: {teacher: ((loss, sums), grads)}} for the live teacher and both caches, from
  one compiled function (one step each, the same student and batch)."""
  student, teacher, _, root, infos = caches
  batch = h.to_jnp(next(iter(read_teacher_cache(str(root / "float32"), batch_size=2))))
  bf16 = next(iter(read_teacher_cache(str(root / "bfloat16"), batch_size=2)))[TEACHER_HIDDEN]
  heads = {d: load_head(str(root / d), infos[d].head_fingerprint) for d in infos}
  sg, ss = nnx.split(student)

  @jax.jit
  def run(ss, teacher, heads, bf16):
    teachers = {"live": (teacher, batch), "float32": (heads["float32"], batch),
                "bfloat16": (heads["bfloat16"], {**batch, TEACHER_HIDDEN: bf16})}
    out = {}
    for name, (strategy, chunk) in STRATEGIES.items():
      objective = make_distill_objective(strategy, chunk_size=chunk, metrics=True)

      def loss(ss, extras, batch):
        result = objective(nnx.merge(sg, ss), extras, batch, None)
        return result.loss_sum, result.sums
      grad = jax.value_and_grad(loss, has_aux=True)
      out[name] = {k: grad(ss, {"teacher": t}, b) for k, (t, b) in teachers.items()}
    return out

  return run(ss, teacher, heads, bf16)


@pytest.mark.parametrize("name", STRATEGIES)
def test_fp32_cache_equals_the_live_teacher(steps, name):
  ((live_loss, live_sums), live_grad) = steps[name]["live"]
  ((loss, sums), grad) = steps[name]["float32"]
  np.testing.assert_allclose(float(loss), float(live_loss), rtol=1e-5)
  assert set(sums) == set(live_sums)  # teacher_ce, top-1 and cosine come from the head too
  for key in live_sums:
    np.testing.assert_allclose(float(sums[key]), float(live_sums[key]), rtol=1e-5, atol=1e-6,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(live_grad)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5 * float(np.max(np.abs(b))))


def test_bf16_cache_is_close_to_the_live_teacher(steps):
  for name in STRATEGIES:
    live, loss = (float(steps[name][k][0][0]) for k in ("live", "bfloat16"))
    np.testing.assert_allclose(loss, live, rtol=BF16_RTOL, err_msg=name)
    assert loss != live, name  # the rounding is there, and bounded


def test_cache_contents_head_and_fingerprint(caches):
  _, teacher, batches, root, infos = caches
  info = infos["float32"]
  assert (info.kind, info.top_k, info.rows, info.hidden_dtype) == ("hidden", 0, 4, "float32")
  assert read_cache_info(str(root / "float32")) == info
  rows32 = list(read_teacher_cache(str(root / "float32"), batch_size=2))
  rows16 = list(read_teacher_cache(str(root / "bfloat16"), batch_size=2))
  for original, r32, r16 in zip(batches, rows32, rows16):
    for key, value in original.items():
      np.testing.assert_array_equal(r16[key], value)
    # fp32 states are the live teacher's (the loss test above); bf16 ones are their rounding
    assert r16[TEACHER_HIDDEN].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(r16[TEACHER_HIDDEN], r32[TEACHER_HIDDEN].astype(jax.numpy.bfloat16))
  assert info.head_fingerprint == fingerprint(head_of(teacher)) == infos["bfloat16"].head_fingerprint
  other = h.make_models(8)[1]
  assert fingerprint(head_of(other)) != info.head_fingerprint
  with pytest.raises(UserError, match="altered"):
    load_head(str(root / "float32"), fingerprint(head_of(other)))
  assert os.path.exists(root / "float32" / HEAD_FILE)
