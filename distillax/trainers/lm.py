"""Next-token training: the objective of the demo teacher and of the scratch student, and the
recipe of `trainer='lm'`."""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
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
  output = ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums={"accuracy": correct})
  if out.router_stats is None:
    return output
  return with_router_losses(output, out.router_stats, moe_aux_loss, router_z_loss)


def with_router_losses(output: ObjectiveOutput, stats: moe.RouterStats, aux_weight: float,
                       z_weight: float) -> ObjectiveOutput:
  """`output` plus the router losses, weighted per token of the loss (the step divides its sums
  by the global token count, so they enter as per-token means, averaged over layers), and per
  layer the max / mean tokens per expert (train metrics)."""
  terms = moe.router_losses(stats)
  aux_sum = output.tokens * jnp.mean(terms["aux_N"])
  z_sum = output.tokens * jnp.mean(terms["z_N"])
  loads = stats.load_E
  ratios = {f"expert_load_max_over_mean_l{i}": (jnp.max(loads[i]), jnp.mean(loads[i]))
            for i in range(loads.shape[0])}
  return ObjectiveOutput(loss_sum=output.loss_sum + aux_weight * aux_sum + z_weight * z_sum,
                         tokens=output.tokens,
                         sums={**output.sums, "moe_aux_loss": aux_sum, "router_z_loss": z_sum},
                         ratios={**output.ratios, **ratios})


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
