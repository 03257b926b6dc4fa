"""Benchmark and demo pages, rendered from the JSON the benchmark scripts (and the demo) wrote,
so that no figure on the site is copied by hand: each `benchmarks/results/*.json` becomes one
page of tables, introduced by the question its script answers (benchmarks/README.md's table).

The renderer is generic: scalar settings become one key/value table, every list of records
(`rows`, `checks`, `layer.rows`, ...) a table of its own. Host load readings are measurement
context, not results, and are left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# Where a committed report.json of `make demo` would live, and its report.md beside it.
DEMO_REPORT = RESULTS / "demo_report.json"
DEMO_REPORT_MD = RESULTS / "demo_report.md"
_SKIPPED = re.compile(r"load")  # load_before, load_after, load_average: not results
_MAX_CELL = 80


def questions() -> dict[str, str]:
  """results file name -> the question its script answers (benchmarks/README.md)."""
  out = {}
  for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
    m = re.match(r"\| `python benchmarks/(\w+)\.py` \| (.+) \| (.+) \|$", line)
    if m:
      for name in re.findall(r"`([\w.]+\.json)`", m.group(3)):
        out[name] = f"`benchmarks/{m.group(1)}.py`: {m.group(2)}"
  return out


def _text(value) -> str:
  return str(value).replace("|", "\\|").replace("\n", " ")


def _cell(value) -> str:
  if isinstance(value, float):
    text = f"{value:.4g}"
  elif isinstance(value, (dict, list)):
    text = json.dumps(value, separators=(",", ":"))
  else:
    text = str(value)
  if len(text) > _MAX_CELL:
    text = text[:_MAX_CELL - 1] + "…"
  return text.replace("|", "\\|").replace("\n", " ")


def _records(value) -> bool:
  return isinstance(value, list) and value and all(isinstance(v, dict) for v in value)


def _table(rows: list[dict]) -> list[str]:
  columns = []
  for row in rows:
    columns += [k for k in row if k not in columns and not _SKIPPED.search(k)]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
  return lines + [""]


def _sections(data: dict, title: str, depth: int) -> list[str]:
  """A key/value table of the scalars (small dicts inlined), then each list of records and each
  nested section under its own heading."""
  scalars = {k: v for k, v in data.items() if not _records(v) and not (
      isinstance(v, dict) and any(_records(x) or isinstance(x, dict) for x in v.values()))
      and not _SKIPPED.search(k)}
  lines = []
  if scalars:
    lines += ["| setting | value |", "|---|---|"]
    for key, value in scalars.items():
      if isinstance(value, dict):  # a small record (machine, settings): one row per field
        lines += [f"| {key}.{k} | {_cell(v)} |" for k, v in value.items()
                  if not _SKIPPED.search(k)]
      else:
        lines.append(f"| {key} | {_cell(value)} |")
    lines.append("")
  for key, value in data.items():
    if _SKIPPED.search(key) or key in scalars:
      continue
    heading = "#" * min(depth, 6) + f" {title}{key}"
    if _records(value):
      lines += [heading, ""] + _table(value)
    elif isinstance(value, dict):
      lines += [heading, ""] + _sections(value, f"{title}{key}.", depth + 1)
  return lines


def render_results(path: Path, question: str) -> str:
  data = json.loads(path.read_text())
  lines = [f"# {path.stem}", "", question, "",
           f"Rendered from `benchmarks/results/{path.name}` when the site was built.", ""]
  return "\n".join(lines + _sections(data, "", 2)) + "\n"


def benchmark_pages() -> dict[str, str]:
  """Site path -> markdown: an index and one page per results file."""
  asked = questions()
  pages, index = {}, [
      "# Benchmarks", "",
      "Each script in `benchmarks/` answers one question, prints a table and writes JSON to "
      "`benchmarks/results/`. The pages below are rendered from those files when the site is "
      "built: re-run a script and rebuild the site to update its page. Figures measured on a "
      "small shared CPU host with simulated devices compare paths with each other; they are not "
      "accelerator throughput. Run a script with `--help` for its flags and `--quick` for its "
      "smallest settings.", "", "| results | question |", "|---|---|"]
  for path in sorted(RESULTS.glob("*.json")):
    if path == DEMO_REPORT:
      continue
    question = asked.get(path.name, "")
    pages[f"benchmarks/{path.stem}.md"] = render_results(path, question)
    index.append(f"| [{path.stem}]({path.stem}.md) | {_text(question)} |")
  pages["benchmarks/index.md"] = "\n".join(index) + "\n"
  return pages


def demo_page() -> str:
  lines = ["# The demo's report", "",
           "`make demo` (`distillax demo --config distillax/configs/demo.py --workdir runs/demo "
           "--devices 8`) trains a teacher, a student from scratch and a distilled one, then "
           "PTQ, QAT and on-policy variants of the distilled student, exports them to GGUF and "
           "measures each in distillax and in llama.cpp. It writes `report.md`, `report.json` "
           "and plots into its workdir.", ""]
  if not DEMO_REPORT.exists():
    return "\n".join(lines + [
        "No demo report is committed to the repository, so this page shows no figures: run "
        "`make demo` and read `runs/demo/report.md`. Copying a run's `report.json` to "
        "`benchmarks/results/demo_report.json` renders it here.", ""])
  if DEMO_REPORT_MD.exists():  # the run's own report.md, its title dropped for this page's
    body = DEMO_REPORT_MD.read_text().split("\n", 1)[1]
    return "\n".join(lines + ["The committed run's `report.md` (`benchmarks/results/"
                               "demo_report.md`; its numbers are in `demo_report.json`):", "",
                               body])
  data = json.loads(DEMO_REPORT.read_text())
  return "\n".join(lines + ["Rendered from `benchmarks/results/demo_report.json`.", ""]
                   + _sections(data, "", 2)) + "\n"
