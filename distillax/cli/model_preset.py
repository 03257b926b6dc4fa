"""`--config.model.preset=NAME`: the student's shape from a named preset, on the command line.

A job config's `model` section holds every field of its model (so each is overridable), and no
`preset` field: which preset filled it is not part of the job. To pre-flight a pair of one's own
(`plan --target` of `--config.teacher.preset=A`, say) the student needs a preset too, without
writing a config file. This flag gives it one: NAME's shape fields (what the model is: its
arrays and their sizes) replace the section's; how the config runs its model (param_dtype,
dtype, remat, attention_impl: the storage and compute fields) stays the config's. vocab_size
stays the config's where it follows the tokenizer (0) or is the teacher preset's table (a
student that speaks its teacher's vocabulary: distill_deepseek.py); a table of the config's
own (the Llama 3 128,256 of distill.py:llama, which its Llama teacher shares) is the preset's
table that came with the section, so NAME's replaces it (--config.model.preset=qwen3-0.6b
--config.teacher.preset=qwen3-1.7b plans both with Qwen3's 151,936 rows). Every other
`--config.model.*` given beside it applies on top, in either order. The resolved fields, not
the name, are what config.json records.

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


def _table_of_the_section(config) -> bool:
  """Whether the config's model.vocab_size is a table of its own (not 0, the tokenizer's) that
  is not its teacher preset's: the vocabulary of the preset the section came from."""
  from distillax.models.presets import PRESETS, get_preset
  own = int(config.model.get("vocab_size", 0) or 0)
  teacher = config.get("teacher")
  preset = str(teacher.get("preset", "") or "") if teacher is not None else ""
  return bool(own) and not (preset in PRESETS and get_preset(preset).vocab_size == own)


def with_model_preset(config, name: str, overrides: dict):
  """`config` whose model section has preset `name`'s shape fields, the config's storage and
  compute fields, and the command line's `model.*` values (`overrides`, by dotted name)."""
  from distillax.configs.common import model_config
  from distillax.models.config import SHAPE, fields_of_kind
  from distillax.models.presets import PRESETS, get_preset
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
  if _table_of_the_section(config):
    section.vocab_size = get_preset(name).vocab_size
  for dotted, value in overrides.items():
    if dotted.startswith("model."):
      section[dotted.removeprefix("model.")] = value
  with config.unlocked():
    config.model = section
  return config
