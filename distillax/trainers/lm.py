"""Next-token training: the objective of the demo teacher and of the scratch student, and the
recipe of `trainer='lm'`."""

from __future__ import annotations

from typing import Mapping

import jax
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.framework import losses
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.trainers.recipe import Recipe
from distillax.trainers.registry import register


def lm_objective(student: nnx.Module, extras: Mapping[str, nnx.Module], batch, rng: jax.Array
                 ) -> ObjectiveOutput:
  """Cross-entropy on every target the loss mask keeps (padding and document edges excluded)."""
  del extras, rng
  out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
  loss_sum, correct, tokens = losses.model_cross_entropy_sums(  # never all (B, L, V) logits
      student, out.final_hidden_BxLxD, batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK])
  return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums={"accuracy": correct})


@register("lm")
class LMRecipe(Recipe):
  """Next-token training of one model (fresh, from an earlier run or a Hugging Face checkpoint,
  with the config's LoRA / QAT transforms)."""

  def objective(self, *, train: bool = False) -> Objective:
    return self.transforms.train_objective(lm_objective) if train else lm_objective
