"""A workdir belongs to one job (trainers/workdir.py), through the CLI as a user meets it.

Rerunning the same job resumes it or says it already finished; another job's command is one line
naming the differing fields and the fix, exit 2, and the workdir stays byte-identical. Fields
that only say how long a job runs, how it logs or where it writes (NOT_JOB_IDENTITY) are not
part of the job.
"""

import json
import os
import shutil
import socket

import pytest

from distillax.configs import distill, draft_eagle3, lm, sections, sequence_kd
from distillax.errors import UserError
from distillax.framework.run.workdir_lock import LOCK_FILE
from distillax.main import main
from distillax.trainers.workdir import (ADDED_LATER, JOB_FILE, NOT_JOB_IDENTITY, check_workdir,
                                        job_identity, read_summary, write_summary)

from tests.support.lock_holder import holding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "distillax", "configs")
LM_TINY = ["--config", os.path.join(CONFIGS, "lm.py") + ":tiny"]
QAT_TINY = ["--config", os.path.join(CONFIGS, "qat.py") + ":tiny"]


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


def _train(workdir, *args):
  return main(["distillax", "train", "--workdir", str(workdir), *args])


def _error_line(capsys):
  err = capsys.readouterr().err.strip().splitlines()
  return [line for line in err if line.startswith("distillax")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """`train --config lm.py:tiny` run to its end (6 steps)."""
  workdir = tmp_path_factory.mktemp("runs") / "lm_tiny"
  assert _train(workdir, *LM_TINY) == 0
  return workdir


@pytest.fixture
def run_copy(finished_run, tmp_path):
  workdir = tmp_path / "lm_tiny"
  shutil.copytree(finished_run, workdir)
  return workdir


def test_the_same_job_again_is_already_finished_and_nothing_is_rewritten(finished_run, capsys):
  before = _snapshot(finished_run)
  capsys.readouterr()
  assert _train(finished_run, *LM_TINY) == 0
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert last == f"distillax train: already finished at step 6; workdir {finished_run}"
  assert _snapshot(finished_run) == before


ANOTHER_JOB = [
    ("another config file", QAT_TINY, "qat.rules"),
    ("another model", LM_TINY + ["--config.model.num_layers=4"],
     "model.num_layers: 2 there, 4 here"),
    ("another seed", LM_TINY + ["--config.seed=1"], "seed: 0 there, 1 here"),
    ("another recipe", ["--config", os.path.join(CONFIGS, "distill.py") + ":tiny"],
     'trainer: "lm" there, "distill" here'),
    ("another data order", LM_TINY + ["--config.data.shuffle_buffer=8"], "data.shuffle_buffer"),
]


@pytest.mark.parametrize("argv,fragment", [c[1:] for c in ANOTHER_JOB],
                         ids=[c[0] for c in ANOTHER_JOB])
def test_another_job_is_one_line_exit_2_and_the_workdir_is_unchanged(finished_run, capsys, argv,
                                                                     fragment):
  before = _snapshot(finished_run)
  capsys.readouterr()
  assert _train(finished_run, *argv) == 2
  lines = _error_line(capsys)
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"distillax train: error: workdir {finished_run} belongs to another "
                             f"job ("), lines[0]
  assert fragment in lines[0] and "pass a new --workdir" in lines[0], lines[0]
  assert _snapshot(finished_run) == before


def test_a_workdir_of_an_older_distillax_takes_its_identity_from_config_json(run_copy, capsys):
  (run_copy / JOB_FILE).unlink()  # what a workdir made before job.json existed holds
  before = _snapshot(run_copy)
  assert _train(run_copy, *LM_TINY, "--config.model.num_layers=4") == 2
  assert "model.num_layers: 2 there, 4 here" in _error_line(capsys)[0]
  assert _train(run_copy, *LM_TINY) == 0
  assert "already finished at step 6" in capsys.readouterr().out
  assert _snapshot(run_copy) == before


def test_a_field_newer_than_the_run_left_unset_is_the_same_job(run_copy, capsys):
  """A job.json written before model.layer_types and qat.schedule existed: this config leaves
  them None and empty, what the run trains, so the run is the same job; set, it is another.
  (train.loss_impl is how the losses are computed, never the job's identity.)"""
  job = json.loads((run_copy / JOB_FILE).read_text())
  assert job["identity"].pop("model.layer_types") is None
  assert "train.loss_impl" not in job["identity"]
  assert job["identity"].pop("qat.schedule") == []
  (run_copy / JOB_FILE).write_text(json.dumps(job))
  assert _train(run_copy, *LM_TINY) == 0
  assert "already finished at step 6" in capsys.readouterr().out
  full = "--config.model.layer_types=('full_attention', 'full_attention')"
  assert _train(run_copy, *LM_TINY, full) == 2
  assert "model.layer_types: <absent> there" in _error_line(capsys)[0]


