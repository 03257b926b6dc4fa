"""What a run's checkpoints hold, and how a state comes back from them.

A checkpoint holds what the run changes: the step, trainable parameters, the student's own
frozen parts, optimizer state, RNG and the data position (`framework.state.Reloaded`). The
frozen models that came from a source (the teacher, a LoRA base) are reloaded from it. So that a
resume never silently pairs a student with a different teacher, every save records the
fingerprints of those sources (config, weight files' sizes and header hashes), and restoring
refuses, in one line naming the source and the fix, when they no longer match.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from distillax import quant
from distillax.errors import UserError
from distillax.framework.state import TrainState
from distillax.models.config import TransformerConfig
from distillax.trainers.sources import (RunSource, checkpoints_of, load_run_config,
                                        student_source)
from distillax.trainers.sources.files import CHECKPOINT_DIR
from distillax.trainers.transforms import StudentTransforms

SOURCES_KEY = "sources"  # in a checkpoint's metadata `extra`


def reloaded_sources(recipe, layout) -> dict:
  """{"teacher": source, "student": source} of the models this job reloads instead of
  storing: the teacher in the step, and the student's source when part of the student is
  frozen (a LoRA base)."""
  out = {}
  if layout.reloaded.reloads_student(layout.abstract):
    out["student"] = recipe.sources.student
  if recipe.teacher_source is not None and layout.reloaded.extras:
    out["teacher"] = recipe.teacher_source
  for key, source in getattr(recipe, "teacher_sources", {}).items():  # several teachers
    if key in layout.reloaded.extras:
      out[key] = source
  return out


def source_fingerprints(recipe, layout) -> dict[str, dict]:
  """The fingerprints of `reloaded_sources`, as every save records them."""
  return {name: s.fingerprint() for name, s in reloaded_sources(recipe, layout).items()}


def _changed(saved: dict, now: dict) -> str:
  keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
  return ", ".join(keys) or "?"


def _as_of_now(saved: dict) -> dict:
  """A saved fingerprint with the model-config fields added since it was written filled in with
  their defaults, which are what that older model computed (a dense model: num_experts 0)."""
  if not isinstance(saved.get("config"), dict):
    return saved
  return {**saved, "config": {**dataclasses.asdict(TransformerConfig()), **saved["config"]}}


def check_fingerprints(meta: dict, now: dict[str, dict], directory: str) -> None:
  """Refuses a checkpoint whose reloaded sources changed since it was saved."""
  saved = (meta.get("extra") or {}).get(SOURCES_KEY) or {}
  step = meta.get("step")
  for name, fingerprint in now.items():
    if name not in saved:
      raise UserError(f"checkpoint step {step} in {directory} does not record its {name} "
                      f"({fingerprint['source']}); it was saved by another distillax or job: "
                      f"use a new workdir")
    if _as_of_now(saved[name]) != fingerprint:
      raise UserError(f"{fingerprint['source']} changed since checkpoint step {step} in "
                      f"{directory} was saved with it as the {name} "
                      f"({_changed(_as_of_now(saved[name]), fingerprint)} "
                      f"differ); the run reloads its {name} from there: put back the {name} it "
                      f"trained with, or start a new workdir")


def newest_meta(workdir: str) -> dict | None:
  """The metadata JSON of the newest checkpoint step that has one, read without orbax (before
  anything in the workdir is opened or written); None when there is none."""
  folder = os.path.join(workdir, CHECKPOINT_DIR)
  steps = sorted((int(n) for n in os.listdir(folder) if n.isdigit()), reverse=True) \
      if os.path.isdir(folder) else []
  for step in steps:
    try:
      with open(os.path.join(folder, str(step), "meta", "meta.json")) as f:
        return json.load(f)
    except (OSError, ValueError):
      continue
  return None


def check_sources_unchanged(workdir: str, recipe, layout) -> dict[str, dict]:
  """The fingerprints of the sources `recipe` reloads, after refusing a workdir whose
  checkpoints were saved with other ones; call it before the workdir is touched."""
  now = source_fingerprints(recipe, layout)
  meta = newest_meta(workdir)
  if meta is not None:
    check_fingerprints(meta, now, workdir)
  return now


def restore_run_state(workdir: str, recipe, engine) -> TrainState:
  """The whole TrainState of `workdir`'s newest valid checkpoint, restored onto `engine`'s
  layout (this job's mesh and shardings) with the reloaded models taken from their sources."""
  layout = engine.layout
  with checkpoints_of(workdir) as ckpt:
    restored = ckpt.restore_latest_valid(abstract_state=layout.stored_abstract,
                                         shardings=layout.stored_shardings)
  if restored is None:
    raise UserError(f"no valid checkpoint in {os.path.join(workdir, 'checkpoints')}; train the "
                    f"run to a checkpoint first")
  stored, _, meta = restored
  check_fingerprints(meta, source_fingerprints(recipe, layout), workdir)
  student, extras = recipe.build(abstract=False)
  return engine.restored_state(stored, student, extras)


def load_trained_model(workdir: str, mesh, rules) -> nnx.Module:
  """The plain student Transformer of `workdir`'s newest valid checkpoint, sharded for
  `mesh`/`rules` (LoRA merged, fake quantization and training-only parts off). Reads the
  student's arrays only: no teacher, no optimizer state."""
  return _trained_model_and_step(workdir, mesh, rules)[0]


def _trained_model_and_step(workdir: str, mesh, rules) -> tuple[nnx.Module, int]:
  source = RunSource(os.path.abspath(workdir), "", base_of=student_source)
  cfg = source.model_config()
  return source.load_with_step(cfg, mesh, rules, seed=int(source.run_config.seed))


def load_as_trained(workdir: str, mesh, rules, *, full_precision: bool = False
                    ) -> tuple[nnx.Module, str]:
  """(student, the form it computes in, in words) of `workdir`'s newest valid checkpoint, for
  inference: the forward the run trained and `distillax eval` judges, i.e. fake-quantized
  under QAT (from qat.start_step on), which its GGUF export reproduces in llama.cpp; the plain
  weights with `full_precision`. LoRA is merged either way. The step named, and whose QAT stage
  applies, is the one whose weights were read (an older one when the newest cannot be read)."""
  model, step = _trained_model_and_step(workdir, mesh, rules)
  # The rules of that step's qat.schedule stage (the last stage's once the run finished).
  transforms = StudentTransforms.from_config(load_run_config(workdir, "--model")).at_step(step)
  fake_quant = transforms.fake_quant_at(step) and not full_precision
  if fake_quant:
    model = quant.quantize_for_training(model, transforms.qat)
  form = transforms.describe(fake_quant=fake_quant, lora_merged=True)
  if transforms.qat is not None and not fake_quant and not full_precision:
    form += f", as trained before qat.start_step={transforms.qat.start_step}"
  return model, f"{form}; checkpoint step {step}"


def step_of(state: TrainState) -> int:
  return int(jax.device_get(state.step))
