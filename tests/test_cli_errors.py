"""Error text names what the user typed (issue 31, item 6): the value of a key given twice that
did not parse; the on_policy keys, not the names their values end up under; where a student of
an HF teacher comes from; one message for every conflict a check can see. And what a command
does with an earlier run: `train.init_from` takes the run's shape, a relative path to it works
from the Python API too, and extending a finished run says at start that the schedule changes.
"""

import json
import re
import shutil

import pytest

from distillax.configs import lm
from distillax.main import main
from distillax.trainers import recipe_for
from tests.test_main import LM, ROOT

ON_POLICY = f"{ROOT}/distillax/configs/on_policy.py:tiny"
DISTILL = f"{ROOT}/distillax/configs/distill.py:tiny"
# The earlier run: lm.py:tiny with a third block (the config's own model has two).
RUN_FLAGS = ["--config.model.num_layers=3", "--config.train.eval_every=0",
             "--config.optimizer.warmup_steps=1", "--config.optimizer.learning_rate=3e-4"]


def _refused(capsys, tmp_path, *argv) -> str:
  """The one error line of a train command that must fail with status 2 and write nothing."""
  capsys.readouterr()
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), *argv])
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith("distillax train: error: "), err
  assert captured.out == "" and not (tmp_path / "wd").exists()
  return err[0]


@pytest.mark.parametrize("values", [("4", "four"), ("four", "4")])
def test_a_key_given_twice_quotes_the_value_that_does_not_parse(capsys, tmp_path, values):
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny",
                  *[f"--config.train.batch_size={v}" for v in values])
  assert "--config.train.batch_size=four must be a whole number" in line, line
  assert "batch_size=4 " not in line


@pytest.mark.parametrize("key, typed, must", [
    ("sampling_temperature", "-0.7", "0 (greedy) or more"),
    ("beta", "2", "in [0, 1]"),
    ("top_p", "0", "in (0, 1] (1 = off)"),
    ("top_k", "-1", "0 (off) or more"),
    ("temperature", "0", "more than 0"),
])
def test_on_policy_values_are_named_by_the_keys_the_user_sets(capsys, tmp_path, key, typed,
                                                              must):
  """The sampler's `temperature`, GeneralizedJSD.beta and "or None" are not what the user
  sets: on_policy.temperature is another field, and the command line cannot pass None."""
  line = _refused(capsys, tmp_path, "--config", ON_POLICY, f"--config.on_policy.{key}={typed}")
  # The value as typed; a float field shows 2 as 2.0.
  assert re.search(rf"error: on_policy\.{key}={re.escape(typed)}(\.0)? must be ", line), line
  assert must in line and f"--config.on_policy.{key}=" in line
  assert "None" not in line and "GeneralizedJSD" not in line


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
  """A Hugging Face Llama directory of vocab_size 320 with its own tokenizer.json (no weights:
  the refusal below comes from its config.json, before any weight is read)."""
  import tokenizers
  import transformers
  path = tmp_path_factory.mktemp("teacher")
  transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128).save_pretrained(path)
  vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(319)}}
  tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")).save(
      str(path / "tokenizer.json"))
  return path


@pytest.mark.parametrize("config, from_scratch", [(ON_POLICY, False), (DISTILL, True)])
def test_a_fresh_student_of_an_hf_teacher_is_told_where_students_come_from(
    capsys, tmp_path, hf_teacher, config, from_scratch):
  """Its vocabulary is the data tokenizer's, padded (384), not the teacher's 320. On-policy, a
  fresh student of 320 would learn from its own random samples: model.vocab_size is no fix."""
  line = _refused(capsys, tmp_path, "--config", config, f"--config.teacher.hf_path={hf_teacher}",
                  f"--config.data.tokenizer=hf:{hf_teacher}")
  assert f"teacher.hf_path={hf_teacher}) has vocab_size=320" in line and "has 384" in line
  for fix in ("--config.student.from_teacher.layers='(0, 2)'", "--config.student.hf_path=",
              "--config.train.init_from="):
    assert fix in line, (fix, line)
  assert ("--config.model.vocab_size=320" in line) == from_scratch, line


