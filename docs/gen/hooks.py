"""mkdocs hook: adds the generated pages (config and CLI references, benchmark and demo pages)
to the site at build time, in memory, so a fresh clone builds the whole site with one command
(`make docs`) and nothing generated is committed or written into docs/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File  # noqa: E402

from docs.gen import cli_reference, config_reference, results_pages  # noqa: E402


def generated_pages() -> dict[str, str]:
  """Site path -> markdown of every generated page."""
  pages = {"reference/config.md": config_reference.render(),
           "reference/cli.md": cli_reference.render(),
           "demo.md": results_pages.demo_page()}
  pages.update(results_pages.benchmark_pages())
  return pages


def on_config(config):
  """Lists every results page under the nav's Benchmarks entry, one per results file."""
  for entry in config["nav"] or []:
    if isinstance(entry, dict) and "Benchmarks" in entry:
      entry["Benchmarks"] += [{name.removeprefix("benchmarks/").removesuffix(".md"): name}
                              for name in sorted(results_pages.benchmark_pages())
                              if name != "benchmarks/index.md"]
  return config


def on_files(files, config):
  for path, text in generated_pages().items():
    files.append(File.generated(config, path, content=text))
  return files
