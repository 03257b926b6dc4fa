"""What the demo's report measures: every row evaluated on the same validation batches, the
exports' sizes, llama.cpp's figures of the GGUF files (demo/edge.py), samples, and the claims
the demo exists to show. demo/render.py turns these numbers into report.md, report.json and plots.

Every row is evaluated through `framework.evaluation.evaluate`, the trainer's and `distillax
eval`'s route, with the stage's own job (recipe, eval objective, engine) at its newest
checkpoint, twice: on the report's `report_eval_batches` (every number of the table, the same
tokens llama.cpp's rows read) and on the stage's own `train.eval_batches`, its `eval` entry in
report.json, which is what `distillax eval --model <stage>` prints, to the last digit. The
row's validation loss is that job's next-token CE (`eval_loss`, whatever the job's objective,
`eval_objective`, is). The PTQ row is the full-precision twin's checkpoint under the QAT stage's
engine: its fake-quant forward before any QAT step, which is PTQ (quant/qat.py). Top-1 agreement
with the teacher compares each row's per-token top-1 with the teacher's, over the real tokens.
Speed and MFU come from each stage's own metrics.jsonl. The quantized rows use llama.cpp's q4_0
weights and q8_0 activations (distillax's fake-quant forward rounds as its CPU kernels do), so
the same students exported as GGUF give llama.cpp's own validation loss, bytes, tokens/s and
memory. Each row also carries `tasks` (demo/task_scores.py: BLEU / chrF of greedy completions
of held-out code, a local lm-eval task), and QAT's recovery is measured under each of the
`qat_seeds` seeds (its spread is what the ratio of two small gaps can be trusted to).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from distillax import partitioning as pt
from distillax import quant
from distillax.data import batch as batch_spec
from distillax.data import make_eval_iterator, make_tokenizer
from distillax.demo import draft, edge, on_policy, progressive
from distillax.demo.stages import TRAINED_STAGES, seed_stage
from distillax.eval.loss import restore_onto, run_recipe
from distillax.framework.evaluation import PerToken, evaluate
from distillax.framework.run.writers import read_jsonl
from distillax.models.hf import checkpoint as hf
from distillax.trainers import load_trained_model

# row -> (the stage whose job evaluates it, the stage whose checkpoint holds its weights).
# PTQ is the fp twin's weights under the QAT stage's fake-quant forward, before any QAT step.
ROW_SOURCES = {"teacher": ("teacher", "teacher"),
               "student_scratch": ("student_scratch", "student_scratch"),
               "student_kd": ("student_kd", "student_kd"),
               "student_kd_fp": ("student_kd_fp", "student_kd_fp"),
               "student_ptq_int4": ("student_qat_int4", "student_kd_fp"),
               "student_qat_int4": ("student_qat_int4", "student_qat_int4"),
               **{stage: (stage, stage) for stage in on_policy.STAGES}}
ROWS = tuple(ROW_SOURCES)


@dataclasses.dataclass
class DemoInputs:
  """What every measurement reads: the finished demo, its mesh and rules, the validation
  batches on the host (every row and llama.cpp read the same tokens) and each trained stage's
  plain model (for exports, samples and parameter counts)."""

  pipeline: Any  # demo.pipeline.DemoPipeline
  mesh: Mesh
  rules: pt.RuleSet
  tokenizer: Any
  batches: list[dict[str, np.ndarray]]  # the report's validation batches
  stage_batches: list[dict[str, np.ndarray]]  # the stages' own eval batches (distillax eval)
  plain: dict[str, nnx.Module]

  @property
  def config(self):
    return self.pipeline.config


def load_inputs(pipeline) -> DemoInputs:
  """The demo's validation batches (the report's `report_eval_batches`, and the stages' own
  `train.eval_batches`, as every stage copies them) and its trained stages' plain models."""
  c = pipeline.config
  mesh, rules = pt.create_mesh(c.mesh), pt.rules_from_config(c.partitioning)
  tokenizer = make_tokenizer(c.data.tokenizer)

  def batches(n):
    return list(make_eval_iterator(c.data, global_batch_size=int(c.train.batch_size),
                                   seq_len=int(c.train.seq_len), num_batches=int(n),
                                   tokenizer=tokenizer))
  plain = {s: load_trained_model(pipeline.stage_dir(s), mesh, rules) for s in TRAINED_STAGES}
  return DemoInputs(pipeline, mesh, rules, tokenizer, batches(c.report_eval_batches),
                    batches(c.train.eval_batches), plain)


