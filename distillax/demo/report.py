"""The demo's report: every model evaluated on the same validation batches, exported, sampled,
and the students judged again by llama.cpp (demo/edge.py).

Numbers come from one evaluation pass per model over identical batches (next-token CE on the
validation split, and top-1 agreement with the teacher), so the rows are comparable; speed and
MFU come from each stage's own metrics.jsonl. The quantized rows use llama.cpp's q4_0 weights
and q8_0 activations (distillax's fake-quant forward rounds as its CPU kernels do), so the same
students exported as GGUF give llama.cpp's own validation loss, bytes, tokens/s and memory.
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
from distillax.demo import edge
from distillax.demo import on_policy
from distillax.demo.stages import TRAINED_STAGES
from distillax.framework import jsonio, losses
from distillax.framework.backends import global_batch_placer
from distillax.framework.writers import read_jsonl
from distillax.models import hf
from distillax.trainers import load_trained_model

LABELS = {"teacher": "teacher", "student_scratch": "student, from scratch",
          "student_kd": "student, distilled",
          "student_kd_fp": "student, distilled + extra fp steps",
          "student_ptq_int4": "  ... + PTQ q4_0",
          "student_qat_int4": "student, distilled + QAT q4_0 (same extra steps)",
          "student_onpolicy": "student, distilled + on-policy (same extra steps)",
          "student_qad_q4_0": "student, distilled + on-policy QAD q4_0 (same extra steps)"}
ROWS = ("teacher", "student_scratch", "student_kd", "student_kd_fp", "student_ptq_int4",
        "student_qat_int4", *on_policy.STAGES)
# Stages that continue student_kd (their curves start at its last step).
CONTINUING = ("student_kd_fp", "student_qat_int4", *on_policy.STAGES)


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
    if stage in CONTINUING:
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


def _samples(models: dict, tokenizer, mesh, rules, prompts, max_new_tokens: int) -> dict:
  from distillax.models.sampler import generate
  prompt, lengths, _ = _prompt_batch(tokenizer, mesh, prompts)
  out = {}
  for name, model in models.items():
    gen = generate(model, prompt, lengths, mesh=mesh, rules=rules, max_new_tokens=max_new_tokens,
                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, temperature=0.7, top_p=0.9,
                   seed=0)
    tokens, n = np.asarray(gen.tokens_BxT), np.asarray(gen.lengths_B)
    out[name] = [p + tokenizer.decode([int(t) for t in tokens[i, :n[i]]])
                 for i, p in enumerate(prompts)]
  return out


def _greedy(model, tokenizer, mesh, rules, prompts, max_new_tokens: int):
  """(each prompt's ids, distillax's greedy continuation of each, not stopped at EOS): what
  llama.cpp's greedy decode of the same file must reproduce."""
  from distillax.models.sampler import generate
  prompt, lengths, encoded = _prompt_batch(tokenizer, mesh, prompts)
  gen = generate(model, prompt, lengths, mesh=mesh, rules=rules, max_new_tokens=max_new_tokens,
                 eos_id=None, pad_id=tokenizer.pad_id, temperature=0.0)
  tokens = np.asarray(gen.tokens_BxT)
  return encoded, [tokens[i, :max_new_tokens].tolist() for i in range(len(encoded))]


def _placed_eval_batches(c, mesh, rules, tokenizer):
  """The report's validation batches placed on the mesh, one row of inputs that PTQ calibrates
  on, and the batches on the host (llama.cpp evaluates the same tokens)."""
  batches = list(make_eval_iterator(c.data, global_batch_size=int(c.train.batch_size),
                                    seq_len=int(c.train.seq_len),
                                    num_batches=int(c.report_eval_batches), tokenizer=tokenizer))
  place = global_batch_placer(mesh, rules)
  placed = [place(b) for b in batches]
  sample = jnp.asarray(batches[0][losses.BATCH_INPUTS][:1])
  return placed, sample, batches


