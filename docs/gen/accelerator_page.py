"""The accelerator page: one chip's figures from `benchmarks/results/accelerator.json`, or a
plain statement that no chip run is committed.

benchmarks/accelerator.py answers "what do these steps reach on one chip". On a CPU (or with
--quick) it runs every row's code with the tiny pair at seconds-long sizes: a check of its
bookkeeping, not a chip's figures. So the page shows the file's tables only when the file says
it ran on a TPU or GPU at full size (its `probe`), in the script's own report form
(benchmarks/lib/accelerator_table.py: each row at its fastest candidate, then every candidate);
otherwise it says there is no chip run and how to make one, and shows no figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lib import accelerator_table
from docs.gen import results_tables

CHIPS = ("tpu", "gpu")
RERUN = ("Run `python benchmarks/accelerator.py --expect-tpu` (or `--expect-gpu`) on a machine "
         "with the chip, as [Running benchmarks](../running-benchmarks.md) describes, and commit "
         "the `accelerator.json` it writes to `benchmarks/results/` to fill this page.")


def chip_of(data: dict | None) -> str | None:
  """The chip a results file's figures come from ('TPU v5 lite', ...), None if not a chip's."""
  probe = (data or {}).get("probe")
  if not isinstance(probe, dict) or probe.get("backend") not in CHIPS or data.get("quick"):
    return None
  return str(probe.get("device_kind") or probe["backend"])


def _where(data: dict | None) -> str:
  if data is None:
    return "No `benchmarks/results/accelerator.json` is committed."
  probe = data.get("probe") if isinstance(data.get("probe"), dict) else {}
  machine = data.get("machine") or {}
  backend = probe.get("backend") or data.get("backend") or machine.get("platform") or "unknown"
  size = "quick sizes" if data.get("quick") or backend not in CHIPS else "full size"
  return (f"The committed `benchmarks/results/accelerator.json` was measured on {backend} "
          f"({size}): the tiny pair running every row's code at seconds-long sizes, a check of "
          f"the script's bookkeeping rather than a chip's figures, so none are shown here.")


def _table(rows: list[dict]) -> list[str]:
  header = [h for h, _ in accelerator_table.COLUMNS]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(results_tables.cell(str(f(r))) for _, f in accelerator_table.COLUMNS)
            + " |" for r in rows]
  return lines + [""]


def _chip_body(data: dict) -> list[str]:
  probe = data["probe"]
  lines = [f"- {results_tables.cell(line)}" for line in accelerator_table.probe_lines(probe)]
  best = [dict(r["best"], row=f"{r['name']} ({r['pair']})") for r in data["rows"] if r["best"]]
  lines += ["", "## Each row at its fastest candidate", ""] + _table(best)
  lines += ["| row | what it measures |", "|---|---|"]
  lines += [f"| {r['name']} | {results_tables.cell(r.get('question', ''))} |" for r in data["rows"]]
  lines.append("")
  missing = [r["name"] for r in data["rows"] if not r["best"]]
  if missing:
    lines += [f"No candidate ran for: {', '.join(missing)}.", ""]
  ratios = accelerator_table.ratio_lines(data)
  if ratios:
    lines += [line for ratio in ratios for line in (ratio, "")]
  candidates = [c for r in data["rows"] for c in r["candidates"]]
  lines += ["## Every candidate", ""] + _table(candidates)
  errors = [c for c in candidates if c.get("error")]
  lines += [f"- {c['status']} `{c['row']}`: {results_tables.cell(c['error'][:300])}"
            for c in errors] + ([""] if errors else [])
  return lines + ["MFU: model FLOPs (causal: half of each T x T attention product) over the "
                  "datasheet peak; compiled peak: arguments + temporaries + outputs - aliased.", ""]


def render(path: Path, question: str, status: str) -> str:
  """The page's markdown; `status`: the freshness sentence (results_pages.freshness)."""
  data = json.loads(path.read_text()) if path.exists() else None
  chip = chip_of(data)
  if chip is None:
    return "\n".join(["# accelerator: no chip run", "", question, "",
                      f"**No chip run is committed.** {_where(data)} {RERUN}", ""])
  return "\n".join([f"# accelerator: one {chip}", "", question, "",
                    f"Rendered from `benchmarks/results/{path.name}` when the site was built. "
                    f"{status}", ""] + _chip_body(data)) + "\n"
