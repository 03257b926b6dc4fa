"""The demo's report: every model evaluated on the same validation batches, exported, sampled.

Numbers come from one evaluation pass per model over identical batches (next-token CE on the
validation split, and top-1 agreement with the teacher), so the rows are comparable; speed and
MFU come from each stage's own metrics.jsonl.
"""

from __future__ import annotations

import math
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax import quant
from distillax.data import make_eval_iterator, make_tokenizer
from distillax.demo.stages import TRAINED_STAGES
from distillax.framework import jsonio, losses
from distillax.framework.backends import global_batch_placer
from distillax.framework.writers import read_jsonl
from distillax.models import hf
from distillax.trainers import load_trained_model

LABELS = {"teacher": "teacher", "student_scratch": "student, from scratch",
          "student_kd": "student, distilled",
          "student_kd_fp": "student, distilled + extra fp steps",
          "student_ptq_int4": "  ... + PTQ int4",
          "student_qat_int4": "student, distilled + QAT int4 (same extra steps)"}
ROWS = ("teacher", "student_scratch", "student_kd", "student_kd_fp", "student_ptq_int4",
        "student_qat_int4")


def _evaluator(mesh, rules, teacher):
  """jit'd (model state, batch) -> sums of CE, tokens and top-1 agreement with the teacher."""
  t_graph, t_state = nnx.split(teacher)
  cache = {}

  def for_model(model):
    graph, state = nnx.split(model)
    if graph not in cache:
      def sums(state, t_state, batch):
        with pt.use_rules(mesh, rules):
          m, t = nnx.merge(graph, state), nnx.merge(t_graph, t_state)
          kwargs = losses.model_inputs(batch)
          logits = m(batch[losses.BATCH_INPUTS], **kwargs).logits_BxLxV
          t_logits = t(batch[losses.BATCH_INPUTS], **kwargs).logits_BxLxV
        mask = batch[losses.BATCH_MASK]
        nll, _, tokens = losses.cross_entropy_sums(logits, batch[losses.BATCH_TARGETS], mask)
        agree = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(t_logits, -1)) * mask)
        return nll, tokens, agree
      cache[graph] = jax.jit(sums)
    return lambda batch: cache[graph](state, t_state, batch)
  return for_model


def _stage_speed(stage_dir: str) -> dict:
  rows = read_jsonl(os.path.join(stage_dir, "metrics.jsonl"))

  def median(key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]  # null: not measured
    return statistics.median(values) if values else float("nan")
  return {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu")}


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _curve(stage_dir: str):
  rows = read_jsonl(os.path.join(stage_dir, "metrics.jsonl"))
  pts = [(r["step"], r.get("eval_hard_ce", r.get("eval_loss"))) for r in rows if "eval_loss" in r]
  pts = [p for p in pts if p[1] is not None]  # a diverged eval is null in strict JSON
  return [p[0] for p in pts], [p[1] for p in pts]


def _plot(pipeline, ptq_loss: float, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5))
  for stage in TRAINED_STAGES:
    xs, ys = _curve(pipeline.stage_dir(stage))
    if stage in ("student_kd_fp", "student_qat_int4"):  # they continue student_kd
      xs = [x + int(pipeline.config.student_steps) for x in xs]
    ax.plot(xs, ys, marker="o", markersize=3, label=LABELS[stage])
  ax.axhline(ptq_loss, color="gray", linestyle="--", label=LABELS["student_ptq_int4"])
  ax.set_xlabel("step (QAT and its fp twin continue the distilled student)")
  ax.set_ylabel("validation next-token loss (nats/token)")
  ax.set_title("distillax demo: validation curves")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _format_table(stages: dict) -> str:
  head = ("stage", "val loss", "val ppl", "top-1 agree", "params", "bytes on disk", "tokens/s",
          "MFU")
  rows = []
  for name in ROWS:
    s = stages[name]
    rows.append((LABELS[name], f"{s['val_loss']:.4f}", f"{s['val_perplexity']:.3f}",
                 f"{s['top1_agreement']:.3f}", f"{s['params']:,}",
                 f"{s['bytes_on_disk'] / 2**20:.2f} MiB",
                 "-" if math.isnan(s["tokens_per_s"]) else f"{s['tokens_per_s']:.0f}",
                 "-" if math.isnan(s["mfu"]) else f"{s['mfu']:.2%}"))
  lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def _samples(models: dict, tokenizer, mesh, rules, prompts, max_new_tokens: int) -> dict:
  from distillax.models.sampler import generate
  encoded = [tokenizer.encode(p) for p in prompts]
  # The batch of prompts is sharded over 'data': pad it to a multiple of that axis.
  n_real = len(encoded)
  encoded += [encoded[0]] * (-len(encoded) % mesh.shape["data"])
  if tokenizer.bos_id is not None:
    encoded = [[tokenizer.bos_id] + e for e in encoded]
  width = max(len(e) for e in encoded)
  prompt = np.full((len(encoded), width), tokenizer.pad_id, np.int32)
  for i, e in enumerate(encoded):
    prompt[i, :len(e)] = e
  lengths = np.array([len(e) for e in encoded], np.int32)
  out = {}
  for name, model in models.items():
    gen = generate(model, prompt, lengths, mesh=mesh, rules=rules, max_new_tokens=max_new_tokens,
                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, temperature=0.7, top_p=0.9,
                   seed=0)
    tokens, n = np.asarray(gen.tokens_BxT), np.asarray(gen.lengths_B)
    out[name] = [p + tokenizer.decode([int(t) for t in tokens[i, :n[i]]])
                 for i, p in enumerate(prompts[:n_real])]
  return out