def evaluate_rows(d: DemoInputs) -> dict[str, tuple[dict[str, float], PerToken, dict]]:
  """Every row's (eval metrics, per-token values) over the report's batches and its eval
  metrics over the stages' own, each with the engine of the stage whose job evaluates it
  (ROW_SOURCES)."""
  jobs, out = {}, {}
  for row, (job, weights) in ROW_SOURCES.items():
    if job not in jobs:
      recipe = run_recipe(d.pipeline.stage_dir(job))
      jobs[job] = recipe, recipe.build_engines(compile_now=False)
    engine, state = restore_onto(*jobs[job], d.pipeline.stage_dir(weights))
    out[row] = (*evaluate(engine, state, d.batches, per_token=True),
                evaluate(engine, state, d.stage_batches))
  return out


def _val_losses(d: DemoInputs, job_dir: str, *weights_dirs: str) -> list[float]:
  """The next-token CE over the report's batches of each checkpoint under `job_dir`'s engine."""
  recipe = run_recipe(job_dir)
  engines, out = recipe.build_engines(compile_now=False), []
  for weights in weights_dirs:
    engine, state = restore_onto(recipe, engines, weights)
    out.append(float(evaluate(engine, state, d.batches)["eval_loss"]))
  return out


def seed_recoveries(d: DemoInputs, stages: dict) -> list[float]:
  """QAT's recovery of the PTQ degradation under each of the `qat_seeds` seeds, on the report's
  batches: the table's stages first, then each extra seed's fp twin, PTQ (its weights under the
  QAT engine) and QAT."""
  s = stages
  out = [edge.recovery(s["student_ptq_int4"]["val_loss"], s["student_qat_int4"]["val_loss"],
                       s["student_kd_fp"]["val_loss"])]
  for k in range(1, int(d.config.get("qat_seeds", 1))):
    fp_dir = d.pipeline.stage_dir(seed_stage("student_kd_fp", k))
    qat_dir = d.pipeline.stage_dir(seed_stage("student_qat_int4", k))
    ptq, qat = _val_losses(d, qat_dir, fp_dir, qat_dir)
    out.append(edge.recovery(ptq, qat, *_val_losses(d, fp_dir, fp_dir)))
  return out


def top1_agreement(a: PerToken, b: PerToken, batches) -> float:
  """The share of the batches' real tokens where the two models' top-1 tokens are the same."""
  same = tokens = 0.0
  for a_BxL, b_BxL, batch in zip(a.top1_BxL, b.top1_BxL, batches):
    mask_BxL = np.asarray(batch[batch_spec.LOSS_MASK], np.float64)
    same += float(np.sum((a_BxL == b_BxL) * mask_BxL))
    tokens += float(np.sum(mask_BxL))
  return same / tokens


def _stage_speed(stage_dir: str) -> dict:
  rows = read_jsonl(os.path.join(stage_dir, "metrics.jsonl"))

  def median(key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]  # null: not measured
    return statistics.median(values) if values else float("nan")
  return {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu")}


def stage_rows(d: DemoInputs, evals: dict, sizes: dict) -> dict:
  """Each row's numbers: next-token CE, perplexity and teacher agreement over the same
  batches, parameter count, bytes on disk, training speed from the stage's own metrics, and
  `eval`: its job's evaluation on its own eval batches, as `distillax eval` prints it."""
  teacher_tokens = evals["teacher"][1]
  stages = {}
  for name in ROWS:
    metrics, per_token, own = evals[name]
    # PTQ trains nothing: no speed of its own; its weights are the distilled student's.
    speed = (_stage_speed(d.pipeline.stage_dir(name)) if name in TRAINED_STAGES
             else {"tokens_per_s": float("nan"), "mfu": float("nan")})
    n_params = sum(int(x.size) for x in jax.tree.leaves(
        nnx.state(d.plain.get(name, d.plain["student_kd_fp"]), nnx.Param)))
    stages[name] = {"val_loss": metrics["eval_loss"],
                    "val_perplexity": metrics["eval_perplexity"],
                    "top1_agreement": top1_agreement(per_token, teacher_tokens, d.batches),
                    "params": n_params, "bytes_on_disk": int(sizes[name]),
                    "val_tokens": metrics["eval_tokens"], **speed, "eval": own}
  return stages


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(path) for f in fs)


