"""The EAGLE-3 draft objective: a head learns the frozen target's next-token distribution from
the target's own hidden states, with training-time test (TTT) over k steps.

Inside the one compiled step (framework/step.py) the frozen target (extras['teacher']) runs on
the batch once, behind stop_gradient, returning its hidden states (the head's input, at
`aux_layers`) and its final hidden states (the teacher signal). The head then runs k steps
(models/eagle3.py `ttt_hidden`): step j at position t reads the target's fused feature (j = 0)
or its own step j-1 output, with the token j places past t's next token, and predicts the token
after that. Its target is the target model's distribution at position t + 1 + j, over the draft
vocabulary (the target's logits at the draft ids, renormalised: what EAGLE-3, speculators and
SpecForge train on), as a soft cross-entropy (forward KL plus the target's entropy, which has
no gradient). Steps are summed with weight decay**j.

Masking, as every loss here: position t of step j counts where the token it predicts is a
target the batch's loss mask keeps (prompt tokens and padding drop out) and lies in t's own
document (packed rows never train across a document boundary). `tokens` is step 0's count; each
step's loss and accuracy are also reported as ratios over their own counts (`ttt{j}_loss`,
`ttt{j}_accuracy`: the head's top-1 equals the target's top-1 within the draft vocabulary, what
greedy acceptance needs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec
from distillax.framework import losses
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models.eagle3 import aux_features
from distillax.models.layers import softcap

TEACHER = "teacher"  # the frozen target's key among the step's extras (as distillation's)


@dataclasses.dataclass(frozen=True)
class DraftSettings:
  """How the head trains (the `draft` section, distillax/configs/draft_eagle3.py)."""

  ttt_steps: int = 3  # steps of training-time test (the tokens the head learns to propose)
  decay: float = 0.8  # weight of step j's loss: decay ** j


def shifted(x_BxL: jax.Array, j: int, fill=0) -> jax.Array:
  """x (B, L, ...) moved j places left along L (x[:, t + j] at t), `fill` past the end."""
  if j == 0:
    return x_BxL
  pad = jnp.full(x_BxL.shape[:1] + (j,) + x_BxL.shape[2:], fill, x_BxL.dtype)
  return jnp.concatenate([x_BxL[:, j:], pad], axis=1)


def target_logits(target, final_hidden_BxLxD: jax.Array, d2t_V: jax.Array) -> jax.Array:
  """The target's float32 logits at the draft vocabulary's ids only (its output layer's columns
  of those ids; never the whole vocabulary)."""
  dt = target.config.jnp_dtype
  w_DxV = jnp.take(target.output_weight_DxV(), d2t_V, axis=1)
  logits = jnp.einsum("BLD,DV->BLV", final_hidden_BxLxD.astype(dt), w_DxV.astype(dt),
                      preferred_element_type=jnp.float32)
  return softcap(logits, target.config.final_logit_softcap)


def target_pass(target, batch, aux_layers):
  """(fused-layer input (B, L, A*D), final hidden (B, L, D)) of the frozen target."""
  out = target(batch[batch_spec.INPUTS], **losses.model_inputs(batch), return_hidden_states=True,
               return_logits=False)
  aux = aux_features(out.hidden_states, aux_layers)
  return jax.lax.stop_gradient(aux), jax.lax.stop_gradient(out.final_hidden_BxLxD)


def step_masks(batch, steps: int):
  """(T, B, L) float masks: step j's position t counts where target t + 1 + j is kept by the
  loss mask and lies in t's document."""
  mask_BxL = batch[batch_spec.LOSS_MASK].astype(jnp.float32)
  seg_BxL = batch.get(batch_spec.SEGMENT_IDS, jnp.ones_like(batch[batch_spec.INPUTS]))
  out = []
  for j in range(steps):
    same_doc = (shifted(seg_BxL, j + 1, fill=-1) == seg_BxL) & (seg_BxL > 0)
    out.append(shifted(mask_BxL, j + 1) * same_doc)
  return jnp.stack(out)


def soft_ce_and_hits(draft_logits_BxLxV, target_logits_BxLxV):
  """Per position: soft cross-entropy of the head against the target's renormalised
  distribution over the draft vocabulary, and whether their top-1 agree."""
  p = jax.nn.softmax(target_logits_BxLxV, axis=-1)
  ce = -jnp.sum(p * jax.nn.log_softmax(draft_logits_BxLxV, axis=-1), axis=-1)
  hits = jnp.argmax(draft_logits_BxLxV, -1) == jnp.argmax(target_logits_BxLxV, -1)
  return ce, hits.astype(jnp.float32)


def make_draft_objective(settings: DraftSettings) -> Objective:
  """The step objective of an Eagle3Head student against extras['teacher']."""
  T, decay = int(settings.ttt_steps), float(settings.decay)

  def objective(head, extras, batch, rng) -> ObjectiveOutput:
    del rng
    target = extras[TEACHER]
    aux, final_BxLxD = target_pass(target, batch, head.config.aux_layers)
    targets_BxL = batch[batch_spec.TARGETS]
    tokens_TxBxL = jnp.stack([shifted(targets_BxL, j) for j in range(T)])
    positions_BxL = batch.get(batch_spec.POSITIONS)
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(targets_BxL.shape[1], dtype=jnp.int32),
                                       targets_BxL.shape)
    seg_BxL = batch.get(batch_spec.SEGMENT_IDS, jnp.ones_like(targets_BxL))
    hidden_TxBxLxD = head.ttt_hidden(aux, tokens_TxBxL, positions_BxL, seg_BxL)
    masks_TxBxL = step_masks(batch, T)
    d2t = head.d2t[...]
    loss_sum, sums, ratios = 0.0, {}, {}
    for j in range(T):
      want = jax.lax.stop_gradient(target_logits(target, shifted(final_BxLxD, j + 1), d2t))
      ce_BxL, hits_BxL = soft_ce_and_hits(head.logits(hidden_TxBxLxD[j]), want)
      m = masks_TxBxL[j]
      step_loss = jnp.sum(ce_BxL * m)
      loss_sum = loss_sum + decay ** j * step_loss
      ratios[f"ttt{j}_loss"] = (step_loss, jnp.sum(m))
      ratios[f"ttt{j}_accuracy"] = (jnp.sum(hits_BxL * m), jnp.sum(m))
    return ObjectiveOutput(loss_sum=loss_sum, tokens=jnp.sum(masks_TxBxL[0]), sums=sums,
                           ratios=ratios)

  return Objective(objective)
