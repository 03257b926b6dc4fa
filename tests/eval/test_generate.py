"""`distillax generate` and `distillax eval` on a finished run, its export and a Hugging Face
directory with a chat template: the same tokens as distillax's sampler, the same eval numbers
as the trainer's (summary.json), one line for each misuse."""

import json
import os

import numpy as np
import pytest

from distillax import partitioning as pt
from distillax.data import ByteTokenizer, make_tokenizer
from distillax.data.chat import template_for
from distillax.edge.completions import greedy_texts
from distillax.eval.loss import restore_onto, run_recipe
from distillax.generate import generate_tokens, load_model_dir
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.models.presets import get_preset
from distillax.models.sampler import Sampler
from distillax.trainers import load_trained_model
from tests.data import chat_testing as ct
from tests.support.models import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = f"{ROOT}/distillax/configs/lm.py:tiny"


# Held-out prompt/completion records the run's evals complete (eval.generate).
HELD_OUT = [{"prompt": "def main(", "completion": "):\n    return 0\n"},
            {"prompt": "import ", "completion": "os\nimport sys\n"},
            {"prompt": "for i in range(", "completion": "10):\n    print(i)\n"}]
GENERATE_TOKENS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished lm.py:tiny run whose evals also score greedy completions of HELD_OUT, and its
  `distillax export`."""
  root = tmp_path_factory.mktemp("generate_eval")
  workdir, export, held_out = root / "run", root / "hf", root / "held_out.jsonl"
  held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
  assert main(["distillax", "train", "--config", LM, "--workdir", str(workdir),
               "--config.train.steps=4", "--config.train.eval_every=2",
               "--config.checkpoint.every_steps=2",  # steps 2 and 4: a fallback has one
               f"--config.eval.generate={held_out}",
               f"--config.eval.max_new_tokens={GENERATE_TOKENS}"]) == 0
  assert main(["distillax", "export", "--config", LM, "--workdir", str(workdir), "--output",
               str(export)]) == 0
  return str(workdir), str(export)


def test_logged_generation_figures_are_eval_generates(run, capsys):
  """The run's last eval (step 4: metrics.jsonl, summary.json) scored its greedy completions of
  the held-out file as `distillax eval --generate` scores that checkpoint's."""
  workdir, _ = run
  held_out = os.path.join(os.path.dirname(workdir), "held_out.jsonl")
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl")) if l.strip()]
  logged = {r["step"]: r for r in rows if "eval_bleu" in r}
  assert sorted(logged) == [2, 4] and "eval_loss" in logged[4]
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", workdir, "--generate", held_out,
               "--max_new_tokens", str(GENERATE_TOKENS)]) == 0
  got = _json_line(capsys)
  assert got["records"] == len(HELD_OUT)
  for name in ("bleu", "chrf", "rouge_l"):
    assert logged[4][f"eval_{name}"] == got[name], name
  # A model trained 4 steps scores ~0, so the texts themselves are compared: the trainer's
  # decode of the checkpoint (on the run's mesh) and llama.cpp's of the run's f32 GGUF, whose
  # scores are the command's on the run.
  recipe = run_recipe(workdir)
  engine, state = restore_onto(recipe, recipe.build_engines(compile_now=False), workdir)
  texts = recipe.generation_eval.completions(engine, state)
  prompts = [r["prompt"] for r in HELD_OUT]
  assert all(texts), texts
  folder = os.path.join(os.path.dirname(workdir), "gguf")
  assert main(["distillax", "export", "--config", LM, "--workdir", workdir, "--output", folder,
               "--format", "gguf"]) == 0
  gguf = os.path.join(folder, "model-f32.gguf")
  assert greedy_texts(gguf, prompts, GENERATE_TOKENS) == texts
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", gguf, "--generate", held_out,
               "--max_new_tokens", str(GENERATE_TOKENS)]) == 0
  out = capsys.readouterr()
  assert json.loads(out.out.strip().splitlines()[-1]) == got
  assert f"distillax eval: {gguf} decoded by llama.cpp (reference kernels, f32 KV cache)" in out.err
  # A file that is not prompt/completion records: one line, before llama.cpp loads anything.
  bad = os.path.join(folder, "bad.jsonl")
  with open(bad, "w") as f:
    f.write('{"text": "def main(): pass"}\n')
  assert main(["distillax", "eval", "--model", gguf, "--generate", bad]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f'distillax eval: error: --generate: {bad} line 1 needs string "prompt" and '
                 f'"completion" fields'], err