def export_all(d: DemoInputs, export_dir: str) -> tuple[dict, dict]:
  """Writes every row's model under `export_dir` (fp32 HF checkpoints; GGUF files for llama.cpp,
  the PTQ and QAT rows as q4_0) and returns (each row's bytes on disk, {edge row: GGUF path}):
  the size column measures what was actually written."""
  c, sizes = d.config, {}
  for stage in ("teacher", "student_scratch", "student_kd", "student_kd_fp", "student_onpolicy"):
    path = os.path.join(export_dir, f"{stage}_fp32")
    hf.save(d.plain[stage], path)
    sizes[stage] = _dir_bytes(path)
  paths = edge.export_gguf(d.plain, tuple(c.quant_rules), d.tokenizer, bool(c.data.add_bos),
                           os.path.join(export_dir, "gguf"))
  sizes["student_ptq_int4"] = os.path.getsize(paths["q4_0_ptq"])
  sizes["student_qat_int4"] = os.path.getsize(paths["q4_0_qat"])
  paths["on_policy"] = on_policy.export_gguf(d.plain, tuple(c.quant_rules), d.tokenizer,
                                             bool(c.data.add_bos), os.path.join(export_dir, "gguf"))
  sizes["student_qad_q4_0"] = os.path.getsize(paths["on_policy"]["student_qad_q4_0"])
  return sizes, paths


def row_models(d: DemoInputs) -> dict:
  """Every row's model as it is deployed: the trained stages' plain weights, the quantized rows
  (PTQ from the fp twin, QAT, QAD, progressive QAT) with their fake quantization made real."""
  sample = jnp.asarray(d.batches[0][batch_spec.INPUTS][:1])
  demo_rules, (_, last_rules) = d.config.quant_rules, d.config.progressive_qat[-1]
  # row -> (stage, the rules it deploys with: progressive QAT's are its schedule's last stage)
  quantized = {"student_ptq_int4": ("student_kd_fp", demo_rules),
               "student_qat_int4": ("student_qat_int4", demo_rules),
               "student_qad_q4_0": ("student_qad_q4_0", demo_rules),
               "student_qat_progressive": ("student_qat_progressive", last_rules)}
  return {**d.plain, **{row: quant.quantize_post_training(
      d.plain[stage], {"rules": [tuple(r) for r in rules]}, sample)
      for row, (stage, rules) in quantized.items()}}


def on_policy_rows(d: DemoInputs, stages: dict, paths: dict, models: dict) -> dict:
  """The on-policy section (demo/on_policy.py): what each student writes on held-out prompts,
  graded by the teacher; the q4_0 rows with their fake quantization made real, and sampled
  from their GGUF files in llama.cpp too."""
  return on_policy.measure(d.config, d.plain, models, stages, d.tokenizer, d.mesh, d.rules,
                           paths)


def progressive_rows(d: DemoInputs, stages: dict, models: dict) -> dict:
  """Progressive against direct q4_0 QAT (demo/progressive.py) over the report's batches."""
  prog_dir = d.pipeline.stage_dir("student_qat_progressive")
  val_losses = {"student_qat_int4": stages["student_qat_int4"]["val_loss"],
                "student_qat_progressive": _val_losses(d, prog_dir, prog_dir)[0]}
  return progressive.measure(models, d.plain["student_kd_fp"], d.batches, d.mesh, d.rules,
                             val_losses, stages["student_ptq_int4"]["val_loss"],
                             stages["student_kd_fp"]["val_loss"])


def task_rows(d: DemoInputs, stages: dict, models: dict) -> None:
  """Adds each row's generation and lm-eval task scores (demo/task_scores.py) to its stage row."""
  from distillax.demo import task_scores  # lm-eval, sacrebleu: the eval extra
  scores = task_scores.measure({row: models[row] for row in ROWS}, d.tokenizer,
                               bool(d.config.data.add_bos), d.mesh, d.rules, d.config)
  for row, values in scores.items():
    stages[row]["tasks"] = values


