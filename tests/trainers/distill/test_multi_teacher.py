"""trainer='distill_multi_teacher': the teachers' sources, manifest and one-line refusals (the
step's math is tests/distill/test_multi_teacher.py; a tiny CLI run is tests/test_configs.py)."""

import json

import pytest

from distillax.configs import distill_multi_teacher, sections
from distillax.errors import UserError
from distillax.trainers import recipe_for
from distillax.trainers.distill.multi_teacher import MANIFEST
from distillax.trainers.sources.teachers import absolute_teacher_paths


def tiny(**distill):
  c = distill_multi_teacher.get_config("tiny")
  c.distill.update(distill)
  return c


def test_manifest_names_each_teacher_with_its_fingerprint(tmp_path):
  c = tiny()
  c.teachers[1].weight = 3.0
  recipe = recipe_for(c, workdir=str(tmp_path))
  _, extras = recipe.build(abstract=True)  # (build(abstract=False) writes it as it loads them)
  assert sorted(extras) == ["teacher:a", "teacher:b"]
  assert not (tmp_path / MANIFEST).exists()
  recipe.write_manifest()
  manifest = json.loads((tmp_path / MANIFEST).read_text())
  assert manifest["mode"] == "mixture"
  assert [(t["name"], t["weight"], t["source"]) for t in manifest["teachers"]] == [
      ("a", 1.0, "teachers[0].preset=tiny"), ("b", 3.0, "teachers[1].preset=tiny")]
  a, b = (t["fingerprint"] for t in manifest["teachers"])
  assert a == recipe.teachers[0].source.fingerprint() and a != b  # two seed streams


def test_refusals_are_one_line():
  both = tiny()
  both.teacher = sections.teacher_section()
  cases = [(both, "both a `teacher` section and a `teachers` list"),
           (tiny(teachers_mode="routing", routes=(("stdlib", "c"),)),
            "names teacher 'c', which is not one of `teachers` \\(a, b\\)"),
           (tiny(teachers_mode="routing"), "needs distill.routes")]
  elsewhere = tiny(teachers_mode="routing", routes=(("stdlib", "a"),))
  elsewhere.data.eval_source = __file__
  cases.append((elsewhere, "routing evaluates each distill.routes source's own validation"))
  zero = tiny()
  for entry in zero.teachers:
    entry.weight = 0.0
  cases.append((zero, "sum to a positive number"))
  gone = tiny()
  gone.teachers[1].hf_path = "/nonexistent/teacher_b"
  cases.append((gone, "teachers\\[1\\].hf_path"))
  derived = tiny()  # it used to be told it had no teacher section
  derived.student.from_teacher.layers = (0,)
  cases.append((derived, "copies blocks of one teacher, but this job distils from 2 \\(the "
                         "`teachers` list\\).*--config.train.init_from="))
  for config, match in cases:
    with pytest.raises(UserError, match=match) as e:
      recipe_for(config)
    assert "\n" not in str(e.value)


def test_teacher_paths_and_routes_are_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  c = tiny(teachers_mode="routing", routes=(("data/a", "a"), ("stdlib", "b")))
  c.teachers[0].workdir = "runs/teacher_a"
  out = absolute_teacher_paths(c)
  assert out.teachers[0].workdir == str(tmp_path / "runs" / "teacher_a")
  assert out.teachers[1].workdir == "" and c.teachers[0].workdir == "runs/teacher_a"
  assert out.distill.routes == ((str(tmp_path / "data" / "a"), "a"), ("stdlib", "b"))
  assert absolute_teacher_paths(out) is out
  # A config read back from a run's config.json holds the entries as dicts.
  c.teachers = [c.teachers[0].to_dict(), c.teachers[1].to_dict()]
  assert absolute_teacher_paths(c).teachers[0].workdir == out.teachers[0].workdir
