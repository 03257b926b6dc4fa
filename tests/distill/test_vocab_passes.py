"""Passes over the vocabulary: shared reductions, the fused chunked loss, the auto chunk rule.

The reference here is the formulation the objective used before the reductions were shared:
every term and metric taking its own `jax.nn.log_softmax` (written out below, as it was), so the
tests can check that sharing changed no value and removed the passes it claims to remove.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.distill import AttentionTransfer, LogitKD, divergences, make_distill_objective
from distillax.framework import vocab_chunks
from distillax.distill.base import DistillInputs
from distillax.distill.objective import run_models
from distillax.errors import ConfigError
from distillax.framework import losses
from tests.distill import helpers as h
from tests.support.models import NORMS_NEAR_ONE, random_model

V = 97  # prime: no other dimension of the tiny models or the batch has this size
# These tests compare loss formulations, so both models run the reference attention: its
# compiled rounding is the same in every program. (Blockwise attention's backward passes the last
# bits of a cotangent on less damped; tests/models/attention/test_impls.py checks it.)
STUDENT = h.STUDENT_CONFIG.replace(vocab_size=V, attention_impl="reference")
TEACHER = h.TEACHER_CONFIG.replace(vocab_size=V, attention_impl="reference")


# ---- the multi-pass formulation, as the objective computed it before --------------------------

def old_logit_kd(s, kd: LogitKD, tokens):
  T = float(kd.temperature)
  s = s.astype(jnp.float32)
  s_logp = jax.nn.log_softmax(s / T, axis=-1)
  t_logp = jax.nn.log_softmax(tokens["__t"].astype(jnp.float32) / T, axis=-1)
  if kd.top_k is None or kd.top_k >= V:
    t_b, s_b = t_logp, s_logp
  else:
    top_logp, top_ids = jax.lax.top_k(t_logp, kd.top_k)
    t_b, s_b = divergences.teacher_buckets(top_logp, V), divergences.student_buckets(s_logp,
                                                                                     top_ids)
  div = divergences.divergence(kd.divergence, t_b, s_b, kd.beta)
  loss = kd.alpha * T ** 2 * div
  if kd.alpha < 1.0:
    loss = loss + (1.0 - kd.alpha) * losses.token_nll(s, tokens[batch_spec.TARGETS])
  return {kd.name: loss, f"{kd.name}_divergence": div}


def old_metrics(s, t, tokens):
  s, t = s.astype(jnp.float32), t.astype(jnp.float32)
  targets = tokens[batch_spec.TARGETS]
  norms = jnp.sqrt(jnp.sum(s * s, axis=-1)) * jnp.sqrt(jnp.sum(t * t, axis=-1))
  out = {"hard_ce": losses.token_nll(s, targets), "teacher_ce": losses.token_nll(t, targets),
         "top1_agreement": (jnp.argmax(s, -1) == jnp.argmax(t, -1)).astype(jnp.float32),
         "logit_cosine": jnp.sum(s * t, axis=-1) / jnp.maximum(norms, 1e-30)}
  return jax.tree.map(jax.lax.stop_gradient, out)


def old_objective(kd: LogitKD):
  """LogitKD alone on unchunked logits, every value from its own log-softmax."""
  def objective(student, extras, batch, rng):
    inputs = run_models(kd, student, extras, batch)

    def per_token(s, t, tokens):
      values = old_metrics(s, t, tokens)
      values.update(old_logit_kd(s, kd, {**tokens, "__t": t}))
      return values

    return inputs.loss_and_sums(per_token, {kd.name: kd.weight})
  return objective


# ---- helpers ----------------------------------------------------------------------------------

def models_and_batch(seed=0, B=2, L=9):
  student, teacher = h.make_models(seed, STUDENT, TEACHER)
  return student, teacher, h.to_jnp(h.make_batch(B=B, L=L, seed=seed, vocab=V))


def loss_fn(objective, student, teacher, batch):
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  def loss(ss):
    out = objective(nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}, batch, None)
    if isinstance(out, tuple):
      return out
    return out.loss_sum, out.sums

  return loss, ss


def new_objective(kd, chunk, metrics=True):
  return make_distill_objective(kd, chunk_size=chunk, metrics=metrics)


def vocab_reductions(hlo_text: str, vocab: int) -> int:
  """Reduce ops over a dimension of size `vocab` the lowered program executes per call: each
  function's own, plus its callees' once per call site (JAX lowers a repeated jnp function,
  e.g. log_softmax, as one private function called several times)."""
  reduce = re.compile(r"stablehlo\.reduce\(.*across dimensions = \[([\d, ]+)\] : "
                      r"\(tensor<([\dx]+)x[a-z]\w*>")
  own, calls, name = {}, {}, None
  for line in hlo_text.splitlines():
    header = re.search(r"func\.func (?:public |private )?@([\w.$-]+)\(", line)
    if header:
      name = header.group(1)
      own[name], calls[name] = 0, []
      continue
    callee = re.search(r"\bcall @([\w.$-]+)\(", line)
    if callee:
      calls[name].append(callee.group(1))
    match = reduce.search(line)
    if match:
      dims = [int(d) for d in match.group(1).split(",")]
      shape = [int(d) for d in match.group(2).split("x")]
      own[name] += any(shape[d] == vocab for d in dims)

  def total(fn):
    return own[fn] + sum(total(c) for c in calls[fn])

  return total("main")


KDS = {
    "forward_kl": LogitKD(temperature=2.0, alpha=0.7),
    "jsd_t1.5_topk": LogitKD(temperature=1.5, alpha=0.4, divergence="jsd", beta=0.3, top_k=7),
    "reverse_kl_alpha1": LogitKD(temperature=3.0, alpha=1.0, divergence="reverse_kl"),
}


# ---- values ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(KDS))
def test_shared_reductions_give_the_old_values_and_gradients(case):
  """Unchunked, chunked (fused) and auto-chunked objectives against the multi-pass one: every
  sum within 1e-6 relative, the gradient within float rounding."""
  kd = KDS[case]
  student, teacher, batch = models_and_batch(seed=1)
  runs = {"old": old_objective(kd), "unchunked": new_objective(kd, None),
          "chunk4": new_objective(kd, 4), "auto": new_objective(kd, vocab_chunks.AUTO)}
  fns = {}
  for name, objective in runs.items():
    loss, ss = loss_fn(objective, student, teacher, batch)
    fns[name] = jax.value_and_grad(loss, has_aux=True)
  results = jax.jit(lambda ss: {k: f(ss) for k, f in fns.items()})(ss)
  (old_loss, old_sums), old_grad = results.pop("old")
  for name, ((loss, sums), grad) in results.items():
    np.testing.assert_allclose(float(loss), float(old_loss), rtol=1e-6, err_msg=name)
    assert set(sums) == set(old_sums), name
    for key, value in old_sums.items():
      np.testing.assert_allclose(float(sums[key]), float(value), rtol=1e-6, atol=1e-7,
                                 err_msg=f"{name}: {key}")
    for (path, g_old), g_new in zip(jax.tree_util.tree_leaves_with_path(old_grad),
                                    jax.tree.leaves(grad)):
      scale = float(jnp.max(jnp.abs(g_old)))
      np.testing.assert_allclose(np.asarray(g_new), np.asarray(g_old), rtol=1e-5,
                                 atol=1e-6 * max(scale, 1e-30),
                                 err_msg=f"{name}: {jax.tree_util.keystr(path)}")


def test_train_objective_reports_what_its_loss_needs():
  kd = KDS["forward_kl"]
  student, teacher, batch = models_and_batch(seed=2)
  objective = new_objective(kd, vocab_chunks.AUTO, metrics=False)
  loss, ss = loss_fn(objective, student, teacher, batch)
  (_, sums) = jax.jit(loss)(ss)
  assert set(sums) == {"logit_kd", "logit_kd_divergence", "hard_ce"}
  full = jax.jit(loss_fn(new_objective(kd, vocab_chunks.AUTO), student, teacher, batch)[0])(ss)[1]
  assert {"teacher_ce", "top1_agreement", "logit_cosine"} <= set(full)
  for key in sums:
    assert float(sums[key]) == float(full[key]), key


def test_only_the_loss_is_differentiated_and_a_metric_only_objective_works():
  """The fused path's sums are metrics (no gradient flows through them); with no token-level
  term (attention transfer alone) the logit metrics still come out, and nothing is fused."""
  student, teacher, batch = models_and_batch(seed=3)
  objective = new_objective(AttentionTransfer({0: 1}), vocab_chunks.AUTO)
  loss, ss = loss_fn(objective, student, teacher, batch)
  (value, sums), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(ss)
  assert {"hard_ce", "teacher_ce", "attention_transfer"} <= set(sums)
  assert float(value) == pytest.approx(float(sums["attention_transfer"]))
  kd_loss, _ = loss_fn(new_objective(KDS["forward_kl"], 4), student, teacher, batch)
  hard_ce_grad = jax.jit(jax.grad(lambda ss: kd_loss(ss)[1]["hard_ce"]))(ss)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(hard_ce_grad))
  assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grad))


# ---- structure of the compiled step -------------------------------------------------------------

def lowered_text(objective, B=2, L=9):
  student, teacher, batch = models_and_batch(B=B, L=L)
  loss, ss = loss_fn(objective, student, teacher, batch)
  return jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(ss).as_text()


def test_train_step_makes_fewer_passes_over_the_vocabulary():
  """Counted in the lowered loss + gradient. Shared, a LogitKD(T=2) train step reduces over V
  7 times per token: the forward takes each model's max (2), the student's log-sum-exp at T=1
  and T=2 and the teacher's at T=2 (3) and the KL sum (1); the backward sums the KL's
  cotangent over V once (the T=2 log-normaliser's transpose; the T=1 NLL needs no sum, and
  the teacher is frozen). The old formulation took 18: log-softmaxes at T=2 (2 x 2), KL (1),
  the hard-label NLL and the hard_ce metric each with their own T=1 log-softmax (2 x 2), the
  teacher's NLL (2), two argmaxes, three dot products for the cosine; backward 2."""
  kd = KDS["forward_kl"]
  old = vocab_reductions(lowered_text(old_objective(kd)), V)
  train_unchunked = vocab_reductions(lowered_text(new_objective(kd, None, metrics=False)), V)
  train_fused = vocab_reductions(lowered_text(new_objective(kd, 4, metrics=False)), V)
  eval_all = vocab_reductions(lowered_text(new_objective(kd, None, metrics=True)), V)
  assert old == 18
  assert train_unchunked == 7 and train_fused == 7
  # The extra metrics: the teacher's T=1 log-sum-exp, two argmaxes, three dot products.
  assert eval_all == 7 + 6


