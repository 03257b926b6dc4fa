"""`distillax export`: the trained student of a run as Hugging Face safetensors or quantized.

  distillax export --config distillax/configs/lm.py --workdir runs/lm --output out/lm_hf
  distillax export --config distillax/configs/qat.py --workdir runs/qat --output out/int4 \
      --format quantized

The run's own config.json says what model and trainer produced it; `--config` supplies the mesh
and rules to load it with and, for `--format quantized`, the `qat.rules` (int4 weights / int8
activations when the config has none). LoRA is merged and training-only parts (feature
projections, fake quantization) are dropped before writing.

`--config` must still describe the run's job: the same `trainer` and the same `model` section
as the run's config.json. Anything else means the command names two different jobs (a distill
config against an lm run, a full-size config against a `:tiny` run), and exporting would
silently write a model the config does not describe; it fails in one line instead. The other
sections (mesh, partitioning, qat) may differ: choosing them is what `--config` is for here.
"""

from __future__ import annotations

import json
import os

import jax

from distillax import partitioning as pt
from distillax.errors import UserError

FORMATS = ("hf", "quantized")


def check_same_job(config, workdir: str) -> None:
  """Refuses a `--config` whose trainer or model section differs from the run's config.json."""
  from distillax.trainers import load_run_config
  run = load_run_config(workdir, "--workdir").to_dict()
  ours = json.loads(config.to_json_best_effort())
  diff = [f"trainer {ours.get('trainer')!r} vs the run's {run.get('trainer')!r}"] if (
      ours.get("trainer") != run.get("trainer")) else []
  theirs_model, our_model = run.get("model", {}), ours.get("model", {})
  diff += [f"model.{k} {our_model.get(k)!r} vs the run's {theirs_model.get(k)!r}"
           for k in sorted(set(our_model) | set(theirs_model))
           if our_model.get(k) != theirs_model.get(k)]
  if diff:
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    raise UserError(f"--config describes another job than the run in --workdir {workdir} "
                    f"({shown}); pass the --config and --config.model overrides the run was "
                    f"trained with (see {os.path.join(workdir, 'config.json')})")


def run_export(config, workdir: str | None, output: str | None, fmt: str) -> int:
  if not workdir:
    raise UserError("--workdir is required: the run whose newest checkpoint to export")
  if not output:
    raise UserError("--output is required: the directory to write the exported model to")
  if fmt not in FORMATS:
    raise UserError(f"--format={fmt!r} is unknown; use one of {', '.join(FORMATS)}")
  if os.path.exists(output) and os.listdir(output):
    raise UserError(f"--output {output} exists and is not empty; choose a new directory")
  check_same_job(config, workdir)
  from distillax import quant
  from distillax.models import hf
  from distillax.trainers import load_trained_model
  mesh = pt.create_mesh(config.mesh)
  rules = pt.rules_from_config(config.partitioning)
  model = load_trained_model(workdir, mesh, rules)
  primary = jax.process_index() == 0  # every process joins the gathers; one says so
  if fmt == "hf":
    hf.save(model, output)
    if primary:
      print(f"distillax export: wrote {output} (Hugging Face safetensors)")
    return 0
  rules = tuple(config.get("qat", {}).get("rules") or quant.INT4_INT8_RULES)
  quant.export_quantized(model, {"rules": rules}, output)
  if primary:
    print(f"distillax export: wrote {output}; "
          f"{quant.format_size_report(quant.size_report(output))}")
  return 0
