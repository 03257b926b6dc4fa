"""Several frozen teachers behind the one teacher interface the logit strategies read.

A job with several teachers (the `teachers` config list) passes each as its own frozen extra
(`teacher:<name>`), so plans and shardings see them one by one. Inside the step they are run on
the same tokens and stood side by side as one `TeacherSet`: its final hidden states are the
teachers' concatenated along the feature axis, and its logits (whole, or per vocabulary chunk
from those hidden states) are the teachers' concatenated along the vocabulary axis, [N, K * V].
`TeacherMix.combine` folds them back into one [N, V] teacher for the strategies, per chunk:

  mixture: the KD target is the weighted mixture p = sum_i w_i softmax(t_i / T) (weights
    normalised to sum to 1). It is handed on as the logits T * log p, whose softmax at
    temperature T is p exactly (log p is already normalised), so every logit strategy at that
    temperature reads the mixture. Metrics at another temperature (teacher_ce at T = 1) read
    p^(1/T) renormalised, not a mixture at 1: they are reports, not losses.
  routing: each token's teacher is the one the batch's TEACHER_INDEX names (one index per
    record, repeated over its tokens, so a packed row may hold records of different teachers);
    each token's KD term reads that teacher only.

Only logit strategies are defined for several teachers: attention and feature maps of different
teachers do not add up to one target.

One of the teachers may be a hidden-state cache (teacher_head.py): its TeacherHead stands in
the set where the teacher model would, its final hidden states are the batch's TEACHER_HIDDEN
(the cache's rows are the batch), and its logits per chunk are the head's, as for a live
teacher.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.distill.teacher_head import TEACHER_HIDDEN, TeacherHead
from distillax.errors import ConfigError
from distillax.framework import token_rows
from distillax.models.transformer import ModelOutput

TEACHER_INDEX = "teacher_index_BxL"  # int32: the routed teacher of each token's record
MODES = ("mixture", "routing")


def teacher_key(name: str) -> str:
  """The frozen-extras key of the teacher called `name`."""
  return f"teacher:{name}"


@dataclasses.dataclass(frozen=True)
class TeacherMix:
  """How several teachers become one: names (in index order), mode, weights, temperature (the
  LogitKD temperature the mixture is formed at)."""

  names: tuple[str, ...]
  mode: str = "mixture"
  weights: tuple[float, ...] = ()
  temperature: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, "names", tuple(self.names))
    object.__setattr__(self, "weights", tuple(float(w) for w in self.weights)
                       or (1.0,) * len(self.names))
    if self.mode not in MODES:
      raise ConfigError(f"distill.teachers_mode={self.mode!r}; choose one of {', '.join(MODES)}")
    if len(self.names) < 1 or len(set(self.names)) != len(self.names):
      raise ConfigError(f"teachers need distinct names, got {list(self.names)}; give each entry "
                        f"of `teachers` its own name")
    if len(self.weights) != len(self.names):
      raise ConfigError(f"{len(self.weights)} teacher weights for {len(self.names)} teachers")
    if any(not w >= 0 for w in self.weights) or not sum(self.weights) > 0:
      raise ConfigError(f"teachers' weights {dict(zip(self.names, self.weights))} must be >= 0 "
                        f"and sum to a positive number, e.g. --config.teachers.0.weight=1")

  @property
  def keys(self) -> tuple[str, ...]:
    return tuple(teacher_key(n) for n in self.names)

  def index_of(self, name: str, where: str) -> int:
    """The index of the teacher `name` (a routing rule's), or one line naming the known ones."""
    if name not in self.names:
      raise ConfigError(f"{where} names teacher {name!r}, which is not one of `teachers` "
                        f"({', '.join(self.names)}); fix the name or add that teacher")
    return self.names.index(name)

  def combine(self, t_NxKV: jax.Array, tokens: Mapping[str, jax.Array]) -> jax.Array:
    """[N, K * V] side-by-side teacher logits -> the one [N, V] teacher the strategies read."""
    K = len(self.names)
    t_NxKxV = t_NxKV.astype(jnp.float32).reshape(t_NxKV.shape[0], K, -1)
    if self.mode == "routing":
      if TEACHER_INDEX not in tokens:
        raise ConfigError(f"distill.teachers_mode='routing' needs the batch's {TEACHER_INDEX} "
                          f"(each record's teacher); the data gave none")
      index_N = jnp.clip(tokens[TEACHER_INDEX].astype(jnp.int32), 0, K - 1)
      return jnp.take_along_axis(t_NxKxV, index_N[:, None, None], axis=1)[:, 0]
    if K == 1:
      return t_NxKxV[:, 0]
    T = float(self.temperature)
    w = jnp.asarray(self.weights, jnp.float32)
    log_w_K = jnp.log(w / jnp.sum(w))  # a weight of 0 drops its teacher (log 0 = -inf)
    logp_NxKxV = jax.nn.log_softmax(t_NxKxV / T, axis=-1)
    mixed_NxV = T * jax.nn.logsumexp(logp_NxKxV + log_w_K[None, :, None], axis=1)
    # A padded column (masked in every teacher: token_rows.py) stays one, as a metric over raw
    # logits (the cosine) finds them.
    padded_NxV = jnp.all(t_NxKxV == token_rows.MASKED_LOGIT, axis=1)
    return jnp.where(padded_NxV, token_rows.MASKED_LOGIT, mixed_NxV)


class TeacherSet(nnx.Module):
  """Teachers of one vocabulary side by side: a stand-in for one teacher model whose output
  layer maps the concatenated hidden states to the concatenated logits. A member may be a
  hidden-state cache's TeacherHead, whose hidden states the call's `cached_hidden_BxLxD` are.
  Each teacher's logits are cut to `vocab_size` (the student's; default the narrowest
  teacher's), so a teacher whose table is padded past it stands beside one that is not, and
  masked past the token rows of the objective traced now (framework/token_rows.py), each
  teacher's own: the losses read the K * V columns as they come (`side_by_side`)."""

  side_by_side = True

  def __init__(self, teachers: Sequence[nnx.Module], vocab_size: int | None = None):
    vocabs = [t.config.vocab_size for t in teachers]
    self.vocab_size = int(vocab_size or min(vocabs))
    if min(vocabs) < self.vocab_size:
      raise ConfigError(f"the teachers' vocabularies ({vocabs}) are narrower than the "
                        f"student's {self.vocab_size}; several teachers must share the "
                        f"student's tokenizer")
    self.teachers = nnx.List(list(teachers))
    # What run_models reads (the shared vocabulary): a live teacher's config where there is one.
    live = [t for t in teachers if not isinstance(t, TeacherHead)]
    self.config = dataclasses.replace((live or list(teachers))[0].config,
                                      vocab_size=self.vocab_size)
    self.dims = tuple(t.config.embed_dim for t in teachers)

  def __call__(self, tokens_BxL, *, cached_hidden_BxLxD=None, **kwargs) -> ModelOutput:
    outs = []
    for t in self.teachers:
      if not isinstance(t, TeacherHead):
        outs.append(t(tokens_BxL, **kwargs))
      elif cached_hidden_BxLxD is None:
        raise ConfigError(f"a teacher is a hidden-state cache, but the batch has no "
                          f"{TEACHER_HIDDEN}; train on the cache's rows")
      else:
        outs.append(t.output(cached_hidden_BxLxD,
                             return_logits=kwargs.get("return_logits", True)))
    logits = None
    if outs[0].logits_BxLxV is not None:
      logits = jnp.concatenate([self._cut(o.logits_BxLxV) for o in outs], axis=-1)
    hidden = jnp.concatenate([o.final_hidden_BxLxD.astype(jnp.float32) for o in outs], axis=-1)
    return ModelOutput(logits_BxLxV=logits, final_hidden_BxLxD=hidden)

  def logits_from_hidden(self, h_NxD):
    """Each teacher's logits from its slice of the concatenated hidden states, side by side."""
    out, start = [], 0
    for teacher, dim in zip(self.teachers, self.dims):
      h = h_NxD[..., start:start + dim]
      start += dim
      out.append(self._cut(teacher.logits_from_hidden(h)))
    return jnp.concatenate(out, axis=-1)

  def _cut(self, logits_xV):
    """One teacher's fp32 logits over the shared vocabulary, its padded columns masked."""
    return token_rows.masked(logits_xV[..., :self.vocab_size].astype(jnp.float32),
                             token_rows.active())


def teacher_set(extras: Mapping, mix: TeacherMix, vocab_size: int | None = None) -> TeacherSet:
  """The TeacherSet of `mix`'s teachers from the frozen extras, in index order, each cut to
  `vocab_size` (the student's)."""
  missing = [k for k in mix.keys if k not in extras]
  if missing:
    raise ConfigError(f"teachers {missing} were not passed as frozen models (extras: "
                      f"{sorted(extras)}); load every teacher of the `teachers` list")
  return TeacherSet([extras[k] for k in mix.keys], vocab_size)