def test_chunked_step_never_builds_a_whole_logit_array():
  """Neither model's [B, L, V] (or [B*L, V]) logits appear in the chunked loss + gradient: only
  chunk-sized ones; the unchunked step has them."""
  B, L = 2, 9
  kd = KDS["forward_kl"]
  whole = (f"tensor<{B}x{L}x{V}x", f"tensor<{B * L}x{V}x")
  chunked_text = lowered_text(new_objective(kd, 4, metrics=False), B, L)
  unchunked_text = lowered_text(new_objective(kd, None, metrics=False), B, L)
  assert not any(w in chunked_text for w in whole)
  assert f"tensor<4x{V}xf32>" in chunked_text  # 18 tokens: 5 chunks of 4 (2 padded)
  assert any(w in unchunked_text for w in whole)


def test_chunked_forward_passes_return_no_logits():
  kd = KDS["forward_kl"]
  student, teacher, batch = models_and_batch()
  for chunk, has_logits in ((vocab_chunks.AUTO, False), (4, False), (None, True)):
    inputs = run_models(kd, student, {"teacher": teacher}, batch, chunk_size=chunk)
    assert isinstance(inputs, DistillInputs)
    assert (inputs.student.logits_BxLxV is not None) == has_logits
    assert (inputs.teacher.logits_BxLxV is not None) == has_logits


