"""`--config.model.preset=NAME` beside `--config.teacher.preset=...` (issue 48, item 5): the
student takes NAME's shape fields, keeps the config's storage and compute fields and vocabulary,
and the other `--config.model.*` values apply on top in either order; a student with a source,
an unknown name, and a field that does not exist are one line naming the flag at fault."""

import dataclasses

import pytest

from distillax.main import _parse, main
from distillax.models.config import SHAPE, fields_of_kind
from distillax.models.presets import get_preset
from tests.test_main import ROOT

DISTILL = f"{ROOT}/distillax/configs/distill.py"


def _config(*flags):
  config, _ = _parse("plan", ["distillax", "plan", "--config", *flags])
  return config


@pytest.mark.parametrize("first", [True, False])
def test_the_student_preset_gives_its_shape_and_the_config_keeps_how_it_runs(first):
  preset, override = "--config.model.preset=qwen3-0.6b", "--config.model.num_layers=3"
  flags = [preset, override] if first else [override, preset]
  config = _config(f"{DISTILL}:llama", "--config.teacher.preset=llama3.1-8b", *flags)
  want = dataclasses.asdict(get_preset("qwen3-0.6b"))
  for name in set(fields_of_kind(SHAPE)) - {"vocab_size", "num_layers"}:
    got = config.model[name]
    assert (tuple(got) if isinstance(got, list) else got) == want[name], name
  assert config.model.num_layers == 3  # the command line's value, whatever the order
  assert want["num_layers"] != 3 and want["embed_dim"] != get_preset("llama3.2-1b").embed_dim
  # distill.py:llama's own: fp32 master weights, bf16 compute, full remat, Llama's vocabulary
  # (the teacher's, which the student shares).
  assert (config.model.param_dtype, config.model.dtype, config.model.remat) == (
      "float32", "bfloat16", "full")
  assert config.model.vocab_size == get_preset("llama3.2-1b").vocab_size
  assert config.teacher.preset == "llama3.1-8b"


def _error(capsys, *flags) -> str:
  capsys.readouterr()
  assert main(["distillax", "plan", "--config", f"{DISTILL}:tiny", *flags]) == 2
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert len(err) == 1 and captured.out == "", captured
  return err[0]


def test_a_field_missing_from_one_section_blames_that_section(capsys):
  """teacher.int8 exists, model.int8 does not: the line names the model's flag."""
  line = _error(capsys, "--config.teacher.int8=True", "--config.model.int8=True")
  assert "--config.model.int8: model has no field 'int8'" in line, line
  assert "teacher has no field" not in line


def test_a_student_preset_with_a_student_source_or_unknown_name_is_one_line(capsys):
  line = _error(capsys, "--config.model.preset=tiny", "--config.student.hf_path=/nowhere")
  assert ("--config.model.preset=tiny gives a fresh student its shape, but "
          "student.hf_path='/nowhere' gives the student its weights") in line, line
  line = _error(capsys, "--config.model.preset=llama9")
  assert "--config.model.preset='llama9': no such preset; choose one of tiny," in line, line


def test_a_preset_pair_of_another_family_plans_with_its_own_vocabulary():
  """distill.py:llama's model section came with Llama 3's 128,256-row table; naming a Qwen3
  student and teacher replaces it with Qwen3's 151,936 for both models (issue 55: they were
  planned with Llama's), while a student whose table is its teacher preset's keeps it."""
  from distillax.trainers import recipe_for
  config = _config(f"{DISTILL}:llama", "--config.model.preset=qwen3-0.6b",
                   "--config.teacher.preset=qwen3-1.7b")
  assert config.model.vocab_size == get_preset("qwen3-0.6b").vocab_size == 151_936
  recipe = recipe_for(config)
  assert recipe.model_config.vocab_size == recipe.teacher_model_config.vocab_size == 151_936
  deepseek = _config(f"{ROOT}/distillax/configs/distill_deepseek.py",
                     "--config.model.preset=qwen3-0.6b")
  assert deepseek.model.vocab_size == get_preset("deepseek-v3").vocab_size == 129_280
  chosen = _config(f"{DISTILL}:llama", "--config.model.preset=qwen3-0.6b",
                   "--config.teacher.preset=qwen3-1.7b", "--config.model.vocab_size=151_680")
  assert chosen.model.vocab_size == 151_680
