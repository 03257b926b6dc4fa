"""What a checkpoint holds (trainers/saved.py): what the run changes, never a frozen model that a
source gives back. A teacher (here a Hugging Face directory) and a LoRA base are reloaded on
resume, the resumed run ends where the uninterrupted one ends, a changed teacher is refused in
one line, and loading a distilled student reads no teacher.
"""

import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from distillax.data import make_tokenizer, padded_vocab_size
from distillax.errors import UserError
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from distillax.trainers import load_trained_model
from distillax.trainers.saved import SOURCES_KEY, check_fingerprints
from distillax import partitioning as pt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "distillax", "configs")


def _train(config: str, workdir, *extra, steps: int = 4) -> int:
  return main(["distillax", "train", "--config", os.path.join(CONFIGS, config),
               "--workdir", str(workdir), f"--config.train.steps={steps}",
               "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=3",
               "--config.train.eval_every=0", "--config.optimizer.warmup_steps=1", *extra])


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry))))


def _flat(tree) -> dict:
  """{'params/model/layers/0/attn/k': array, ...}: orbax writes every key as a string."""
  return {"/".join(_key(e) for e in p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _saved(workdir, step: int) -> dict:
  """The arrays of a checkpoint step, as a flat {path: array} dict."""
  return _flat(ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state"))


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
  assert not [k for k in saved if "teacher" in k]
  assert any(k.startswith("params/model/") for k in saved)
  assert any(k.startswith("opt_state/") for k in saved)
  resumed = _resume_from_step_2(workdir, tmp_path / "resumed", "distill.py:tiny",
                                f"--config.teacher.hf_path={teacher}")
  assert resumed.keys() == saved.keys()
  for key, value in saved.items():
    np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def _snapshot(folder) -> dict:
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file()}


def test_a_changed_teacher_is_refused_on_resume_and_nothing_is_written(tmp_path, capsys):
  teacher, workdir = tmp_path / "teacher", tmp_path / "kd"
  _write_teacher(teacher, seed=7)
  assert _train("distill.py:tiny", workdir, f"--config.teacher.hf_path={teacher}", steps=2) == 0
  shutil.rmtree(teacher)
  _write_teacher(teacher, seed=8)  # same shapes, other weights: only the fingerprint tells
  before = _snapshot(workdir)
  capsys.readouterr()
  assert _train("distill.py:tiny", workdir, f"--config.teacher.hf_path={teacher}", steps=4) == 2
  err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(err) == 1, err
  assert f"teacher.hf_path={teacher}" in err[0] and "changed since checkpoint step 2" in err[0]
  assert "start a new workdir" in err[0]
  assert _snapshot(workdir) == before


def test_loading_a_distilled_student_reads_no_teacher(distilled, tmp_path):
  workdir, teacher = distilled
  copy, gone = tmp_path / "kd", tmp_path / "teacher_gone"
  shutil.copytree(workdir, copy)
  shutil.move(teacher, gone)  # the teacher's directory no longer exists
  try:
    model = load_trained_model(str(copy), pt.create_mesh({"data": 8, "model": 1}),
                               pt.rules_from_config({"strategy": "fsdp"}))
  finally:
    shutil.move(gone, teacher)
  saved = _saved(copy, 4)
  got = _flat(nnx.to_pure_dict(nnx.state(model)))
  assert got
  for key, value in got.items():
    np.testing.assert_array_equal(value, saved[f"params/model/{key}"], err_msg=key)


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


def test_a_checkpoint_saved_before_the_moe_fields_keeps_its_teacher():
  """A teacher fingerprint written before the mixture-of-experts fields existed: the same dense
  teacher now (the new fields at their defaults) is the same teacher; another shape is not."""
  now = {"teacher": {"kind": "fresh", "source": "teacher.preset=tiny",
                     "config": get_preset("tiny").to_dict(), "seed_offset": 1}}
  added = ("num_experts", "num_experts_per_tok", "moe_mlp_dim", "router", "norm_topk_prob",
           "moe_impl")
  older = dict(now["teacher"], config={k: v for k, v in now["teacher"]["config"].items()
                                       if k not in added})
  check_fingerprints({"step": 3, "extra": {SOURCES_KEY: {"teacher": older}}}, now, "ckpt")
  moe_now = {"teacher": dict(now["teacher"], config=get_preset("tiny_moe").to_dict())}
  with pytest.raises(UserError, match="teacher.preset=tiny changed since checkpoint step 3"):
    check_fingerprints({"step": 3, "extra": {SOURCES_KEY: {"teacher": older}}}, moe_now, "ckpt")
