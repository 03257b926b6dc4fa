"""Router distillation: each student router's distribution over its experts imitates the
teacher's, when the student's experts are the teacher's (a student derived from teacher blocks,
keeping all of each layer's experts or a subset: student.from_teacher.experts).

For each mapped pair (student layer i -> teacher layer j) and each real token, with the
teacher's router logits restricted to the experts student layer i kept (student expert e is
teacher expert kept[i][e]; all experts, in order, when nothing was cut):

  KL( softmax(teacher logits[kept[i]]) || softmax(student logits) )

averaged over the mapped layers (as the router losses are). The routers' logits come from each
router's input behind stop_gradient (models/moe/layer.py), so the term trains the student's routers
and nothing below them: the experts and attention learn from the other terms only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from distillax.distill.base import (DistillInputs, Needs, Strategy, check_common,
                                    check_layer_range, masked_sum, normalize_layer_map)
from distillax.errors import ConfigError

_FIX = ("derive the student from the teacher's blocks (student.from_teacher.layers, and "
        "student.from_teacher.experts for a subset) or set distill.router.weight=0")


def _kept(experts) -> tuple[tuple[int, ...], ...] | None:
  if experts is None:
    return None
  try:
    return tuple(tuple(int(e) for e in row) for row in experts)
  except (TypeError, ValueError):
    raise ConfigError(f"RouterKD.experts={experts!r} must be one tuple of teacher expert "
                      f"indices per student layer, e.g. ((0, 3), (1, 2)), or None") from None


@dataclasses.dataclass(frozen=True)
class RouterKD(Strategy):
  """Per-layer router imitation. layer_map: {student layer: teacher layer} (None: layer i to
  layer i, equal depths); experts: per student layer, the teacher experts it kept (None: the
  same experts as the teacher, in order)."""

  layer_map: Any = None
  experts: Any = None
  weight: float = 1.0
  name: str = "router_kd"

  def __post_init__(self):
    check_common(self)
    if self.layer_map is not None:
      object.__setattr__(self, "layer_map", normalize_layer_map(self.layer_map, "RouterKD"))
    object.__setattr__(self, "experts", _kept(self.experts))

  @property
  def needs(self) -> Needs:
    return Needs(teacher=True, router_logits=True)

  def pairs(self, student_layers: int, teacher_layers: int) -> tuple[tuple[int, int], ...]:
    if self.layer_map is not None:
      check_layer_range(self.layer_map, student_layers, teacher_layers, "RouterKD", "layer")
      return self.layer_map
    if student_layers != teacher_layers:
      raise ConfigError(f"RouterKD: the student has {student_layers} layers and the teacher "
                        f"{teacher_layers}; without a layer map (a student of teacher blocks "
                        f"has one) their routers do not correspond; {_FIX}")
    return tuple((i, i) for i in range(student_layers))

  def check_experts(self, student_layers: int, student_experts: int, teacher_layers: int,
                    teacher_experts: int) -> tuple[tuple[int, int], ...]:
    """The layer pairs, after checking that each student layer's experts are teacher experts;
    a ConfigError names the mismatch and the fix."""
    if not student_experts or not teacher_experts:
      which = "student" if not student_experts else "teacher"
      raise ConfigError(f"RouterKD distils routers, but the {which} is dense "
                        f"(model.num_experts=0); set distill.router.weight=0 or use two "
                        f"mixtures of experts")
    pairs = self.pairs(student_layers, teacher_layers)
    if self.experts is None and student_experts != teacher_experts:
      raise ConfigError(f"RouterKD: the student's {student_experts} experts per layer are not "
                        f"the teacher's {teacher_experts} and no kept-expert map says which "
                        f"they are; {_FIX}")
    if self.experts is not None:
      for s, _ in pairs:
        row = self.experts[s] if s < len(self.experts) else ()
        if len(row) != student_experts or any(not 0 <= e < teacher_experts for e in row):
          raise ConfigError(f"RouterKD: student layer {s} has {student_experts} experts but the "
                            f"kept-expert map gives {list(row)} of the teacher's "
                            f"{teacher_experts}; {_FIX}")
    return pairs

  def term_sums(self, inputs: DistillInputs):
    s_logits = inputs.student.router_logits_NxBxLxE
    t_logits = None if inputs.teacher is None else inputs.teacher.router_logits_NxBxLxE
    if s_logits is None or t_logits is None:
      which = "student" if s_logits is None else "teacher"
      raise ConfigError(f"RouterKD needs router logits from both models, but the {which} has "
                        f"no experts (or was not run with return_router_logits=True, as "
                        f"make_distill_objective runs it)")
    pairs = self.check_experts(s_logits.shape[0], s_logits.shape[-1], t_logits.shape[0],
                               t_logits.shape[-1])
    per_token_BxL = 0.0
    for s_layer, t_layer in pairs:
      teacher_BxLxE = jax.lax.stop_gradient(t_logits[t_layer]).astype(jnp.float32)
      if self.experts is not None:
        teacher_BxLxE = jnp.take(teacher_BxLxE, jnp.asarray(self.experts[s_layer]), axis=-1)
      log_p = jax.nn.log_softmax(teacher_BxLxE, axis=-1)
      log_q = jax.nn.log_softmax(s_logits[s_layer].astype(jnp.float32), axis=-1)
      per_token_BxL = per_token_BxL + jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    term = masked_sum(per_token_BxL / len(pairs), inputs.mask_BxL)
    return term, {self.name: term}
