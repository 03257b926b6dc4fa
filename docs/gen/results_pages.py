"""Benchmark and demo pages, rendered from the JSON the benchmark scripts (and the demo) wrote,
so that no figure on the site is copied by hand: each `benchmarks/results/*.json` becomes one
page of tables, introduced by the question its script answers (benchmarks/README.md's table).

The renderer is generic (results_tables.py): scalar settings become one key/value table, every
list or mapping of records (`rows`, `checks`, `layer.rows`, ...) a table of its own, and records
nested in them tables of their own again; no cell holds JSON. Host load readings are
measurement context, not results, and are left out.

Each page says whether its figures are what the script measures as it is now (`freshness`): a
results file records the SHA-256 of the script that wrote it (`provenance`,
benchmarks/lib/common.py's write_json), compared here with the script's text when the site is
built; a file that records none (written before scripts recorded it, or by a script that writes
its own JSON) is compared by git history instead: it is stale when its script was committed
after it. A stale page says so above its tables, and the index says which pages are.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

from docs.gen import accelerator_page, results_tables

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# Where a committed report.json of `make demo` would live, and its report.md beside it.
DEMO_REPORT = RESULTS / "demo_report.json"
DEMO_REPORT_MD = RESULTS / "demo_report.md"
# One chip's figures (benchmarks/accelerator.py): its own page, present even without the file.
ACCELERATOR = RESULTS / "accelerator.json"


def questions() -> dict[str, str]:
  """results file name -> the question its script answers (benchmarks/README.md)."""
  out = {}
  for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
    m = re.match(r"\| `python benchmarks/(\w+)\.py` \| (.+) \| (.+) \|$", line)
    if m:
      for name in re.findall(r"`([\w.]+\.json)`", m.group(3)):
        out[name] = f"`benchmarks/{m.group(1)}.py`: {m.group(2)}"
  return out


def script_of(name: str) -> str | None:
  """The script that writes results file `name` (benchmarks/README.md's table; a file named
  after its settings, peft_100m.json, by the longest script name it starts with)."""
  found = questions().get(name)
  if found:
    return re.match(r"`(benchmarks/\w+\.py)`", found).group(1)
  stem = Path(name).stem
  scripts = [p.stem for p in (ROOT / "benchmarks").glob("*.py") if stem.startswith(p.stem)]
  return f"benchmarks/{max(scripts, key=len)}.py" if scripts else None


def _committed_at(path: Path) -> int | None:
  """When `path` was last committed (seconds), or None without git history."""
  try:
    out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False).stdout.strip()
  except OSError:
    return None
  return int(out) if out.isdigit() else None


def freshness(path: Path, data: dict) -> tuple[str, str]:
  """('current' | 'stale' | 'unchecked', the sentence a page shows) for results file `path`."""
  prov = data.get("provenance") if isinstance(data, dict) else None
  script = prov["script"] if prov else script_of(path.name)
  if script is None:
    return "unchecked", "No script is known to write this file, so its figures are unchecked."
  rerun = f"rerun `python {script}` (with the settings shown below) to refresh them."
  if not (ROOT / script).exists():
    return "stale", f"**Stale:** `{script}`, which wrote these figures, no longer exists."
  if prov:
    now = hashlib.sha256((ROOT / script).read_bytes()).hexdigest()
    if now != prov["script_sha256"]:
      return "stale", (f"**Stale:** `{script}` has changed since it wrote these figures; {rerun}")
    old_rows = [r for r in data.get("rows", []) if isinstance(r, dict) and r.get("stale")]
    if old_rows:
      return "stale", (f"**Partly stale:** {len(old_rows)} row(s) marked `stale` were measured "
                       f"by an older `{script}`; {rerun}")
    return "current", f"Written by `{script}` as it is now."
  results_at, script_at = _committed_at(path), _committed_at(ROOT / script)
  if results_at is None or script_at is None:
    return "unchecked", (f"This file records no hash of `{script}` and git has no history of "
                         f"them here, so whether its figures are current is unchecked.")
  if script_at > results_at:
    return "stale", (f"**Stale:** `{script}` was changed after these figures were committed; "
                     f"{rerun}")
  return "current", f"`{script}` has not changed since these figures were committed."


def _text(value) -> str:
  return str(value).replace("|", "\\|").replace("\n", " ")


def render_results(path: Path, question: str) -> str:
  data = json.loads(path.read_text())
  _, status = freshness(path, data)
  lines = [f"# {path.stem}", "", question, "",
           f"Rendered from `benchmarks/results/{path.name}` when the site was built. {status}", ""]
  return "\n".join(lines + results_tables.sections(data, "", 2)) + "\n"


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
      "smallest settings. A page whose script changed after it wrote the figures is marked stale.",
      "", "| results | figures | question |", "|---|---|---|"]
  for path in sorted(set(RESULTS.glob("*.json")) | {ACCELERATOR}):
    if path == DEMO_REPORT:
      continue
    question = asked.get(path.name, "")
    data = json.loads(path.read_text()) if path.exists() else None
    state, status = freshness(path, data) if data is not None else ("no chip run", "")
    if path == ACCELERATOR:  # one chip's figures, or the statement that none are committed
      pages[f"benchmarks/{path.stem}.md"] = accelerator_page.render(path, question, status)
      state = state if accelerator_page.chip_of(data) else "no chip run"
    else:
      pages[f"benchmarks/{path.stem}.md"] = render_results(path, question)
    index.append(f"| [{path.stem}]({path.stem}.md) | {state} | {_text(question)} |")
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
                   + results_tables.sections(data, "", 2)) + "\n"
