"""Students from real weights: a Hugging Face checkpoint (`student.hf_path`, `train.init_from`)
and blocks of the teacher (`student.from_teacher.layers`), checked against transformers and the
teacher's own tensors; and the one-line refusals of students that cannot be distilled.

Every checkpoint is a tiny random model built by transformers here; nothing is downloaded.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from distillax.configs import distill, lm
from distillax.distill import unwrap_student
from distillax.errors import UserError
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.models.transformer import layer_params
from distillax.edge.export import gguf_architecture
from distillax.trainers import recipe_for
from tests.support.models import forward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = np.random.default_rng(0).integers(3, 300, size=(2, 12)).astype(np.int64)
LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False, attn_implementation="eager")


def _llama(seed: int, **changes):
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **changes}))
  with torch.no_grad():  # random norms too, so a swapped norm cannot go unnoticed
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


def _logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(directory, transformers model) of a 4-block Llama."""
  model = _llama(0)
  path = tmp_path_factory.mktemp("llama")
  model.save_pretrained(path)
  return str(path), model


def _student(recipe):
  student, extras = recipe.build(abstract=False)
  return unwrap_student(student)[0], extras


def _max_diff(model, want) -> float:
  got = np.asarray(forward(model, jnp.asarray(TOKENS, jnp.int32)).logits_BxLxV)
  return float(np.max(np.abs(got - want)))


@pytest.mark.parametrize("field", ["student.hf_path", "train.init_from"])
def test_a_student_from_a_checkpoint_starts_at_its_logits(checkpoint, field):
  path, model = checkpoint
  if field == "student.hf_path":
    config = distill.get_config("tiny")
    config.teacher.preset, config.student.hf_path = "tiny", path
  else:
    config = lm.get_config("tiny")
    config.train.init_from = path
  recipe = recipe_for(config)
  # The model section is the checkpoint's (config.json records it), the preset's is gone.
  assert recipe.config.model.num_layers == 4 and recipe.config.model.mlp_dim == 96
  assert recipe.model_config.vocab_size == 320 and not recipe.model_config.tie_embeddings
  student, _ = _student(recipe)
  assert _max_diff(student, _logits(model)) <= 1e-4
  # Read sharded: the embedding is split over the 8 devices (fsdp), not whole on one.
  embedding = student.embedder.embedding[...]
  assert len({str(s.index) for s in embedding.addressable_shards}) == 8


def _blocks_equal(student_layers, teacher_layers, layers):
  for i, t in enumerate(layers):
    pairs = zip(jax.tree.leaves(student_layers[i]), jax.tree.leaves(teacher_layers[t]))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs), (i, t)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_student_from_teacher_blocks_copies_them_bit_for_bit(checkpoint, scan_layers):
  path, model = checkpoint
  layers = (0, 2, 3)
  config = distill.get_config("tiny")
  config.teacher.hf_path, config.student.from_teacher.layers = path, layers
  config.model.scan_layers = scan_layers  # how the student runs is the config's to say
  recipe = recipe_for(config)
  assert recipe.model_config.num_layers == 3 and recipe.model_config.scan_layers == scan_layers
  student, extras = _student(recipe)
  teacher = extras["teacher"]
  _blocks_equal(layer_params(student), layer_params(teacher), layers)
  for name in ("embedder", "final_norm"):
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(getattr(student, name)))),
                    jax.tree.leaves(nnx.to_pure_dict(nnx.state(getattr(teacher, name))))):
      assert np.array_equal(np.asarray(a), np.asarray(b))
  assert np.array_equal(np.asarray(student.lm_head[...]), np.asarray(teacher.lm_head[...]))
  # Its forward is transformers' Llama made of the same blocks.
  picked = _from_blocks(model, layers, _llama(1, num_hidden_layers=3))
  assert _max_diff(student, _logits(picked)) <= 1e-4


def _from_blocks(model, layers, fresh):
  """`fresh` (a transformers model of len(layers) blocks) with `model`'s embeddings, final
  norm, head and blocks `layers`, in that order."""
  state = model.state_dict()
  renamed = {k: state[k] for k in state if not k.startswith("model.layers.")}
  for i, t in enumerate(layers):
    prefix = f"model.layers.{t}."
    renamed.update({f"model.layers.{i}." + k[len(prefix):]: v for k, v in state.items()
                    if k.startswith(prefix)})
  fresh.load_state_dict(renamed)
  return fresh.eval()


GEMMA2 = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
              max_position_embeddings=64, attn_implementation="eager")


def _gemma2(seed: int, **changes):
  torch.manual_seed(seed)
  model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**GEMMA2, **changes}))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.3 if "norm" in name else 0.1)
  return model.eval()


