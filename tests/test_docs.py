"""The documentation site (mkdocs.yml, docs/): it builds in strict mode, as `make docs` does (a
broken link, a missing page or an unresolved API reference fails the build); its generated
references hold every config field and CLI flag; the commands its pages print are ones a user
can run; and the pages carry no dates, load averages, commit hashes or issue numbers.

The guides' commands are run by the tests that run the config docstrings
(tests/test_docstring_commands.py, tests/test_walkthrough_hf.py, tests/test_configs.py): here
each guide is checked to print those very commands, and every `distillax` command on any page
is parsed as the CLI parses it (config file, flags and `--config.*` overrides), which runs
nothing.
"""

import dataclasses
import html.parser
import os
import re
import shlex
import urllib.parse
from pathlib import Path

import ml_collections
import pytest

from distillax.cli import flags
from distillax.configs import common, sections
from distillax.data import default_data_config
from distillax.framework.optim import default_optimizer_config
from distillax.main import _parse
from distillax.models.config import TransformerConfig
from tests.test_docstring_commands import ALL, docstring_commands

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))
# Guide -> the config modules whose docstring commands it must print, all of them.
GUIDE_COMMANDS = {
    "guides/distil-hf.md": ["distillax/configs/distill_hf.py"],
    "guides/distillation.md": ["distillax/configs/distill.py",
                               "distillax/configs/distill_features.py",
                               "distillax/configs/sequence_kd.py"],
    "guides/on-policy.md": ["distillax/configs/on_policy.py"],
    "guides/drafts.md": ["distillax/configs/draft_eagle3.py"],
    "guides/lora.md": ["distillax/configs/lora.py", "distillax/configs/qlora.py"],
    "guides/teacher-caches.md": ["distillax/configs/distill_cached.py"],
    "guides/multi-teacher.md": ["distillax/configs/distill_multi_teacher.py"],
    "guides/cross-tokenizer.md": ["distillax/configs/distill_cross_tokenizer.py"],
}
# Every guide prints at least one command that the docstring tests run or parse.
TESTED = {tuple(argv) for _, argv in ALL}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """The site built strictly into a temporary directory, as `make docs` builds it."""
  from mkdocs.commands.build import build
  from mkdocs.config import load_config

  os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
  out = tmp_path_factory.mktemp("site")
  build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(out), strict=True))
  return out


def _html(site, page: str) -> str:
  return (site / f"{page}.html").read_text()


def _section_fields() -> dict[str, list[str]]:
  """Every config field, dotted, by section: each function of configs/sections.py, the optimizer
  and data sections and the top level, enumerated from the running code."""
  def leaves(cfg, prefix):
    out = []
    for key, value in cfg.items():
      if isinstance(value, ml_collections.ConfigDict):
        out += leaves(value, f"{prefix}{key}.")
      else:
        out.append(f"{prefix}{key}")
    return out
  fields = {name.removesuffix("_section"): leaves(getattr(sections, name)(),
                                                  name.removesuffix("_section") + ".")
            for name in sections.__all__}
  fields["optimizer"] = leaves(default_optimizer_config(), "optimizer.")
  fields["data"] = leaves(default_data_config(), "data.")
  top = common.base_config()
  fields[""] = [k for k, v in top.items() if not isinstance(v, ml_collections.ConfigDict)]
  return fields


def test_site_builds_strictly_with_every_page(site):
  for page in ("guides/distil-hf", "guides/plan-target", "reference/api", "benchmarks/moe",
               "demo", "architecture"):
    assert (site / f"{page}.html").is_file(), page
  # mkdocstrings rendered the modules' docstrings: a class of each module is documented.
  api = _html(site, "reference/api")
  for name in ("LogitKD", "TransformerConfig", "build_engine"):
    assert f'id="distillax.' in api and name in api, name


def test_config_reference_lists_every_field_with_its_default_and_comment(site):
  from docs.gen import config_reference

  page = _html(site, "reference/config")
  rows = {m.group(1): m.group(2) for m in re.finditer(
      r"^\| `([\w.]+)` \| (.*) \|$", config_reference.render(), re.M)}
  for section, fields in _section_fields().items():
    assert fields, section
    for dotted in fields:
      assert f"<code>{dotted}</code>" in page, dotted
      # every job field has a default and its one-line comment (configs are data)
      default, _, comment = rows[dotted].rpartition(" | ")
      assert default.startswith(("`", "<code>")) and comment.strip(), (dotted, rows[dotted])
  for field in dataclasses.fields(TransformerConfig):
    assert f"<code>model.{field.name}</code>" in page, field.name
    kind = rows[f"model.{field.name}"].split(" | ")[0]
    assert kind == field.metadata.get("kind", "shape"), field.name
  assert rows["train.steps"].startswith("`200` | optimizer steps")  # sections.py, by hand
  # a field of a sub-section built in a loop
  assert rows["distill.attention.loss"].startswith("`'kl'` | kl \\| mse (attention)")
  # a job of several teachers: its own distill fields and the teachers list's entries
  for dotted in ("distill.teachers_mode", "distill.routes", "teachers[i].weight"):
    assert f"<code>{dotted}</code>" in page, dotted


