"""The demo's last stage: the students as GGUF files, judged by llama.cpp on this CPU.

The full-precision twin (`student_kd_fp`) is written as f32, f16 and q8_0 / q4_0 PTQ (its
weights rounded at export), the QAT student as q4_0 with the rules it trained with (llama.cpp's
q4_0 weights, q8_0 activations); each file then runs in its own child process
(edge/measurements.file_figures): validation loss over exactly the tokens distillax's
rows use (every packed segment evaluated from position 0, as its positions restart there),
file bytes, prompt and decode tokens/s, peak RSS of that process. Greedy continuations of the
QAT student in llama.cpp are compared token for token with distillax's own.
"""

from __future__ import annotations

import os

from distillax.data import batch as batch_spec
from distillax.demo.markdown import table_lines
from distillax.edge import measurements
from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import write_gguf
# The report (demo/measure.py) reads these through this module; they are distillax.edge's.
from distillax.edge.measurements import greedy_agreement, max_segment_diff, segments  # noqa: F401

Q8_0_RULES = (("", None, None, None), (".*", "q8_0", "q8_0", None))
# row -> (trained stage it exports, GGUF type, rules: None = the demo's, () = none needed)
EDGE_ROWS = {"f32": ("student_kd_fp", "f32", ()), "f16": ("student_kd_fp", "f16", ()),
             "q8_0_ptq": ("student_kd_fp", "q8_0", Q8_0_RULES),
             "q4_0_ptq": ("student_kd_fp", "q4_0", None),
             "q4_0_qat": ("student_qat_int4", "q4_0", None)}
# The rows above are the judge: llama.cpp's reference kernels (forced on every CPU) and a float32
# KV cache, so they measure the formats' rounding alone. The deployed row runs the QAT file as a
# device runs it by default: the kernels llama.cpp picks for this CPU and a float16 KV cache.
DEPLOYED_ROW = "q4_0_qat_deployed"
EDGE_LABELS = {"f32": "f32 (distilled + fp steps)", "f16": "f16", "q8_0_ptq": "q8_0 PTQ",
               "q4_0_ptq": "q4_0 PTQ", "q4_0_qat": "q4_0 QAT",
               DEPLOYED_ROW: "q4_0 QAT, deployment default"}


def export_gguf(plain: dict, demo_rules, tokenizer, add_bos: bool, export_dir: str) -> dict:
  """Writes every edge row's GGUF file under `export_dir`; returns {row: path}."""
  paths = {}
  for row, (stage, quant, rules) in EDGE_ROWS.items():
    path = os.path.join(export_dir, f"{stage}-{quant}.gguf")
    write_gguf(plain[stage], path, quant=quant, tokenizer=tokenizer, add_bos=add_bos,
               rules=demo_rules if rules is None else (rules or None))
    paths[row] = path
  return paths


def speed_tokens(batches, decode_tokens: int) -> dict:
  """The timed prompt (one full validation row) and decode tokens (the next row's first)."""
  inputs = batches[0][batch_spec.INPUTS]
  return {"prompt": inputs[0].tolist(), "decode": inputs[1 % len(inputs)][:decode_tokens].tolist()}


def measure(paths: dict, segs, speed: dict, greedy_prompts, greedy_tokens: int,
            n_threads: int | None, vocab_limit: int | None = None) -> dict:
  """Each row's llama.cpp figures (measurements.file_figures: one child process per file):
  val_loss / val_perplexity over the segments, bytes, tokens/s, memory, and the kernel path and
  KV cache behind them; the QAT row's per-segment CE sums and greedy. With a q4_0_qat file,
  also the deployed row. vocab_limit: the tokenizer's size (the losses' softmax is over its ids,
  as distillax's: the files hold unused tokens past them)."""
  rows = {}
  # (row, the EDGE_ROWS entry whose file it runs, kernel path, float32 KV cache)
  runs = [(row, row, "reference", True) for row in paths]
  if "q4_0_qat" in paths:
    runs.append((DEPLOYED_ROW, "q4_0_qat", gguf_runtime.deployment_kernels(), False))
  for row, source, kernels, exact_cache in runs:
    qat = row == "q4_0_qat"
    figures = measurements.file_figures(
        paths[source], segs, speed, n_threads=n_threads, kernels=kernels,
        exact_cache=exact_cache, greedy_prompts=greedy_prompts if qat else (),
        greedy_tokens=greedy_tokens, vocab_limit=vocab_limit)
    segment_nll, greedy = figures.pop("segment_nll"), figures.pop("greedy")
    rows[row] = {"format": EDGE_ROWS[source][1], "source_stage": EDGE_ROWS[source][0],
                 **figures}
    if qat:
      rows[row]["greedy"], rows[row]["segment_nll"] = greedy, segment_nll
  return rows


def recovery(ptq: float, qat: float, full: float) -> float:
  """(PTQ - QAT) / (PTQ - full precision); NaN when PTQ costs nothing (no ratio to state)."""
  return (ptq - qat) / (ptq - full) if ptq - full > 0 else float("nan")


def table(rows: dict) -> str:
  """The edge rows as a markdown table."""
  head = ("llama.cpp (this CPU)", "kernels, KV cache", "val loss", "val ppl", "file",
          "prompt tok/s", "decode tok/s", "peak RSS")
  cells = [(EDGE_LABELS[name], f"{r['kernels']}, {r['kv_cache']}", f"{r['val_loss']:.4f}",
            f"{r['val_perplexity']:.3f}", f"{r['file_bytes'] / 2**20:.3f} MiB",
            f"{r['prompt_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.0f}",
            f"{r['peak_rss_bytes'] / 2**20:.1f} MiB") for name, r in rows.items()]
  return "\n".join(table_lines(head, cells))


def plot(rows: dict, path: str) -> None:
  """Size against quality, both measured in llama.cpp: file MiB vs validation loss per format,
  with decode tokens/s in the labels."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, r in rows.items():
    x, y = r["file_bytes"] / 2**20, r["val_loss"]
    ax.scatter([x], [y], s=40, marker="*" if name == "q4_0_qat" else "o")
    ax.annotate(f"{EDGE_LABELS[name]}\n{r['decode_tokens_per_s']:,.0f} tok/s decode", (x, y),
                textcoords="offset points", xytext=(6, 4), fontsize=8)
  ax.set_xlabel("GGUF file size (MiB)")
  ax.set_ylabel("validation loss in llama.cpp (nats/token)")
  ax.set_title("distillax demo on the edge: size vs quality (llama.cpp, this CPU)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
