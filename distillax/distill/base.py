"""The strategy protocol: what a distillation loss needs, what it sees, and how losses add up.

A strategy is a small frozen dataclass with a `weight` and a `name`. It turns what the student and
the teacher computed on a batch (`DistillInputs`) into `(loss_sum, metric_sums)`: SUMS over the
real tokens of the batch (loss_mask_BxL), never means, so the train step can add them over
micro-batches and devices and divide once by the global token count.

Two kinds of leaf strategies exist:
  * token-level ones (`needs.logits`): a per-token function of student and teacher logits
    (`token_values`, or `shared_token_values` reading logits.TokenLogits, whose reductions over
    the vocabulary every leaf and metric share). The objective evaluates every token-level leaf
    and the logit metrics in ONE pass over the logits, whole or a chunk of tokens at a time
    (framework/vocab_chunks.py).
  * the rest (attention, features) read intermediates from the model outputs (`term_sums`).

`Composite` (or `s1 + s2`) is a weighted sum of strategies and is itself a strategy; the metric of
every leaf term is reported unweighted under the leaf's own name, so names must be unique.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec
from distillax.distill.logits import TokenLogits
from distillax.errors import ConfigError
from distillax.framework import token_rows, vocab_chunks
from distillax.models.transformer import ModelOutput

# Metric names the objective itself reports; a strategy may not take one of them as its name.
RESERVED_NAMES = ("loss", "tokens", "hard_ce", "teacher_ce", "top1_agreement", "logit_cosine")

TokenFn = Callable[[jax.Array, jax.Array | None, Mapping[str, jax.Array]], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Needs:
  """What a strategy reads; the objective asks the models for nothing more (flags are static)."""

  logits: bool = False  # per-token student (and teacher) logits: a token-level strategy
  teacher: bool = True  # runs the online teacher (False: teacher data comes with the batch)
  hidden_states: bool = False  # per-layer residual streams (num_layers + 1, B, L, D)
  attention: bool = False  # per-layer attention probabilities (num_layers, B, H, L, S)
  router_logits: bool = False  # per-layer router logits of an MoE (num_layers, B, L, E)

  def __or__(self, other: "Needs") -> "Needs":
    return Needs(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class DistillInputs:
  """Everything a strategy may read for one (micro-)batch.

  student/teacher: the forward outputs (teacher None without an online teacher; its arrays are
    already behind stop_gradient; on the chunked path their logits are None: only the final
    hidden states come out of the forward). student_model/teacher_model: the Transformers, for
    `logits_from_hidden`. projections: the student's learned feature projections (DistillStudent),
    keyed by strategy name. chunk_size: tokens per chunk for token-level losses (None: whole).
  """

  batch: Mapping[str, jax.Array]
  student: ModelOutput
  teacher: ModelOutput | None = None
  student_model: Any = None
  teacher_model: Any = None
  projections: Mapping[str, Any] | None = None
  chunk_size: int | None = None

  @property
  def mask_BxL(self) -> jax.Array:
    return self.batch[batch_spec.LOSS_MASK].astype(jnp.float32)

  def _tokens(self) -> dict[str, jax.Array]:
    """Every batch entry shaped (B, L, ...): what a token function may read."""
    B, L = self.batch[batch_spec.LOSS_MASK].shape
    return {k: v for k, v in self.batch.items()
            if hasattr(v, "shape") and tuple(v.shape[:2]) == (B, L)}

  def token_sums(self, fn: TokenFn) -> dict[str, jax.Array]:
    """Masked sums over real tokens of `fn(student_logits_NxV, teacher_logits_NxV, tokens)`,
    as metrics (behind stop_gradient); a differentiable term goes through `loss_and_sums`."""
    return self.loss_and_sums(fn, {})[1]

  def loss_and_sums(self, fn: TokenFn, weights: Mapping[str, float]
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(sum of weights[k] * sums[k], sums) with `sums` = `token_sums(fn)` as metrics: only the
    weighted loss is differentiable. Chunked, it is the vocabulary-chunk engine's, which forms
    the student's logit gradient in the same pass as the loss."""
    tokens, mask_BxL = self._tokens(), self.batch[batch_spec.LOSS_MASK]
    # Both models' columns past the tokenizer's ids (a padded vocabulary's) leave every softmax
    # (framework/token_rows.py): the teacher's columns are the student's, so the same ones.
    rows = token_rows.active()
    # Several teachers side by side (multi_teacher.TeacherSet, K * V logits) cut and mask each
    # teacher's own columns: the cut and mask of one V-column teacher would drop the others.
    side_by_side = getattr(self.teacher_model, "side_by_side", False)
    if self.chunk_size is None:
      t_logits = None if self.teacher is None else self.teacher.logits_BxLxV
      if t_logits is not None and not side_by_side:  # a padded teacher: cut to the student's
        t_logits = token_rows.masked(t_logits[..., :self.student.logits_BxLxV.shape[-1]], rows)
      return vocab_chunks.whole_sums(fn, weights, tokens, mask_BxL,
                                     token_rows.masked(self.student.logits_BxLxV, rows), t_logits)
    self._check_chunk_inputs()
    teacher = t_hidden = None
    if self.teacher is not None:
      teacher = vocab_chunks.OutputLayer.of_model(self.teacher_model)
      if not side_by_side:
        teacher = student_vocab_layer(teacher, self.teacher_model.config.vocab_size,
                                      self.student_model.config.vocab_size).over_token_rows(rows)
      t_hidden = self.teacher.final_hidden_BxLxD
    return vocab_chunks.vocab_chunk_sums(
        fn, weights, tokens, mask_BxL,
        vocab_chunks.OutputLayer.of_model(self.student_model).over_token_rows(rows),
        self.student.final_hidden_BxLxD, teacher, t_hidden, chunk_size=self.chunk_size)

  def _check_chunk_inputs(self) -> None:
    if self.student_model is None or (self.teacher is not None and self.teacher_model is None):
      raise ConfigError("chunked logit losses need the student and teacher models "
                        "(DistillInputs.student_model / teacher_model) to compute logits")


