"""The cross-tokenizer distillation job: with one tokenizer on both sides its objective is
ordinary forward-KL LogitKD; tokenizers that cannot be aligned by bytes are refused in one line."""

import io
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from distillax.configs import distill_cross_tokenizer
from distillax.distill import LogitKD, make_distill_objective
from distillax.main import main
from distillax.partitioning import create_mesh
from distillax.trainers import recipe_for
from tests.data.chat_testing import training_lines
from tests.support.tokenizers import trained_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = os.path.join(ROOT, "distillax", "configs", "distill_cross_tokenizer.py")


def test_one_tokenizer_on_both_sides_is_logit_kd():
  c = distill_cross_tokenizer.get_config("tiny")
  c.teacher.tokenizer = c.data.tokenizer  # the student's 512-id BPE on both sides
  c.distill.cross_tokenizer.temperature, c.distill.cross_tokenizer.alpha = 1.5, 0.6
  # One device: the comparison is of the two losses, not of sharding (and compiles faster).
  recipe = recipe_for(c, mesh=create_mesh(c.mesh, devices=jax.devices()[:1]))
  student, extras = recipe.build(abstract=False)
  batch = {k: jax.device_put(v) for k, v in next(recipe.train_iterator()).items()}
  # Same text, same cut: the teacher's rows are the student's.
  np.testing.assert_array_equal(batch["teacher_inputs_BxM"], batch["inputs_BxL"])
  assert float(batch["loss_mask_BxL"].sum()) > 100
  kd = make_distill_objective(LogitKD(temperature=1.5, alpha=0.6, divergence="forward_kl"),
                              chunk_size=None, metrics=False)
  both = nnx.jit(lambda s, e, b: (recipe.objective()(s, e, b, None), kd(s, e, b, None)))
  ours, kd = both(student, extras, batch)
  assert float(ours.tokens) == float(kd.tokens)
  per_token = lambda out: float(out.loss_sum) / float(out.tokens)
  assert abs(per_token(ours) - per_token(kd)) < 1e-6, (per_token(ours), per_token(kd))
  assert float(ours.sums["span_kl"]) == 0.0 and float(ours.sums["uld"]) == 0.0
  assert per_token(kd) > 1.0  # a real comparison: random teacher and student disagree


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
  import sentencepiece as spm
  buffer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(training_lines()), model_writer=buffer, vocab_size=400,
      model_type="bpe", byte_fallback=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
      minloglevel=2, num_threads=1)
  path = tmp_path_factory.mktemp("spm") / "tiny.model"
  path.write_bytes(buffer.getvalue())
  return str(path)


def test_teacher_tokenizer_without_byte_offsets_is_one_line(spm_model, tmp_path, capsys):
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir", str(workdir),
               f"--config.teacher.tokenizer=spm:{spm_model}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and not workdir.exists()
  assert len(err) == 1 and f"teacher.tokenizer='spm:{spm_model}'" in err[0], err
  assert "cannot spell its tokens as bytes" in err[0] and "'hf:" in err[0]


@pytest.mark.parametrize("override, named", [
    ("--config.data.layout=messages", "data.layout='messages'"),
    ("--config.distill.objective=cross-tokenizer", "distill.objective='cross-tokenizer'"),
])
def test_refusals_are_one_line(override, named, tmp_path, capsys):
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir", str(workdir),
               override])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and not workdir.exists()
  assert len(err) == 1 and named in err[0], err


def test_teacher_tokenizer_path_is_relative_to_the_current_directory(tmp_path, monkeypatch):
  from distillax.configs.paths import resolve_job_config
  from distillax.errors import UserError
  monkeypatch.chdir(tmp_path)
  (tmp_path / "tok").mkdir()
  c = distill_cross_tokenizer.get_config("tiny")
  c.teacher.tokenizer = "hf:tok"
  assert resolve_job_config(c, "train").teacher.tokenizer == f"hf:{tmp_path / 'tok'}"
  c.teacher.tokenizer = "hf:missing/tokenizer.json"
  with pytest.raises(UserError, match=r"^teacher.tokenizer='hf:missing/tokenizer.json' is rel"):
    resolve_job_config(c, "train")


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory):
  """A Hugging Face teacher directory with its own 700-id tokenizer.json (config.json written
  by hand: the job reads the model's shape from it; no weights are loaded here)."""
  folder = tmp_path_factory.mktemp("hf_teacher")
  trained_bpe(folder, 700)
  (folder / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 704,
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}))
  return folder


def test_a_teacher_checkpoint_alone_distils_on_its_own_tokenizer(teacher_checkpoint):
  """The guide: teacher.tokenizer left empty is the checkpoint's own. The config used to set
  the corpus BPE for every teacher and refuse teacher.hf_path alone."""
  c = distill_cross_tokenizer.get_config()
  c.teacher.hf_path = str(teacher_checkpoint)
  recipe = recipe_for(c)
  with open(teacher_checkpoint / "tokenizer.json") as f:
    own = json.load(f)["model"]["vocab"]
  assert recipe.teacher_tokenizer.vocab_size == len(own) == 700


def test_a_teacher_checkpoint_against_tinys_tokenizer_names_the_fix(teacher_checkpoint, tmp_path,
                                                                    capsys):
  """:tiny gives its fresh teacher the corpus BPE; a checkpoint there is told to leave
  teacher.tokenizer empty (not that distillation needs one tokenizer on both sides)."""
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir", str(workdir),
               f"--config.teacher.hf_path={teacher_checkpoint}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and not workdir.exists() and len(err) == 1, err
  assert f"is not the tokenizer teacher.hf_path={teacher_checkpoint} comes with (1024 vs 700" in \
      err[0] and "--config.teacher.tokenizer=''" in err[0], err