def _json_line(capsys) -> dict:
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_a_run_gives_its_summary_numbers(run, capsys):
  workdir, export = run
  summary = json.loads(open(os.path.join(workdir, "summary.json")).read())
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", workdir]) == 0
  out = capsys.readouterr()
  got = json.loads(out.out.strip().splitlines()[-1])
  for key in ("eval_loss", "eval_perplexity", "eval_tokens", "eval_accuracy", "eval_bleu",
              "eval_chrf", "eval_rouge_l"):  # the last three: the run's eval.generate
    assert got[key] == summary[key], key
  # One line names the form evaluated (tests/test_export_gguf.py has a QAT run's).
  assert f"distillax eval: {workdir} evaluated as full precision; checkpoint step 4" in out.err
  # Its export, evaluated as the same job: the same weights of the tokenizer's ids, batches and
  # objective. The export carries only the tokenizer's rows (issue 47: no runtime may emit a
  # padded id), and the run's losses take their softmax over those rows too (issue 55): one
  # figure, within float rounding (the logits of those ids are equal:
  # tests/trainers/test_students.py).
  assert main(["distillax", "eval", "--model", export, "--config", LM]) == 0
  out = capsys.readouterr()
  exported = json.loads(out.out.strip().splitlines()[-1])
  assert f"{export} evaluated as full precision (a Hugging Face checkpoint)" in out.err
  for key in ("eval_loss", "eval_perplexity", "eval_accuracy"):
    assert exported[key] == pytest.approx(summary[key], rel=1e-6, abs=0), key
  assert exported["eval_tokens"] == summary["eval_tokens"]
  # Another split of the same run: --config's data section and eval sizes.
  assert main(["distillax", "eval", "--model", workdir, "--config", LM,
               "--config.train.eval_batches=1"]) == 0
  fewer = _json_line(capsys)
  assert fewer["eval_tokens"] == summary["eval_tokens"] / 2


def _greedy(model, tokens, steps, eos_id, pad_id, vocab_limit):
  ids = Sampler(model)(np.asarray([tokens], np.int32), max_new_tokens=steps, eos_id=eos_id,
                       pad_id=pad_id, vocab_limit=vocab_limit).tokens_BxT[0].tolist()
  return ids[:ids.index(eos_id)] if eos_id in ids else ids


def test_generate_prints_what_the_sampler_generates(run, capsys):
  workdir, export = run
  byte = ByteTokenizer()
  mesh, rules = pt.create_mesh(None), pt.rules_from_config({"strategy": "fsdp"})
  model = load_trained_model(workdir, mesh, rules)
  prompt = [byte.bos_id] + byte.encode("def main(")
  want = _greedy(model, prompt, 12, byte.eos_id, byte.pad_id, byte.vocab_size)
  capsys.readouterr()
  assert main(["distillax", "generate", "--model", workdir, "--prompt", "def main(",
               "--max_new_tokens", "12"]) == 0
  out = capsys.readouterr()
  assert out.out == byte.decode(want) + "\n"
  assert (f"distillax generate: {workdir} loaded as full precision; checkpoint step 4"
          in out.err.splitlines())
  # The export generates the same tokens through its Hugging Face form of the byte tokenizer.
  loaded = load_model_dir(export)
  assert loaded.stop_ids == (byte.eos_id,)
  assert generate_tokens(loaded, prompt, max_new_tokens=12) == want
  # Sampling is seeded: the same seed, the same text; top-k 1 is greedy.
  argv = ["distillax", "generate", "--model", workdir, "--prompt", "def main(",
          "--max_new_tokens", "12", "--temperature", "1.0"]
  texts = []
  for extra in (["--seed", "3"], ["--seed", "3"], ["--top_k", "1"]):
    assert main(argv + extra) == 0
    texts.append(capsys.readouterr().out)
  assert texts[0] == texts[1] and texts[2] == byte.decode(want) + "\n"


def test_generate_samples_only_the_tokenizers_ids(run):
  """The run's model has 384 vocabulary rows for the byte tokenizer's 259 ids: whatever it
  samples (temperature 1, nothing filtered) is a token, never a padded row the text would
  silently drop."""
  workdir, _ = run
  byte = ByteTokenizer()
  loaded = load_model_dir(workdir)
  ids = generate_tokens(loaded, [byte.bos_id] + byte.encode("def "), max_new_tokens=100,
                        temperature=1.0, seed=1)
  assert loaded.model.config.vocab_size == 384 and len(ids) > 50
  assert max(ids) < byte.vocab_size, ids