def test_every_conflict_of_config_model_and_data_comes_in_one_line(capsys, tmp_path):
  """A sequence longer than the model takes, a warmup as long as the run and a validation
  fraction that holds out no document: three problems, one run to learn them all."""
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny", "--config.train.seq_len=4096",
                  "--config.optimizer.warmup_steps=6", "--config.data.validation_fraction=1e-06")
  assert "3 problems" in line
  assert "(1) train.seq_len=4096 exceeds model.max_seq_len=128" in line
  assert "(2) optimizer.warmup_steps=6 must be smaller than train.steps=6" in line
  assert "(3) data.validation_fraction=1e-06 holds out none of the" in line


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished 2-step lm.py:tiny run with 3 blocks."""
  workdir = tmp_path_factory.mktemp("earlier") / "run"
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(workdir),
               "--config.train.steps=2", *RUN_FLAGS]) == 0
  return workdir


def test_init_from_a_run_takes_its_shape_and_an_override_against_it_is_refused(
    capsys, tmp_path, run):
  later = tmp_path / "later"
  base = ["distillax", "train", "--config", f"{LM}:tiny", f"--config.train.init_from={run}",
          "--config.train.steps=2", "--config.train.eval_every=0",
          "--config.optimizer.warmup_steps=1"]
  assert main([*base, "--workdir", str(later)]) == 0
  # The earlier run's model section as it is (its vocabulary too: 0, the tokenizer's size), so
  # the later run's job identity is what copying the section by hand gave.
  earlier_model = json.loads((run / "config.json").read_text())["model"]
  assert earlier_model["num_layers"] == 3 and earlier_model["vocab_size"] == 0
  assert json.loads((later / "config.json").read_text())["model"] == earlier_model
  line = _refused(capsys, tmp_path, *base[2:], "--config.model.num_layers=2")
  assert f"--config.model.num_layers=2 disagrees with train.init_from={run}" in line, line
  assert "num_layers=3" in line and "drop the override" in line


def test_a_relative_init_from_loads_the_run_from_the_python_api(run, monkeypatch):
  """The CLI makes paths absolute; a recipe made in Python does so too (orbax refuses relative
  checkpoint paths: "no readable checkpoint ... train the run first")."""
  monkeypatch.chdir(run.parent)
  config = lm.get_config("tiny")
  config.model.num_layers, config.train.init_from = 3, "run"
  recipe = recipe_for(config)
  student = recipe.build_student(abstract=False)
  assert student.config.num_layers == 3
  assert recipe.config.train.init_from == str(run)  # what config.json records


def test_extending_a_finished_run_says_the_schedule_is_recomputed(capsys, tmp_path, run):
  """2 -> 3 steps of warmup_cosine (peak 3e-4, warmup 1, end 10%): at step 2 the 2-step
  schedule had reached its end, 3e-5; over 3 steps step 2 is halfway down the cosine,
  3e-5 + 0.5 * 2.7e-4 = 1.65e-4."""
  extended = tmp_path / "extended"
  shutil.copytree(run, extended)
  capsys.readouterr()
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(extended),
               "--config.train.steps=3", *RUN_FLAGS]) == 0
  notes = [line for line in capsys.readouterr().err.splitlines() if "schedule" in line]
  assert len(notes) == 1 and notes[0].startswith("W"), notes
  assert ("train.steps=3 resumes this workdir's run of 2 steps with the learning-rate schedule "
          "(warmup_cosine) recomputed over 3 steps: at step 2 the rate is 0.000165, where the "
          "2-step schedule had 3e-05") in notes[0]
  assert json.loads((extended / "summary.json").read_text())["step"] == 3


def test_a_generation_eval_file_that_is_not_prompt_completion_records_is_one_line(capsys,
                                                                                 tmp_path):
  """eval.generate is read when the job is made: a missing file, a record without the fields
  or no room to generate fail in one line naming the field, before the workdir exists."""
  missing = tmp_path / "none.jsonl"
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny", f"--config.eval.generate={missing}")
  assert f"eval.generate={missing}: no such file" in line, line
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "def f(", "answer": "x)"}\n')
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny", f"--config.eval.generate={bad}")
  assert f'eval.generate: {bad} line 1 needs string "prompt" and "completion" fields' in line
  line = _refused(capsys, tmp_path, "--config", f"{LM}:tiny", f"--config.eval.generate={bad}",
                  "--config.eval.max_new_tokens=0")
  assert "eval.max_new_tokens=0 must be at least 1" in line, line