@pytest.fixture(scope="module")
def gemma2_checkpoint(tmp_path_factory):
  """(directory, transformers model) of a 4-block Gemma 2: sliding, full, sliding, full, with a
  window of 4, a third of the 12-token sequences."""
  model = _gemma2(3, num_hidden_layers=4)
  assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
  path = tmp_path_factory.mktemp("gemma2")
  model.save_pretrained(path)
  return str(path), model


@pytest.mark.parametrize("layers", [(0, 2), (1, 0, 2)])
def test_a_gemma2_student_from_teacher_blocks_keeps_their_attention(gemma2_checkpoint, layers,
                                                                    tmp_path):
  """Each copied block attends as in the teacher (two sliding blocks side by side; a full one
  at an even position), in distillax, in the Hugging Face export as transformers reads it, and
  GGUF export, whose gemma2 cannot say so, refuses in one line."""
  path, model = gemma2_checkpoint
  types = [model.config.layer_types[t] for t in layers]
  config = distill.get_config("tiny")
  config.teacher.hf_path, config.student.from_teacher.layers = path, layers
  recipe = recipe_for(config)
  assert recipe.model_config.local_layers() == [t == "sliding_attention" for t in types]
  student, _ = _student(recipe)
  picked = _from_blocks(model, layers, _gemma2(4, num_hidden_layers=len(layers),
                                               layer_types=types))
  assert _max_diff(student, _logits(picked)) <= 1e-4
  hf.save(student, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["layer_types"] == types
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager").eval()
  assert exported.config.layer_types == types
  assert _max_diff(student, _logits(exported)) <= 1e-4
  assert hf.load(str(tmp_path)).config.local_layers() == student.config.local_layers()
  with pytest.raises(UserError, match=r"llama.cpp's gemma2 runs layers \['sliding', 'full'"):
    gguf_architecture(student.config)
  # Blocks that alternate from a sliding one are what llama.cpp's gemma2 runs: exported.
  assert gguf_architecture(recipe.teacher_model_config.select_layers((2, 1, 0))) == "gemma2"


def test_a_student_from_a_preset_teacher_copies_the_teacher_it_distils_from():
  config = distill.get_config("tiny")
  config.teacher.preset, config.student.from_teacher.layers = "tiny", (1,)
  recipe = recipe_for(config)
  student, extras = _student(recipe)
  _blocks_equal(layer_params(student), layer_params(extras["teacher"]), (1,))


def _cli(capsys, tmp_path, *overrides, config="distill.py:tiny"):
  """(exit code, stderr lines) of a train command; the workdir must stay unwritten."""
  code = main(["distillax", "train", "--config", f"{ROOT}/distillax/configs/{config}", "--workdir",
               str(tmp_path / "run"), *overrides])
  err = capsys.readouterr().err.strip().splitlines()
  assert not (tmp_path / "run").exists()
  return code, err


def _tokenizer_dir(folder, order_seed: int, size: int = 320):
  """A word-level tokenizer.json of `size` made-up tokens; the seed shuffles their ids."""
  import tokenizers
  words = [f"w{i}" for i in range(size - 1)]
  np.random.default_rng(order_seed).shuffle(words)
  vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.save(str(folder / "tokenizer.json"))


@pytest.fixture
def mismatched(tmp_path, checkpoint):
  """Two checkpoints with tokenizers: a teacher, a student of another vocabulary size and a
  student of the same size whose tokenizer maps the ids differently."""
  path, model = checkpoint
  dirs = {}
  for name, seed, vocab in (("teacher", 0, 320), ("other_size", 0, 384), ("other_ids", 1, 320)):
    folder = tmp_path / name
    _llama(2, vocab_size=vocab).save_pretrained(folder)
    _tokenizer_dir(folder, seed)
    dirs[name] = str(folder)
  return dirs


def test_students_that_cannot_be_distilled_fail_in_one_line(capsys, tmp_path, checkpoint,
                                                           mismatched):
  path, _ = checkpoint
  t = mismatched["teacher"]
  data = f"--config.data.tokenizer=hf:{t}"
  cases = [
      ("vocabulary size", [f"--config.teacher.hf_path={t}", data,
                           f"--config.student.hf_path={mismatched['other_size']}"],
       ["vocab_size=384", "320", "one tokenizer"]),
      ("tokenizer ids", [f"--config.teacher.hf_path={t}", data,
                         f"--config.student.hf_path={mismatched['other_ids']}"],
       ["different tokenizers", "teacher.hf_path", "student.hf_path"]),
      ("data not in the teacher's tokenizer", [f"--config.teacher.hf_path={t}"],
       ["data.tokenizer='byte'", f"--config.data.tokenizer=hf:{t}/tokenizer.json"]),
      ("model override against the checkpoint", ["--config.teacher.preset=tiny",
                                                 f"--config.student.hf_path={path}",
                                                 "--config.model.num_layers=3"],
       ["--config.model.num_layers=3", "num_layers=4", "drop the override"]),
      ("layer count against the blocks", [f"--config.teacher.hf_path={path}",
                                          "--config.student.from_teacher.layers=(0,1)",
                                          "--config.model.num_layers=1"],
       ["num_layers=2", "len(student.from_teacher.layers)"]),
      ("blocks the teacher lacks", [f"--config.teacher.hf_path={path}",
                                    "--config.student.from_teacher.layers=(0,4)"],
       ["blocks [4]", "the teacher has 4"]),
      ("two sources", [f"--config.teacher.hf_path={path}", f"--config.student.hf_path={path}",
                       "--config.student.from_teacher.layers=(0,)"],
       ["student.hf_path and student.from_teacher.layers", "clear all but one"]),
  ]
  capsys.readouterr()  # the fixtures' save_pretrained progress bars
  for name, overrides, fragments in cases:
    code, err = _cli(capsys, tmp_path, *overrides)
    assert code == 2 and len(err) == 1, (name, err)
    for fragment in fragments:
      assert fragment in err[0], (name, err[0], fragment)


def test_training_from_a_checkpoint_records_its_shape_and_exports_it(tmp_path, checkpoint,
                                                                    capsys):
  """A run started from a checkpoint keeps its model in config.json (the same --config then
  exports it, with no model overrides) and exports the weights it trained."""
  path, _ = checkpoint
  cfg = ["--config", f"{ROOT}/distillax/configs/lm.py:tiny", f"--config.train.init_from={path}"]
  run, out = tmp_path / "run", tmp_path / "hf"
  assert main(["distillax", "train", *cfg, "--workdir", str(run), "--config.train.steps=3",
               "--config.optimizer.learning_rate=1e-9"]) == 0
  model_section = json.loads((run / "config.json").read_text())["model"]
  assert (model_section["num_layers"], model_section["vocab_size"]) == (4, 320)
  assert main(["distillax", "export", *cfg, "--workdir", str(run), "--output", str(out)]) == 0
  capsys.readouterr()
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  # Three steps at a negligible learning rate: still the checkpoint it started from, on the
  # run's byte tokenizer's 259 ids (the export writes those rows of the checkpoint's 320).
  assert exported.config.vocab_size == 259
  ids = np.minimum(TOKENS, 258)
  np.testing.assert_allclose(_logits(exported, ids), _logits(checkpoint[1], ids)[..., :259],
                             atol=1e-4)
  assert hf.load(str(out)).config.num_layers == 4


class _Given:
  """A source holding an already-built model (drawn in numpy: no init to compile)."""
  kind, field = "hf", "given"

  def __init__(self, model):
    self.model = model

  def model_config(self):
    return self.model.config

  def load(self, cfg, mesh, rules, *, seed):
    return self.model


def test_a_student_keeping_teacher_experts_is_the_teacher_sliced_by_hand():
  """All four experts listed: the teacher itself. A subset per layer: the teacher's blocks with
  the kept experts' weights and router columns cut out in numpy, run through the model."""
  from distillax.models.presets import get_preset
  from distillax.models.init import abstract_model
  from distillax.trainers.sources import BlocksSource, place
  from tests.support.engines import mesh_and_rules
  from tests.support.models import logits, random_model
  kept = ((3, 0, 2), (1, 2, 3))
  config = distill.get_config("tiny")  # the config route: the derived student's shape
  config.teacher.preset = "tiny_moe"
  config.student.from_teacher.layers, config.student.from_teacher.experts = (1, 0), kept
  recipe = recipe_for(config)
  assert (recipe.model_config.num_experts, recipe.config.model.num_experts) == (3, 3)
  assert recipe.sources.student.kept_experts() == kept
  mesh, rules = mesh_and_rules("fsdp", 8)  # every model placed alike: two compiles in all
  teacher = random_model(get_preset("tiny_moe"), seed=3, mesh=mesh)
  tokens = jnp.asarray(TOKENS % 256, jnp.int32)

  def student(layers, experts):
    source = BlocksSource(_Given(teacher), layers, experts=experts)
    return source.load(source.model_config(), mesh, rules, seed=0)

  want = np.asarray(logits(teacher, tokens))
  np.testing.assert_array_equal(np.asarray(logits(student((0, 1), (0, 1, 2, 3)), tokens)), want)
  values = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(teacher)))
  sliced = {k: v for k, v in values.items() if k != "layers"}
  sliced["layers"] = {}
  for i, (t, e) in enumerate(zip((1, 0), kept)):
    block = values["layers"][t]
    mlp = block["mlp"]
    sliced["layers"][i] = {**block, "mlp": {"router": mlp["router"][:, list(e)],
                                            **{n: mlp[n][list(e)] for n in ("gate", "up",
                                                                            "down")}}}
  subset = student((1, 0), kept)
  by_hand = place(sliced, mesh, rules, abstract_model(subset.config))
  got = np.asarray(logits(subset, tokens))
  np.testing.assert_allclose(got, np.asarray(logits(by_hand, tokens)), atol=1e-6)
  assert np.max(np.abs(got - want)) > 1e-3  # fewer experts: another model


