"""The demo's progressive-against-direct QAT comparison.

Two q4_0 students take the same `qat_steps` from the distilled student: `student_qat_int4`
rounds to q4_0 from its first step; `student_qat_progressive` steps the bit-width down
(`progressive_qat`, a qat.schedule: full precision, then int8 weights, then the same q4_0 /
q8_0 rules). Each is judged against the full-precision twin that took the same steps
(`student_kd_fp`) in the quantization-fidelity figures of `distillax eval --against`
(eval.against.fidelity_over: KL to the twin, same top-1, top-p agreement, perplexity ratio) over
the report's validation batches, with the fake quantization made real (the deployed weights),
and by its recovery of the PTQ degradation, (PTQ - QAT) / (PTQ - fp), on the same tokens.
"""

from __future__ import annotations

from distillax import partitioning as pt
from distillax.demo import edge
from distillax.demo.markdown import table_lines
from distillax.eval.against import TOP_P, fidelity_over

ROWS = ("student_qat_int4", "student_qat_progressive")
LABELS = {"student_qat_int4": "direct: q4_0 from the first step",
          "student_qat_progressive": "progressive: fp, int8, then q4_0"}


def measure(models: dict, twin, batches, mesh, rules, val_losses: dict[str, float],
            ptq_loss: float, fp_loss: float) -> dict:
  """Each row's fidelity to `twin`, its validation loss and its recovery of PTQ's loss."""
  out = {}
  for row in ROWS:
    with pt.use_rules(mesh, rules):
      figures = fidelity_over(models[row], twin, batches)
    out[row] = {**figures, "val_loss": val_losses[row],
                "recovery": edge.recovery(ptq_loss, val_losses[row], fp_loss)}
  return out


def _percent(share: float) -> str:
  """A share as a percentage; '-' when there is none (PTQ costing nothing leaves no ratio)."""
  return "-" if share != share else f"{100 * share:.1f}%"


def markdown(rows: dict, c) -> list[str]:
  """report.md's progressive-QAT section."""
  first, second = (int(step) for step, _ in c.progressive_qat)
  head = ("q4_0 student", "val loss", "recovery of PTQ's loss", "KL to fp twin mean / p99 / max",
          "same top-1", f"top-1 in fp top-p {TOP_P:g}", "perplexity ratio")
  cells = [(LABELS[row], f"{r['val_loss']:.4f}", _percent(r["recovery"]),
            f"{r['kl_mean']:.4f} / {r['kl_p99']:.4f} / {r['kl_max']:.3f}",
            f"{100 * r['same_top1']:.2f}%", f"{100 * r[f'in_top_p{TOP_P:g}']:.2f}%",
            f"{r['perplexity_ratio']:.4f}") for row, r in rows.items()]
  return ["## Progressive against direct QAT", "",
          f"Both take the same {int(c.qat_steps)} steps from the distilled student; the "
          f"progressive one trains in full precision until step {first}, with int8 weights "
          f"until step {second}, then with the direct one's q4_0 weights / q8_0 activations. "
          f"Each is compared with the full-precision student that took the same steps, over "
          f"the table's validation tokens, its fake quantization made real (the deployed "
          f"weights).", "", *table_lines(head, cells), ""]


__all__ = ["LABELS", "ROWS", "markdown", "measure"]
