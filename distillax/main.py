"""`distillax train|plan|export|cache-teacher|demo|generate|eval|expert-load
--config=<file.py>[:arg] [--config.a.b=v ...]`.

A thin entry: parse flags, join the distributed runtime when asked, resolve the config's paths
and hand it to the command's job (distillax/cli/dispatch.py). Errors a user can cause print one
line naming the problem and the fix (distillax/cli/error_lines.py) and exit with status 2;
nothing is written to an existing workdir before the config has been validated.
`distillax <command> --help` lists the flags a command reads (distillax/cli/flags.py);
`distillax --version` says which distillax this is. Nothing imported here imports JAX: `--devices`
has to reach XLA_FLAGS first. A host without a TPU then runs JAX on the CPU without libtpu's
start-up lines (distillax/cli/host_platforms.py). Then, unless the command line or the
environment launch several processes, `train` starts JAX's backends in a thread, so the
accelerator opens while the job's modules import (distillax/cli/devices.py).
"""

from __future__ import annotations

import os
import sys

# preset_devices under its old name too: tests/conftest.py sets up its devices through it.
from distillax import interrupts
from distillax.cli.devices import opens_devices_early, settle_early_devices
from distillax.cli.devices import preset_devices as _preset_devices
from distillax.cli.dispatch import JOBS
from distillax.cli.error_lines import fail, parse_error_line
from distillax.cli.flags import (COMMAND_FLAGS, COMMANDS, CONFIG_OPTIONAL, FLAGS, PATH_FLAGS,
                                 USAGE, flag_value)
from distillax.cli.interrupted import interrupted
from distillax.cli.ipython_probe import import_flax_without_ipython_probe
from distillax.cli.help_text import command_help, overview_help, version_line
from distillax.cli.model_preset import split_model_preset, with_model_preset
from distillax.cli.run_base import RUN_FLAG, has_overrides, run_config_base
from distillax.cli.host_platforms import skip_absent_tpu
from distillax.cli.target_env import prepare_target_environment


def main(argv: list[str] | None = None) -> int:
  """The command's exit status: 0, 2 for a user's error (one line); after Ctrl-C (one line,
  whenever it came: distillax/interrupts.py) 3 when a rerun resumes from a saved step, 130 when
  nothing was saved (distillax/cli/interrupted.py)."""
  argv = list(sys.argv if argv is None else argv)
  previous = interrupts.install()
  try:
    return _main(argv)
  except KeyboardInterrupt:  # between a train run's steps, Ctrl-C saves the step instead
    command = argv[1] if len(argv) > 1 and argv[1] in COMMANDS else None
    line, code = interrupted(command, flag_value(argv[2:], "workdir"))
    print(line, file=sys.stderr, flush=True)
    return code
  finally:
    if not interrupts.pending():  # Ctrl-C leaves at once (interrupts.leave)
      settle_early_devices()
    interrupts.restore(previous)


