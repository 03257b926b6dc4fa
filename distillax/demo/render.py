"""The demo's report as files: report.md (the tables and the claims in words), report.json (every
measured section) and the plots, from the sections demo/measure.py measured.

report.md is the concatenation of MARKDOWN_SECTIONS and the figures are FIGURES: each a small
function of (demo config, measured sections), so a new measurement shows up by adding its own
renderer to one of them; nothing here measures.
"""

from __future__ import annotations

import math
import os

from distillax.demo import draft, edge, on_policy, progressive
from distillax.demo.measure import ROWS
from distillax.demo.stages import TRAINED_STAGES
from distillax.demo.markdown import table_lines
from distillax import jsonio
from distillax.framework.run.writers import ROLLED_BACK, read_jsonl

LABELS = {"teacher": "teacher", "student_scratch": "student, from scratch",
          "student_kd": "student, distilled",
          "student_kd_fp": "student, distilled + extra fp steps",
          "student_ptq_int4": "  ... + PTQ q4_0",
          "student_qat_int4": "student, distilled + QAT q4_0 (same extra steps)",
          "student_qat_progressive": "student, distilled + progressive QAT (same extra steps)",
          "student_onpolicy": "student, distilled + on-policy (same extra steps)",
          "student_qad_q4_0": "student, distilled + on-policy QAD q4_0 (same extra steps)"}
# Stages that continue student_kd (their curves start at its last step).
CONTINUING = ("student_kd_fp", "student_qat_int4", "student_qat_progressive", *on_policy.STAGES)


def _next_token_loss(row: dict):
  """An eval row's next-token CE: eval_loss; rows written before eval_objective existed held
  a distillation objective there and the CE in eval_hard_ce."""
  return row["eval_loss"] if "eval_objective" in row else row.get("eval_hard_ce", row["eval_loss"])


def _curve(stage_dir: str):
  rows = read_jsonl(os.path.join(stage_dir, "metrics.jsonl"))
  # Rows a rollback abandoned are not the stage's curve.
  pts = [(r["step"], _next_token_loss(r)) for r in rows
         if "eval_loss" in r and not r.get(ROLLED_BACK)]
  pts = [p for p in pts if p[1] is not None]  # a diverged eval is null in strict JSON
  return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(pipeline, sections: dict, path: str) -> None:
  """Every trained stage's validation next-token loss against its step, and the PTQ level."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5))
  for stage in TRAINED_STAGES:
    xs, ys = _curve(pipeline.stage_dir(stage))
    if stage in CONTINUING:
      xs = [x + int(pipeline.config.student_steps) for x in xs]
    ax.plot(xs, ys, marker="o", markersize=3, label=LABELS[stage])
  ax.axhline(sections["stages"]["student_ptq_int4"]["val_loss"], color="gray", linestyle="--",
             label=LABELS["student_ptq_int4"])
  ax.set_xlabel("step (QAT and its fp twin continue the distilled student)")
  ax.set_ylabel("validation next-token loss (nats/token)")
  ax.set_title("distillax demo: validation curves")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_edge(pipeline, sections: dict, path: str) -> None:
  del pipeline
  edge.plot(sections["edge"], path)


# (file name in the demo workdir, renderer (pipeline, sections, path)).
FIGURES = (("loss_curves.png", plot_curves), ("edge_size_quality.png", plot_edge))


def _task_columns(stages: dict) -> list[str]:
  """The lm-eval metrics every row has (the BLEU / chrF columns come first, on their own)."""
  keys = [{k for k in s.get("tasks", {}) if k not in ("bleu", "chrf")
           and not k.endswith("_sample_len")} for s in stages.values()]
  return sorted(set.intersection(*keys)) if keys else []


def stage_table(stages: dict) -> str:
  """The rows as a markdown table."""
  tasks = _task_columns(stages)
  has_text = all("tasks" in s for s in stages.values())
  head = ("stage", "val loss", "val ppl", "top-1 agree",
          *(("BLEU", "chrF") if has_text else ()), *tasks, "params", "bytes on disk",
          "tokens/s", "MFU")
  rows = []
  for name in ROWS:
    s = stages[name]
    text = (f"{s['tasks']['bleu']:.2f}", f"{s['tasks']['chrf']:.2f}") if has_text else ()
    rows.append((LABELS[name], f"{s['val_loss']:.4f}", f"{s['val_perplexity']:.3f}",
                 f"{s['top1_agreement']:.3f}", *text,
                 *(f"{s['tasks'][k]:.3f}" for k in tasks), f"{s['params']:,}",
                 f"{s['bytes_on_disk'] / 2**20:.2f} MiB",
                 "-" if math.isnan(s["tokens_per_s"]) else f"{s['tokens_per_s']:.0f}",
                 "-" if math.isnan(s["mfu"]) else f"{s['mfu']:.2%}"))
  return "\n".join(table_lines(head, rows))


def _recovery_words(recovery: float, where: str) -> str:
  """The recovery claim in words; without a PTQ degradation there is no ratio to state."""
  if not math.isfinite(recovery):
    return (f"{where}, PTQ q4_0 costs nothing (its loss is not above full precision's), so "
            f"there is nothing for QAT to recover")
  return (f"{where}, QAT recovers {recovery:.0%} of the degradation PTQ causes "
          f"((PTQ - QAT) / (PTQ - full precision))")


def _text_eval_words(c) -> str:
  t = c.text_eval
  return (f"BLEU / chrF: sacreBLEU's corpus scores of greedy completions ({int(t.new_tokens)} "
          f"tokens) of {int(t.prompts)} held-out code prompts against what the documents say "
          f"next; {t.task}: lm-eval's own metrics of that local task (`distillax eval --tasks`); "
          f"quantized rows in their quantization made real.")


def _seed_words(checks: dict) -> str:
  """The recovery over the QAT seeds, when the demo trained more than one."""
  by_seed = checks.get("qat_recovery_by_seed", [])
  if len(by_seed) < 2 or not all(math.isfinite(r) for r in by_seed):
    return ""
  return (f"; over {len(by_seed)} seeds of QAT and its fp twin: "
          f"{', '.join(f'{r:.0%}' for r in by_seed)} (mean {checks['qat_recovery_mean']:.0%}, "
          f"sd {checks['qat_recovery_sd']:.0%})")


def _gap_words(share: float) -> str:
  if share != share:
    return "the teacher is not better than the scratch student here (no gap to close)"
  return f"distillation closes {share:.0%} of the scratch-to-teacher gap in validation loss"


def _stages_markdown(c, sections: dict) -> list[str]:
  """The setup, the table of rows and the distillation and QAT claims."""
  setup, checks = sections["setup"], sections["checks"]
  return [
      "# distillax demo report", "",
      f"Mesh {setup['mesh']} (data x model), strategy {setup['strategy']}, "
      f"{setup['devices']} {setup['platform']} devices; validation: "
      f"{int(setup['val_tokens'])} tokens of the held-out split, the same for every row "
      f"(each stage's `eval` in report.json is its evaluation on its own eval batches, what "
      f"`distillax eval --model <stage>` prints). "
      f"q4_0: llama.cpp's blocks of 32 weights with an fp16 scale, matmul inputs rounded to "
      f"q8_0 as its CPU kernels do; PTQ / QAT sizes are the q4_0 GGUF files. "
      f"{_text_eval_words(c)}",
      "", stage_table(sections["stages"]), "",
      f"- distilled student beats scratch student: {checks['kd_beats_scratch']}; "
      f"{_gap_words(checks['kd_share_of_gap_closed'])}",
      f"- QAT q4_0 beats PTQ q4_0: {checks['qat_beats_ptq']}; both start from the distilled "
      f"student and take the same {int(c.qat_steps)} extra steps; "
      f"{_recovery_words(checks['qat_recovery_of_ptq_degradation'], 'in distillax')}"
      f"{_seed_words(checks)}", ""]


def _edge_markdown(c, sections: dict) -> list[str]:
  """report.md's llama.cpp section: the table and what it shows."""
  checks, e = sections["checks"], sections["edge"]
  return [
      "## On the edge: the students as GGUF files in llama.cpp", "",
      f"llama.cpp (llama-cpp-python) on this CPU ({e['f32']['system_info']}), threads: "
      f"{e['f32']['n_threads']}, one child process per file. Every row but the last is the "
      f"judge: llama.cpp's reference kernels (forced on every CPU; quant/ggml.py models their "
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
      f"{checks['greedy_tokens_agreeing']} of {int(c.edge_greedy_tokens)} tokens agree per "
      f"prompt", ""]


