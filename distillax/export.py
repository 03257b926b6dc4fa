"""`distillax export`: the trained student of a run as Hugging Face safetensors, GGUF for
llama.cpp (edge/export.py) or quantized; an EAGLE-3 head run (trainer='draft') in the
speculators format vLLM serves (--format speculators, models/hf/speculators.py).

  distillax export --config distillax/configs/lm.py --workdir runs/lm --output out/lm_hf
  distillax export --config distillax/configs/qat.py --workdir runs/qat --output out/int4 \
      --format quantized
  distillax export --config distillax/configs/qat.py --workdir runs/qat --output out/gguf \
      --format gguf --quant q4_0 --config.qat.rules="(('.*', 'q4_0', 'q8_0', None),)"

The run's own config.json says what model and trainer produced it; `--config` supplies the mesh
and rules to load it with and, for `--format quantized`, the `qat.rules` (int4 weights / int8
activations when the config has none). LoRA is merged and training-only parts (feature
projections, fake quantization) are dropped before writing; one line names that form (the
plain weights, LoRA merged), which the GGUF q8_0/q4_0 and quantized formats round again. The
Hugging Face export also carries the run's tokenizer, chat template and a
generation_config.json, so transformers' AutoTokenizer, apply_chat_template and generate work
on it as it is.

The Hugging Face and GGUF exports carry only the tokenizer's ids: a model's vocabulary is padded
past its tokenizer's (to a multiple of 128, so it shards evenly), and the runtimes they go to
sample over every row of the output layer, so a padded row could be emitted at any temperature,
an id no tokenizer decodes. They are cut off (`real_token_rows`): lm.py:tiny's 384 rows are
written as its byte tokenizer's 259.

`--config` is optional: without it the run's own config.json says everything (its mesh,
rules and qat section), so `distillax export --workdir runs/kd --output out/kd_hf` is enough.
A `--config` given must still describe the run's job: the same `trainer` and the same `model` section
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

FORMATS = ("hf", "quantized", "gguf", "speculators")


def check_same_job(config, workdir: str, model_overrides=None) -> None:
  """Refuses a `--config` whose trainer or model section differs from the run's config.json."""
  from distillax.trainers import load_run_config
  from distillax.trainers.sources import job_sources, resolve_student
  run = load_run_config(workdir, "--workdir").to_dict()
  # The model section as the run's recipe resolved it (a student from a source has its shape).
  ours = json.loads(resolve_student(config, job_sources(config),
                                    model_overrides).to_json_best_effort())
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


def _run_tokenizer(workdir: str):
  """(tokenizer, chat template text or None) the run trained with (its config.json's
  data.tokenizer and data.chat_template), which the export carries: a model is only usable
  with the ids and the chat format it learned."""
  from distillax.data import make_tokenizer
  from distillax.trainers import load_run_config
  data = load_run_config(workdir, "--workdir").data
  spec, template_file = data.tokenizer, data.get("chat_template") or ""
  try:
    tokenizer = make_tokenizer(spec)
    if not template_file:
      return tokenizer, None
    with open(template_file, encoding="utf-8") as f:
      return tokenizer, f.read()
  except (UserError, OSError) as e:
    raise UserError(f"the run in --workdir {workdir} trained with data.tokenizer={spec!r} "
                    f"(data.chat_template={template_file!r}), which the export carries, but it "
                    f"cannot be read ({e})") from None


def real_token_rows(model, vocab_size: int):
  """`model` with only its first `vocab_size` token rows: the embedding table, an untied output
  layer and a per-layer input table that follows the vocabulary (Gemma 4's). The logits of
  those ids are unchanged; the padded rows past them are gone."""
  from flax import nnx
  from distillax.models.transformer import Transformer
  config = model.config
  if vocab_size >= config.vocab_size:
    return model
  values = nnx.to_pure_dict(nnx.state(model))
  values["embedder"]["embedding"] = values["embedder"]["embedding"][:vocab_size]
  if "lm_head" in values:
    values["lm_head"] = values["lm_head"][:, :vocab_size]
  if config.per_layer_input_dim and not config.per_layer_input_vocab_size:
    table = values["per_layer_inputs"]["embedding"]
    values["per_layer_inputs"]["embedding"] = table[:vocab_size]
  cut = config.replace(vocab_size=vocab_size)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cut, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(abstract, values)
  return nnx.merge(graphdef, abstract)


def check_output(output: str) -> None:
  """--output must be a new or empty directory: not a file, nor below one."""
  existing = output
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    what = "is a file" if existing == output else f"is below the file {existing}"
    raise UserError(f"--output {output} {what}, but an export is a directory of files; choose "
                    f"a new directory path")
  if existing == output and os.listdir(output):
    raise UserError(f"--output {output} exists and is not empty; choose a new directory")