def _placed_eval_batches(c, mesh, rules, tokenizer):
  """The report's validation batches, placed on the mesh, and one row of inputs that PTQ and
  the quantized export calibrate on."""
  batches = list(make_eval_iterator(c.data, global_batch_size=int(c.train.batch_size),
                                    seq_len=int(c.train.seq_len),
                                    num_batches=int(c.report_eval_batches), tokenizer=tokenizer))
  place = global_batch_placer(mesh, rules)
  placed = [place(b) for b in batches]
  sample = jnp.asarray(batches[0][losses.BATCH_INPUTS][:1])
  return placed, sample


def _models_by_row(plain: dict, qcfg: dict, sample) -> dict:
  """Every row's model: the trained stages as they are, plus the int4 PTQ of the fp twin and
  the QAT student with its fake quantization made real (PTQ of QAT-trained weights)."""
  models = dict(plain)
  models["student_ptq_int4"] = quant.quantize_post_training(plain["student_kd_fp"], qcfg, sample)
  models["student_qat_int4"] = quant.quantize_post_training(plain["student_qat_int4"], qcfg,
                                                            sample)
  return models


def _export_all(plain: dict, qcfg: dict, sample, export_dir: str) -> dict:
  """Writes every row's model under `export_dir` (fp32 HF checkpoints, int4 exports) and returns
  each row's bytes on disk: the size column measures what was actually written."""
  sizes = {}
  for stage in ("teacher", "student_scratch", "student_kd", "student_kd_fp"):
    path = os.path.join(export_dir, f"{stage}_fp32")
    hf.save(plain[stage], path)
    sizes[stage] = _dir_bytes(path)
  for stage, source in (("student_ptq_int4", "student_kd_fp"),
                        ("student_qat_int4", "student_qat_int4")):
    path = os.path.join(export_dir, stage)
    quant.export_quantized(plain[source], qcfg, path, sample)
    sizes[stage] = quant.size_report(path)["bytes_on_disk"]
  return sizes


def _stage_rows(pipeline, evaluate, models: dict, plain: dict, sizes: dict, placed) -> dict:
  """Each row's numbers: CE, perplexity and teacher agreement summed over the same batches,
  parameter count, bytes on disk, and training speed from the stage's own metrics."""
  stages = {}
  for name in ROWS:
    fn = evaluate(models[name])
    totals = np.zeros(3)
    for b in placed:
      totals += np.asarray(jax.device_get(fn(b)), np.float64)
    nll, tokens, agree = totals
    # PTQ trains nothing: no speed of its own; its weights are the distilled student's.
    speed = (_stage_speed(pipeline.stage_dir(name)) if name in TRAINED_STAGES
             else {"tokens_per_s": float("nan"), "mfu": float("nan")})
    n_params = sum(int(x.size) for x in jax.tree.leaves(
        nnx.state(plain.get(name, plain["student_kd_fp"]), nnx.Param)))
    stages[name] = {"val_loss": float(nll / tokens), "val_perplexity": math.exp(nll / tokens),
                    "top1_agreement": float(agree / tokens), "params": n_params,
                    "bytes_on_disk": int(sizes[name]), "val_tokens": float(tokens), **speed}
  return stages


def _checks(stages: dict, export_diff: float) -> dict:
  """The claims the demo exists to show, as booleans and numbers the tests can read."""
  s = stages
  ptq_gap = s["student_ptq_int4"]["val_loss"] - s["student_kd_fp"]["val_loss"]
  recovery = ((s["student_ptq_int4"]["val_loss"] - s["student_qat_int4"]["val_loss"]) / ptq_gap
              if ptq_gap > 0 else float("nan"))
  return {
      "kd_beats_scratch": bool(s["student_kd"]["val_loss"] < s["student_scratch"]["val_loss"]),
      "qat_beats_ptq": bool(s["student_qat_int4"]["val_loss"] < s["student_ptq_int4"]["val_loss"]),
      "qat_recovery_of_ptq_degradation": recovery,
      "int4_export_max_abs_ce_sum_diff": export_diff,
  }


