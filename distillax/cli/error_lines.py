"""The one line a command line that went wrong prints: `distillax <command>: error: <what is
wrong and the fix>`, exit status 2. The absl flag parser and ml_collections' config_flags raise
their own wording (a KeyError for a field, "Unknown command line flag", a parse error for a
value); these functions turn each into a line that names the field or flag, what it may be, and
a command that works.
"""

from __future__ import annotations

import ast
import difflib
import re
import sys

from distillax.cli.flags import COMMAND_FLAGS, flag_value, flag_values

_TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
               tuple: "a tuple, e.g. (('a', 1),)"}


def fail(command: str, message: str) -> int:
  """Print `message` as the command's one error line (whitespace folded); returns 2."""
  message = " ".join(str(message).split())
  print(f"{' '.join(['distillax', command]).strip()}: error: {message}", file=sys.stderr)
  return 2


def _chain(e: BaseException) -> list[BaseException]:
  """`e` and the exceptions it was raised from or while handling, outermost first."""
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def parse_error_line(e: Exception, command: str, flag_argv: list[str],
                     config_arg: str | None) -> str:
  """One line for a command line that did not parse: the config file's own reason when it
  raised one (config_flags wraps it in "Error whilst parsing config file"), else what the flag
  parser or the override found, with the fix."""
  from absl import flags

  from distillax.errors import UserError

  chain = _chain(e)
  own = [x for x in chain if isinstance(x, UserError)]
  if own:
    return str(own[-1]).strip().splitlines()[0]  # the innermost: the config file's own words
  defaults = _config_defaults(config_arg) if config_arg else None
  missing = [x for x in chain if isinstance(x, KeyError)]
  if missing and missing[-1].args:
    return _unknown_key_line(str(missing[-1].args[0]), flag_argv, defaults)
  first = (str(e).strip().splitlines() or [type(e).__name__])[0]
  unknown = re.match(r"Unknown command line flag '([^']+)'", first)
  if unknown:
    return _unknown_flag_line(unknown.group(1), command, defaults)
  bad_value = re.match(r"flag --config\.([\w.]+)=", first)
  if bad_value:
    return _bad_value_line(bad_value.group(1), flag_argv, defaults, str(chain[-1]))
  if isinstance(e, flags.Error):
    return f"{first} (see distillax {command} --help)"
  inner = chain[-1]
  return (f"could not load the config ({type(inner).__name__}: "
          f"{(str(inner).strip().splitlines() or [''])[0]}); check the --config file and the "
          f"override values")


def _config_defaults(config_arg: str):
  """The config file's own values, without the command line's overrides (to name the fields
  an override may set and their types); None when the file itself does not load."""
  from absl import flags
  from ml_collections import config_flags
  fv = flags.FlagValues()
  saved_argv, sys.argv = sys.argv, sys.argv[:1]
  try:
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv)
    fv(["distillax", f"--config={config_arg}"])
    return fv.config
  except Exception:  # noqa: BLE001 - only used to word an error better
    return None
  finally:
    sys.argv = saved_argv


def _section(defaults, path: list[str]):
  """The config value at `path` (a list of keys), or None when it does not exist."""
  node = defaults
  for key in path:
    if node is None or not hasattr(node, "keys") or key not in node:
      return None
    node = node[key]
  return node


def _missing_at(defaults, path: list[str], key: str) -> bool:
  """Whether `path` (an override's keys) names `key` where the config has no such field: its
  section exists and lacks it, or the section itself is missing."""
  parent = path[:path.index(key)]
  section = _section(defaults, parent)
  return not (hasattr(section, "keys") and key in section)


