"""`distillax train|plan|export|cache-teacher|demo|generate|eval --config=<file.py>[:arg]
[--config.a.b=v ...]`.

A thin entry: parse flags, join the distributed runtime when asked, hand the config to the
command. Errors a user can cause print one line naming the problem and the fix and exit with
status 2; nothing is written to an existing workdir before the config has been validated.
`distillax <command> --help` lists the flags a command reads; `distillax --version` says which
distillax this is.
"""

from __future__ import annotations

import difflib
import os
import re
import sys

COMMANDS = ("train", "plan", "export", "cache-teacher", "demo", "generate", "eval")
USAGE = ("usage: distillax {train,plan,export,cache-teacher,demo,generate,eval} --config "
         "<file.py>[:arg] [--workdir DIR] [--config.key=value ...]")
# Commands whose --config is optional: a run's own config.json says what they need.
CONFIG_OPTIONAL = ("generate", "eval", "export")
ABOUT = {
    "train": "train the job a config describes in --workdir; the same command again resumes it",
    "plan": "compile the step for --devices simulated devices and print where every array lives "
            "and what each device holds; nothing is trained or written",
    "export": "write the trained student of the run in --workdir to --output (Hugging Face "
              "safetensors, GGUF for llama.cpp, or quantized)",
    "cache-teacher": "run a distill config's teacher over the data once and store its top-k "
                     "logits, to distill without a teacher in the step",
    "demo": "the end-to-end demo: teacher, students from scratch and distilled, PTQ and QAT, "
            "then a report",
    "generate": "continue --prompt (or answer the chat turns of --messages) with the model in "
                "--model (a run's workdir, a Hugging Face directory or an export) and print it",
    "eval": "print the exact eval loss and perplexity of --model (a run, or a Hugging Face "
            "directory with a --config naming the data) on its validation split",
}
_DISTRIBUTED = ("coordinator_address", "num_processes", "process_id")
# The flags each command reads besides --config and --verbose.
COMMAND_FLAGS = {
    "train": ("workdir", "devices") + _DISTRIBUTED,
    "plan": ("devices", "memory_gb"),
    "export": ("workdir", "output", "format", "quant", "devices") + _DISTRIBUTED,
    "cache-teacher": ("workdir", "devices") + _DISTRIBUTED,
    "demo": ("workdir", "devices") + _DISTRIBUTED,
    "generate": ("model", "prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p",
                 "seed", "devices"),
    "eval": ("model", "devices") + _DISTRIBUTED,
}
# name -> (absl flag kind, default, placeholder in --help, help)
FLAGS = {
    "workdir": ("string", None, "DIR", "the run's directory (config.json, metrics, checkpoints); "
                                       "export reads it, cache-teacher writes the cache there"),
    "devices": ("integer", None, "N", "simulate N CPU devices (plan; training on a CPU host)"),
    "memory_gb": ("float", None, "GIB", "per-device memory to check the plan against"),
    "output": ("string", None, "DIR", "new or empty directory to write the exported model to"),
    "format": ("string", "hf", "FORMAT", "hf (safetensors) | gguf (llama.cpp) | quantized"),
    "quant": ("string", None, "TYPE", "--format gguf: f32 (default) | f16 | q8_0 | q4_0 (q8_0/q4_0 "
                                      "where qat.rules say, every matmul without rules)"),
    "coordinator_address": ("string", None, "HOST:PORT", "address of process 0 (multi-process)"),
    "num_processes": ("integer", None, "N", "processes in the job (multi-process)"),
    "process_id": ("integer", None, "I", "index of this process (multi-process)"),
    "verbose": ("bool", False, "", "also show the INFO lines of orbax, jax, grain and absl"),
    "model": ("string", None, "DIR", "a run's --workdir, a Hugging Face checkpoint directory or "
                                     "an export (generate, eval)"),
    "prompt": ("string", None, "TEXT", "the text to continue (BOS first when the tokenizer has "
                                       "one)"),
    "messages": ("string", None, "JSON", "chat turns, a JSON list of {\"role\", \"content\"} "
                                         "or a .json file of one, rendered with the tokenizer's "
                                         "chat template"),
    "max_new_tokens": ("integer", 128, "N", "tokens to generate at most"),
    "temperature": ("float", 0.0, "T", "sampling temperature; 0 = greedy"),
    "top_k": ("integer", None, "K", "sample from the K most likely tokens only"),
    "top_p": ("float", None, "P", "sample from the smallest set of tokens with mass P"),
    "seed": ("integer", 0, "N", "sampling seed"),
}


def _fail(command: str, message: str) -> int:
  message = " ".join(str(message).split())
  print(f"{' '.join(['distillax', command]).strip()}: error: {message}", file=sys.stderr)
  return 2


