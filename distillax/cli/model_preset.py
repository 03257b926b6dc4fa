"""`--config.model.preset=NAME`: the student's shape from a named preset, on the command line.

A job config's `model` section holds every field of its model (so each is overridable), and no
`preset` field: which preset filled it is not part of the job. To pre-flight a pair of one's own
(`plan --target` of `--config.teacher.preset=A`, say) the student needs a preset too, without
writing a config file. This flag gives it one: NAME's shape fields (what the model is: its
arrays and their sizes) replace the section's; how the config runs its model (param_dtype,
dtype, remat, attention_impl: the storage and compute fields) stays the config's, and so does
vocab_size, which follows the tokenizer and the teacher (0 = the tokenizer's, as base_config
builds every section from a preset); every other `--config.model.*` given beside it applies on
top, in either order. The resolved fields, not the name, are what config.json records.

A student whose weights come from a source (student.hf_path, student.from_teacher.layers,
train.init_from) has that source's shape, so the flag with one of them is refused.
"""

from __future__ import annotations

from distillax.errors import UserError

FLAG = "config.model.preset"
# Settings that give the student its weights, and with them its shape.
_STUDENT_SOURCES = (("train", "init_from"), ("student", "hf_path"),
                    ("student", "from_teacher", "layers"))


def split_model_preset(argv: list[str]) -> tuple[list[str], str | None]:
  """(argv without `--config.model.preset`, the preset it named or None): config_flags would
  refuse the flag, the model section having no such field. Given twice, the last one wins."""
  out, name, skip = [], None, False
  for i, arg in enumerate(argv):
    if skip:
      skip = False
    elif arg.startswith(f"--{FLAG}="):
      name = arg.split("=", 1)[1]
    elif arg == f"--{FLAG}":
      if i + 1 >= len(argv):
        raise UserError(f"--{FLAG} needs a preset name, e.g. --{FLAG}=llama3.2-1b")
      name, skip = argv[i + 1], True
    else:
      out.append(arg)
  return out, name


def _source_set(config) -> str | None:
  """The first setting of `config` that gives the student its weights, as `name=value`."""
  for path in _STUDENT_SOURCES:
    node = config
    for key in path:
      node = node.get(key) if hasattr(node, "get") else None
    if node:
      return f"{'.'.join(path)}={node!r}"
  return None


def with_model_preset(config, name: str, overrides: dict):
  """`config` whose model section has preset `name`'s shape fields, the config's storage and
  compute fields, and the command line's `model.*` values (`overrides`, by dotted name)."""
  from distillax.configs.common import model_config
  from distillax.models.config import SHAPE, fields_of_kind
  from distillax.models.presets import PRESETS
  if name not in PRESETS:
    raise UserError(f"--{FLAG}={name!r}: no such preset; choose one of {', '.join(PRESETS)}")
  if "model" not in config:
    raise UserError(f"--{FLAG}={name} sets the model section, which this config does not have")
  source = _source_set(config)
  if source:
    raise UserError(f"--{FLAG}={name} gives a fresh student its shape, but {source} gives the "
                    f"student its weights and their shape; drop one of them")
  shape = set(fields_of_kind(SHAPE)) - {"vocab_size"}
  section = model_config(name)
  for key in section.keys():
    if key not in shape and key in config.model:
      section[key] = config.model[key]
  for dotted, value in overrides.items():
    if dotted.startswith("model."):
      section[dotted.removeprefix("model.")] = value
  with config.unlocked():
    config.model = section
  return config
