"""The demo's report: every model evaluated on the same validation batches, exported, sampled,
and the students judged again by llama.cpp (demo/edge.py).

Two halves: demo/measure.py measures every section (each row through
`framework.evaluation.evaluate`, the route of the trainer and `distillax eval`, so a stage's
row is what `distillax eval --model <stage>` prints), demo/render.py writes them as report.md,
report.json and the plots. A new figure is a measured section plus its renderer.
"""

from __future__ import annotations

from distillax.demo import measure, render


def build_report(pipeline) -> dict:
  """Measures a finished demo (evaluations, exports under export/, llama.cpp, samples), writes
  report.md, report.json, loss_curves.png and edge_size_quality.png into its workdir, prints
  report.md; returns the sections (setup, stages, edge, checks, samples)."""
  sections = measure.measure_all(pipeline)
  print("\n" + render.write_report(pipeline, sections))
  return sections