@pytest.mark.parametrize("experts,says", [
    ((0,), "student.from_teacher.experts keeps 1 experts per layer, but the teacher routes each "
           "token to 2 (model.num_experts_per_tok=2); keep at least 2"),
    ((0, 4), "student.from_teacher.experts names expert(s) [4] (student layer 0) but the teacher "
             "has 4 per layer (0..3); pick experts it has"),
    (((0, 1), (1, 2, 3)), "every layer must keep the same number"),
])
def test_expert_subsets_the_teacher_cannot_give_fail_in_one_line(capsys, tmp_path, experts, says):
  code, err = _cli(capsys, tmp_path, "--config.teacher.preset=tiny_moe",
                   "--config.student.from_teacher.layers=(0,1)",
                   f"--config.student.from_teacher.experts={experts!r}".replace(" ", ""))
  assert code == 2 and len(err) == 1 and says in err[0], err


def test_kept_experts_read_one_tuple_for_all_per_student_or_per_teacher_layer():
  from distillax.models.presets import get_preset
  from distillax.trainers.sources.experts import kept_experts
  teacher = get_preset("tiny_moe")  # 2 layers of 4 experts, k = 2
  assert kept_experts((), (0, 1), teacher) is None
  assert kept_experts((3, 1), (1, 0), teacher) == ((3, 1), (3, 1))
  assert kept_experts(((0, 1), (2, 3)), (1, 0), teacher) == ((0, 1), (2, 3))  # per student
  # expert-load prints one tuple per teacher layer: a one-block student takes its block's.
  assert kept_experts(((0, 1), (2, 3)), (1,), teacher) == ((2, 3),)