def _samples_markdown(c, sections: dict) -> list[str]:
  del c
  lines = ["## Samples (temperature 0.7, top-p 0.9, seed 0)", ""]
  for name, texts in sections["samples"].items():
    lines += [f"- **{name}**: `{t!r}`" for t in texts]
  return lines


def _on_policy_markdown(c, sections: dict) -> list[str]:
  rows = sections["on_policy"]
  return on_policy.markdown(rows, on_policy.checks(rows), c)


def _progressive_markdown(c, sections: dict) -> list[str]:
  return progressive.markdown(sections["progressive_qat"], c)


def _draft_markdown(c, sections: dict) -> list[str]:
  return draft.markdown(sections["draft"], c)


# report.md, top to bottom: each renderer (demo config, sections) -> lines.
MARKDOWN_SECTIONS = (_stages_markdown, _edge_markdown, _progressive_markdown,
                     _on_policy_markdown, _draft_markdown, _samples_markdown)


def report_markdown(c, sections: dict) -> str:
  return "\n".join(line for render in MARKDOWN_SECTIONS for line in render(c, sections)) + "\n"


def report_json(sections: dict) -> dict:
  """report.json: the stages at top level (readers look rows up by stage name), next to every
  other section."""
  return {**sections["stages"], **{k: v for k, v in sections.items() if k != "stages"}}


def write_report(pipeline, sections: dict) -> str:
  """Writes report.md, report.json and the FIGURES into the demo workdir; returns report.md."""
  markdown = report_markdown(pipeline.config, sections)
  with open(os.path.join(pipeline.workdir, "report.md"), "w") as f:
    f.write(markdown)
  # Strict JSON: a number that does not exist (PTQ's training speed, the recovery ratio when PTQ
  # costs nothing) is null, not NaN.
  with open(os.path.join(pipeline.workdir, "report.json"), "w") as f:
    jsonio.dump(report_json(sections), f, indent=2)
  for name, plot in FIGURES:
    plot(pipeline, sections, os.path.join(pipeline.workdir, name))
  return markdown