def _prompt_batch(tokenizer, mesh, prompts):
  """(right-padded prompt ids, lengths, each prompt's ids with BOS) of the sample prompts."""
  encoded = [tokenizer.encode(p) for p in prompts]
  if tokenizer.bos_id is not None:
    encoded = [[tokenizer.bos_id] + e for e in encoded]
  # The batch of prompts is sharded over 'data': pad it to a multiple of that axis.
  padded = encoded + [encoded[0]] * (-len(encoded) % mesh.shape["data"])
  width = max(len(e) for e in padded)
  prompt = np.full((len(padded), width), tokenizer.pad_id, np.int32)
  for i, e in enumerate(padded):
    prompt[i, :len(e)] = e
  return prompt, np.array([len(e) for e in padded], np.int32), encoded


def samples(d: DemoInputs) -> dict:
  """Each sampled stage's continuation of every sample prompt (temperature 0.7, top-p 0.9)."""
  from distillax.models.sampler import generate
  c, tokenizer = d.config, d.tokenizer
  prompts = list(c.sample_prompts)
  prompt, lengths, _ = _prompt_batch(tokenizer, d.mesh, prompts)
  out = {}
  for name in ("teacher", "student_scratch", "student_kd"):
    gen = generate(d.plain[name], prompt, lengths, mesh=d.mesh, rules=d.rules,
                   max_new_tokens=int(c.sample_tokens), eos_id=tokenizer.eos_id,
                   pad_id=tokenizer.pad_id, temperature=0.7, top_p=0.9, seed=0,
                   vocab_limit=tokenizer.vocab_size)
    tokens, n = np.asarray(gen.tokens_BxT), np.asarray(gen.lengths_B)
    out[name] = [p + tokenizer.decode([int(t) for t in tokens[i, :n[i]]])
                 for i, p in enumerate(prompts)]
  return out


def _greedy_qat(d: DemoInputs, max_new_tokens: int):
  """(each prompt's ids, distillax's greedy continuation of each by the QAT student with its
  fake quantization made real, not stopped at EOS): what llama.cpp's greedy decode of the q4_0
  QAT file must reproduce."""
  from distillax.models.sampler import generate
  sample = jnp.asarray(d.batches[0][batch_spec.INPUTS][:1])
  model = quant.quantize_post_training(d.plain["student_qat_int4"],
                                       {"rules": [tuple(r) for r in d.config.quant_rules]},
                                       sample)
  prompt, lengths, encoded = _prompt_batch(d.tokenizer, d.mesh, list(d.config.sample_prompts))
  gen = generate(model, prompt, lengths, mesh=d.mesh, rules=d.rules,
                 max_new_tokens=max_new_tokens, eos_id=None, pad_id=d.tokenizer.pad_id,
                 temperature=0.0)
  tokens = np.asarray(gen.tokens_BxT)
  return encoded, [tokens[i, :max_new_tokens].tolist() for i in range(len(encoded))]


def edge_rows(d: DemoInputs, paths: dict, qat_tokens: PerToken):
  """llama.cpp's figures of every GGUF file; how many greedy tokens of the q4_0 QAT file agree
  with distillax's greedy decoding of the QAT student; the largest |CE sum difference| of that
  file against the QAT stage's fake-quant forward (its per-token NLL, `qat_tokens`) over the
  first batch's sequences."""
  c, n = d.config, int(d.config.edge_greedy_tokens)
  prompts, ours = _greedy_qat(d, n)
  segs = edge.segments(d.batches)
  rows = edge.measure(paths, segs, {**edge.speed_tokens(d.batches, int(c.edge_decode_tokens)),
                                    "rounds": int(c.edge_speed_rounds)},
                      prompts, n, int(c.edge_threads) or None,
                      vocab_limit=d.tokenizer.vocab_size)
  qat = rows["q4_0_qat"]
  diff = edge.max_segment_diff(segs, qat.pop("segment_nll"), qat_tokens.nll_BxL[0])
  return rows, edge.greedy_agreement(qat.pop("greedy"), ours), diff