def test_a_config_json_no_distillax_run_wrote_is_never_overwritten(tmp_path, capsys):
  workdir = tmp_path / "mine"
  workdir.mkdir()
  (workdir / "config.json").write_text('{"keep": true}')
  before = _snapshot(workdir)
  assert _train(workdir, *LM_TINY) == 2
  lines = _error_line(capsys)
  assert len(lines) == 1 and "was not written by a distillax run" in lines[0], lines
  assert "pass a new --workdir" in lines[0]
  assert _snapshot(workdir) == before


def test_more_steps_and_other_logging_continue_the_finished_run(run_copy, capsys):
  job_before = (run_copy / JOB_FILE).read_bytes()
  rows_before = (run_copy / "metrics.jsonl").read_text().splitlines()
  assert _train(run_copy, *LM_TINY, "--config.train.steps=8", "--config.train.log_every=1",
                "--config.checkpoint.every_steps=4", "--config.train.eval_every=4") == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out[-1] == f"distillax train: done at step 8; workdir {run_copy}"
  assert (run_copy / JOB_FILE).read_bytes() == job_before
  rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
  assert (run_copy / "metrics.jsonl").read_text().splitlines()[:len(rows_before)] == rows_before
  assert [r["step"] for r in rows[len(rows_before):] if "loss" in r] == [7, 8]
  assert read_summary(str(run_copy))["step"] == 8
  assert json.loads((run_copy / "config.json").read_text())["train"]["steps"] == 8


# ---- the identity itself --------------------------------------------------------------------

def _set(config, dotted, value):
  *sections, name = dotted.split(".")
  for section in sections:
    config = config[section]
  config[name] = value


def _some_value(value):
  if isinstance(value, list):  # a tuple field (model.splash_blocks): twice each entry
    return tuple(2 * v for v in value)
  if isinstance(value, bool):
    return not value
  if isinstance(value, (int, float)):
    return value + 1
  return str(value) + "_changed"


def test_only_the_listed_fields_leave_the_identity_unchanged():
  configs = [lm.get_config("tiny"), distill.get_config("tiny"), sequence_kd.get_config("tiny")]
  listed = set()
  for config in configs:
    base = job_identity(config)
    flat = json.loads(config.to_json_best_effort())
    for section, fields in flat.items():
      for name, value in (fields.items() if isinstance(fields, dict) else [(None, fields)]):
        dotted = section if name is None else f"{section}.{name}"
        if isinstance(value, dict) or (isinstance(value, list) and not (
            value and all(isinstance(v, int) for v in value))):
          continue
        changed = config.copy_and_resolve_references()
        try:  # a None that is off (model.moe_capacity_factor) takes a float; others skip
          _set(changed, dotted, 1.5 if value is None else _some_value(value))
        except TypeError:
          continue
        is_listed = dotted in NOT_JOB_IDENTITY or f"{section}." in NOT_JOB_IDENTITY
        assert (job_identity(changed) == base) == is_listed, dotted
        if is_listed:
          listed.add(dotted if dotted in NOT_JOB_IDENTITY else f"{section}.")
  assert listed == set(NOT_JOB_IDENTITY)  # every listed name exists in some job config


def test_a_finished_summary_with_fewer_steps_than_asked_is_not_finished(tmp_path):
  config = lm.get_config("tiny")
  state = check_workdir(str(tmp_path), config)
  assert not state.finished and not state.has_job_file
  (tmp_path / JOB_FILE).write_text(json.dumps({"identity": job_identity(config)}))
  write_summary(str(tmp_path), {"step": 6, "finished": True})
  assert check_workdir(str(tmp_path), config).finished
  config.train.steps = 9
  assert not check_workdir(str(tmp_path), config).finished


def test_summary_json_is_strict_json(tmp_path):
  write_summary(str(tmp_path), {"step": 3, "loss": float("nan"), "eval_loss": float("inf")})
  text = (tmp_path / "summary.json").read_text()

  def refuse(name):
    raise AssertionError(f"{name} is not JSON")

  assert json.loads(text, parse_constant=refuse) == {"step": 3, "loss": None, "eval_loss": None}


