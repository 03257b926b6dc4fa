"""Chunked logit losses: same value and gradient as unchunked, without full logits in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill import AttentionTransfer, LogitKD, make_distill_objective
from distillax.models.config import TransformerConfig
from distillax.models.transformer import Transformer
from tests.distill import helpers as h

GEMMA_LIKE = dict(tie_embeddings=True, final_logit_softcap=5.0, scale_embeddings=True,
                  norm_scale_plus_one=True, mlp_activation="geglu")

CASES = {
    # 18 tokens in chunks of 4: 5 chunks of 4 with 2 padded positions.
    "topk_composite_ragged": (LogitKD(top_k=5) + 0.5 * AttentionTransfer({1: 2}), 4, {}),
    "jsd_single_chunk": (LogitKD(divergence="jsd", beta=0.3, temperature=3.0), 64, {}),
    "reverse_kl_tied_softcap": (LogitKD(divergence="reverse_kl", alpha=0.4), 6, GEMMA_LIKE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_equals_unchunked_value_and_gradient(case):
  strategy, chunk_size, family = CASES[case]
  # A comparison of loss paths: both models run the reference attention, whose compiled rounding
  # is the same in every program (blockwise's backward passes a cotangent's last bits on less
  # damped; tests/models/attention/test_impls.py checks it against the reference).
  family = dict(family, attention_impl="reference")
  student, teacher = h.make_models(3, h.STUDENT_CONFIG.replace(**family),
                                   h.TEACHER_CONFIG.replace(**family))
  batch = h.to_jnp(h.make_batch(seed=3))
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  def value_and_grad(chunk):
    objective = make_distill_objective(strategy, chunk_size=chunk)

    def loss(ss):
      out = objective(nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}, batch, None)
      return out.loss_sum, out.sums

    return jax.value_and_grad(loss, has_aux=True)(ss)

  both = jax.jit(lambda: (value_and_grad(None), value_and_grad(chunk_size)))  # one compile
  ((full_loss, full_sums), full_grad), ((chunk_loss, chunk_sums), chunk_grad) = both()
  np.testing.assert_allclose(float(chunk_loss), float(full_loss), rtol=1e-5)
  assert set(chunk_sums) == set(full_sums)
  for name in full_sums:
    np.testing.assert_allclose(float(chunk_sums[name]), float(full_sums[name]), rtol=1e-5,
                               atol=1e-6, err_msg=name)
  for path, g_full in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(full_grad)):
    g_chunk = nnx.to_pure_dict(chunk_grad)
    for key in path:
      g_chunk = g_chunk[key.key]
    scale = float(jnp.max(jnp.abs(g_full)))
    assert scale > 0, path
    np.testing.assert_allclose(np.asarray(g_chunk), np.asarray(g_full), rtol=1e-5,
                               atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_chunked_never_holds_full_logits():
  """Compiled temporary memory of loss+gradient: chunked stays below ONE model's full fp32
  logits, while the unchunked loss needs several such arrays."""
  V, B, L = 8192, 4, 64
  small = dict(vocab_size=V, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
               max_seq_len=L)
  teacher = nnx.eval_shape(lambda: Transformer(TransformerConfig(embed_dim=32, **small),
                                               rngs=nnx.Rngs(0)))
  student = nnx.eval_shape(lambda: Transformer(TransformerConfig(embed_dim=16, **small),
                                               rngs=nnx.Rngs(1)))
  batch = {"inputs_BxL": jax.ShapeDtypeStruct((B, L), jnp.int32),
           "targets_BxL": jax.ShapeDtypeStruct((B, L), jnp.int32),
           "loss_mask_BxL": jax.ShapeDtypeStruct((B, L), jnp.float32)}
  sg, ss = nnx.split(student)
  tg, ts = nnx.split(teacher)

  def temp_bytes(chunk):
    objective = make_distill_objective(LogitKD(top_k=16), chunk_size=chunk)
    loss = lambda ss, ts, b: objective(nnx.merge(sg, ss), {"teacher": nnx.merge(tg, ts)}, b,
                                       None).loss_sum
    compiled = jax.jit(jax.grad(loss)).lower(ss, ts, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  one_model_logits = B * L * V * 4
  unchunked, chunked = temp_bytes(None), temp_bytes(16)
  print(f"temp bytes: unchunked {unchunked}, chunked {chunked}, one model's logits "
        f"{one_model_logits}")
  assert unchunked > 2 * one_model_logits
  assert chunked < one_model_logits, (chunked, one_model_logits)
  assert chunked < unchunked / 4
