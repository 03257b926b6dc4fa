"""What to quantize and how: an ordered list of rules over module paths, first match wins.

A rule names a module path regex (re.fullmatch against paths such as 'layers/0/attn',
'layers/1/mlp', 'layers/attn' under scan_layers, and '' for the top module, whose matmul is the
untied output projection `lm_head`), the weight type, the activation type and the scale layout:
per-channel (tile_size None: one scale per output channel) or tiled (one scale per `tile_size`
consecutive inputs of the last contracted axis). A rule whose weight_qtype is None keeps the
matched modules in full precision, which lets an early rule exempt modules from a later catch-all.

Configs are plain data: `QuantConfig.from_config` takes a ConfigDict / dict whose `rules` are
dicts or (module_path, weight_qtype, act_qtype, tile_size) tuples.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import ml_collections

from distillax.errors import ConfigError

WEIGHT_QTYPES = ("int8", "int4", "nf4", "float8_e4m3fn", "q8_0", "q4_0")
ACT_QTYPES = ("int8", "float8_e4m3fn", "q8_0")
# llama.cpp's block formats (quant/ggml.py): fixed blocks of 32 inputs, written by export gguf.
GGML_WEIGHT_QTYPES = ("q8_0", "q4_0")
# Bits per stored element, for size estimates (scales are counted separately).
@dataclasses.dataclass(frozen=True)
class QuantRule:
  """One rule: modules whose path fullmatches `module_path` get these types."""

  module_path: str = ".*"
  weight_qtype: str | None = "int8"  # int8 | int4 | nf4 | float8_e4m3fn | q8_0 | q4_0 | None
  act_qtype: str | None = None  # int8 | float8_e4m3fn | q8_0 | None (activations stay fp)
  tile_size: int | None = None  # None: per-channel scales; int: scales per tile of inputs

  def __post_init__(self):
    where = f"quant rule module_path={self.module_path!r}"
    try:
      re.compile(self.module_path)
    except re.error as e:
      raise ConfigError(f"{where}: not a valid regex ({e}); fix the pattern") from None
    if self.weight_qtype is not None and self.weight_qtype not in WEIGHT_QTYPES:
      raise ConfigError(f"{where}: weight_qtype={self.weight_qtype!r}; choose one of "
                        f"{', '.join(WEIGHT_QTYPES)} or None")
    if self.act_qtype is not None and self.act_qtype not in ACT_QTYPES:
      raise ConfigError(f"{where}: act_qtype={self.act_qtype!r}; choose one of "
                        f"{', '.join(ACT_QTYPES)} or None")
    if self.act_qtype is not None and self.weight_qtype is None:
      raise ConfigError(f"{where}: act_qtype={self.act_qtype!r} needs a weight_qtype; "
                        f"activations are only quantized at quantized weight matmuls")
    _check_ggml(self, where)
    if self.tile_size is not None and (isinstance(self.tile_size, bool) or
                                       not isinstance(self.tile_size, int) or
                                       self.tile_size <= 0):
      raise ConfigError(f"{where}: tile_size={self.tile_size!r} must be a positive integer "
                        f"or None (per-channel)")

  @property
  def int8_matmul_eligible(self) -> bool:
    """int8 weights per channel and int8 activations: what QuantConfig.int8_matmul runs as
    int8 dots."""
    return (self.weight_qtype == "int8" and self.act_qtype == "int8"
            and self.tile_size is None)

  def matches(self, module_path: str) -> bool:
    return re.fullmatch(self.module_path, module_path) is not None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _check_ggml(rule: "QuantRule", where: str) -> None:
  """llama.cpp's types come as its kernels use them: blocks of 32 (no other tile size), and q8_0
  activations only at q8_0 / q4_0 weights (the only matmuls whose inputs llama.cpp rounds)."""
  if rule.weight_qtype in GGML_WEIGHT_QTYPES and rule.tile_size not in (None, 32):
    raise ConfigError(f"{where}: weight_qtype={rule.weight_qtype!r} has fixed blocks of 32 "
                      f"inputs; set tile_size=None (got {rule.tile_size!r})")
  if rule.act_qtype == "q8_0" and rule.weight_qtype not in GGML_WEIGHT_QTYPES:
    raise ConfigError(f"{where}: act_qtype='q8_0' models llama.cpp's kernels for q8_0 / q4_0 "
                      f"weights; use weight_qtype='q8_0' or 'q4_0' (got "
                      f"{rule.weight_qtype!r})")


# The deployment default: int4 weights / int8 activations for every matmul except the embedding
# lookup (module path ""), which deployments usually keep in full precision; with tied
# embeddings that keeps the output projection full precision too.
INT4_INT8_RULES = (("", None, None, None), (".*", "int4", "int8", None))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """Ordered rules (first match wins) and the step at which fake quantization starts; or, for
  progressive QAT, a schedule of (first step, rules) stages (full precision before the first).

  Under a schedule `rules` are the last stage's (the form the run ends in, which export writes)
  and `start_step` the first stage's step. Fake quantization keeps no state of its own (weights
  are rounded where they are read, scales computed from them), so every stage has the same
  state tree and a stage switch swaps compiled steps only, like the delayed start.
  """

  rules: tuple[QuantRule, ...] = ()
  start_step: int = 0  # full-precision steps before the trainer swaps to the fake-quant model
  schedule: tuple[tuple[int, tuple[QuantRule, ...]], ...] = ()  # progressive stages; () = off
  # Rules of int8 weights and int8 activations per channel (tile_size None) multiply int8
  # codes in their forward (s8 x s8 -> s32 dots; quant/int8_train.py) instead of rounded
  # values in the compute dtype; straight-through backward either way.
  int8_matmul: bool = False
  # ... and their backward's two matmuls too (dx, dw: the cotangent rounded per token or per
  # channel, quant/int8_train.py), as MaxText's int8 training; needs int8_matmul.
  int8_backward: bool = False

  def __post_init__(self):
    if not isinstance(self.start_step, int) or self.start_step < 0:
      raise ConfigError(f"qat.start_step={self.start_step!r} must be a non-negative integer")
    for name in ("int8_matmul", "int8_backward"):
      if not isinstance(getattr(self, name), bool):
        raise ConfigError(f"qat.{name}={getattr(self, name)!r} must be True or False")
    if self.int8_backward and not self.int8_matmul:
      raise ConfigError("qat.int8_backward=True needs qat.int8_matmul=True (the backward's int8 "
                        "matmuls are those of the int8 forward's); set both")
    object.__setattr__(self, "rules", tuple(self.rules))
    object.__setattr__(self, "schedule", tuple((s, tuple(r)) for s, r in self.schedule))
    if self.schedule:
      object.__setattr__(self, "rules", self.schedule[-1][1])
      object.__setattr__(self, "start_step", self.schedule[0][0])
    if self.int8_matmul and self.rules and not any(r.int8_matmul_eligible for r in self.rules):
      raise ConfigError("qat.int8_matmul=True but no qat rule has weight_qtype='int8', "
                        "act_qtype='int8' and tile_size=None (the matmuls it runs in int8); "
                        "add one, e.g. ('.*', 'int8', 'int8', None), or set it False")

  def rule_for(self, module_path: str) -> QuantRule | None:
    """The first rule matching `module_path`, or None."""
    for rule in self.rules:
      if rule.matches(module_path):
        return rule
    return None

  def stages(self) -> tuple[tuple[int, "QuantConfig"], ...]:
    """((first step, that stage's rules as a one-stage QuantConfig), ...) in step order."""
    if not self.schedule:
      return ((self.start_step, QuantConfig(self.rules, int8_matmul=self.int8_matmul,
                                            int8_backward=self.int8_backward)),)
    return tuple((step, QuantConfig(rules, int8_matmul=self.int8_matmul,
                                    int8_backward=self.int8_backward))
                 for step, rules in self.schedule)

  def stage_at(self, step: int) -> "QuantConfig | None":
    """The rules the forward at `step` fake-quantizes with; None before fake quantization."""
    current = None
    for first, stage in self.stages():
      if step >= first:
        current = stage
    return current

  def to_dict(self) -> dict[str, Any]:
    extra = {name: True for name in ("int8_matmul", "int8_backward") if getattr(self, name)}
    if self.schedule:
      return {"rules": [], "start_step": 0,
              "schedule": [[s, [r.to_dict() for r in rules]] for s, rules in self.schedule],
              **extra}
    return {"rules": [r.to_dict() for r in self.rules], "start_step": self.start_step, **extra}

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any] | "QuantConfig") -> "QuantConfig":
    """From a ConfigDict/dict with `rules` (dicts or 4-tuples), optional `start_step` and
    optional `schedule` ((step, rules) pairs)."""
    if isinstance(cfg, QuantConfig):
      return cfg
    if isinstance(cfg, ml_collections.ConfigDict):
      cfg = cfg.to_dict()
    unknown = sorted(set(cfg) - {"rules", "start_step", "schedule", "int8_matmul",
                                 "int8_backward"})
    if unknown:
      raise ConfigError(f"unknown qat config field(s) {unknown}; known: rules, start_step, "
                        f"schedule, int8_matmul, int8_backward")
    rules = tuple(_rule(r, f"qat.rules[{i}]") for i, r in enumerate(cfg.get("rules") or ()))
    start_step = int(cfg.get("start_step", 0))
    schedule = _schedule(cfg.get("schedule") or ())
    if schedule and rules:
      raise ConfigError("qat.rules and qat.schedule are both set; put every stage's rules in "
                        "qat.schedule (the last stage is the deployed form) and set "
                        "--config.qat.rules=()")
    if schedule and start_step:
      raise ConfigError(f"qat.start_step={start_step} and qat.schedule are both set; the first "
                        f"stage's step is where fake quantization starts: set "
                        f"--config.qat.start_step=0")
    return cls(rules=rules, start_step=start_step, schedule=schedule,
               int8_matmul=cfg.get("int8_matmul", False),
               int8_backward=cfg.get("int8_backward", False))

  @classmethod
  def simple(cls, weight_qtype: str, act_qtype: str | None = None, tile_size: int | None = None,
             module_path: str = ".*", start_step: int = 0) -> "QuantConfig":
    """One rule for every module: the common case."""
    return cls((QuantRule(module_path, weight_qtype, act_qtype, tile_size),), start_step)