def test_cli_reference_lists_every_command_and_flag(site):
  page = _html(site, "reference/cli")
  for command in flags.COMMANDS:
    assert f'id="{command}"' in page, command
    section = page[page.index(f'id="{command}"'):]
    following = [f'id="{c}"' for c in flags.COMMANDS if c != command and f'id="{c}"' in section]
    section = section[:min([section.index(f) for f in following], default=len(section))]
    for name in flags.COMMAND_FLAGS[command]:
      assert f"--{name}" in section, (command, name)
  for name, (_, _, _, help_text) in flags.FLAGS.items():
    assert f"--{name}" in page and help_text.split(" (")[0][:30] in page.replace("&#39;", "'"), \
        name


def _page_commands(page: Path) -> list[list[str]]:
  """argv of each `distillax ...` line of the page's ```bash blocks (continuations joined,
  comments dropped, shell variables set in the block expanded)."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
    env = {}
    for line in block.replace("\\\n", " ").splitlines():
      if re.match(r"^[A-Z_]+=", line):
        key, _, value = shlex.split(line, comments=True)[0].partition("=")
        env[key] = value
      elif line.startswith("distillax "):
        words = shlex.split(line, comments=True)
        out.append([re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words])
  return out


def test_every_guide_prints_commands_the_tests_run(monkeypatch, tmp_path):
  """Each command parses from a directory that mirrors the repository; each guide holds a
  command the docstring tests run, and the listed guides every command of their configs."""
  monkeypatch.chdir(tmp_path)
  os.symlink(ROOT / "distillax", tmp_path / "distillax")
  for page in PAGES:
    commands = _page_commands(page)
    name = str(page.relative_to(DOCS))
    for argv in commands:
      assert argv[1] in flags.COMMANDS, (name, argv)
      config, _ = _parse(argv[1], argv)
      assert config is not None or argv[1] in flags.CONFIG_OPTIONAL, (name, argv)
    if name.startswith("guides/"):
      assert any(tuple(argv) in TESTED for argv in commands), name
  for name, modules in GUIDE_COMMANDS.items():
    shown = {tuple(argv) for argv in _page_commands(DOCS / name)}
    for module in modules:
      for argv in docstring_commands(str(ROOT / module)):
        assert tuple(argv) in shown, (name, argv)


def test_pages_carry_no_dates_loads_hashes_or_issue_numbers():
  banned = re.compile(r"\b20\d\d-\d\d-\d\d\b|load average|\bload (of )?~?\d|\bcommit [0-9a-f]{7}"
                      r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\bissue \d+|#\d+\b")
  found = [(str(p.relative_to(DOCS)), m.group(0)) for p in PAGES
           for m in banned.finditer(p.read_text())]
  assert not found, found
  from docs.gen import results_pages
  # nor do the generated benchmark pages: load readings are left out of the JSON's tables
  for name, text in results_pages.benchmark_pages().items():
    assert "load_before" not in text and "load_average" not in text, name
    assert not banned.search(text), (name, banned.search(text).group(0))


def test_results_pages_say_whether_their_script_changed_since_it_wrote_them(tmp_path):
  """A results file records the SHA-256 of the script that wrote it (write_json's
  `provenance`); its page says the figures are current while the script is unchanged, stale
  once it has changed or when rows came from an older version, and never prints the hash. A
  file without the record is judged by git history (unchecked outside it)."""
  import json

  from benchmarks.lib import common
  from docs.gen import results_pages
  path = common.write_json(tmp_path, "step", {"rows": [{"preset": "dp", "ms": 1.5}]},
                           script=ROOT / "benchmarks" / "step.py")
  data = json.loads(path.read_text())
  assert data["provenance"] == {"script": "benchmarks/step.py", "script_sha256": (
      common.script_sha256(ROOT / "benchmarks" / "step.py"))}
  page = results_pages.render_results(path, "q")
  assert "Written by `benchmarks/step.py` as it is now." in page
  assert data["provenance"]["script_sha256"] not in page and "provenance" not in page
  for change, says in (({"script_sha256": "0" * 64}, "**Stale:** `benchmarks/step.py` has "
                        "changed since it wrote these figures; rerun `python benchmarks/step.py`"),
                       ({"script": "benchmarks/gone.py"}, "**Stale:** `benchmarks/gone.py`, "
                        "which wrote these figures, no longer exists.")):
    path.write_text(json.dumps({**data, "provenance": {**data["provenance"], **change}}))
    assert says in results_pages.render_results(path, "q")
  path.write_text(json.dumps({**data, "rows": [{"ms": 1.0}, {"ms": 2.0, "stale": True}]}))
  assert results_pages.freshness(path, json.loads(path.read_text()))[0] == "stale"
  path.write_text(json.dumps({"rows": data["rows"]}))  # no record, and no git history of it
  assert results_pages.freshness(path, json.loads(path.read_text()))[0] == "unchecked"
  assert results_pages.script_of("peft_100m_remat_full.json") == "benchmarks/peft.py"


class _Links(html.parser.HTMLParser):
  def __init__(self):
    super().__init__()
    self.links = []

  def handle_starttag(self, tag, attrs):
    for name, value in attrs:
      if name in ("href", "src") and value:
        self.links.append(value)


def test_every_link_opens_a_file_from_disk(site):
  """Opened as the README says (site/index.html over file://), every page's links, the nav's
  among them, name files: a link to a directory would show its listing."""
  pages = sorted(site.rglob("*.html"))
  followed = 0
  for page in pages:
    if page.name == "404.html":  # served by a web server only, from the site's root
      continue
    parser = _Links()
    parser.feed(page.read_text())
    for link in parser.links:
      target = urllib.parse.urlsplit(link)
      if target.scheme or target.netloc or not target.path:  # external, or an anchor here
        continue
      path = (page.parent / urllib.parse.unquote(target.path)).resolve()
      assert path.is_file(), (str(page.relative_to(site)), link)
      followed += 1
  index = _Links()
  index.feed((site / "index.html").read_text())
  for page in ("reference/config.html", "benchmarks/plan_targets.html", "guides/on-policy.html"):
    assert page in index.links, page  # the nav reaches the generated pages and the guides
  assert followed > 20 * len(pages), followed


def _table_cells(markdown: str):
  for line in markdown.splitlines():
    if line.startswith("|") and not line.startswith("|---"):
      yield from (c.strip() for c in line.strip().strip("|").split(" | "))


def test_benchmark_pages_hold_no_json_and_no_cut_cells():
  from docs.gen import results_pages
  pages = {**results_pages.benchmark_pages(), "demo.md": results_pages.demo_page()}
  link = re.compile(r"^\[[^\]]+\]\([^)]+\)$")
  for name, text in pages.items():
    for cell in _table_cells(text):
      assert not cell.endswith("…"), (name, cell[-80:])
      assert not cell.startswith("{") and not (cell.startswith("[") and not link.match(cell)), (
          name, cell[:80])


def test_nested_results_become_tables_of_their_own(tmp_path):
  """A row's record, its mapping of records and its list of records each get a table, led by
  the columns that name the row; lists of numbers are written out. Expected lines by hand."""
  import json

  from docs.gen import results_pages
  rows = [{"model": "a", "devices": 2, "step_s": 0.5, "step_s_all": [0.5, 0.25],
           "memory": {"temp": 1536, "args": 2.5},
           "collectives": {"all-gather": {"count": 3, "bytes": 64.0},
                           "all-reduce": {"count": 1, "bytes": 8.0}},
           "checks": [{"check": "dp bytes", "ok": True}]},
          {"model": "a", "devices": 4, "step_s": 0.25, "step_s_all": [0.25],
           "memory": {"temp": 768, "args": 2.5}, "collectives": {}, "checks": []}]
  path = tmp_path / "nested.json"
  path.write_text(json.dumps({"settings": {"batch": 8}, "rows": rows}))
  page = results_pages.render_results(path, "q")
  for expected in ("| settings.batch | 8 |",
                   "## rows", "| model | devices | step_s | step_s_all |",
                   "| a | 2 | 0.5 | 0.5, 0.25 |", "| a | 4 | 0.25 | 0.25 |",
                   "### rows.memory", "| model | devices | temp | args |",
                   "| a | 2 | 1536 | 2.5 |", "| a | 4 | 768 | 2.5 |",
                   "### rows.collectives", "| model | devices | collectives | count | bytes |",
                   "| a | 2 | all-gather | 3 | 64 |", "| a | 2 | all-reduce | 1 | 8 |",
                   "### rows.checks", "| model | devices | checks # | check | ok |",
                   "| a | 2 | 0 | dp bytes | True |"):
    assert expected in page.splitlines(), (expected, page)


def test_accelerator_page_shows_a_chips_figures_or_says_there_are_none(tmp_path):
  """The committed file's figures are shown only if they come from a chip at full size; a
  report in accelerator.py's format built from the TPU v5e lever rows in benchmarks/results/tpu
  is shown in accelerator_table's form."""
  import json

  from benchmarks.lib import accelerator_table
  from docs.gen import accelerator_page, results_pages
  committed = json.loads(results_pages.ACCELERATOR.read_text()) if (
      results_pages.ACCELERATOR.exists()) else None
  page = results_pages.benchmark_pages()["benchmarks/accelerator.md"]
  if accelerator_page.chip_of(committed) is None:
    assert "**No chip run is committed.**" in page and "|" not in page, page
  else:
    assert accelerator_page.chip_of(committed) in page.splitlines()[0]
  levers = [json.loads(line) for line in (results_pages.RESULTS / "tpu" / "levers_call1.jsonl")
            .read_text().splitlines()]
  ran = [r for r in levers if r.get("status") == "ok" and r["row"].startswith("train:")][:2]
  assert ran, "no TPU lever row ran"
  payload = {"benchmark": "accelerator", "quick": False, "status": "done",
             "probe": next(r for r in levers if r.get("row") == "probe"),
             "rows": [{"name": "train", "pair": "real", "question": "the train step",
                       "candidates": ran, "best": max(ran, key=lambda r: r["tokens_per_s"])},
                      {"name": "kd", "pair": "real", "question": "KD", "candidates": [],
                       "best": None}]}
  path = tmp_path / "accelerator.json"
  path.write_text(json.dumps(payload))
  chip_page = accelerator_page.render(path, "q", "current")
  assert chip_page.startswith("# accelerator: one TPU v5 lite"), chip_page[:80]
  best = payload["rows"][0]["best"]
  assert f"{best['tokens_per_s']:,.0f}" in chip_page and accelerator_table._ms(best["step_s"]) \
      in chip_page and "No candidate ran for: kd." in chip_page
  path.write_text(json.dumps({**payload, "quick": True}))  # a chip's seconds-long check
  assert "No chip run is committed" in accelerator_page.render(path, "q", "current")


def test_config_reference_covers_every_trainer_and_every_section(monkeypatch):
  """Every registered recipe has its line in the trainers table, and every section and field of
  every config the docstring commands load (the demo's, a job of its own, aside) is listed."""
  from docs.gen import config_reference
  from distillax.trainers import registry

  page = config_reference.render()
  trainers = page[page.index("## Trainers"):]
  assert len(registry.registered()) >= 9
  for name in registry.registered():
    assert f"| `{name}` | " in trainers, name
  monkeypatch.chdir(ROOT)
  seen = set()
  for _, argv in ALL:
    if "--config" not in argv:
      continue
    config, _ = _parse(argv[1], argv)
    if config.get("job") == "demo":
      continue
    for key, value in config.items():
      if isinstance(value, ml_collections.ConfigDict):
        seen.add(key)
        assert f"## `{key}`" in page, (argv, key)
        if key != "model":  # model: TransformerConfig's fields, checked above
          for dotted in config_reference.flatten(value, f"{key}."):
            assert f"`{dotted}`" in page, (argv, dotted)
  assert "on_policy" in seen


def test_every_command_of_a_fixed_mesh_names_its_devices(monkeypatch, tmp_path):
  """A command whose config fixes a mesh of N > 1 devices (data x model, no -1 to fill) runs as
  printed on a one-device CPU host only with `--devices N`; every page and config docstring
  prints it so (distill_deepseek.py:tiny and distill_moe.py:tiny,qwen35 once did not). A
  --target compile has the target's devices."""
  monkeypatch.chdir(tmp_path)
  os.symlink(ROOT / "distillax", tmp_path / "distillax")
  commands = [(str(p.relative_to(DOCS)), argv) for p in PAGES for argv in _page_commands(p)]
  missing, checked = [], 0
  for where, argv in commands + ALL:
    if argv[1] not in flags.COMMANDS or "--target" in argv:
      continue
    config, given = _parse(argv[1], argv)
    if config is None or "mesh" not in config:
      continue
    data, model = int(config.mesh.data), int(config.mesh.model)
    devices = given["devices"].value if "devices" in given else None
    if data > 0 and model > 0 and data * model > 1:
      checked += 1
      if devices != data * model:
        missing.append(f"{where}: {' '.join(argv)} (mesh {data}x{model})")
  assert checked >= 4 and not missing, "\n".join(missing)