def test_the_same_job_continues_on_another_topology(run_copy):
  """Mesh, preset and backend say where a job runs, not which job it is: raising train.steps on
  a finished fsdp 8x1 run and rerunning it as fsdp_tp on 4x2 continues it from its checkpoint."""
  assert _train(run_copy, *LM_TINY, "--config.train.steps=8", "--config.mesh.data=4",
                "--config.mesh.model=2", "--config.partitioning.strategy=fsdp_tp") == 0
  rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
  train_steps = [r["step"] for r in rows if "loss" in r]
  assert train_steps == sorted(train_steps) and train_steps[-1] == 8
  assert read_summary(str(run_copy))["step"] == 8
  assert json.loads((run_copy / "config.json").read_text())["mesh"]["model"] == 2


def test_a_resume_that_only_changes_how_the_forward_computes_continues_and_logs_it(
    run_copy, capsys, caplog):
  """attention_impl and remat are declared compute fields (models/config.py): the same job,
  resumed with the change said once; the paths are tested equal elsewhere."""
  job_before = (run_copy / JOB_FILE).read_bytes()
  assert _train(run_copy, *LM_TINY, "--config.train.steps=8",
                "--config.model.attention_impl=reference", "--config.model.remat=full") == 0
  captured = capsys.readouterr()
  assert captured.out.strip().splitlines()[-1] == f"distillax train: done at step 8; workdir {run_copy}"
  said = caplog.text + captured.err
  assert 'model.attention_impl: "auto" -> "reference" (how the forward computes' in said, said
  assert 'model.remat: "none" -> "full"' in said
  assert (run_copy / JOB_FILE).read_bytes() == job_before
  model = json.loads((run_copy / "config.json").read_text())["model"]
  assert (model["attention_impl"], model["remat"]) == ("reference", "full")


def test_a_job_json_that_still_holds_a_compute_field_is_the_same_job(run_copy):
  """A workdir whose job.json was written while attention_impl was part of the identity."""
  job = json.loads((run_copy / JOB_FILE).read_text())
  job["identity"]["model.attention_impl"] = "auto"
  (run_copy / JOB_FILE).write_text(json.dumps(job))
  config = lm.get_config("tiny")
  config.model.attention_impl = "blockwise"
  state = check_workdir(str(run_copy), config)
  assert state.finished and state.changes == (
      'model.attention_impl: "auto" -> "blockwise" (how the forward computes: the same model, '
      'tested equal)',)


def test_a_run_from_before_mixtures_of_experts_is_the_same_dense_job(run_copy, capsys):
  """A job.json written before the MoE fields existed: a dense model without router losses is
  the job it ran; experts (or a router loss) make another."""
  job = json.loads((run_copy / JOB_FILE).read_text())
  for name in ("model.num_experts", "model.num_experts_per_tok", "model.moe_mlp_dim",
               "model.router", "model.norm_topk_prob", "train.moe_aux_loss",
               "train.router_z_loss"):
    del job["identity"][name]
  (run_copy / JOB_FILE).write_text(json.dumps(job))
  assert _train(run_copy, *LM_TINY) == 0
  assert "already finished at step 6" in capsys.readouterr().out
  assert _train(run_copy, *LM_TINY, "--config.model.num_experts=4") == 2
  assert "model.num_experts: <absent> there, 4 here" in _error_line(capsys)[0]


def test_an_unwritable_workdir_is_refused_before_the_step_is_built(tmp_path, capsys,
                                                                   monkeypatch):
  """Issue 48: an unwritable --workdir was reported after the step's lowering, with its compile
  running (10 s). It is found with the config's other checks now: no step is built. (A path
  below a file, which root cannot write either.)"""
  from distillax.trainers.recipe import Recipe

  def no_step(self, *args, **kwargs):
    raise AssertionError("the step was built before the workdir was checked")
  monkeypatch.setattr(Recipe, "build_engines", no_step)
  (tmp_path / "a_file").write_text("")
  workdir = tmp_path / "a_file" / "run"
  assert _train(workdir, *LM_TINY) == 2
  lines = _error_line(capsys)
  assert len(lines) == 1 and f"workdir {workdir} is not writable" in lines[0], lines
  assert "pass --workdir pointing to a directory you can write" in lines[0]


def test_a_workdir_another_process_holds_is_one_line_exit_2_and_unchanged(run_copy, capsys):
  """Issue 55: the same job submitted twice (a requeue), or another job, while a process holds
  the workdir: both used to run into one workdir at once. The second is refused before anything
  compiles, naming the holder's pid and host, and the workdir is byte-identical."""
  with holding(run_copy) as holder:
    before = _snapshot(run_copy)
    for argv in ([*LM_TINY, "--config.train.steps=8"], [*LM_TINY, "--config.seed=1"]):
      capsys.readouterr()
      assert _train(run_copy, *argv) == 2
      lines = _error_line(capsys)
      assert len(lines) == 1, lines
      assert lines[0] == (
          f"distillax train: error: workdir {run_copy} is in use by another distillax process "
          f"(pid {holder.pid} on host {socket.gethostname()}); wait for it to end or stop it, "
          f"or pass a new --workdir (if that process is gone, remove {run_copy / LOCK_FILE})")
      assert _snapshot(run_copy) == before


