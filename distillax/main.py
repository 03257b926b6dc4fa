"""`distillax train|plan|export|cache-teacher|demo --config=<file.py>[:arg] [--config.a.b=v ...]`.

A thin entry: parse flags, join the distributed runtime when asked, hand the config to the
command. Errors a user can cause print one line naming the problem and the fix and exit with
status 2; nothing is written to an existing workdir before the config has been validated.
"""

from __future__ import annotations

import os
import sys

COMMANDS = ("train", "plan", "export", "cache-teacher", "demo")
USAGE = ("usage: distillax {train,plan,export,cache-teacher,demo} --config <file.py>[:arg] "
         "[--workdir DIR] [--config.key=value ...]")


def _fail(command: str, message: str) -> int:
  message = " ".join(str(message).split())
  print(f"distillax {command}: error: {message}", file=sys.stderr)
  return 2


def _preset_devices(argv: list[str]) -> None:
  """`--devices N` simulates N CPU devices (plan; train on a CPU host, as the demo does); XLA
  reads this before JAX is imported, so it is handled before anything imports JAX."""
  for i, arg in enumerate(argv):
    value = arg.split("=", 1)[1] if arg.startswith("--devices=") else (
        argv[i + 1] if arg == "--devices" and i + 1 < len(argv) else None)
    if value is not None and value.isdigit():
      flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
               if not f.startswith("--xla_force_host_platform_device_count")]
      os.environ["XLA_FLAGS"] = " ".join(flags + [
          f"--xla_force_host_platform_device_count={value}"])
      os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help"):
    print(USAGE, file=sys.stderr if len(argv) < 2 else sys.stdout)
    return 2 if len(argv) < 2 else 0
  command = argv[1]
  if command not in COMMANDS:
    return _fail("", f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
  if command in ("plan", "train", "demo"):
    _preset_devices(argv)

  from absl import flags, logging
  from ml_collections import config_flags

  from distillax.errors import UserError

  fv = flags.FlagValues()
  flag_argv = argv[:1] + argv[2:]
  # config_flags discovers `--config.a.b` overrides by scanning sys.argv when the flag is defined.
  saved_argv, sys.argv = sys.argv, flag_argv
  config_flags.DEFINE_config_file("config", None, "job config file[:arg]", flag_values=fv,
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "run directory (config.json, metrics, checkpoints)",
                      flag_values=fv)
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (multi-process)",
                      flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "processes in the job", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "index of this process", flag_values=fv)
  flags.DEFINE_integer("devices", None, "simulate this many CPU devices (plan; CPU training)",
                       flag_values=fv)
  flags.DEFINE_float("memory_gb", None, "plan: per-device memory to check the plan against",
                     flag_values=fv)
  flags.DEFINE_string("output", None, "export: output directory", flag_values=fv)
  flags.DEFINE_string("format", "hf", "export: hf | quantized", flag_values=fv)
  try:
    fv(flag_argv)
    if fv["config"].value is None:
      raise UserError("--config is required, e.g. --config distillax/configs/lm.py:tiny")
    config = fv.config
    config.to_dict()  # a config file that failed to load raises only when first read
  except flags.Error as e:
    return _fail(command, _flag_error_line(str(e)))
  except UserError as e:
    return _fail(command, str(e))
  except Exception as e:  # noqa: BLE001 - a config file that fails to load is a user error
    return _fail(command, f"could not load the config ({type(e).__name__}: {e}); check the "
                          f"--config path and the override values")
  finally:
    sys.argv = saved_argv

  _quiet_library_logs(logging)
  try:
    from distillax.framework import runtime
    runtime.initialize(config, coordinator_address=fv.coordinator_address,
                       num_processes=fv.num_processes, process_id=fv.process_id)
    return _run_job(command, config, fv)
  except UserError as e:
    return _fail(command, str(e))


def _quiet_library_logs(absl_logging) -> None:
  """INFO lines from distillax itself; only warnings and errors from orbax, jax and grain."""
  import logging as py_logging

  class _Filter(py_logging.Filter):
    def filter(self, record):
      own = "/distillax/" in record.pathname.replace(os.sep, "/")
      return own or record.levelno >= py_logging.WARNING

  absl_logging.set_verbosity(absl_logging.INFO)
  absl_logging.use_absl_handler()
  absl_logging.get_absl_handler().addFilter(_Filter())


def _flag_error_line(message: str) -> str:
  first = message.strip().splitlines()[0] if message.strip() else message
  return first + " (see --help; config keys are checked against the config file's defaults)"


def _run_job(command: str, config, fv) -> int:
  """The job a command names; each imports only what it needs."""
  if command == "train":
    return _train(config, fv.workdir)
  if command == "plan":
    from distillax.plan import run_plan
    return run_plan(config, devices=fv.devices, memory_gb=fv.memory_gb)
  if command == "export":
    from distillax.export import run_export
    return run_export(config, fv.workdir, fv.output, fv.format)
  if command == "demo":
    from distillax.demo import run_demo
    return run_demo(config, fv.workdir)
  from distillax.cache_teacher import run_cache_teacher
  return run_cache_teacher(config, fv.workdir)


def _train(config, workdir: str | None) -> int:
  from distillax.errors import UserError
  from distillax.trainers import Trainer, recipe_for
  if not workdir:
    raise UserError("--workdir is required for train, e.g. --workdir runs/my_run")
  summary = Trainer(recipe_for(config, workdir=workdir), workdir).run()
  at = f" at step {summary['step']}" if "step" in summary else ""
  import jax
  if jax.process_index() == 0:
    print(f"distillax train: done{at}; workdir {os.path.abspath(workdir)}")
  return 0


def run() -> None:
  """Console-script entry point."""
  sys.exit(main())


if __name__ == "__main__":
  run()