def test_generate_answers_chat_turns_with_the_chat_template(tmp_path, capsys):
  folder = ct.save_tokenizer(tmp_path / "tokenizer", ct.CHATML)
  tokenizer = make_tokenizer(f"hf:{folder}")
  model = random_model(get_preset("tiny").replace(vocab_size=ct.VOCAB_SIZE), seed=5)
  hf.save(model, tmp_path / "chat", tokenizer=tokenizer)
  messages = [{"role": "user", "content": "What does os.path.join do?"}]
  ids = tokenizer.encode(template_for(tokenizer).render(messages, add_generation_prompt=True))
  want = _greedy(model, ids, 10, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size)
  (tmp_path / "chat.json").write_text(json.dumps(messages))
  capsys.readouterr()
  for given in (json.dumps(messages), str(tmp_path / "chat.json")):
    assert main(["distillax", "generate", "--model", str(tmp_path / "chat"), "--messages", given,
                 "--max_new_tokens", "10"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(want) + "\n"


def test_generate_and_eval_misuse_fails_in_one_line(run, tmp_path, capsys):
  workdir, export = run
  cases = [
      (["generate", "--model", workdir], ["--prompt", "--messages"]),
      (["generate", "--model", workdir, "--prompt", "x", "--messages", "[]"], ["exactly one"]),
      (["generate", "--model", workdir, "--messages", '[{"role": "user", "content": "hi"}]'],
       ["chat template", "--prompt"]),
      (["generate", "--model", workdir, "--messages", '{"role": "user"}'],
       ["--messages", "role", "content"]),
      (["generate", "--prompt", "x"], ["--model is required"]),
      (["generate", "--model", str(tmp_path), "--prompt", "x"], ["--model", "not a distillax"]),
      (["eval", "--model", export], ["--config", "Hugging Face directory"]),
      (["eval"], ["--model is required"]),
  ]
  capsys.readouterr()
  for argv, fragments in cases:
    assert main(["distillax"] + argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"distillax {argv[0]}: error:"), (argv, err)
    for fragment in fragments:
      assert fragment in err[0], (argv, err[0], fragment)


def test_generate_of_a_gguf_says_where_ggufs_run(tmp_path, capsys):
  """A GGUF is not a run directory: the line says where it runs (llama.cpp, eval --generate)."""
  gguf = tmp_path / "student.gguf"
  gguf.write_bytes(b"GGUF")
  capsys.readouterr()
  assert main(["distillax", "generate", "--model", str(gguf), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("distillax generate: error: "), err
  assert f"--model {gguf} is a GGUF file, which runs in llama.cpp" in err[0], err
  assert f"distillax eval --model {gguf} --generate FILE" in err[0]
  assert "not a distillax run directory" not in err[0]


def test_config_overrides_without_a_config_file_apply_to_the_runs_own_config(run, capsys,
                                                                            tmp_path):
  """Issue 55: `--config.KEY=VALUE` on eval, export and generate was "unknown flag" without
  `--config FILE`. The run's own config.json is now the base: eval reads one batch fewer as
  asked, export and generate on another placement give the same weights and tokens, and a
  Hugging Face directory (no distillax config) is one line asking for --config FILE."""
  from safetensors.numpy import load_file
  workdir, export = run
  summary = json.loads(open(os.path.join(workdir, "summary.json")).read())
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", workdir, "--config.train.eval_batches=1"]) == 0
  assert _json_line(capsys)["eval_tokens"] == summary["eval_tokens"] / 2
  # A field config.json holds as null (no type kept) takes a value too.
  assert main(["distillax", "eval", "--model", workdir, "--config.train.eval_batches=1",
               "--config.data.seed=3"]) == 0
  assert _json_line(capsys)["eval_tokens"] == summary["eval_tokens"] / 2
  out = tmp_path / "dp"
  assert main(["distillax", "export", "--workdir", workdir, "--output", str(out),
               "--config.partitioning.strategy=dp"]) == 0
  want, got = (load_file(os.path.join(d, "model.safetensors")) for d in (export, out))
  assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
  argv = ["distillax", "generate", "--model", workdir, "--prompt", "def main(",
          "--max_new_tokens", "8"]
  capsys.readouterr()
  assert main(argv) == 0
  text = capsys.readouterr().out
  assert main(argv + ["--config.partitioning.strategy=dp"]) == 0
  assert capsys.readouterr().out == text
  assert main(["distillax", "eval", "--model", export, "--config.train.eval_batches=1"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "is a Hugging Face checkpoint" in err[0] and "--config FILE" in err[0]


def test_a_fallback_from_an_unreadable_checkpoint_names_the_step_it_loads(run, capsys,
                                                                         tmp_path):
  """Issue 55: after falling back from an unreadable newest checkpoint, export and generate
  said "checkpoint step 4" and used step 2's weights (eval said 2). Each names the step whose
  weights it read, and the export is bit for bit that of the run without step 4."""
  import shutil
  from safetensors.numpy import load_file
  workdir, _ = run
  broken, older = tmp_path / "broken", tmp_path / "older"
  for copy in (broken, older):
    shutil.copytree(workdir, copy)
  data = sorted((broken / "checkpoints" / "4" / "state" / "d").iterdir())
  data[0].write_bytes(data[0].read_bytes()[:10])  # truncated, as a killed copy leaves it
  shutil.rmtree(older / "checkpoints" / "4")
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", str(broken)]) == 0
  assert f"{broken} evaluated as full precision; checkpoint step 2" in capsys.readouterr().err
  assert main(["distillax", "generate", "--model", str(broken), "--prompt", "def main(",
               "--max_new_tokens", "4"]) == 0
  assert (f"distillax generate: {broken} loaded as full precision; checkpoint step 2"
          in capsys.readouterr().err.splitlines())
  for run_dir in (broken, older):
    assert main(["distillax", "export", "--workdir", str(run_dir), "--output",
                 str(tmp_path / f"hf_{run_dir.name}")]) == 0
    assert (f"distillax export: {run_dir} loaded as full precision; checkpoint step 2"
            in capsys.readouterr().out.splitlines())
  want, got = (load_file(str(tmp_path / f"hf_{d}" / "model.safetensors"))
               for d in ("older", "broken"))
  assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
