"""The CLI reference page: every command with what it does and the flags it reads, and every
flag with its kind, default and help, generated from `distillax/cli/flags.py` (the tables the
CLI itself is built from) when the site is built."""

from __future__ import annotations

from distillax.cli import flags

# Flags every command takes, described here because flags.FLAGS lists only the others' tables.
COMMON = {"config": ("string", None, "FILE.py[:ARG]",
                     "the job's config file, with an optional argument such as :tiny"),
          "config.KEY=VALUE": ("override", None, "", "set one config field (see the config "
                               "reference); type-checked against its default")}


def _cell(text) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def command_flags(command: str) -> tuple[str, ...]:
  return ("config", "config.KEY=VALUE") + tuple(flags.COMMAND_FLAGS[command]) + ("verbose",)


def _flag_row(name: str) -> str:
  kind, default, placeholder, help_text = COMMON.get(name) or flags.FLAGS[name]
  shown = f"--{name}" + (f" {placeholder}" if placeholder else "")
  default = "" if default is None else f"`{default!r}`"
  return f"| `{_cell(shown)}` | {kind} | {default} | {_cell(help_text)} |"


def render() -> str:
  lines = ["# CLI reference", "",
           "Generated from the command line's own tables when the site is built. Every "
           "command is run as `distillax COMMAND --config FILE.py[:ARG] [flags]`; "
           "`distillax COMMAND --help` prints the same.", "",
           f"    {flags.USAGE}", "", "| command | what it does |", "|---|---|"]
  lines += [f"| [`{c}`](#{c}) | {_cell(flags.ABOUT[c])} |" for c in flags.COMMANDS]
  lines.append("")
  for command in flags.COMMANDS:
    optional = " (optional: a run's own config.json says what it needs)" if (
        command in flags.CONFIG_OPTIONAL) else ""
    lines += [f"## {command}", "", flags.ABOUT[command] + ".", "",
              f"`--config` is read{optional or ' (required)'}.", "",
              "| flag | kind | default | help |", "|---|---|---|---|"]
    lines += [_flag_row(name) for name in command_flags(command)]
    lines.append("")
  return "\n".join(lines) + "\n"
