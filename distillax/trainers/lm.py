"""Next-token training: the objective of the demo teacher and of the scratch student, and the
recipe of `trainer='lm'`."""

from __future__ import annotations

import functools
from typing import Mapping

import jax
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.framework import losses
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models import moe
from distillax.trainers.recipe import Recipe
from distillax.trainers.registry import register


def lm_objective(student: nnx.Module, extras: Mapping[str, nnx.Module], batch, rng: jax.Array,
                 *, moe_aux_loss: float = 0.0, router_z_loss: float = 0.0) -> ObjectiveOutput:
  """Cross-entropy on every target the loss mask keeps (padding and document edges excluded);
  for a mixture of experts also the weighted router losses and the expert-load metrics."""
  del extras, rng
  out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
  loss_sum, correct, tokens = losses.model_cross_entropy_sums(  # never all (B, L, V) logits
      student, out.final_hidden_BxLxD, batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK])
  sums, ratios = {"accuracy": correct}, {}
  if out.router_stats is not None:
    extra, router_sums, ratios = moe.objective_terms(out.router_stats, tokens, moe_aux_loss,
                                                     router_z_loss)
    loss_sum, sums = loss_sum + extra, {**sums, **router_sums}
  return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums=sums, ratios=ratios)


@register("lm")
class LMRecipe(Recipe):
  """Next-token training of one model (fresh, from an earlier run or a Hugging Face checkpoint,
  with the config's LoRA / QAT transforms)."""

  router_losses = True

  def objective(self, *, train: bool = False) -> Objective:
    if not train:
      return lm_objective
    weights = {name: float(self.config.train.get(name, 0.0))
               for name in ("moe_aux_loss", "router_z_loss")}
    objective = lm_objective
    if any(weights.values()):
      objective = functools.partial(lm_objective, **weights)
    return self.transforms.train_objective(objective)