def checks(stages: dict, edge_rows: dict, export_diff: float, agreement: list[int],
           greedy_tokens: int) -> dict:
  """The claims the demo exists to show, as booleans and numbers the tests can read: QAT's
  recovery measured twice, in distillax's fake-quant forward and in llama.cpp's own."""
  s, e = stages, edge_rows
  return {
      "kd_beats_scratch": bool(s["student_kd"]["val_loss"] < s["student_scratch"]["val_loss"]),
      # (scratch - distilled) / (scratch - teacher): 1 when distillation reaches the teacher
      "kd_share_of_gap_closed": edge.recovery(s["student_scratch"]["val_loss"],
                                              s["student_kd"]["val_loss"],
                                              s["teacher"]["val_loss"]),
      "qat_beats_ptq": bool(s["student_qat_int4"]["val_loss"] < s["student_ptq_int4"]["val_loss"]),
      "qat_recovery_of_ptq_degradation": edge.recovery(
          s["student_ptq_int4"]["val_loss"], s["student_qat_int4"]["val_loss"],
          s["student_kd_fp"]["val_loss"]),
      "qat_beats_ptq_in_llama_cpp": bool(e["q4_0_qat"]["val_loss"] < e["q4_0_ptq"]["val_loss"]),
      "llama_cpp_qat_recovery_of_ptq_degradation": edge.recovery(
          e["q4_0_ptq"]["val_loss"], e["q4_0_qat"]["val_loss"], e["f32"]["val_loss"]),
      # llama.cpp's validation loss against distillax's on the same tokens, per format
      "llama_cpp_f32_val_loss_diff": abs(e["f32"]["val_loss"] - s["student_kd_fp"]["val_loss"]),
      "llama_cpp_q4_0_ptq_val_loss_diff": abs(e["q4_0_ptq"]["val_loss"]
                                              - s["student_ptq_int4"]["val_loss"]),
      "llama_cpp_q4_0_qat_val_loss_diff": abs(e["q4_0_qat"]["val_loss"]
                                              - s["student_qat_int4"]["val_loss"]),
      "q4_0_gguf_max_abs_ce_sum_diff": export_diff,
      "greedy_tokens_agreeing": agreement,
      "greedy_agrees": bool(all(n == greedy_tokens for n in agreement)),
  }


def setup(d: DemoInputs) -> dict:
  """Where the numbers were measured: mesh, strategy, devices, validation tokens."""
  return {"mesh": pt.mesh_shape_str(d.mesh), "strategy": str(d.config.partitioning.strategy),
          "devices": jax.device_count(), "platform": jax.devices()[0].platform,
          "val_tokens": float(sum(np.sum(b[batch_spec.LOSS_MASK]) for b in d.batches))}


def measure_all(pipeline) -> dict:
  """Every section of the report, measured: setup, stages (the table's rows), edge (llama.cpp),
  checks and samples. Writes the exports under the demo workdir's export/."""
  d = load_inputs(pipeline)
  evals = evaluate_rows(d)
  sizes, paths = export_all(d, os.path.join(pipeline.workdir, "export"))
  stages = stage_rows(d, evals, sizes)
  op_paths = paths.pop("on_policy")  # the on-policy section's files, not edge rows
  edge_figures, agreement, export_diff = edge_rows(d, paths, evals["student_qat_int4"][1])
  models = row_models(d)
  task_rows(d, stages, models)
  op_rows = on_policy_rows(d, stages, op_paths, models)
  prog_rows = progressive_rows(d, stages, models)
  all_checks = checks(stages, edge_figures, export_diff, agreement,
                      int(d.config.edge_greedy_tokens))
  all_checks.update(on_policy.checks(op_rows))
  recoveries = seed_recoveries(d, stages)
  all_checks["qat_recovery_by_seed"] = recoveries
  all_checks["qat_recovery_mean"] = statistics.fmean(recoveries)
  all_checks["qat_recovery_sd"] = (statistics.stdev(recoveries) if len(recoveries) > 1
                                   else float("nan"))
  drafts = draft.measure(d.config, d.pipeline, d.tokenizer)
  return {"setup": setup(d), "stages": stages, "edge": edge_figures, "checks": all_checks,
          "samples": samples(d), "on_policy": op_rows, "progressive_qat": prog_rows,
          "draft": drafts}


__all__ = ["DemoInputs", "ROWS", "ROW_SOURCES", "measure_all", "top1_agreement"]
