"""`--config.KEY=VALUE` on `eval`, `export` and `generate` without `--config FILE`: the run's
own config.json is the config the overrides apply to.

These commands read a run (`--model`, or `export`'s `--workdir`), whose config.json already says
everything the run was; a user who wants another eval split or another mesh should not have to
retype the train flags in a config file. With `--config FILE` the file is the base instead (its
data, mesh and eval sizes; the run's model section still decides the model), as before.
A Hugging Face directory has no distillax config: overrides there need `--config FILE`.
"""

from __future__ import annotations

import os

from distillax.cli.flags import flag_value
from distillax.errors import UserError

# Which flag names the run each config-optional command reads.
RUN_FLAG = {"eval": "model", "generate": "model", "export": "workdir"}


def has_overrides(flag_argv: list[str]) -> bool:
  return any(a.startswith("--config.") for a in flag_argv)


def run_config_base(command: str, flag_argv: list[str]):
  """The ConfigDict of the run the command reads (its config.json), the base of the command
  line's `--config.*` overrides; a UserError when there is no run to take it from."""
  from distillax.trainers import is_hf_checkpoint, load_run_config
  name = RUN_FLAG[command]
  run = flag_value(flag_argv, name)
  if not run:
    raise UserError(f"--config.KEY=VALUE sets a field of a config: give --{name} (a run, whose "
                    f"config.json is the base) or --config FILE")
  run = os.path.abspath(run)
  if is_hf_checkpoint(run):
    raise UserError(f"--{name} {run} is a Hugging Face checkpoint, which has no distillax config "
                    f"for --config.KEY=VALUE to set; add --config FILE naming the job, e.g. "
                    f"--config distillax/configs/lm.py:tiny")
  return _overridable(load_run_config(run, f"--{name}"))


def _overridable(config):
  """`config` whose None fields take a value of any type: config.json keeps no type for them
  (config_flags refuses to override a NoneType field), and the job checks the values anyway."""
  from ml_collections import config_dict
  with config.unlocked():
    for key, value in list(config.items()):
      if isinstance(value, config_dict.ConfigDict):
        _overridable(value)
      elif value is None:
        config[key] = config_dict.placeholder(object)
  return config
