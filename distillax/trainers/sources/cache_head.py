"""The teacher of a hidden-state cache: its LM head, saved beside the cached hidden states.

A job that distils from a hidden-state cache (teacher.cache_dir of kind 'hidden') has no teacher
model in its step; its frozen extra is this head (distill/teacher_head.py), loaded from the cache
and placed on the mesh like any other source's weights, and reloaded from the cache on resume.
A teacher the config also names (teacher.workdir or teacher.hf_path) is checked to be the one
that wrote the cache: their LM heads' fingerprints agree.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from distillax.distill.teacher_head import (abstract_head, fingerprint, head_of, load_head,
                                            read_head_config)
from distillax.errors import ConfigError
from distillax.trainers.sources.kinds import ModelSource, place
from distillax.trainers.sources.select import teacher_model_config


@dataclasses.dataclass(frozen=True)
class CacheHeadSource:
  """The head saved in `cache_dir`, whose cache_info.json records `want_fingerprint`; `field`
  is the setting that names the cache (a `teachers` entry's own)."""

  cache_dir: str
  want_fingerprint: str
  field: str = "teacher.cache_dir"
  kind = "cache"

  def named(self) -> str:
    return f"{self.field}={self.cache_dir}"

  def fingerprint(self) -> dict:
    """What a save records of it (several teachers): the head's fingerprint the cache names."""
    return {"kind": self.kind, "source": self.named(), "head": self.want_fingerprint}

  def abstract(self) -> nnx.Module:
    return abstract_head(read_head_config(self.cache_dir))

  def load(self, mesh, rules) -> nnx.Module:
    return place(load_head(self.cache_dir, self.want_fingerprint), mesh, rules)

  def check_teacher(self, teacher_section, teacher: ModelSource | None, vocab_size: int,
                    mesh, rules, *, seed: int) -> None:
    """Refuses a named teacher (an earlier run, a Hugging Face directory) whose LM head is not
    the cache's; a preset teacher names no weights, so nothing is checked."""
    if teacher is None or teacher.kind not in ("run", "hf"):
      return
    cfg = teacher_model_config(teacher_section, teacher, vocab_size)
    model = teacher.load(cfg, mesh, rules, seed=seed)
    if fingerprint(head_of(model)) != self.want_fingerprint:
      raise ConfigError(f"the teacher cache {self.named()} was written by another teacher than "
                        f"{teacher.named()} (their LM head fingerprints differ); rewrite the cache "
                        f"with this teacher or clear --config.{teacher.field}")


__all__ = ["CacheHeadSource"]