def test_a_missing_weight_file_is_found_before_the_step_is_built(capsys, tmp_path, checkpoint,
                                                                 monkeypatch):
  """Issue 55: a shard the index lists but the directory lacks (or no safetensors file at all)
  was found when the models were created, after the step's compile (13-18 s there), and left
  checkpoints/ and compile_cache/ in the new workdir. One line now, before any step is built,
  and no workdir."""
  import shutil
  from distillax.trainers.recipe import Recipe

  def no_step(self, *args, **kwargs):
    raise AssertionError("the step was built before the weight files were checked")
  monkeypatch.setattr(Recipe, "build_engines", no_step)
  path, _ = checkpoint
  sharded, bare = tmp_path / "sharded", tmp_path / "bare"
  for folder in (sharded, bare):
    shutil.copytree(path, folder)
  first = "model-00001-of-00002.safetensors"
  os.rename(sharded / "model.safetensors", sharded / first)
  with hf.safe_open(str(sharded / first), framework="numpy") as f:
    names = sorted(f.keys())
  weight_map = {n: first for n in names[1:]}
  weight_map[names[0]] = "model-00002-of-00002.safetensors"  # the shard that was not copied
  (sharded / hf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
  os.remove(bare / "model.safetensors")
  capsys.readouterr()
  for folder, fragment in ((sharded, f"{sharded}/model-00002-of-00002.safetensors (listed in "
                                     f"{hf.INDEX_FILE}) not found"),
                           (bare, f"no *.safetensors file in {bare}")):
    code, err = _cli(capsys, tmp_path, f"--config.train.init_from={folder}",
                     config="lm.py:tiny")
    assert code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_derived_student_shorter_than_seq_len_is_told_what_may_change(capsys, tmp_path):
  """A student of teacher blocks has the teacher's 128 positions: the line says where they come
  from and what to change (train.seq_len, or a teacher of more positions), not to raise
  model.max_seq_len, which the source refuses (issue 55)."""
  code, err = _cli(capsys, tmp_path, "--config.teacher.preset=tiny_moe",
                   "--config.student.from_teacher.layers=(0,1)", "--config.train.seq_len=256")
  assert code == 2 and len(err) == 1, err
  assert ("train.seq_len=256 exceeds the student's max_seq_len=128, which comes with "
          "student.from_teacher.layers=(0, 1) (model.max_seq_len cannot change a shape its "
          "source gives); lower train.seq_len (e.g. --config.train.seq_len=128), or derive the "
          "student from a teacher of more positions (its max_seq_len)") in err[0], err
  assert "raise the second" not in err[0]
