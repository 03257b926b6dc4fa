"""The command line's tables agree with each other: every command has a job and every flag a
command reads is described; `--help` says which export format is legacy; a host without a TPU
hears nothing from libtpu."""

import importlib.util
import os
import subprocess
import sys

import pytest

from distillax.cli import host_platforms
from distillax.cli.dispatch import JOBS
from distillax.cli.flags import COMMAND_FLAGS, COMMANDS, FLAGS, PATH_FLAGS
from distillax.main import main
from tests.test_main import LM, ROOT


def test_every_command_has_a_job_and_every_flag_it_reads_is_described():
  assert sorted(JOBS) == sorted(COMMANDS) == sorted(COMMAND_FLAGS)
  read = {f for flags in COMMAND_FLAGS.values() for f in flags} | {"verbose"}
  assert sorted(read) == sorted(FLAGS)
  assert set(PATH_FLAGS) <= set(FLAGS)


def test_help_marks_the_quantized_format_legacy(capsys):
  assert main(["distillax", "export", "--help"]) == 0
  out = capsys.readouterr().out
  format_line = next(line for line in out.splitlines() if line.strip().startswith("--format"))
  assert "hf" in format_line and "gguf" in format_line and "quantized (legacy" in format_line
  assert main(["distillax", "--help"]) == 0
  export_line = next(line for line in capsys.readouterr().out.splitlines()
                     if line.strip().startswith("export "))
  assert "legacy quantized format" in export_line


# What libtpu prints when JAX tries it on a host without a TPU (issue 48).
TPU_RUNTIME_LINES = ("Failed to find host bounds", "Logging before InitGoogle",
                     "TPU_WORKER_HOSTNAMES", "libtpu")


def _user_env() -> dict:
  """This process's environment as a user's shell has it (none of the JAX, XLA or libtpu
  settings tests/conftest.py adds), but for ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu stays quiet
  while another process on the machine holds its lock file, and must not here."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_PLATFORMS", "TPU_", "XLA_FLAGS", "ALLOW_MULTIPLE_LIBTPU"))}
  return {**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONPATH": ROOT}


@pytest.fixture(scope="module")
def plain_jax_is_noisy():
  """The premise, where libtpu (the aot extra) is installed: JAX alone prints libtpu's lines."""
  if importlib.util.find_spec("libtpu") is not None:
    plain = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=_user_env(),
                           capture_output=True, text=True, check=True)
    assert any(line in plain.stderr for line in TPU_RUNTIME_LINES), plain.stderr


@pytest.mark.parametrize("args,rc,says", [
    # starts JAX's backends: its dense-model refusal comes after the mesh is made
    (["expert-load", "--config", f"{LM}:tiny"], 2, "is a dense model"),
    # loads libtpu for compile-only TPU devices
    (["plan", "--config", f"{LM}:tiny", "--target", "tpu:v5e-4"], 0, "compiled jit step"),
])
def test_a_cli_command_on_this_host_without_a_tpu_prints_no_tpu_runtime_line(
    plain_jax_is_noisy, args, rc, says):
  """A command prints only its own lines, though JAX alone prints libtpu's lines here."""
  env = _user_env()
  done = subprocess.run([sys.executable, "-m", "distillax.main", *args], env=env,
                        capture_output=True, text=True, cwd=ROOT)
  assert done.returncode == rc and says in done.stderr, done.stderr[-3000:]
  noise = [line for line in done.stderr.splitlines()
           if any(part in line for part in TPU_RUNTIME_LINES)]
  assert not noise, noise


@pytest.mark.parametrize("chips,platforms", [(0, "cpu"), (4, None)])
def test_jax_keeps_a_tpu_hosts_chip_and_runs_a_host_without_one_on_cpu(monkeypatch, chips,
                                                                       platforms):
  """The decision takes JAX's own test of the host: a host with TPU chips on its PCI bus keeps
  JAX's choice (JAX_PLATFORMS unset: JAX picks the TPU); one without runs on the CPU; a user's
  JAX_PLATFORMS always stands."""
  from jax._src import hardware_utils
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
  monkeypatch.setattr(host_platforms, "_libtpu_installed", lambda: True)
  monkeypatch.setattr(host_platforms, "_tpu_device_nodes", lambda: False)
  monkeypatch.setattr(host_platforms, "_gpu_present", lambda hardware: False)
  monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                      lambda: (chips, hardware_utils.TpuVersion.v5e if chips else None))
  assert host_platforms.cpu_only_platforms() == platforms
  monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
  assert host_platforms.cpu_only_platforms() is None


@pytest.mark.parametrize("command", ["plan", "export", "eval"])
def test_ctrl_c_outside_a_run_exits_130_never_plans_does_not_fit_3(command, monkeypatch,
                                                                    capsys, tmp_path):
  """Issue 55: `plan` interrupted by Ctrl-C exited 3, which is also its DOES NOT FIT. A command
  Ctrl-C ends with nothing to resume exits 130 (128 + SIGINT) with one line and no advice to
  rerun. The Ctrl-C lands where a user's would: inside the command's job."""
  from distillax.cli import dispatch
  from distillax.interrupts import INTERRUPTED_EXIT_CODE

  def pressed(config, flags):
    raise KeyboardInterrupt
  monkeypatch.setitem(dispatch.JOBS, command, pressed)
  argv = {"plan": ["--config", LM],
          "export": ["--config", LM, "--workdir", str(tmp_path), "--output", str(tmp_path / "o")],
          "eval": ["--config", LM, "--model", str(tmp_path)]}[command]
  capsys.readouterr()
  assert main(["distillax", command, *argv]) == INTERRUPTED_EXIT_CODE == 130
  assert capsys.readouterr().err.strip().splitlines() == [f"distillax {command}: interrupted"]


def test_ctrl_c_before_trains_job_resumes_only_where_a_step_was_saved(tmp_path, monkeypatch,
                                                                     capsys):
  """A train command interrupted before its run started: 3 and "resume from step N" when its
  workdir holds a checkpoint (an earlier session's), else 130 and "nothing was saved"."""
  from distillax.cli import dispatch
  from distillax.interrupts import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE

  def pressed(config, flags):
    raise KeyboardInterrupt
  monkeypatch.setitem(dispatch.JOBS, "train", pressed)
  argv = ["distillax", "train", "--config", LM, "--workdir", str(tmp_path / "run")]
  capsys.readouterr()
  assert main(argv) == INTERRUPTED_EXIT_CODE
  assert capsys.readouterr().err.strip().splitlines() == [
      "distillax train: interrupted before its first step; nothing was saved"]
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
  (tmp_path / "run" / "checkpoints" / "8").mkdir()
  assert main(argv) == STOPPED_EXIT_CODE
  assert capsys.readouterr().err.strip().splitlines() == [
      "distillax train: interrupted; rerun the same command to resume from step 8"]