def _recovery_words(recovery: float) -> str:
  """The recovery claim in words; without a PTQ degradation there is no ratio to state."""
  if not math.isfinite(recovery):
    return ("PTQ int4 costs nothing here (its loss is not above full precision's), so there is "
            "nothing for QAT to recover")
  return (f"QAT recovers {recovery:.0%} of the degradation PTQ causes "
          f"((PTQ - QAT) / (PTQ - full precision))")


def _report_markdown(c, mesh, stages: dict, checks: dict, samples: dict) -> str:
  """report.md: the setup, the table, the checks in words, and the samples."""
  s = stages
  recovery, export_diff = (checks["qat_recovery_of_ptq_degradation"],
                           checks["int4_export_max_abs_ce_sum_diff"])
  lines = [
      "# distillax demo report", "",
      f"Mesh {pt.mesh_shape_str(mesh)} (data x model), strategy {c.partitioning.strategy}, "
      f"{jax.device_count()} {jax.devices()[0].platform} devices; validation: "
      f"{int(s['teacher']['val_tokens'])} tokens of the held-out split, the same for every row.",
      "", _format_table(stages), "",
      f"- distilled student beats scratch student: {checks['kd_beats_scratch']}",
      f"- QAT int4 beats PTQ int4: {checks['qat_beats_ptq']}; both start from the distilled "
      f"student and take the same {int(c.qat_steps)} extra steps; {_recovery_words(recovery)}",
      f"- int4 export reloaded: CE sum on one batch differs by {export_diff:.2e} from the "
      f"fake-quant forward",
      "", "## Samples (temperature 0.7, top-p 0.9, seed 0)", ""]
  for name, texts in samples.items():
    for t in texts:
      lines.append(f"- **{name}**: `{t!r}`")
  return "\n".join(lines) + "\n"


def _write_report(workdir: str, report_md: str, stages: dict, checks: dict,
                  samples: dict) -> None:
  """report.md, and report.json with the stages at top level next to checks and samples."""
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(report_md)
  # Strict JSON: a number that does not exist (PTQ's training speed, the recovery ratio when PTQ
  # costs nothing) is null, not NaN.
  with open(os.path.join(workdir, "report.json"), "w") as f:
    jsonio.dump({**stages, "checks": checks, "samples": samples}, f, indent=2)


def build_report(pipeline) -> dict:
  """Evaluates, exports and samples every stage of a finished demo; writes report.md,
  report.json and loss_curves.png into its workdir; returns stages, checks and samples."""
  c = pipeline.config
  workdir = pipeline.workdir
  mesh = pt.create_mesh(c.mesh)
  rules = pt.rules_from_config(c.partitioning)
  tokenizer = make_tokenizer(c.data.tokenizer)
  placed, sample = _placed_eval_batches(c, mesh, rules, tokenizer)
  qcfg = {"rules": [tuple(r) for r in c.quant_rules]}

  plain = {s: load_trained_model(pipeline.stage_dir(s), mesh, rules) for s in TRAINED_STAGES}
  models = _models_by_row(plain, qcfg, sample)
  export_dir = os.path.join(workdir, "export")
  sizes = _export_all(plain, qcfg, sample, export_dir)
  reloaded = quant.load_quantized(os.path.join(export_dir, "student_qat_int4"), mesh=mesh,
                                  rules=rules, sample_tokens=sample)
  evaluate = _evaluator(mesh, rules, plain["teacher"])
  export_diff = float(jnp.max(jnp.abs(
      evaluate(reloaded)(placed[0])[0] - evaluate(models["student_qat_int4"])(placed[0])[0])))

  stages = _stage_rows(pipeline, evaluate, models, plain, sizes, placed)
  checks = _checks(stages, export_diff)
  _plot(pipeline, stages["student_ptq_int4"]["val_loss"], os.path.join(workdir, "loss_curves.png"))
  samples = _samples({"teacher": plain["teacher"], "student_scratch": plain["student_scratch"],
                      "student_kd": plain["student_kd"]}, tokenizer, mesh, rules,
                     list(c.sample_prompts), int(c.sample_tokens))
  report_md = _report_markdown(c, mesh, stages, checks, samples)
  _write_report(workdir, report_md, stages, checks, samples)
  print("\n" + report_md)
  return {"stages": stages, "checks": checks, "samples": samples}