# ---- the chunk size ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows, length, vocab", [(4, 256, 128_256), (4, 256, 32_000),
                                                 (4, 256, 256), (8, 512, 151_936),
                                                 (1, 8, 2**26), (3, 1, 10)])
def test_auto_chunk_is_the_most_positions_whose_logits_fit_the_budget(rows, length, vocab):
  positions = vocab_chunks.auto_chunk_len(rows, length, vocab)
  budget = vocab_chunks.CHUNK_BUDGET_BYTES
  row_bytes = rows * vocab * 4  # one position of every row
  assert 1 <= positions <= length
  assert positions == length or positions == 1 or (
      positions * row_bytes <= budget < (positions + 1) * row_bytes)
  if row_bytes * length <= budget:
    assert positions == length  # small vocabularies: one chunk holds the batch


def test_auto_chunk_examples():
  # 128 MiB / (4 bytes x 4 rows x 128,256) = 65.4: Llama 3's vocabulary gets 65 positions of 4
  # rows (260 tokens) per chunk on one device.
  assert vocab_chunks.auto_chunk_len(4, 256, 128_256) == 65
  assert vocab_chunks.auto_chunk_len(4, 1024, 32_000) == 262
  assert vocab_chunks.auto_chunk_len(4, 1024, 32_000, budget_bytes=64 * 2**20) == 131
  assert vocab_chunks.chunk_len(vocab_chunks.AUTO, 4, 256, 128_256) == 65
  assert vocab_chunks.chunk_len(100, 4, 256, 128_256) == 25  # 100 tokens: 25 positions x 4 rows


