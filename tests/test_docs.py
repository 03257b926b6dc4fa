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
import os
import re
import shlex
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
  return (site / page / "index.html").read_text()


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
    assert (site / page / "index.html").exists(), page
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
