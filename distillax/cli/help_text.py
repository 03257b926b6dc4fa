"""`distillax --help`, `distillax <command> --help` and `--version`, printed from the tables in
flags.py so that help never disagrees with the flags a command defines."""

from __future__ import annotations

from distillax.cli.flags import ABOUT, COMMAND_FLAGS, COMMANDS, CONFIG_OPTIONAL, FLAGS, USAGE
from distillax.cli.run_base import RUN_FLAG

RUN_BASE_NOTE = ("; optional: given, it replaces the run's own config.json as the base (its "
                 "data, mesh, partitioning and eval sizes; the run's checkpoint still decides "
                 "the model)")
RUN_OVERRIDE_NOTE = ("; without --config FILE, a field of the run's own config.json (e.g. "
                     "--config.train.eval_batches=1)")


def version_line() -> str:
  """`distillax <version>` from the installed package's metadata (pyproject.toml)."""
  from importlib import metadata
  try:
    return f"distillax {metadata.version('distillax')}"
  except metadata.PackageNotFoundError:
    return "distillax (version unknown: not installed; pip install -e .)"


def _help_line(flag: str, text: str) -> str:
  return f"  {flag:<32} {text}"


def overview_help() -> str:
  """`distillax --help`: the commands."""
  lines = [USAGE, "", "commands:"]
  lines += [_help_line(name, ABOUT[name]) for name in COMMANDS]
  lines += ["", "`distillax <command> --help` lists a command's flags; `distillax --version` "
                "prints the version."]
  return "\n".join(lines)


def command_help(command: str) -> str:
  """`distillax <command> --help`: what the command does and every flag it reads."""
  config = ("[--config <file.py>[:arg]]" if command in CONFIG_OPTIONAL
            else "--config <file.py>[:arg]")
  lines = [f"usage: distillax {command} {config} [--config.key=value ...] [flags]", "",
           ABOUT[command] + ".", "", "flags:",
           _help_line("--config FILE[:ARG]", "job config and its argument, e.g. "
                                             "distillax/configs/lm.py:tiny"
                      + (RUN_BASE_NOTE if command in RUN_FLAG else "")),
           _help_line("--config.KEY=VALUE", "set one config field (type-checked against the "
                                            "file's value), e.g. --config.train.steps=100"
                      + (RUN_OVERRIDE_NOTE if command in RUN_FLAG else "")),
           _help_line("--config.model.preset=NAME", "the model's shape from a preset (e.g. "
                                                    "qwen3-0.6b); how it runs and its "
                                                    "vocab_size stay the config's")]
  for name in COMMAND_FLAGS[command] + ("verbose",):
    _, default, placeholder, text = FLAGS[name]
    flag = f"--{name} {placeholder}".strip()
    lines.append(_help_line(flag, text + (f" (default {default})" if default else "")))
  lines += [_help_line("--version", "print the distillax version and exit"),
            _help_line("-h, --help", "show this help and exit")]
  return "\n".join(lines)
