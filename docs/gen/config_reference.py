"""The config reference page: every field of every config section, its default and the comment
written beside it, and every TransformerConfig field with its kind. Generated at build time from
the code, so the page cannot fall behind it."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import importlib
import inspect
import pkgutil
import re
import shlex
import warnings
from pathlib import Path

import ml_collections

from distillax import configs as configs_package
from distillax import main
from distillax.configs import common, sections
from distillax.data import pipeline
from distillax.framework import optim
from distillax.models import config as model_config
from distillax.trainers import registry
from docs.gen.source_comments import field_comments, lookup

ROOT = Path(__file__).resolve().parents[2]
# (section, function that builds it): the top level ("") and the sections that live with their
# code first, then every section of configs/sections.py, then every other `*_section` function
# of a config module (on_policy), so a new section shows up by itself.
_FIRST = (("", common.base_config), ("mesh", sections.mesh_section),
          ("partitioning", sections.partitioning_section),
          ("optimizer", optim.default_optimizer_config), ("data", pipeline.default_data_config),
          ("train", sections.train_section), ("checkpoint", sections.checkpoint_section))


def _config_modules():
  for info in pkgutil.iter_modules(configs_package.__path__):
    yield importlib.import_module(f"{configs_package.__name__}.{info.name}")


def _other_sections():
  """(name, function) of each `<name>_section` function defined in a config module other than
  sections.py."""
  found = {}
  for module in _config_modules():
    if module is sections:
      continue
    for attr, value in vars(module).items():
      if attr.endswith("_section") and inspect.isfunction(value) and (
          value.__module__ == module.__name__):
        found[attr.removesuffix("_section")] = value
  return tuple(sorted(found.items()))


SECTIONS = _FIRST + tuple(
    (name.removesuffix("_section"), getattr(sections, name)) for name in sections.__all__
    if name.removesuffix("_section") not in {n for n, _ in _FIRST}) + _other_sections()
# Sections a job of several teachers (trainer='distill_multi_teacher') has instead: (heading,
# dotted prefix, the function whose source holds the comments, its arguments, the one-teacher
# section); only the fields the one-teacher sections lack are listed.
VARIANTS = (("distill, with several teachers", "distill",
             sections.multi_teacher_distill_section, (), sections.distill_section),
            ("teachers[i], each entry of the teachers list", "teachers[i]",
             sections.teachers_entry, ("<name>",), sections.teacher_section))


def flatten(cfg: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
  """Dotted path -> default value, sub-sections walked."""
  out = {}
  for key in sorted(cfg.keys()):
    value = cfg[key]
    if isinstance(value, ml_collections.ConfigDict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def section_fields(name: str, build) -> dict[str, object]:
  """The section's own fields (the top level leaves the sections out)."""
  fields = flatten(build())
  if not name:
    fields = {k: v for k, v in fields.items() if "." not in k}
  return fields


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _value(value) -> str:
  """The default as code. A `|` in a table cell's code span would show its escaping backslash,
  so such values are written as HTML code with the pipe as an entity."""
  text = repr(value)
  if "|" in text:
    return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"
  return f"`{_cell(text)}`"


def render() -> str:
  lines = ["# Config reference", "",
           "Every field of a job config, with its default and what it does, generated from "
           "the code when the site is built. Override any of them on the command line with "
           "`--config.SECTION.FIELD=VALUE`; the value is type-checked against the default.",
           ""] + trainers_section()
  for name, build in SECTIONS:
    comments = field_comments(build)
    lines += [f"## `{name or 'top level'}`", "", "| field | default | what it is |",
              "|---|---|---|"]
    for key, value in section_fields(name, build).items():
      dotted = f"{name}.{key}" if name else key
      lines.append(f"| `{dotted}` | {_value(value)} | {_cell(lookup(comments, key))} |")
    lines.append("")
  for heading, prefix, build, args, base in VARIANTS:
    comments, known = field_comments(build), flatten(base())
    lines += [f"## {heading}", "", "| field | default | what it is |", "|---|---|---|"]
    for key, value in flatten(build(*args)).items():
      if key not in known:
        lines.append(f"| `{prefix}.{key}` | {_value(value)} | {_cell(lookup(comments, key))} |")
    lines.append("")
  lines += model_section()
  return "\n".join(lines) + "\n"


def _docstring_commands(module) -> list[list[str]]:
  """argv of each `distillax ...` line of a module's docstring (continuations joined)."""
  doc = (module.__doc__ or "").replace("\\\n", " ")
  return [shlex.split(line.strip().split("(`")[0]) for line in doc.splitlines()
          if line.strip().startswith("distillax ")]


def example_configs() -> list[tuple[str, ml_collections.ConfigDict]]:
  """(`file.py[:arg]`, config) of each job the config modules' docstring commands train, parsed
  as the CLI parses them (overrides applied) from the repository root; the demo's config, a job
  of its own (`distillax demo`), is left out."""
  out = []
  with contextlib.chdir(ROOT), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # ml_collections' load_module
    for module in _config_modules():
      for argv in _docstring_commands(module):
        if argv[1] != "train":
          continue
        config, _ = main._parse(argv[1], argv)
        if config is not None and config.get("job") != "demo":
          spec = argv[argv.index("--config") + 1].removeprefix("distillax/configs/")
          out.append((spec, config))
  return out


def trainers_section() -> list[str]:
  """Every registered recipe: the fields that choose it, what it builds (its docstring), the
  config files that run it and the sections their configs have."""
  examples = {}
  for spec, config in example_configs():
    examples.setdefault(registry.recipe_kind(config), []).append((spec, config))
  lines = ["## Trainers", "",
           "The `trainer` field (with, for some, the other fields shown) picks the recipe that "
           "builds the job. Every registered recipe, the config files whose documented `train` "
           "commands run it, and the sections those configs have:", "",
           "| trainer | chosen by | what it builds | config files | sections |",
           "|---|---|---|---|---|"]
  for name, cls in sorted(registry.registered().items()):
    found = examples.get(name, [])
    chosen = registry.CHOSEN_BY_FIELDS.get(name, f"trainer={name!r}")
    doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    files = ", ".join(f"`{spec}`" for spec in dict.fromkeys(spec for spec, _ in found))
    names = sorted({k for _, c in found for k, v in c.items()
                    if isinstance(v, ml_collections.ConfigDict)})
    lines.append(f"| `{name}` | `{_cell(chosen)}` | {_cell(doc)} | {files or 'none shipped'} | "
                 f"{', '.join(f'`{n}`' for n in names)} |")
  return lines + [""]


def model_section() -> list[str]:
  comments = field_comments(model_config.TransformerConfig)
  lines = ["## `model`", "",
           "The `model` section holds every `TransformerConfig` field "
           "(`distillax/models/config.py`); a config's preset fills them. The kind says what "
           "changing a field changes: `shape` is another model (a run started from another "
           "refuses it), `storage` how its arrays are stored, `compute` only how the forward "
           "computes (the same function).", "",
           "| field | kind | default | what it is |", "|---|---|---|---|"]
  for f in dataclasses.fields(model_config.TransformerConfig):
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    lines.append(f"| `model.{f.name}` | {model_config.field_kind(f.name)} | {_value(default)} | "
                 f"{_cell(comments.get(f.name, ''))} |")
  return lines + [""]