def _models_by_row(plain: dict, qcfg: dict, sample) -> dict:
  """Every row's model: the trained stages as they are, plus the q4_0 PTQ of the fp twin and
  the QAT student with its fake quantization made real (PTQ of QAT-trained weights)."""
  models = dict(plain)
  models["student_ptq_int4"] = quant.quantize_post_training(plain["student_kd_fp"], qcfg, sample)
  for row in ("student_qat_int4", "student_qad_q4_0"):
    models[row] = quant.quantize_post_training(plain[row], qcfg, sample)
  return models


def _export_all(c, plain: dict, tokenizer, export_dir: str) -> tuple[dict, dict]:
  """Writes every row's model under `export_dir` (fp32 HF checkpoints; GGUF files for llama.cpp,
  the PTQ and QAT rows as q4_0) and returns (each row's bytes on disk, {edge row: GGUF path}):
  the size column measures what was actually written."""
  sizes = {}
  for stage in ("teacher", "student_scratch", "student_kd", "student_kd_fp", "student_onpolicy"):
    path = os.path.join(export_dir, f"{stage}_fp32")
    hf.save(plain[stage], path)
    sizes[stage] = _dir_bytes(path)
  paths = edge.export_gguf(plain, tuple(c.quant_rules), tokenizer, bool(c.data.add_bos),
                           os.path.join(export_dir, "gguf"))
  sizes["student_ptq_int4"] = os.path.getsize(paths["q4_0_ptq"])
  sizes["student_qat_int4"] = os.path.getsize(paths["q4_0_qat"])
  paths["on_policy"] = on_policy.export_gguf(plain, tuple(c.quant_rules), tokenizer,
                                             bool(c.data.add_bos), os.path.join(export_dir, "gguf"))
  sizes["student_qad_q4_0"] = os.path.getsize(paths["on_policy"]["student_qad_q4_0"])
  return sizes, paths


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