def test_a_new_workdir_another_process_holds_gets_nothing_from_the_second(tmp_path, capsys):
  workdir = tmp_path / "new"
  with holding(workdir):
    assert _train(workdir, *LM_TINY) == 2
    assert "is in use by another distillax process" in _error_line(capsys)[0]
    assert os.listdir(workdir) == [LOCK_FILE]


def test_a_crashed_holders_lock_is_taken_over_and_released(run_copy, capsys):
  """A holder killed as a crash would leaves lock.json behind: the next command takes it over
  (here: the finished job, reported as such) and removes it at its end."""
  with holding(run_copy) as holder:
    holder.kill()
    assert (run_copy / LOCK_FILE).exists()
    capsys.readouterr()
    assert _train(run_copy, *LM_TINY) == 0
    assert "already finished at step 6" in capsys.readouterr().out
    assert not (run_copy / LOCK_FILE).exists()


def test_the_workdir_is_locked_before_the_step_is_built(tmp_path, monkeypatch, capsys):
  """The lock is held (by this process) before the step's lowering; a start that then fails
  leaves nothing of a new workdir, the folder included."""
  from distillax.framework.run.workdir_lock import WorkdirLock
  from distillax.trainers.recipe import Recipe
  workdir, seen = tmp_path / "runs" / "run", []

  def checked(self, *args, **kwargs):
    seen.append(json.loads((workdir / LOCK_FILE).read_text())["pid"])
    with pytest.raises(UserError, match="is in use by another distillax process"):
      WorkdirLock(str(workdir)).acquire(lambda w, e: e)
    raise UserError("stopped here by the test")
  monkeypatch.setattr(Recipe, "build_engines", checked)
  assert _train(workdir, *LM_TINY) == 2
  assert _error_line(capsys) == ["distillax train: error: stopped here by the test"]
  assert seen == [os.getpid()]
  assert os.listdir(tmp_path) == []


def _two_processes(workdir, logs, *argv) -> tuple[int, list[str]]:
  """(exit status, each process's last line of its own) of `distillax train` as two real
  processes of one job (4 CPU devices each)."""
  import sys

  from distillax.launch_local import launch
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  status = launch([sys.executable, "-m", "distillax", "train", "--workdir", str(workdir), *argv],
                  num_processes=2, devices_per_process=4, timeout_s=600, env=env,
                  log_dir=str(logs))
  # gloo's C++ connection lines ("[Gloo] Rank 0 is connected to 1 peer ranks...") reach the log
  # before or after Python's, as the two streams flush: not distillax's lines.
  ours = lambda i: [line for line in (logs / f"process_{i}.log").read_text().strip().splitlines()
                    if not line.startswith("[Gloo]")]
  return status, [ours(i)[-1] for i in (0, 1)]


def test_the_processes_of_one_job_share_its_lock_and_end_together_when_refused(run_copy,
                                                                                tmp_path):
  """Process 0 takes the lock for the job: its other process is not refused by it (the finished
  job is reported by both), and when another process holds the workdir, both end at once, exit
  2, each in one line (the other process used to fail 30 s later in a collective)."""
  status, last = _two_processes(run_copy, tmp_path / "logs", *LM_TINY)
  assert status == 0, last
  assert last[0] == f"distillax train: already finished at step 6; workdir {run_copy}"
  before = _snapshot(run_copy)
  with holding(run_copy) as holder:
    status, last = _two_processes(run_copy, tmp_path / "refused", *LM_TINY)
  assert status == 2, last
  assert f"is in use by another distillax process (pid {holder.pid} on host" in last[0], last
  assert last[1] == (f"distillax train: error: process 0 could not take the lock of workdir "
                     f"{run_copy}; its line says why"), last
  assert _snapshot(run_copy) == before


def test_the_draft_fields_added_later_are_their_sections_defaults():
  """ADDED_LATER repeats the defaults of the fields a draft config gained with draft.regenerate
  (the trainers floor cannot import the config sections): they must stay those defaults, or an
  older draft run would read as another job."""
  added = {k: v for k, v in ADDED_LATER.items() if k.startswith(("sequence_kd.", "draft."))}
  defaults = {f"sequence_kd.{k}": v for k, v in sections.sequence_kd_section().items()
              if k != "output"}
  defaults["draft.regenerate"] = draft_eagle3.draft_section().regenerate
  assert added == defaults
