"""When `distillax train` opens the devices (distillax/cli/devices.py, framework/run/runtime.py):
in a thread as soon as JAX is imported, unless the command line or the environment launch one
of several processes (JAX's distributed runtime must start before any backend does); a config
file that asks for that runtime itself is refused with the command-line form; and an error
opening the devices is raised in the job's own thread, as it was when the job opened them.
(tests/trainers/test_first_step.py checks the first step's line under the CLI;
tests/trainers/test_workdir.py runs `train` as two processes launched through the environment.)
"""

import os
import subprocess
import sys

import jax
import pytest

from distillax.cli.devices import opens_devices_early
from distillax.framework.run import runtime
from distillax.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = os.path.join(ROOT, "distillax", "configs", "lm.py")
ENV = runtime.DISTRIBUTED_ENV


@pytest.fixture
def one_process(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_train_opens_its_devices_early_unless_several_processes_are_launched(one_process):
  argv = ["--config", f"{LM}:tiny", "--workdir", "runs/x"]
  assert opens_devices_early("train", argv)
  for flag in (["--num_processes=2"], ["--coordinator_address", "10.0.0.1:8476"],
               ["--process_id", "0"], ["--config.runtime.auto_detect=True"]):
    assert not opens_devices_early("train", argv + flag), flag
  for name in ENV:
    one_process.setenv(name, "1")
    assert not opens_devices_early("train", argv), name
    one_process.delenv(name)
  one_process.setenv("JAX_PROCESS_ID", "")  # set but empty: not a launch
  assert opens_devices_early("train", argv)
  for command in ("plan", "eval", "export", "generate", "cache-teacher", "demo", "expert-load"):
    assert not opens_devices_early(command, argv), command


def test_a_config_file_asking_for_the_distributed_runtime_is_refused_with_the_flag(
    one_process, tmp_path, capsys):
  """The config file is read after the devices started opening: its runtime section cannot
  be honoured any more, and the one line says what to type instead. Nothing joined a runtime,
  nothing was written."""
  config = tmp_path / "pod.py"
  config.write_text("from distillax.configs import lm\n\n\ndef get_config(arg=None):\n"
                    "  c = lm.get_config('tiny')\n  c.runtime.auto_detect = True\n  return c\n")
  workdir = tmp_path / "run"
  assert main(["distillax", "train", "--config", str(config), "--workdir", str(workdir)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("distillax train: error: the config file sets "
                                             "config.runtime"), err
  assert "--config.runtime.auto_detect=True" in err[0] and "--coordinator_address" in err[0]
  assert not jax.distributed.is_initialized() and not workdir.exists()
  assert runtime.wait_for_early_devices() is None  # main waited for its thread before returning


def _train_without_a_platform(tmp_path, *flags) -> tuple[int, list[str]]:
  """(exit status, stderr lines) of `train` in a process whose JAX platform does not exist."""
  env = dict(os.environ, JAX_PLATFORMS="nonexistent",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for name in ENV:
    env.pop(name, None)
  done = subprocess.run([sys.executable, "-m", "distillax", "train", "--config", f"{LM}:tiny",
                         "--workdir", str(tmp_path / "run"), *flags], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  return done.returncode, done.stderr.strip().splitlines()


def test_an_error_opening_the_devices_early_is_raised_where_the_job_needs_them(tmp_path):
  """The early thread's error comes out of the recipe (the job's thread), not as a thread's
  traceback: the same exit status and last line as a run that opens its devices itself (a
  --config.runtime.* flag turns the early start off)."""
  early_rc, early = _train_without_a_platform(tmp_path)
  plain_rc, plain = _train_without_a_platform(tmp_path, "--config.runtime.auto_detect=False")
  assert early_rc == plain_rc == 1
  assert early[-1] == plain[-1] and "Unable to initialize backend 'nonexistent'" in early[-1]
  assert any("wait_for_early_devices" in line for line in early), early
  assert not any("wait_for_early_devices" in line for line in plain), plain
  assert not any("Exception in thread" in line for line in early), early
  assert not (tmp_path / "run").exists()
