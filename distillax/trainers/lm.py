"""Next-token training: the objective of the demo teacher and of the scratch student, and the
recipe of `trainer='lm'`."""

from __future__ import annotations

import functools
from typing import Mapping

import jax
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.framework import losses, vocab_chunks
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models.moe import layer as moe
from distillax.trainers.recipe import Recipe
from distillax.trainers.registry import register


def lm_objective(student: nnx.Module, extras: Mapping[str, nnx.Module], batch, rng: jax.Array,
                 *, moe_aux_loss: float = 0.0, router_z_loss: float = 0.0,
                 loss_impl: str = "chunked",
                 chunk_size: int = vocab_chunks.AUTO) -> ObjectiveOutput:
  """Cross-entropy on every target the loss mask keeps (padding and document edges excluded);
  for a mixture of experts also the weighted router losses and the expert-load metrics.
  loss_impl: 'chunked' or 'sliced' (the vocabulary-chunk engine over token chunks or over
  vocabulary slices; both also sum the argmax accuracy); chunk_size: the chunk engine's tokens
  per chunk (vocab_chunks.AUTO: from its per-device budget)."""
  del extras, rng
  out = student(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_logits=False)
  targets_BxL, mask_BxL = batch[batch_spec.TARGETS], batch[batch_spec.LOSS_MASK]
  sums, ratios = {}, {}
  loss_sum, sums["accuracy"], tokens = losses.model_cross_entropy_sums(  # never (B, L, V)
      student, out.final_hidden_BxLxD, targets_BxL, mask_BxL, sliced=loss_impl == "sliced",
      chunk_size=chunk_size)
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
  sliced_loss = True
  # Its eval objective (lm_objective) also reports the argmax accuracy.
  rollback_metrics = ("eval_perplexity", "eval_loss", "eval_objective", "eval_accuracy")

  def objective(self, *, train: bool = False) -> Objective:
    """Train: the CE with the router losses train weighs; eval: the CE and the accuracy
    unweighted. Both through the engine train.loss_impl resolved to."""
    if not train:
      if self.loss_impl == "chunked":
        return lm_objective
      return functools.partial(lm_objective, loss_impl=self.loss_impl)
    weights = {name: float(self.config.train.get(name, 0.0))
               for name in ("moe_aux_loss", "router_z_loss")}
    options = {k: v for k, v in weights.items() if v}
    if self.loss_impl != "chunked":
      options["loss_impl"] = self.loss_impl
    objective = functools.partial(lm_objective, **options) if options else lm_objective
    return self.transforms.train_objective(objective)