def _schedule(value: Any) -> tuple[tuple[int, tuple[QuantRule, ...]], ...]:
  """qat.schedule's stages, each a (step, rules) pair or a {"step", "rules"} dict, checked:
  non-negative steps in increasing order, each stage with at least one valid rule."""
  if isinstance(value, str) or not isinstance(value, Sequence):
    raise ConfigError(f"qat.schedule={value!r}; give a list of (step, rules) stages")
  stages = []
  for i, stage in enumerate(value):
    where = f"qat.schedule[{i}]"
    if isinstance(stage, ml_collections.ConfigDict):
      stage = stage.to_dict()
    if isinstance(stage, Mapping) and set(stage) == {"step", "rules"}:
      stage = (stage["step"], stage["rules"])
    if isinstance(stage, str) or not isinstance(stage, Sequence) or len(stage) != 2:
      raise ConfigError(f"{where}={stage!r}; give a (step, rules) pair, e.g. "
                        f"(100, (('.*', 'int8', None, None),))")
    step, rules = stage
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
      raise ConfigError(f"{where} step={step!r} must be a non-negative integer")
    if stages and step <= stages[-1][0]:
      raise ConfigError(f"{where} step={step} is not after qat.schedule[{i - 1}] "
                        f"step={stages[-1][0]}; list the stages in increasing step order")
    if isinstance(rules, str) or not isinstance(rules, Sequence) or not rules:
      raise ConfigError(f"{where} rules={rules!r}; give at least one (module_path, "
                        f"weight_qtype, act_qtype, tile_size) rule (the steps before the "
                        f"first stage are the full-precision ones)")
    stages.append((step, tuple(_rule(r, f"{where}.rules[{j}]") for j, r in enumerate(rules))))
  return tuple(stages)


def _rule(value: Any, where: str) -> QuantRule:
  if isinstance(value, QuantRule):
    return value
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, Mapping):
    fields = {f.name for f in dataclasses.fields(QuantRule)}
    unknown = sorted(set(value) - fields)
    if unknown:
      raise ConfigError(f"{where} has unknown field(s) {unknown}; known: "
                        f"{', '.join(sorted(fields))}")
    return QuantRule(**value)
  if isinstance(value, Sequence) and not isinstance(value, str) and 1 <= len(value) <= 4:
    return QuantRule(*value)
  raise ConfigError(f"{where}={value!r}; give a dict or a (module_path, weight_qtype, "
                    f"act_qtype, tile_size) tuple")
