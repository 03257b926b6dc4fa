"""benchmarks/lib/prologue.py and subproc.py: the device count reaches JAX from `--devices`
(other XLA flags kept, also in child processes), a bad count is one line and exit 2, and the
benchmarks folder no longer shadows packages named like its scripts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import prologue, subproc

ROOT = Path(__file__).resolve().parents[2]
KEPT = "--xla_backend_optimization_level=0"  # any XLA flag of the user's, besides the count


@pytest.mark.parametrize("argv,want", [
    (["--quick", "--devices", "4"], 4), (["--devices=2", "--out", "x"], 2),
    (["--devices", "2", "--devices", "3"], 3),  # the last one, as argparse takes it
    (["--devices", "0"], None), (["--devices", "x"], None), (["--devices"], None),
    (["--quick"], None)])
def test_devices_in_argv(argv, want):
  assert prologue.devices_in(argv) == want


def test_the_count_reaches_jax_and_other_flags_stay(tmp_path):
  """Run from inside benchmarks/ (Python puts a script's folder first on sys.path): after the
  prologue, `qat` no longer resolves to benchmarks/qat.py."""
  code = ("import importlib.util, json, os, sys; sys.argv = ['x', '--devices', '3']; "
          "from benchmarks.lib import prologue; prologue.start('__main__', default_devices=1); "
          "import jax; print(json.dumps({'devices': jax.device_count(), "
          "'flags': os.environ['XLA_FLAGS'], 'qat': importlib.util.find_spec('qat') is None}))")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"{KEPT} --xla_force_host_platform_device_count=8"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out["devices"] == 3
  assert out["flags"].split() == [KEPT, "--xla_force_host_platform_device_count=3"]
  assert out["qat"]  # benchmarks/ is off sys.path


def test_a_child_process_keeps_the_parents_other_xla_flags(tmp_path, monkeypatch):
  child = tmp_path / "child.py"
  child.write_text(
      "import argparse, json, os\n"
      "p = argparse.ArgumentParser(); p.add_argument('--devices'); p.add_argument('--child-out')\n"
      "a = p.parse_args()\n"
      "json.dump({'devices': a.devices, 'flags': os.environ.get('XLA_FLAGS', '')}, "
      "open(a.child_out, 'w'))\n")
  monkeypatch.setenv("XLA_FLAGS", f"{KEPT} --xla_force_host_platform_device_count=8")
  result = subproc.run_child(child, 2, [], echo=False)
  assert result["devices"] == "2" and KEPT in result["flags"].split()


def test_a_bad_device_count_is_one_line_and_exit_2(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), "--quick",
                         "--devices", "0", "--json", str(tmp_path / "a.json")], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.splitlines()[-1] == (
      "accelerator.py: error: argument --devices: '0' is not a positive whole number")
  assert not (tmp_path / "a.json").exists()  # nothing written


def test_a_running_jax_is_kept_with_its_count_and_refused_with_another(monkeypatch, capsys):
  """A test runs a script inside its own process (8 devices): the prologue keeps that JAX when
  the script asks for 8, and stops in one line with exit 2 when it asks for another count."""
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.setattr(sys, "argv", ["qat.py", "--devices", "8"])
  monkeypatch.setattr(prologue, "_started", None)
  flags = os.environ.get("XLA_FLAGS")
  prologue.start("__main__", default_devices=1)
  assert prologue.started() == prologue.Devices(1, 8)
  assert os.environ.get("XLA_FLAGS") == flags  # nothing written for a JAX that already runs
  monkeypatch.setattr(sys, "argv", ["qat.py"])
  with pytest.raises(SystemExit) as stop:
    prologue.start("__main__", default_devices=1)
  assert stop.value.code == 2
  assert capsys.readouterr().err.splitlines() == [
      "qat.py: error: JAX already runs with 8 devices, this run asks for --devices 1: run the "
      "script in its own process"]