def test_chunk_size_from_config():
  from distillax.configs.sections import distill_section
  assert distill_section().chunk_size == vocab_chunks.AUTO  # chunked by default
  assert vocab_chunks.chunk_size_from_config(0) is None
  assert vocab_chunks.chunk_size_from_config(-1) == vocab_chunks.AUTO
  assert vocab_chunks.chunk_size_from_config(256) == 256
  for bad in (-2, -100):
    with pytest.raises(ConfigError, match="chunk_size"):
      vocab_chunks.chunk_size_from_config(bad)
  for bad in (0, -3, True, 2.5):
    with pytest.raises(ConfigError, match="chunk_size"):
      make_distill_objective(LogitKD(), chunk_size=bad)


def test_teacher_forward_runs_in_the_dtype_its_config_asks():
  """teacher.dtype=bfloat16: the teacher's output layer (chunked) multiplies in bf16 into fp32
  logits; the loss moves by bf16 rounding only. The default teacher computes in fp32."""
  kd = KDS["forward_kl"]
  student, teacher, batch = models_and_batch(seed=4)
  bf16_teacher = random_model(TEACHER.replace(dtype="bfloat16"), 4 + 100, NORMS_NEAR_ONE)
  objective = new_objective(kd, 4, metrics=False)

  def run(t):
    loss, ss = loss_fn(objective, student, t, batch)
    return jax.jit(jax.value_and_grad(loss, has_aux=True)), ss

  def bf16_output_layer(text):
    return any("dot_general" in line and "bf16>" in line and f"x{V}xf32>" in line
               for line in text.splitlines())

  (fn32, ss), (fn16, _) = run(teacher), run(bf16_teacher)
  (loss32, _), _ = fn32(ss)
  (loss16, _), _ = fn16(ss)
  assert float(loss16) != float(loss32)
  np.testing.assert_allclose(float(loss16), float(loss32), rtol=2e-2)
  assert bf16_output_layer(fn16.lower(ss).as_text())
  assert not bf16_output_layer(fn32.lower(ss).as_text())