def student_vocab_layer(layer: vocab_chunks.OutputLayer, teacher_vocab: int, student_vocab: int
                        ) -> vocab_chunks.OutputLayer:
  """The teacher's output layer cut to the student's vocabulary, chunk by chunk: a padded
  teacher table (Gemma 3 27B's 262,208 rows over the 1B's 262,144) holds rows past the
  student's that no tokenizer id reaches; they leave every distribution."""
  if teacher_vocab == student_vocab:
    return layer
  return vocab_chunks.OutputLayer(lambda params, h: layer.logits_fn(params, h)[..., :student_vocab],
                                  layer.params)


class Strategy:
  """Base of every strategy (subclasses are frozen dataclasses with `weight` and `name`)."""

  weight: float
  name: str

  @property
  def needs(self) -> Needs:
    raise NotImplementedError

  def leaves(self) -> tuple[tuple[float, "Strategy"], ...]:
    """(effective weight, leaf strategy) pairs; a leaf is its own single term."""
    return ((float(self.weight), self),)

  def token_values(self, s_logits_NxV, t_logits_NxV, tokens) -> dict[str, jax.Array]:
    """Token-level leaves: per-token values, `{self.name: loss_N, ...}` (unweighted, unmasked)."""
    raise NotImplementedError(f"{type(self).__name__} is not a token-level strategy")

  def shared_token_values(self, logits) -> dict[str, jax.Array]:
    """`token_values` from a logits.TokenLogits, whose reductions over the vocabulary the
    objective shares between leaves and metrics; override to read them (LogitKD does)."""
    return self.token_values(logits.student, logits.teacher, logits.tokens)

  def term_sums(self, inputs: DistillInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(unweighted term sum, metric sums incl. {name: term sum}) over the real tokens."""
    if not self.needs.logits:
      raise NotImplementedError
    return inputs.loss_and_sums(self.token_values, {self.name: 1.0})

  def loss_sums(self, inputs: DistillInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(weight * term sum, metric sums) of one leaf. A composite is evaluated only by the
    objective (objective.py), which shares one pass over the logits between its leaves."""
    term, sums = self.term_sums(inputs)
    return self.weight * term, sums

  def __add__(self, other: "Strategy") -> "Composite":
    if not isinstance(other, Strategy):
      return NotImplemented
    parts = lambda s: s.strategies if isinstance(s, Composite) and s.weight == 1.0 else (s,)
    return Composite(parts(self) + parts(other))

  def __mul__(self, factor: float) -> "Strategy":
    if not isinstance(factor, (int, float)):
      return NotImplemented
    return dataclasses.replace(self, weight=self.weight * float(factor))

  __rmul__ = __mul__


def check_common(strategy: Strategy) -> None:
  """Validation every leaf shares: a finite non-negative weight and a usable, unreserved name."""
  w = strategy.weight
  if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0 or w == float("inf"):
    raise ConfigError(f"{type(strategy).__name__}.weight={w!r} must be a finite number >= 0")
  if not isinstance(strategy.name, str) or not strategy.name:
    raise ConfigError(f"{type(strategy).__name__}.name={strategy.name!r} must be a non-empty "
                      f"string (it names the term in the metrics)")
  if strategy.name in RESERVED_NAMES:
    raise ConfigError(f"{type(strategy).__name__}.name={strategy.name!r} is a metric the objective "
                      f"reports itself; pick another name")


class LogitStrategy(Strategy):
  """A token-level strategy written once, against a logits.TokenLogits (the objective shares
  its reductions over the vocabulary between leaves and metrics): `token_values` only wraps raw
  logits into one. `reads_teacher = False` for a strategy whose teacher is a cache in the batch."""

  reads_teacher = True

  @property
  def needs(self) -> Needs:
    return Needs(logits=True, teacher=self.reads_teacher)

  def token_values(self, s_logits_NxV, t_logits_NxV, tokens):
    teacher_NxV = t_logits_NxV if self.reads_teacher else None
    return self.shared_token_values(TokenLogits(s_logits_NxV, teacher_NxV, tokens))

  def shared_token_values(self, logits: TokenLogits) -> dict[str, jax.Array]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Composite(Strategy):
  """weight * sum_i(strategies[i].weight * term_i): a weighted sum that is itself a strategy."""

  strategies: tuple[Strategy, ...]
  weight: float = 1.0
  name: str = "composite"

  def __post_init__(self):
    object.__setattr__(self, "strategies", tuple(self.strategies))
    if not self.strategies:
      raise ConfigError("Composite needs at least one strategy")
    for s in self.strategies:
      if not isinstance(s, Strategy):
        raise ConfigError(f"Composite got {s!r}; every part must be a distillation strategy")
    check_common(self)
    names = [leaf.name for _, leaf in self.leaves()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ConfigError(f"strategy names {duplicates} appear more than once in a composite; give "
                        f"each term a distinct name= so its metric is reported separately")

  @property
  def needs(self) -> Needs:
    out = Needs(teacher=False)
    for s in self.strategies:
      out = out | s.needs
    return out

  def leaves(self):
    return tuple((self.weight * w, leaf) for s in self.strategies for w, leaf in s.leaves())



# ---- layer maps -----------------------------------------------------------------------------

def normalize_layer_map(layer_map: Mapping[Any, Any] | Iterable[Iterable[Any]], owner: str
                        ) -> tuple[tuple[int, int], ...]:
  """{student_layer: teacher_layer} (keys may be digit strings, as configs give them) or pairs ->
  sorted, hashable ((student, teacher), ...)."""
  items = layer_map.items() if isinstance(layer_map, Mapping) else layer_map
  try:
    pairs = [(_layer_index(s), _layer_index(t)) for s, t in items]
  except (TypeError, ValueError):
    raise ConfigError(f"{owner}.layer_map={layer_map!r} must map student layer -> teacher layer "
                      f"as non-negative integers, e.g. {{1: 3, 2: 6}}") from None
  if not pairs:
    raise ConfigError(f"{owner}.layer_map is empty; map at least one student layer to a teacher "
                      f"layer, e.g. {{1: 3}}")
  students = [s for s, _ in pairs]
  if len(set(students)) != len(students):
    raise ConfigError(f"{owner}.layer_map maps a student layer twice: {layer_map!r}")
  return tuple(sorted(pairs))


def _layer_index(x) -> int:
  if isinstance(x, bool):
    raise TypeError
  value = int(x)
  if value < 0 or (isinstance(x, float) and x != value):
    raise ValueError
  return value


def check_layer_range(layer_map, student_count: int, teacher_count: int, owner: str,
                      what: str, note: str = "") -> None:
  """Raises a ConfigError naming the first mapped layer outside the models' ranges."""
  note = f"; {note}" if note else ""
  for s, t in layer_map:
    if s >= student_count:
      raise ConfigError(f"{owner}.layer_map: student {what} {s} does not exist (the student has "
                        f"{student_count}: 0..{student_count - 1}{note}); fix the layer map")
    if t >= teacher_count:
      raise ConfigError(f"{owner}.layer_map: teacher {what} {t} does not exist (the teacher has "
                        f"{teacher_count}: 0..{teacher_count - 1}{note}); fix the layer map")


def masked_sum(values_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
  """Sum over real tokens; `where`, not a product, so garbage at padding cannot leak as NaN."""
  return jnp.sum(jnp.where(mask_BxL > 0, values_BxL.astype(jnp.float32), 0.0))