def _version() -> str:
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
                                             "distillax/configs/lm.py:tiny"),
           _help_line("--config.KEY=VALUE", "set one config field (type-checked against the "
                                            "file's value), e.g. --config.train.steps=100")]
  for name in COMMAND_FLAGS[command] + ("verbose",):
    _, default, placeholder, text = FLAGS[name]
    flag = f"--{name} {placeholder}".strip()
    lines.append(_help_line(flag, text + (f" (default {default})" if default else "")))
  lines += [_help_line("--version", "print the distillax version and exit"),
            _help_line("-h, --help", "show this help and exit")]
  return "\n".join(lines)


def _flag_value(argv: list[str], name: str) -> str | None:
  """The value given to `--name` (as `--name=v` or `--name v`), or None."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _preset_devices(argv: list[str]) -> str | None:
  """`--devices N` simulates N CPU devices (plan; train on a CPU host, as the demo does); XLA
  reads this before JAX is imported, so it is handled before anything imports JAX. Returns the
  error line for a value that is not a positive whole number.

  Simulated devices (from --devices, or a device count already in XLA_FLAGS, as launch_local
  and tests/conftest.py set it) also get patient collectives: XLA:CPU runs each device's share
  of a collective on its own thread and aborts the process (rc 134, "Termination timeout ...
  only 7 of them arrived") when one thread arrives 20 s + 40 s after the first, which 8 devices
  on 2 busy cores can reach with nothing wrong. Here the limit is 60 s + 540 s; XLA_FLAGS that
  set either flag keep their own value."""
  value = _flag_value(argv, "devices")
  if value is not None:
    if not (value.isdigit() and int(value) > 0):
      return (f"--devices={value} must be a positive whole number of simulated CPU devices, "
              f"e.g. --devices 8")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={value}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "").split()
  if any(f.startswith("--xla_force_host_platform_device_count") for f in flags):
    patient = {"--xla_cpu_collective_call_warn_stuck_timeout_seconds": 60,
               "--xla_cpu_collective_call_terminate_timeout_seconds": 540}
    given = {f.split("=", 1)[0] for f in flags}
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"{name}={s}" for name, s in patient.items() if name not in given])
  return None


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2:
    print(USAGE, file=sys.stderr)
    return 2
  command, rest = argv[1], argv[2:]
  if command in ("-h", "--help", "--version"):
    print(_version() if command == "--version" else overview_help())
    return 0
  if command not in COMMANDS:
    return _fail("", f"unknown command {command!r}; use one of {', '.join(COMMANDS)}")
  if "--version" in rest or "-h" in rest or "--help" in rest:
    print(_version() if "--version" in rest else command_help(command))
    return 0
  devices_error = _preset_devices(rest)
  if devices_error:
    return _fail(command, devices_error)

  from distillax.errors import UserError
  from distillax.framework import logs

  logs.configure(verbose=False)  # before anything logs: no absl "Logging before flag parsing"
  try:
    config, fv = _parse(command, argv)
  except UserError as e:
    return _fail(command, str(e))
  logs.configure(verbose=bool(fv.verbose))
  try:
    from distillax.framework import runtime
    runtime.initialize(config, coordinator_address=_flag(fv, "coordinator_address"),
                       num_processes=_flag(fv, "num_processes"),
                       process_id=_flag(fv, "process_id"))
    return _run_job(command, config, fv)
  except UserError as e:
    return _fail(command, str(e))


def _flag(fv, name: str):
  """A flag's value, None for a flag this command does not define."""
  return fv[name].value if name in fv else None


def _parse(command: str, argv: list[str]):
  """(config, flag values) of a command line; a UserError names what is wrong and the fix."""
  from absl import flags
  from ml_collections import config_flags

  from distillax.errors import UserError

  fv = flags.FlagValues()
  flag_argv = argv[:1] + argv[2:]
  config_arg = _flag_value(flag_argv, "config")
  if config_arg is not None and not os.path.exists(config_arg.split(":", 1)[0]):
    raise UserError(f"--config {config_arg.split(':', 1)[0]}: no such file; pass a job config "
                    f"file, e.g. --config distillax/configs/lm.py:tiny")
  # config_flags discovers `--config.a.b` overrides by scanning sys.argv when the flag is defined.
  saved_argv, sys.argv = sys.argv, flag_argv
  try:
    config_flags.DEFINE_config_file("config", None, "job config file[:arg]", flag_values=fv,
                                    lock_config=True)
    for name in COMMAND_FLAGS[command] + ("verbose",):
      kind, default, _, text = FLAGS[name]
      getattr(flags, f"DEFINE_{kind}")(name, default, text, flag_values=fv)
    fv(flag_argv)
    if fv["config"].value is None and command in CONFIG_OPTIONAL:
      return None, fv
    if fv["config"].value is None:
      raise UserError("--config is required, e.g. --config distillax/configs/lm.py:tiny")
    config = fv.config
    config.to_dict()  # a config file that failed to load raises only when first read
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 - every way a command line fails to parse is the user's
    raise UserError(_parse_error_line(e, command, flag_argv, config_arg)) from None
  finally:
    sys.argv = saved_argv
  return config, fv


def _chain(e: BaseException) -> list[BaseException]:
  """`e` and the exceptions it was raised from or while handling, outermost first."""
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def _parse_error_line(e: Exception, command: str, flag_argv: list[str],
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


def _unknown_key_line(key: str, flag_argv: list[str], defaults) -> str:
  """`--config.train.step=10`: the field that does not exist, the closest ones that do, and
  the override spelled with the closest."""
  overrides = [a[2:].split("=", 1)[0] for a in flag_argv if a.startswith("--config.")]
  path = next((o.split(".")[1:] for o in overrides if key in o.split(".")[1:]), [key])
  parent = path[:path.index(key)]
  section = _section(defaults, parent)
  known = sorted(section.keys()) if hasattr(section, "keys") else []
  where = ".".join(parent) or "the config"
  dotted = ".".join(path)
  line = f"--config.{dotted}: {where} has no field {key!r}"
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
  if close:
    value = _flag_value(flag_argv, f"config.{dotted}") or "..."
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
  value = _flag_value(flag_argv, f"config.{dotted}")
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
  words = _TYPE_WORDS.get(kind, f"a {kind.__name__}" if kind else "a value of the field's type")
  example = f", e.g. --config.{dotted}={default!r}" if default is not None else ""
  return f"--config.{dotted}={value} must be {words} ({reason}){example}"


_TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
               tuple: "a tuple, e.g. (('a', 1),)"}


def _run_job(command: str, config, fv) -> int:
  """The job a command names, with every path the user wrote made absolute (relative to the
  current directory) first; each imports only what it needs."""
  from ml_collections import config_flags

  from distillax.configs.paths import absolute, resolve_job_config
  from distillax.trainers.sources import command_line_overrides
  overrides = None
  if config is not None:
    config = resolve_job_config(config, command)
    overrides = config_flags.get_override_values(fv["config"])
  with command_line_overrides(overrides):
    return _dispatch(command, config, fv)


def _dispatch(command: str, config, fv) -> int:
  from distillax.configs.paths import absolute
  workdir, model = absolute(_flag(fv, "workdir")), absolute(_flag(fv, "model"))
  if command == "train":
    return _train(config, workdir)
  if command == "plan":
    from distillax.plan import run_plan
    return run_plan(config, devices=fv.devices, memory_gb=fv.memory_gb)
  if command == "export":
    from distillax.export import run_export
    return run_export(config, workdir, absolute(fv.output), fv.format, fv.quant)
  if command == "demo":
    from distillax.demo import run_demo
    return run_demo(config, workdir)
  if command == "generate":
    from distillax.generate import run_generate
    return run_generate(config, model, prompt=fv.prompt, messages=fv.messages,
                        max_new_tokens=fv.max_new_tokens, temperature=fv.temperature,
                        top_k=fv.top_k, top_p=fv.top_p, seed=fv.seed)
  if command == "eval":
    from distillax.evaluate import run_eval
    return run_eval(config, model)
  from distillax.cache_teacher import run_cache_teacher
  return run_cache_teacher(config, workdir)


def _train(config, workdir: str | None) -> int:
  """0 when the run finished (now or earlier); STOPPED_EXIT_CODE when a signal (SIGTERM, Ctrl-C)
  stopped it first, with a checkpoint to resume from."""
  import jax

  from distillax.errors import UserError
  from distillax.framework.preemption import STOPPED_EXIT_CODE
  from distillax.trainers import Trainer, recipe_for
  if not workdir:
    raise UserError("--workdir is required for train, e.g. --workdir runs/my_run")
  where = os.path.abspath(workdir)
  try:
    summary = Trainer(recipe_for(config, workdir=workdir), workdir).run()
  except KeyboardInterrupt:  # outside the steps (compiling, say); between steps Ctrl-C saves
    print("distillax train: interrupted; rerun the same command to resume", file=sys.stderr,
          flush=True)
    return STOPPED_EXIT_CODE
  step, total = summary.get("step"), int(config.train.steps)
  if summary.get("already_finished"):
    line, code = f"already finished at step {step}; workdir {where}", 0
  elif summary.get("finished"):
    line, code = f"done at step {step}; workdir {where}", 0
  else:
    line = f"stopped at step {step} of {total}; rerun the same command to resume"
    code = STOPPED_EXIT_CODE
  if jax.process_index() == 0:
    print(f"distillax train: {line}", flush=True)
  return code


def run() -> None:
  """Console-script entry point."""
  sys.exit(main())


if __name__ == "__main__":
  run()
