"""The student transforms a job composes onto any recipe: LoRA/QLoRA adapters and QAT fake
quantization, from the `lora` and `qat` sections. They change the student model, never the
step: any objective can train an adapted or fake-quantized student."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from distillax import quant
from distillax.framework.step import Objective


@dataclasses.dataclass(frozen=True)
class StudentTransforms:
  lora: Any = None  # the `lora` section when module_regex is set, else None
  qat: quant.QuantConfig | None = None  # the parsed `qat` section when it has rules/a schedule
  seed: int = 0

  @classmethod
  def from_config(cls, config) -> "StudentTransforms":
    lora = config.get("lora")
    qat = config.get("qat")
    qat_cfg = None
    if qat and (qat.rules or qat.get("schedule")):  # a run from before qat.schedule has none
      qat_cfg = quant.QuantConfig.from_config({"rules": list(qat.rules),
                                               "start_step": int(qat.start_step),
                                               "schedule": list(qat.get("schedule") or ()),
                                               "int8_matmul": bool(qat.get("int8_matmul",
                                                                           False)),
                                               "int8_backward": bool(qat.get("int8_backward",
                                                                             False))})
    return cls(lora=lora if lora and lora.module_regex else None, qat=qat_cfg,
               seed=int(config.seed))

  @property
  def qat_start_step(self) -> int:
    """Full-precision steps before fake quantization starts (0 = from the first step)."""
    return self.qat.start_step if self.qat is not None else 0

  def apply(self, model: nnx.Module, *, quantize: bool = True) -> nnx.Module:
    """Adapters first, then fake quantization (its rounding sees the frozen base weights).

    The state tree is the same with and without fake quantization, so a delayed QAT start
    swaps compiled steps without touching the state.
    """
    if self.lora is not None:
      lc = self.lora
      model = quant.apply_lora(model, module_regex=lc.module_regex, rank=int(lc.rank),
                               alpha=float(lc.alpha), dropout=float(lc.dropout),
                               base_qtype=lc.base_qtype or None,
                               base_tile_size=(int(lc.base_tile_size) or None) if lc.base_qtype
                               else None, seed=self.seed)
    if quantize and self.qat is not None:
      model = quant.quantize_for_training(model, self.qat)
    return model

  def trainable(self) -> Any:
    """Only the adapters train under LoRA; otherwise every parameter."""
    return quant.LoRAParam if self.lora is not None else nnx.Param

  def train_objective(self, objective: Objective) -> Objective:
    """Adapter dropout is a training-only part of the objective (eval runs `objective`)."""
    if self.lora is not None and float(self.lora.dropout) > 0:
      return quant.with_lora_dropout(objective)
    return objective

  def fake_quant_at(self, step: int) -> bool:
    """Whether the run's forward at `step` is fake-quantized (QAT rules, started by then)."""
    return self.qat is not None and step >= self.qat.start_step

  def at_step(self, step: int) -> "StudentTransforms":
    """These transforms with the QAT rules of `step`'s stage (qat.schedule); unchanged
    without a schedule or before its first stage."""
    stage = self.qat.stage_at(step) if self.qat is not None and self.qat.schedule else None
    return self if stage is None else dataclasses.replace(self, qat=stage)

  def describe(self, *, fake_quant: bool, lora_merged: bool) -> str:
    """The form a loaded student computes in, in words (`distillax generate`, `eval` and
    `export` print it, so nobody judges one form believing it is another)."""
    if fake_quant and self.qat is not None:
      # A rule whose weight type is None keeps what it matches in full precision (the
      # embedding, say): named as that, never as a type "None".
      weights = "/".join(dict.fromkeys(str(r.weight_qtype) for r in self.qat.rules
                                       if r.weight_qtype))
      acts = "/".join(dict.fromkeys(str(r.act_qtype) for r in self.qat.rules if r.act_qtype))
      kept = any(not r.weight_qtype for r in self.qat.rules)
      form = (f"fake-quant {weights or 'no'} weights" + (f", {acts} activations" if acts else "")
              + (", the rest full precision" if kept and weights else "")
              + " (qat.rules: the forward QAT trains)")
    elif self.qat is not None:
      form = "full precision (qat.rules' fake quantization off)"
    else:
      form = "full precision"
    if self.lora is not None:
      form += ", LoRA merged" if lora_merged else ", LoRA adapters on"
    return form

  def strip(self, model: nnx.Module) -> nnx.Module:
    """The plain model inside: LoRA merged, fake quantization off (export re-applies it)."""
    if self.lora is not None:
      model = quant.merge_lora(model)
    if self.qat is not None:
      model = quant.full_precision(model)
    return model
