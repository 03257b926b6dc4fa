"""What a checkpoint holds (trainers/saved.py): what the run changes, never a frozen model that a
source gives back. A teacher (here a Hugging Face directory) and a LoRA base are reloaded on
resume, the resumed run ends where the uninterrupted one ends, a changed teacher is refused in
one line, and loading a distilled student reads no teacher.
"""

import filecmp
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from distillax.data import make_tokenizer, padded_vocab_size
from distillax.main import main
from distillax.models import hf
from distillax.models.config import get_preset
from distillax.models.init import create_model
from distillax.trainers import load_trained_model
from tests.trainers.test_base import _flatten

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "distillax", "configs")


def _train(config: str, workdir, *extra, steps: int = 4) -> int:
  return main(["distillax", "train", "--config", os.path.join(CONFIGS, config),
               "--workdir", str(workdir), f"--config.train.steps={steps}",
               "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=3",
               "--config.train.eval_every=0", "--config.optimizer.warmup_steps=1", *extra])


def _saved(workdir, step: int) -> dict:
  """The arrays of a checkpoint step, as a flat {path: array} dict."""
  tree = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
  return {k: np.asarray(v) for k, v in _flatten(tree).items()}


def _write_teacher(path, seed: int) -> None:
  tokenizer = make_tokenizer("byte")
  cfg = get_preset("tiny").replace(vocab_size=padded_vocab_size(tokenizer))
  hf.save(create_model(cfg, seed=seed), path, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
  """(workdir, teacher dir) of a 4-step distillation from a Hugging Face teacher."""
  teacher = tmp_path_factory.mktemp("teacher")
  _write_teacher(teacher, seed=7)
  workdir = tmp_path_factory.mktemp("runs") / "kd"
  assert _train("distill.py:tiny", workdir, f"--config.teacher.hf_path={teacher}") == 0
  return workdir, teacher


def _resume_from_step_2(workdir, into, config: str, *extra) -> dict:
  """Final arrays of a copy of `workdir` rolled back to its step-2 checkpoint and rerun."""
  shutil.copytree(workdir, into)
  shutil.rmtree(into / "checkpoints" / "4")
  os.remove(into / "summary.json")
  assert _train(config, into, *extra) == 0
  return _saved(into, 4)


def test_a_distillation_checkpoint_holds_no_teacher_and_resumes_exactly(distilled, tmp_path):
  workdir, teacher = distilled
  saved = _saved(workdir, 4)
  assert not [k for k in saved if k.startswith("frozen/teacher")]
  assert any(k.startswith("params/model/") for k in saved)
  assert any(k.startswith("opt_state/") for k in saved)
  resumed = _resume_from_step_2(workdir, tmp_path / "resumed", "distill.py:tiny",
                                f"--config.teacher.hf_path={teacher}")
  assert resumed.keys() == saved.keys()
  for key, value in saved.items():
    np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_a_changed_teacher_is_refused_on_resume_and_nothing_is_written(distilled, tmp_path,
                                                                         capsys):
  workdir, _ = distilled
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  other = tmp_path / "other_teacher"
  _write_teacher(other, seed=8)  # same shapes, other weights: only the fingerprint tells
  capsys.readouterr()
  assert _train("distill.py:tiny", copy, f"--config.teacher.hf_path={other}", steps=6) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert f"teacher.hf_path={other}" in err[0] and "changed since checkpoint step 4" in err[0]
  assert "start a new workdir" in err[0]
  compared = filecmp.dircmp(workdir, copy)
  assert not (compared.left_only or compared.right_only or compared.diff_files)


def test_loading_a_distilled_student_reads_no_teacher(distilled, tmp_path):
  workdir, teacher = distilled
  copy, gone = tmp_path / "kd", tmp_path / "teacher_gone"
  shutil.copytree(workdir, copy)
  shutil.move(teacher, gone)  # the teacher's directory no longer exists
  try:
    model = load_trained_model(str(copy), None, None)
  finally:
    shutil.move(gone, teacher)
  saved = _saved(copy, 4)
  from flax import nnx
  got = _flatten(nnx.to_pure_dict(nnx.state(model)))
  for key, value in got.items():
    np.testing.assert_array_equal(np.asarray(value), saved[f"params/model/{key}"], err_msg=key)


def test_a_lora_checkpoint_holds_no_frozen_base_and_resumes_onto_another_mesh(tmp_path):
  workdir = tmp_path / "lora"
  assert _train("lora.py:tiny", workdir) == 0
  saved = _saved(workdir, 4)
  assert not [k for k in saved if k.startswith("frozen/")], "the frozen base was stored"
  assert [k for k in saved if k.startswith("params/")]
  resumed = _resume_from_step_2(workdir, tmp_path / "resumed", "lora.py:tiny",
                                "--config.mesh.data=4", "--config.mesh.model=2",
                                "--config.partitioning.strategy=fsdp_tp")
  for key, value in saved.items():
    np.testing.assert_allclose(resumed[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