def _main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(USAGE, file=sys.stderr)
    return 2
  command, rest = argv[1], argv[2:]
  if command in ("-h", "--help", "--version"):
    print(version_line() if command == "--version" else overview_help())
    return 0
  if command not in COMMANDS:
    return fail("", f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
  if "--version" in rest or "-h" in rest or "--help" in rest:
    print(version_line() if "--version" in rest else command_help(command))
    return 0
  devices_error = _preset_devices(rest)
  if devices_error:
    return fail(command, devices_error)
  if command == "plan" and flag_value(rest, "target") is not None:
    prepare_target_environment(flag_value(rest, "target"))
  skip_absent_tpu()  # after XLA_FLAGS: it imports JAX (and starts no backend)
  if opens_devices_early(command, rest):  # after the platforms too: the backends read them
    from distillax.framework.run import runtime
    runtime.open_devices_early()
  import_flax_without_ipython_probe()  # while the devices open

  from distillax.errors import UserError
  from distillax.framework.run import logs

  logs.configure(verbose=False)  # before anything logs: no absl "Logging before flag parsing"
  try:
    config, fv = _parse(command, argv)
  except UserError as e:
    return fail(command, str(e))
  logs.configure(verbose=bool(fv.verbose))
  try:
    from ml_collections import config_flags

    from distillax.framework.run import runtime
    runtime.initialize(config, coordinator_address=_flag(fv, "coordinator_address"),
                       num_processes=_flag(fv, "num_processes"),
                       process_id=_flag(fv, "process_id"))
    config, flag_values = _resolve(command, config, fv)
    # The fields set on the command line: a job checks the model ones against its student's
    # source (an argument, so the Python API passes its own or none).
    flag_values["config_overrides"] = (config_flags.get_override_values(fv["config"])
                                       if config is not None else None)
    return JOBS[command](config, flag_values)
  except UserError as e:
    return fail(command, str(e))


def _flag(fv, name: str):
  """A flag's value, None for a flag this command does not define."""
  return fv[name].value if name in fv else None


def _parse(command: str, argv: list[str]):
  """(config, flag values) of a command line; a UserError names what is wrong and the fix."""
  from absl import flags
  from ml_collections import config_flags

  from distillax.errors import UserError

  fv = flags.FlagValues()
  flag_argv, model_preset = split_model_preset(argv[:1] + argv[2:])
  config_arg = flag_value(flag_argv, "config")
  if config_arg is not None and not os.path.exists(config_arg.split(":", 1)[0]):
    raise UserError(f"--config {config_arg.split(':', 1)[0]}: no such file; pass a job config "
                    f"file, e.g. --config distillax/configs/lm.py:tiny")
  # config_flags discovers `--config.a.b` overrides by scanning sys.argv when the flag is defined.
  saved_argv, sys.argv = sys.argv, flag_argv
  try:
    if (config_arg is None and command in RUN_FLAG and model_preset is None
        and has_overrides(flag_argv)):  # the run's own config.json is what they change
      config_flags.DEFINE_config_dict("config", run_config_base(command, flag_argv),
                                      "the run's config", flag_values=fv, lock_config=True)
    else:
      config_flags.DEFINE_config_file("config", None, "job config file[:arg]", flag_values=fv,
                                      lock_config=True)
    for name in COMMAND_FLAGS[command] + ("verbose",):
      kind, default, _, text = FLAGS[name]
      getattr(flags, f"DEFINE_{kind}")(name, default, text, flag_values=fv)
    fv(flag_argv)
    if fv["config"].value is None and command in CONFIG_OPTIONAL and model_preset is None:
      return None, fv
    if fv["config"].value is None:
      raise UserError("--config is required, e.g. --config distillax/configs/lm.py:tiny")
    config = fv.config
    config.to_dict()  # a config file that failed to load raises only when first read
    if model_preset is not None:
      config = with_model_preset(config, model_preset, config_flags.get_override_values(
          fv["config"]))
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 - every way a command line fails to parse is the user's
    raise UserError(parse_error_line(e, command, flag_argv, config_arg)) from None
  finally:
    sys.argv = saved_argv
  return config, fv


def _resolve(command: str, config, fv) -> tuple[object, dict]:
  """The config with every path the user wrote in it made absolute (relative to the current
  directory), and the command's flag values with its path flags made absolute the same way."""
  from distillax.configs.paths import absolute, resolve_job_config
  if config is not None:
    config = resolve_job_config(config, command)
  values = {name: _flag(fv, name) for name in COMMAND_FLAGS[command]}
  return config, {name: absolute(v) if name in PATH_FLAGS else v for name, v in values.items()}


def run() -> None:
  """Console-script entry point. An interrupted command leaves without the interpreter's
  teardown (interrupts.leave)."""
  code = main()
  interrupts.leave(code)
  sys.exit(code)


if __name__ == "__main__":
  run()
