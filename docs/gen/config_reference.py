"""The config reference page: every field of every config section, its default and the comment
written beside it, and every TransformerConfig field with its kind. Generated at build time from
the code, so the page cannot fall behind it."""

from __future__ import annotations

import dataclasses
import html

import ml_collections

from distillax.configs import common, sections
from distillax.data import pipeline
from distillax.framework import optim
from distillax.models import config as model_config
from docs.gen.source_comments import field_comments, lookup

# (section, function that builds it): the top level ("") and the sections that live with their
# code first, then every section of configs/sections.py, so a new section shows up by itself.
_FIRST = (("", common.base_config), ("mesh", sections.mesh_section),
          ("partitioning", sections.partitioning_section),
          ("optimizer", optim.default_optimizer_config), ("data", pipeline.default_data_config),
          ("train", sections.train_section), ("checkpoint", sections.checkpoint_section))
SECTIONS = _FIRST + tuple(
    (name.removesuffix("_section"), getattr(sections, name)) for name in sections.__all__
    if name.removesuffix("_section") not in {n for n, _ in _FIRST})
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
           "", "Which sections a job has depends on its config file "
           "(`distillax/configs/*.py`): every job has the top level and `mesh` to `runtime`; "
           "distillation jobs add `teacher`, `student` and `distill`; `cache-teacher` reads "
           "`cache` and sequence-level KD `sequence_kd`.", ""]
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