def run_export(config, workdir: str | None, output: str | None, fmt: str,
               gguf_quant: str | None = None, *, model_overrides=None) -> int:
  if not workdir:
    raise UserError("--workdir is required: the run whose newest checkpoint to export")
  if not output:
    raise UserError("--output is required: the directory to write the exported model to")
  if fmt not in FORMATS:
    raise UserError(f"--format={fmt!r} is unknown; use one of {', '.join(FORMATS)}")
  if fmt == "speculators":
    return _export_speculators(workdir, output, gguf_quant)
  from distillax.edge.export import check_export_args, export_run
  gguf_quant = check_export_args(fmt, gguf_quant)
  check_output(output)
  if config is None:  # the run's own config.json: its mesh, rules and qat section
    from distillax.trainers import load_run_config
    config = load_run_config(workdir, "--workdir")
  else:
    check_same_job(config, workdir, model_overrides)
  from distillax import quant
  from distillax.models.hf import checkpoint as hf
  from distillax.trainers import load_as_trained
  mesh = pt.create_mesh(config.mesh)
  rules = pt.rules_from_config(config.partitioning)
  model, form = load_as_trained(workdir, mesh, rules, full_precision=True)
  primary = jax.process_index() == 0  # every process joins the gathers; one says so
  if primary:
    print(f"distillax export: {workdir} loaded as {form}", flush=True)
  tokenizer, template = _run_tokenizer(workdir) if fmt in ("hf", "gguf") else (None, None)
  if tokenizer is not None:
    model = real_token_rows(model, tokenizer.vocab_size)
  if fmt == "hf":
    hf.save(model, output, tokenizer=tokenizer, chat_template=template)
    if primary:
      print(f"distillax export: wrote {output} (Hugging Face safetensors, tokenizer and "
            f"generation config)")
    return 0
  if fmt == "gguf":  # llama.cpp: the run's tokenizer in the file, q8_0/q4_0 by qat.rules
    from distillax.trainers import load_run_config
    add_bos = bool(load_run_config(workdir, "--workdir").data.get("add_bos", True))
    line = export_run(model, output, gguf_quant, _final_rules(config), tokenizer, add_bos)
    if primary:
      print(f"distillax export: {line}")
    return 0
  rules = tuple(_final_rules(config) or quant.INT4_INT8_RULES)
  quant.export_quantized(model, {"rules": rules}, output)
  if primary:
    print(f"distillax export: wrote {output}; "
          f"{quant.format_size_report(quant.size_report(output))}")
  return 0


def _export_speculators(workdir: str, output: str, quant: str | None) -> int:
  """An EAGLE-3 head run (trainer='draft') in the speculators format vLLM serves
  (models/hf/speculators.py). Its config names the target (the verifier): the run's
  teacher.hf_path, or else the target written as a Hugging Face checkpoint to
  <output>/verifier (a run's or a preset's target)."""
  if quant is not None:
    raise UserError("--quant applies to --format gguf; drop it for --format speculators")
  from distillax.trainers import load_run_config
  if str(load_run_config(workdir, "--workdir").get("trainer")) != "draft":
    raise UserError(f"--format speculators writes an EAGLE-3 head; --workdir {workdir} is not a "
                    f"draft run (trainer='draft', distillax/configs/draft_eagle3.py): use "
                    f"--format hf for it")
  check_output(output)
  from distillax.models.hf import speculators
  from distillax.trainers.draft import load_draft_run
  head, target, recipe = load_draft_run(workdir)
  speculators.check_exportable(head)
  verifier = recipe.config.teacher.hf_path
  if verifier:  # the served target is that checkpoint
    verifier = os.path.abspath(verifier)
  else:  # a run's or a preset's target: written beside the head, as vLLM will serve it
    from distillax.models.hf import checkpoint as hf
    tokenizer, template = _run_tokenizer(workdir)
    verifier = os.path.abspath(os.path.join(output, "verifier"))
    hf.save(real_token_rows(target, tokenizer.vocab_size), verifier, tokenizer=tokenizer,
            chat_template=template)
  speculators.save(head, target.config, output, target_vocab=int(recipe.tokenizer.vocab_size),
                   proposals=int(recipe.settings.ttt_steps), verifier_path=verifier)
  if jax.process_index() == 0:
    print(f"distillax export: wrote {output} (speculators eagle3: config.json, "
          f"model.safetensors; draft vocabulary {head.config.draft_vocab_size} of "
          f"{recipe.tokenizer.vocab_size}, target layers {list(head.config.aux_layers)}; "
          f"verifier {verifier})")
  return 0


def _final_rules(config) -> tuple:
  """The QAT rules of the form a run ends in: qat.rules, or qat.schedule's last stage's."""
  from distillax import quant
  qat = config.get("qat")
  return quant.QuantConfig.from_config(qat).rules if qat else ()
