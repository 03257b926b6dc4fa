"""Per-token losses shared by every objective, computed in fp32 and returned as sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec
from distillax.framework import token_loss_impl, token_rows, vocab_chunks, vocab_slices


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Negative log-likelihood of each target token, fp32 whatever the logits' dtype."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None].astype(jnp.int32), axis=-1)[..., 0]


def cross_entropy_sums(logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss_sum, correct_sum, tokens) over the tokens where mask is 1."""
  mask_BxL = mask_BxL.astype(jnp.float32)
  nll_BxL = token_nll(logits_BxLxV, targets_BxL)
  correct_BxL = (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)
  return jnp.sum(nll_BxL * mask_BxL), jnp.sum(correct_BxL * mask_BxL), jnp.sum(mask_BxL)


def _next_token_values(logits_NxV, teacher_logits_NxV, tokens) -> dict[str, jax.Array]:
  """Per-position NLL and argmax hit, weighted by the loss mask (the chunk engine's values)."""
  del teacher_logits_NxV
  mask_N = tokens[batch_spec.LOSS_MASK].astype(jnp.float32)
  targets_N = tokens[batch_spec.TARGETS]
  correct_N = (jnp.argmax(logits_NxV, axis=-1) == targets_N).astype(jnp.float32)
  return {"loss": token_nll(logits_NxV, targets_N) * mask_N, "correct": correct_N * mask_N}


def sliced_head(model, hidden_BxLxD) -> tuple[vocab_slices.Head, jax.Array]:
  """(the model's output layer as vocab_slices reads it, its flat input): the matmuls the model
  runs (`output_operands`: a QAT head rounded, a LoRA head's adapter as a second matmul), over
  the token rows of the objective traced now."""
  (h, weight, vocab_axis), *more = model.output_operands(hidden_BxLxD)
  head = vocab_slices.Head(weight, vocab_axis, model.config.dtype,
                           model.config.final_logit_softcap,
                           token_rows.effective(token_rows.active(), weight.shape[vocab_axis]),
                           more=tuple((flat_tokens(x), w) for x, w, _ in more))
  return head, flat_tokens(h)


def chunk_layer(model) -> vocab_chunks.OutputLayer:
  """A model's output layer as the vocabulary-chunk engine reads it, over the token rows of the
  objective traced now (framework/token_rows.py)."""
  return vocab_chunks.OutputLayer.of_model(model).over_token_rows(token_rows.active())


def flat_tokens(x_BxL):
  return x_BxL.reshape((-1,) + x_BxL.shape[2:])


def model_cross_entropy_sums(model, hidden_BxLxD, targets_BxL, mask_BxL, *,
                             chunk_size: int = vocab_chunks.AUTO, sliced: bool = False):
  """`cross_entropy_sums` of the model's logits from its final hidden states: the (B, L, V) fp32
  logits never exist. Through the vocabulary-chunk engine, or over vocabulary slices
  (`sliced`, vocab_slices.py: the same sums, a weight gradient written once per slice); both
  over the token rows of the objective traced now (framework/token_rows.py)."""
  if sliced:
    head, h_NxD = sliced_head(model, hidden_BxLxD)
    spec = vocab_slices.Spec(accuracy=True)
    loss, sums = vocab_slices.token_sums(spec, head, h_NxD, flat_tokens(targets_BxL),
                                         flat_tokens(mask_BxL))
    token_loss_impl.record(vocab_slices.describe(spec, head, targets_BxL.size))
    return loss, sums["correct"], jnp.sum(mask_BxL.astype(jnp.float32))
  tokens = {batch_spec.TARGETS: targets_BxL, batch_spec.LOSS_MASK: mask_BxL}
  loss, sums = vocab_chunks.vocab_chunk_sums(
      _next_token_values, {"loss": 1.0}, tokens, mask_BxL, chunk_layer(model), hidden_BxLxD,
      chunk_size=chunk_size)
  return loss, sums["correct"], jnp.sum(mask_BxL.astype(jnp.float32))


def model_inputs(batch) -> dict:
  """The keyword arguments a distillax model takes from a packed batch."""
  kwargs = {}
  if batch_spec.POSITIONS in batch:
    kwargs["positions_BxL"] = batch[batch_spec.POSITIONS]
  if batch_spec.SEGMENT_IDS in batch:
    kwargs["segment_ids_BxL"] = batch[batch_spec.SEGMENT_IDS]
  return kwargs