def _unknown_key_line(key: str, flag_argv: list[str], defaults) -> str:
  """`--config.train.step=10`: the field that does not exist, the closest ones that do, and
  the override spelled with the closest."""
  overrides = [a[2:].split("=", 1)[0] for a in flag_argv if a.startswith("--config.")]
  paths = [o.split(".")[1:] for o in overrides if key in o.split(".")[1:]]
  # The override that names `key` in a section lacking it, not the first to name `key`:
  # `--config.teacher.preset=x --config.model.preset=y` fails on model's, not teacher's.
  path = next((p for p in paths if _missing_at(defaults, p, key)), (paths or [[key]])[0])
  parent = path[:path.index(key)]
  section = _section(defaults, parent)
  known = sorted(section.keys()) if hasattr(section, "keys") else []
  where = ".".join(parent) or "the config"
  dotted = ".".join(path)
  line = f"--config.{dotted}: {where} has no field {key!r}"
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
  if close:
    value = flag_value(flag_argv, f"config.{dotted}") or "..."
    fixed = ".".join(parent + [close[0]] + path[len(parent) + 1:])
    suggestions = ", ".join(".".join(parent + [c]) for c in close)
    return f"{line}; did you mean {suggestions}? e.g. --config.{fixed}={value}"
  if known:
    return f"{line}; its fields are {', '.join(known)}; fix the name"
  return f"{line}; config fields are checked against the config file's defaults; fix the name"


def _unknown_flag_line(name: str, command: str, defaults) -> str:
  """`--stepz=3`: the command's flags, or the config field the user probably meant."""
  known = ["config"] + list(COMMAND_FLAGS[command]) + ["verbose"]
  close = difflib.get_close_matches(name, known, n=1)
  fields = [f"{s}.{name}" for s in (defaults.keys() if defaults is not None else ())
            if hasattr(defaults[s], "keys") and name in defaults[s]]
  if close:
    hint = f"did you mean --{close[0]}?"
  elif fields:
    hint = f"config fields are set as --config.{fields[0]}=..."
  else:
    hint = f"it takes {', '.join('--' + k for k in known)}"
  return f"unknown flag --{name} for distillax {command}; {hint} (see distillax {command} --help)"


def _bad_value_line(dotted: str, flag_argv: list[str], defaults, reason: str) -> str:
  """`--config.train.steps=abc`: the value does not parse as the field's type; name the type and
  a good value (the config file's)."""
  path = dotted.split(".")
  default = _section(defaults, path)
  reason = (reason.strip().splitlines() or [""])[0]
  if hasattr(default, "keys"):
    first = next(iter(default.keys()), "key")
    return (f"--config.{dotted} is a section of the config, not a value; set its fields, e.g. "
            f"--config.{dotted}.{first}=...")
  try:  # a placeholder field (no value yet) still has a type
    kind = _section(defaults, path[:-1]).get_ref(path[-1]).get_type()
  except Exception:  # noqa: BLE001 - only used to word an error better
    kind = type(default) if default is not None else None
  value = _failing_value(flag_values(flag_argv, f"config.{dotted}"), reason, kind)
  words = _TYPE_WORDS.get(kind, f"a {kind.__name__}" if kind else "a value of the field's type")
  example = f", e.g. --config.{dotted}={default!r}" if default is not None else ""
  return f"--config.{dotted}={value} must be {words} ({reason}){example}"


def _parses_as(value: str, kind) -> bool:
  """Whether `value` reads as a value of type `kind` (roughly as config_flags reads it)."""
  try:
    if kind is bool:
      return value.lower() in ("true", "false", "1", "0", "yes", "no", "t", "f", "y", "n")
    if kind in (int, float):
      kind(value)
    elif kind is tuple:
      return isinstance(ast.literal_eval(value), (tuple, list))
    return True
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return False


def _failing_value(values: list[str], reason: str, kind) -> str | None:
  """Of the values given to one key (it may be given twice), the one the parser refused:
  overrides apply in order and the first that does not parse stops the parse, so it is the
  first the parser's reason quotes, else the first that does not read as the field's type."""
  quoted = [v for v in values if f"'{v}'" in reason]
  refused = quoted or [v for v in values if not _parses_as(v, kind)]
  return (refused or values or [None])[0]
