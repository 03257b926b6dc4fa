"""Next-token training: the objective of the demo teacher and of the scratch student."""

from __future__ import annotations

from typing import Mapping

import jax
from flax import nnx

from distillax.framework import chunked_loss, losses
from distillax.framework.step import ObjectiveOutput


def lm_objective(student: nnx.Module, extras: Mapping[str, nnx.Module], batch, rng: jax.Array
                 ) -> ObjectiveOutput:
  """Cross-entropy on every target the loss mask keeps (padding and document edges excluded)."""
  del extras, rng
  out = student(batch[losses.BATCH_INPUTS], **losses.model_inputs(batch), return_logits=False)
  loss_sum, correct, tokens = chunked_loss.model_cross_entropy_sums(  # never all (B, L, V) logits
      student, out.final_hidden_BxLxD, batch[losses.BATCH_TARGETS], batch[losses.BATCH_MASK])
  return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums={"accuracy": correct})