def _checks(stages: dict, edge_rows: dict, export_diff: float, agreement: list[int],
            greedy_tokens: int) -> dict:
  """The claims the demo exists to show, as booleans and numbers the tests can read: QAT's
  recovery measured twice, in distillax's fake-quant forward and in llama.cpp's own."""
  s, e = stages, edge_rows
  return {
      "kd_beats_scratch": bool(s["student_kd"]["val_loss"] < s["student_scratch"]["val_loss"]),
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


def _recovery_words(recovery: float, where: str) -> str:
  """The recovery claim in words; without a PTQ degradation there is no ratio to state."""
  if not math.isfinite(recovery):
    return (f"{where}, PTQ q4_0 costs nothing (its loss is not above full precision's), so "
            f"there is nothing for QAT to recover")
  return (f"{where}, QAT recovers {recovery:.0%} of the degradation PTQ causes "
          f"((PTQ - QAT) / (PTQ - full precision))")


def _edge_markdown(checks: dict, edge_rows: dict, greedy_tokens: int) -> list[str]:
  """report.md's llama.cpp section: the table and what it shows."""
  e, n_threads = edge_rows, edge_rows["f32"]["n_threads"]
  return [
      "## On the edge: the students as GGUF files in llama.cpp", "",
      f"llama.cpp (llama-cpp-python) on this CPU ({e['f32']['system_info']}), threads: "
      f"{n_threads}, one child process per file. Every row but the last is the judge: "
      f"llama.cpp's reference kernels (forced on every CPU; quant/ggml.py models their "
      f"rounding) and a float32 KV cache. The last row runs the QAT file as a device does by "
      f"default: the '{e[edge.DEPLOYED_ROW]['kernels']}' kernels llama.cpp picks for this CPU "
      f"and a float16 KV cache. Validation loss over the same tokens as above; prompt: "
      f"{e['f32']['prompt_tokens']} tokens in one batch, decode: {e['f32']['decode_tokens']} "
      f"one-token steps (median of rounds); peak RSS: the process's own high-water mark "
      f"(Python, numpy and llama_cpp alone: "
      f"{e['f32']['rss_before_load_bytes'] / 2**20:.1f} MiB).", "",
      edge.table(e), "",
      f"- QAT q4_0 beats PTQ q4_0 in llama.cpp: {checks['qat_beats_ptq_in_llama_cpp']}; "
      f"{_recovery_words(checks['llama_cpp_qat_recovery_of_ptq_degradation'], 'in llama.cpp')}; "
      f"{_recovery_words(checks['qat_recovery_of_ptq_degradation'], 'in distillax')}",
      f"- llama.cpp's validation loss vs distillax's: f32 "
      f"{checks['llama_cpp_f32_val_loss_diff']:.1e}, q4_0 PTQ "
      f"{checks['llama_cpp_q4_0_ptq_val_loss_diff']:.1e}, q4_0 QAT "
      f"{checks['llama_cpp_q4_0_qat_val_loss_diff']:.1e} apart; q4_0 QAT file vs the fake-quant "
      f"forward, largest CE sum difference over one batch's sequences: "
      f"{checks['q4_0_gguf_max_abs_ce_sum_diff']:.2e}",
      f"- greedy decoding of the q4_0 QAT student, llama.cpp vs distillax: "
      f"{checks['greedy_tokens_agreeing']} of {greedy_tokens} tokens agree per prompt", ""]


def _report_markdown(c, mesh, stages: dict, checks: dict, edge_rows: dict,
                     samples: dict, on_policy_lines=()) -> str:
  """report.md: the setup, the table, the checks in words, the edge rows and the samples."""
  s = stages
  lines = [
      "# distillax demo report", "",
      f"Mesh {pt.mesh_shape_str(mesh)} (data x model), strategy {c.partitioning.strategy}, "
      f"{jax.device_count()} {jax.devices()[0].platform} devices; validation: "
      f"{int(s['teacher']['val_tokens'])} tokens of the held-out split, the same for every row. "
      f"q4_0: llama.cpp's blocks of 32 weights with an fp16 scale, matmul inputs rounded to "
      f"q8_0 as its CPU kernels do; PTQ / QAT sizes are the q4_0 GGUF files.",
      "", _format_table(stages), "",
      f"- distilled student beats scratch student: {checks['kd_beats_scratch']}",
      f"- QAT q4_0 beats PTQ q4_0: {checks['qat_beats_ptq']}; both start from the distilled "
      f"student and take the same {int(c.qat_steps)} extra steps; "
      f"{_recovery_words(checks['qat_recovery_of_ptq_degradation'], 'in distillax')}", "",
      *_edge_markdown(checks, edge_rows, int(c.edge_greedy_tokens)),
      *on_policy_lines,
      "## Samples (temperature 0.7, top-p 0.9, seed 0)", ""]
  for name, texts in samples.items():
    for t in texts:
      lines.append(f"- **{name}**: `{t!r}`")
  return "\n".join(lines) + "\n"


def _write_report(workdir: str, report_md: str, stages: dict, checks: dict, edge_rows: dict,
                  samples: dict, extra: dict | None = None) -> None:
  """report.md, and report.json with the stages at top level next to edge, checks, samples."""
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(report_md)
  # Strict JSON: a number that does not exist (PTQ's training speed, the recovery ratio when PTQ
  # costs nothing) is null, not NaN.
  with open(os.path.join(workdir, "report.json"), "w") as f:
    jsonio.dump({**stages, "edge": edge_rows, "checks": checks, "samples": samples,
                 **(extra or {})}, f, indent=2)


def _token_nll(model, batch, mesh, rules) -> np.ndarray:
  """distillax's per-token -log p(target) (B, L) of one placed batch, the log-softmax in
  float64 on the host as llama.cpp's side computes it."""
  graph, state = nnx.split(model)

  @jax.jit
  def batch_logits(state, batch):
    with pt.use_rules(mesh, rules):
      m = nnx.merge(graph, state)
      return m(batch[losses.BATCH_INPUTS], **losses.model_inputs(batch)).logits_BxLxV

  z = np.asarray(jax.device_get(batch_logits(state, batch)), np.float64)
  z -= z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  targets = np.asarray(jax.device_get(batch[losses.BATCH_TARGETS]))
  return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _edge_rows(c, paths: dict, batches, placed, models: dict, tokenizer, mesh, rules):
  """llama.cpp's figures of every GGUF file; how many greedy tokens of the q4_0 QAT file agree
  with distillax's greedy decoding of the QAT student; the largest |CE sum difference| of that
  file against the fake-quant forward over the first batch's sequences."""
  n = int(c.edge_greedy_tokens)
  prompts, ours = _greedy(models["student_qat_int4"], tokenizer, mesh, rules,
                          list(c.sample_prompts), n)
  segs = edge.segments(batches)
  rows = edge.measure(paths, segs, {**edge.speed_tokens(batches, int(c.edge_decode_tokens)),
                                    "rounds": int(c.edge_speed_rounds)},
                      prompts, n, int(c.edge_threads) or None)
  qat = rows["q4_0_qat"]
  diff = edge.max_segment_diff(segs, qat.pop("segment_nll"),
                               _token_nll(models["student_qat_int4"], placed[0], mesh, rules))
  return rows, edge.greedy_agreement(qat.pop("greedy"), ours), diff


def build_report(pipeline) -> dict:
  """Evaluates, exports and samples every stage of a finished demo, runs the exports in
  llama.cpp; writes report.md, report.json, loss_curves.png and edge_size_quality.png into its
  workdir; returns stages, edge rows, checks and samples."""
  c = pipeline.config
  workdir = pipeline.workdir
  mesh = pt.create_mesh(c.mesh)
  rules = pt.rules_from_config(c.partitioning)
  tokenizer = make_tokenizer(c.data.tokenizer)
  placed, sample, batches = _placed_eval_batches(c, mesh, rules, tokenizer)
  qcfg = {"rules": [tuple(r) for r in c.quant_rules]}

  plain = {s: load_trained_model(pipeline.stage_dir(s), mesh, rules) for s in TRAINED_STAGES}
  models = _models_by_row(plain, qcfg, sample)
  sizes, paths = _export_all(c, plain, tokenizer, os.path.join(workdir, "export"))
  op_paths = paths.pop("on_policy")  # the on-policy section's files, not edge rows
  evaluate = _evaluator(mesh, rules, plain["teacher"])
  stages = _stage_rows(pipeline, evaluate, models, plain, sizes, placed)
  edge_rows, agreement, export_diff = _edge_rows(c, paths, batches, placed, models, tokenizer,
                                                 mesh, rules)
  checks = _checks(stages, edge_rows, export_diff, agreement, int(c.edge_greedy_tokens))
  op_rows = on_policy.measure(c, plain, models, stages, tokenizer, mesh, rules, op_paths)
  checks.update(on_policy.checks(op_rows))
  _plot(pipeline, stages["student_ptq_int4"]["val_loss"], os.path.join(workdir, "loss_curves.png"))
  edge.plot(edge_rows, os.path.join(workdir, "edge_size_quality.png"))
  samples = _samples({"teacher": plain["teacher"], "student_scratch": plain["student_scratch"],
                      "student_kd": plain["student_kd"]}, tokenizer, mesh, rules,
                     list(c.sample_prompts), int(c.sample_tokens))
  report_md = _report_markdown(c, mesh, stages, checks, edge_rows, samples,
                               on_policy.markdown(op_rows, on_policy.checks(op_rows), c))
  _write_report(workdir, report_md, stages, checks, edge_rows, samples, {"on_policy": op_rows})
  print("\n" + report_md)
  return {"stages": stages, "edge": edge_rows, "checks": checks, "samples": samples,
          "on_policy": op_rows}
