"""`distillax export`: the trained student of a run as Hugging Face safetensors or quantized.

  distillax export --config distillax/configs/lm.py --workdir runs/lm --output out/lm_hf
  distillax export --config distillax/configs/qat.py --workdir runs/qat --output out/int4 \
      --format quantized

The run's own config.json says what model and trainer produced it; `--config` supplies the mesh
and rules to load it with and, for `--format quantized`, the `qat.rules` (int4 weights / int8
activations when the config has none). LoRA is merged and training-only parts (feature
projections, fake quantization) are dropped before writing.
"""

from __future__ import annotations

import os

from distillax import partitioning as pt
from distillax.errors import UserError

FORMATS = ("hf", "quantized")


def run_export(config, workdir: str | None, output: str | None, fmt: str) -> int:
  if not workdir:
    raise UserError("--workdir is required: the run whose newest checkpoint to export")
  if not output:
    raise UserError("--output is required: the directory to write the exported model to")
  if fmt not in FORMATS:
    raise UserError(f"--format={fmt!r} is unknown; use one of {', '.join(FORMATS)}")
  if os.path.exists(output) and os.listdir(output):
    raise UserError(f"--output {output} exists and is not empty; choose a new directory")
  from distillax import quant
  from distillax.models import hf
  from distillax.trainers import load_trained_model
  mesh = pt.create_mesh(config.mesh)
  rules = pt.rules_from_config(config.partitioning)
  model = load_trained_model(workdir, mesh, rules)
  if fmt == "hf":
    hf.save(model, output)
    print(f"distillax export: wrote {output} (Hugging Face safetensors)")
    return 0
  rules = tuple(config.get("qat", {}).get("rules") or quant.INT4_INT8_RULES)
  quant.export_quantized(model, {"rules": rules}, output)
  print(f"distillax export: wrote {output}; {quant.format_size_report(quant.size_report(output))}")
  return 0
