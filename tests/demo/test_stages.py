"""The demo's stage reuse goes by the same job identity as every run (trainers/workdir.py): a
stage directory is reused only when it holds this demo config's stage, finished; a stage of
another demo config is one line and exit 2 with nothing changed; Ctrl-C stops the demo cleanly.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from distillax.configs import demo, lm
from distillax.demo.stages import TRAINED_STAGES, stage_config, stage_finished
from distillax.framework.run.preemption import STOPPED_EXIT_CODE
from distillax.main import main
from distillax.trainers.workdir import check_workdir, prepare_workdir, write_summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "distillax", "configs", "demo.py")


def _snapshot(folder):
  """Every file's bytes and every directory, recursively."""
  out = {}
  for parent, dirs, files in os.walk(folder):
    rel = os.path.relpath(parent, folder)
    out.update({os.path.join(rel, d) + "/": None for d in dirs})
    for name in files:
      with open(os.path.join(parent, name), "rb") as f:
        out[os.path.join(rel, name)] = f.read()
  return out


def _as_if_trained(workdir, config):
  """`workdir` holding `config`'s job finished, as the workdir code writes it (no training)."""
  prepare_workdir(check_workdir(str(workdir), config), config, primary=True)
  write_summary(str(workdir), {"step": int(config.train.steps), "finished": True})


@pytest.fixture
def tiny_demo_workdir(tmp_path):
  """The files a finished `distillax demo --config demo.py:tiny` leaves that decide reuse."""
  workdir = tmp_path / "demo"
  tiny = demo.get_config("tiny")
  for stage in TRAINED_STAGES:
    _as_if_trained(workdir / stage, stage_config(tiny, stage, str(workdir)))
  (workdir / "config.json").write_text(tiny.to_json_best_effort(indent=2, sort_keys=True))
  return workdir


def _stages_finished(config, workdir):
  return {s: stage_finished(s, str(workdir / s), stage_config(config, s, str(workdir)))
          for s in TRAINED_STAGES}


def test_the_same_demo_config_reuses_every_stage(tiny_demo_workdir):
  finished = _stages_finished(demo.get_config("tiny"), tiny_demo_workdir)
  assert finished == {s: True for s in TRAINED_STAGES}


def test_more_qat_steps_continue_only_the_stages_that_run_them(tiny_demo_workdir):
  config = demo.get_config("tiny")
  config.qat_steps = 5
  finished = _stages_finished(config, tiny_demo_workdir)
  assert finished == {"teacher": True, "student_scratch": True, "student_kd": True,
                      "student_kd_fp": False, "student_qat_int4": False,
                      "student_qat_progressive": False, "student_onpolicy": False,
                      "student_qad_q4_0": False}


def _demo(workdir, config_arg, capsys):
  capsys.readouterr()
  code = main(["distillax", "demo", "--config", config_arg, "--workdir", str(workdir)])
  return code, [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("distillax")]


def test_the_full_demo_into_a_tiny_demo_workdir_is_one_line_and_changes_nothing(
    tiny_demo_workdir, capsys):
  before = _snapshot(tiny_demo_workdir)
  code, lines = _demo(tiny_demo_workdir, DEMO, capsys)
  assert code == 2 and len(lines) == 1, lines
  teacher = tiny_demo_workdir / "teacher"
  assert lines[0].startswith(f"distillax demo: error: demo stage teacher ({teacher}) belongs to "
                             f"another job (model."), lines[0]
  assert "pass a new --workdir" in lines[0]
  assert _snapshot(tiny_demo_workdir) == before


def test_the_demo_into_another_runs_workdir_is_one_line_and_changes_nothing(tmp_path, capsys):
  workdir = tmp_path / "lm_run"
  _as_if_trained(workdir, lm.get_config("tiny"))
  before = _snapshot(workdir)
  code, lines = _demo(workdir, f"{DEMO}:tiny", capsys)
  assert code == 2 and len(lines) == 1, lines
  assert "is not a demo's" in lines[0] and "pass a new --workdir" in lines[0], lines[0]
  assert _snapshot(workdir) == before


def test_ctrl_c_stops_the_demo_with_one_line_and_a_checkpoint(tmp_path):
  workdir = tmp_path / "demo"
  # The session's XLA_FLAGS (tests/conftest.py): its 8 devices and its cheap compile, which
  # changes how fast the teacher's step runs, not how the demo stops.
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  cmd = [sys.executable, "-m", "distillax", "demo", "--config", f"{DEMO}:tiny",
         "--config.teacher_steps=200", "--workdir", str(workdir)]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  metrics = workdir / "teacher" / "metrics.jsonl"
  deadline = time.time() + 600
  while not (metrics.exists() and '"loss"' in metrics.read_text()):
    assert proc.poll() is None and time.time() < deadline, "the teacher never logged a step"
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == STOPPED_EXIT_CODE, out[-3000:]
  assert "Traceback" not in out
  last = re.fullmatch(r"distillax demo: stopped at step (\d+) of 200 \(stage teacher\); rerun "
                      r"the same command to resume", out.strip().splitlines()[-1])
  assert last, out[-1000:]
  stopped = int(last.group(1))
  assert (workdir / "teacher" / "checkpoints" / str(stopped)).is_dir()
  summary = json.loads((workdir / "teacher" / "summary.json").read_text())
  assert summary["finished"] is False and summary["step"] == stopped
