"""The teacher's output layer alone: what a hidden-state cache needs to give back exact logits.

A hidden-state teacher cache (teacher_cache.py, kind 'hidden') stores the teacher's final hidden
states (after the final norm) per position; `TeacherHead` is the rest of the teacher, the
projection to the vocabulary with everything the model applies there (a tied embedding or an
untied lm_head, the compute dtype, Gemma's final logit soft-cap). It stands where the teacher
model stands (extras['teacher']) and answers the same calls the distillation objective makes:
`config.vocab_size`, `logits_from_hidden` (the vocabulary-chunk engine's per-chunk logits),
`output_operands` (the vocabulary slices' matmul) and a forward that returns the cached hidden
states of the batch, so every logit strategy reads its logits as from a live teacher.

The head is saved once beside the cache (HEAD_FILE, safetensors) with a fingerprint: a SHA-256
of its weight bytes and its settings, so a training job can check that a configured teacher is
the one the cache came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.errors import UserError
from distillax.models.layers import softcap
from distillax.models.transformer import ModelOutput
from distillax.partitioning import constrain

HEAD_FILE = "teacher_head.safetensors"
TEACHER_HIDDEN = "teacher_hidden_BxLxD"  # batch key: the teacher's final hidden states
_WEIGHT = "weight"  # the tensor's name in HEAD_FILE
# The weight's axes per layout: a tied embedding is (vocab, embed), an untied lm_head the other.
_AXES = {"VxD": ("vocab", "embed"), "DxV": ("embed", "vocab")}


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """Everything besides the weight that the teacher's logits depend on."""

  vocab_size: int
  embed_dim: int
  layout: str  # 'VxD' (tied embedding) or 'DxV' (lm_head)
  dtype: str  # compute dtype: hidden states and weight are cast to it before the matmul
  param_dtype: str  # the weight's stored dtype
  final_logit_softcap: float | None = None

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)


class TeacherHead(nnx.Module):
  """A frozen teacher's output layer; computes logits exactly as the teacher's own
  `logits_from_hidden` (same einsum, dtypes and soft-cap)."""

  def __init__(self, weight, config: HeadConfig):
    self.config = config
    self.weight = nnx.Param(jnp.asarray(weight, jnp.dtype(config.param_dtype)),
                            logical_axes=_AXES[config.layout])

  def logits_from_hidden(self, h_xD: jax.Array) -> jax.Array:
    dt = self.config.jnp_dtype
    spec = "...D,VD->...V" if self.config.layout == "VxD" else "...D,DV->...V"
    logits = jnp.einsum(spec, h_xD.astype(dt), self.weight[...].astype(dt),
                        preferred_element_type=jnp.float32)
    logits = softcap(logits, self.config.final_logit_softcap)
    if logits.ndim == 3:
      logits = constrain(logits, ("batch", "length", "vocab"))
    return logits

  def output_operands(self, h_xD: jax.Array) -> list[tuple[jax.Array, jax.Array, int]]:
    """The head's one matmul as vocabulary slices read it, [(input in the compute dtype, weight,
    its vocab axis)] (Transformer.output_operands): the same logits as `logits_from_hidden`."""
    return [(h_xD.astype(self.config.jnp_dtype), self.weight[...],
             0 if self.config.layout == "VxD" else 1)]

  def output(self, hidden_BxLxD: jax.Array, *, return_logits: bool = True) -> ModelOutput:
    """The teacher's forward on a batch whose final hidden states came from the cache."""
    logits = self.logits_from_hidden(hidden_BxLxD) if return_logits else None
    return ModelOutput(logits_BxLxV=logits, final_hidden_BxLxD=hidden_BxLxD)


def head_of(model) -> TeacherHead:
  """The output layer of a Transformer as a TeacherHead (its weight gathered to this host)."""
  from jax.experimental import multihost_utils
  cfg = model.config
  tied = model.lm_head is None
  weight = model.embedder.embedding if tied else model.lm_head
  value = weight[...]
  if jax.process_count() > 1:
    value = multihost_utils.process_allgather(value, tiled=True)
  config = HeadConfig(vocab_size=cfg.vocab_size, embed_dim=cfg.embed_dim,
                      layout="VxD" if tied else "DxV", dtype=str(jnp.dtype(cfg.jnp_dtype)),
                      param_dtype=str(jnp.dtype(cfg.jnp_param_dtype)),
                      final_logit_softcap=cfg.final_logit_softcap)
  return TeacherHead(np.asarray(jax.device_get(value)), config)


def _stored(head: TeacherHead) -> np.ndarray:
  """The weight as saved: float32 (exact for bfloat16 and float16 weights)."""
  return np.ascontiguousarray(np.asarray(jax.device_get(head.weight[...]), np.float32))


def fingerprint(head: TeacherHead) -> str:
  """SHA-256 of the weight's bytes (as saved) and the head's settings."""
  digest = hashlib.sha256(_stored(head).tobytes())
  digest.update(json.dumps(dataclasses.asdict(head.config), sort_keys=True).encode())
  return digest.hexdigest()


def save_head(head: TeacherHead, directory: str) -> str:
  """Writes HEAD_FILE into `directory` (settings in its metadata); returns the fingerprint."""
  from safetensors.numpy import save_file
  metadata = {"head_config": json.dumps(dataclasses.asdict(head.config), sort_keys=True)}
  save_file({_WEIGHT: _stored(head)}, os.path.join(directory, HEAD_FILE), metadata=metadata)
  return fingerprint(head)


def load_head(directory: str, want_fingerprint: str | None = None) -> TeacherHead:
  """The head saved beside a cache, checked against the fingerprint cache_info.json records."""
  from safetensors import safe_open
  config = read_head_config(directory)
  path = os.path.join(directory, HEAD_FILE)
  with safe_open(path, framework="numpy") as f:
    head = TeacherHead(f.get_tensor(_WEIGHT), config)
  if want_fingerprint is not None and fingerprint(head) != want_fingerprint:
    raise UserError(f"{path} does not match the fingerprint in the cache's cache_info.json; the "
                    f"cache directory was altered: rewrite it with distillax cache-teacher")
  return head


def read_head_config(directory: str) -> HeadConfig:
  """The saved head's settings alone (its metadata: the weight is not read)."""
  from safetensors import safe_open
  path = os.path.join(directory, HEAD_FILE)
  if not os.path.exists(path):
    raise UserError(f"{directory} holds no teacher head ({HEAD_FILE}); the hidden-state cache is "
                    f"incomplete: rewrite it with distillax cache-teacher --kind hidden")
  with safe_open(path, framework="numpy") as f:
    return HeadConfig(**json.loads(f.metadata()["head_config"]))


def abstract_head(config: HeadConfig) -> TeacherHead:
  """A TeacherHead of ShapeDtypeStructs (no memory), for plans and abstract builds."""
  shape = ((config.vocab_size, config.embed_dim) if config.layout == "VxD"
           else (config.embed_dim, config.vocab_size))
  return nnx.eval_shape(lambda: TeacherHead(jnp.zeros(shape, jnp.float32), config))


__all__ = ["HEAD_FILE", "HeadConfig", "TEACHER_HIDDEN", "TeacherHead", "abstract_head",
           "fingerprint", "head_of", "load_head", "read_head_config", "save_head"]
