"""Attention transfer: the student's attention maps imitate the teacher's, layer by layer.

For each mapped pair (student layer i -> teacher layer j), both models' attention probabilities
(B, H, L, S) are compared per query token. When the head counts differ, the teacher's heads are
grouped onto the student's: student head h is compared with the mean of teacher heads
[h*g, (h+1)*g), g = H_teacher / H_student (a mean of distributions is a distribution, so KL stays
well defined). Per real query token the term is

  sum over mapped layers of  mean over student heads of  d(teacher row, student row)

with d = KL(teacher || student) over the keys ('kl') or the squared error summed over the keys
('mse'). Masked keys carry probability 0 in both maps and contribute nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from distillax.distill.base import (DistillInputs, Needs, Strategy, check_common,
                                    check_layer_range, masked_sum, normalize_layer_map)
from distillax.errors import ConfigError

ATTENTION_LOSSES = ("kl", "mse")
_TINY = 1e-30  # student probabilities are floored here inside the log (underflowed keys)


def group_heads(probs_BxHxLxS: jax.Array, num_groups: int) -> jax.Array:
  """(B, H, L, S) -> (B, H / num_groups, L, S): mean over consecutive groups of heads."""
  B, H, L, S = probs_BxHxLxS.shape
  return jnp.mean(probs_BxHxLxS.reshape(B, H // num_groups, num_groups, L, S), axis=2)


def attention_row_loss(kind: str, teacher_BxHxLxS: jax.Array, student_BxHxLxS: jax.Array
                       ) -> jax.Array:
  """d(teacher row, student row) averaged over heads: (B, L)."""
  p, q = teacher_BxHxLxS, student_BxHxLxS
  if kind == "kl":
    log_ratio = jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.log(jnp.maximum(q, _TINY))
    per_row = jnp.sum(jnp.where(p > 0, p * log_ratio, 0.0), axis=-1)
  else:
    per_row = jnp.sum(jnp.square(q - p), axis=-1)
  return jnp.mean(per_row, axis=1)


@dataclasses.dataclass(frozen=True)
class AttentionTransfer(Strategy):
  """Per-layer attention-map imitation. layer_map: {student_layer: teacher_layer}, 0-based block
  indices; loss: 'kl' (KL(teacher || student) per query row) or 'mse'."""

  layer_map: Any = None
  loss: str = "kl"
  weight: float = 1.0
  name: str = "attention_transfer"

  def __post_init__(self):
    check_common(self)
    object.__setattr__(self, "layer_map",
                       normalize_layer_map(self.layer_map or {}, "AttentionTransfer"))
    if self.loss not in ATTENTION_LOSSES:
      raise ConfigError(f"AttentionTransfer.loss={self.loss!r}; choose one of "
                        f"{', '.join(ATTENTION_LOSSES)}")

  @property
  def needs(self) -> Needs:
    return Needs(attention=True, teacher=True)

  def check_shapes(self, student_probs_shape, teacher_probs_shape) -> int:
    """Validates the map against (layers, B, H, L, S) shapes; returns the head group size."""
    check_layer_range(self.layer_map, student_probs_shape[0], teacher_probs_shape[0],
                      "AttentionTransfer", "layer")
    hs, ht = student_probs_shape[2], teacher_probs_shape[2]
    if ht % hs:
      raise ConfigError(f"AttentionTransfer: teacher heads ({ht}) are not a multiple of student "
                        f"heads ({hs}); teacher heads are averaged in groups onto student heads, "
                        f"so pick models whose head counts divide")
    if tuple(student_probs_shape[-2:]) != tuple(teacher_probs_shape[-2:]):
      raise ConfigError(f"AttentionTransfer: attention maps of shape {student_probs_shape[-2:]} "
                        f"(student) and {teacher_probs_shape[-2:]} (teacher) differ; run both on "
                        f"the same tokens")
    return ht // hs

  def term_sums(self, inputs: DistillInputs):
    s_probs, t_probs = inputs.student.attention_probs, inputs.teacher.attention_probs
    if s_probs is None or t_probs is None:
      raise ConfigError("AttentionTransfer needs attention probabilities from both models; run "
                        "the models with return_attention=True (make_distill_objective does)")
    groups = self.check_shapes(s_probs.shape, t_probs.shape)
    t_probs = jax.lax.stop_gradient(t_probs)
    per_token_BxL = 0.0
    for s_layer, t_layer in self.layer_map:
      teacher = group_heads(t_probs[t_layer].astype(jnp.float32), groups)
      per_token_BxL = per_token_BxL + attention_row_loss(
          self.loss, teacher, s_probs[s_layer].astype(jnp.float32))
    term = masked_sum(per_token_BxL, inputs.mask_BxL)
    return term, {self.name: term}
