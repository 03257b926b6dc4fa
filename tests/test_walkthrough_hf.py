"""The walkthrough "Distil your own Hugging Face model" (distillax/configs/distill_hf.py's
docstring, also in docs/guides/distil-hf.md: tests/test_docs.py checks the page prints these
commands), run as a user runs it: its commands verbatim, from a directory holding
models/teacher and data/chats.jsonl, every path relative to it, shrunk to `:tiny`.

The teacher is a random Qwen2 built and saved by transformers; its tokenizer is a byte-level BPE
trained here on the embedded corpus and saved with a ChatML template (tests/data/chat_testing.py);
the chats are made from the corpus. Nothing is downloaded. The walkthrough ends where a user
does: transformers loads the export, chats with it (apply_chat_template + generate) and gives
distillax's logits within 1e-4.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from distillax import partitioning as pt
from distillax.configs.paths import resolve_job_config
from distillax.main import _parse, main
from distillax.trainers import load_trained_model, recipe_for
from tests.data import chat_testing as ct
from tests.support.models import forward
from tests.test_docstring_commands import docstring_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(ROOT, "distillax", "configs", "distill_hf.py")
STEPS = ["--config.train.steps=3", "--config.train.eval_every=3",
         "--config.checkpoint.every_steps=3"]


def _qwen2(folder, layers: int, seed: int) -> None:
  """A random Qwen2 (q/k/v biases, untied head, odd MLP width) saved beside a tokenizer."""
  torch.manual_seed(seed)
  cfg = transformers.Qwen2Config(
      vocab_size=ct.VOCAB_SIZE, hidden_size=48, intermediate_size=100, num_hidden_layers=layers,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
      pad_token_id=0)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(folder))


def _walkthrough() -> dict[str, list[str]]:
  """The docstring's commands by what they do."""
  commands = docstring_commands(CONFIG_FILE)
  def one(test):
    found = [argv for argv in commands if test(argv)]
    assert len(found) == 1, found
    return found[0]
  return {"distil": one(lambda a: a[1] == "train" and "runs/hf_kd" in a),
          "distil_small": one(lambda a: a[1] == "train" and "runs/hf_kd_small" in a),
          "eval": one(lambda a: a[1] == "eval"),
          "export": one(lambda a: a[1] == "export"),
          "generate": one(lambda a: a[1] == "generate")}


def _tiny(argv: list[str]) -> list[str]:
  out = [a + ":tiny" if a.endswith("distill_hf.py") else a for a in argv]
  return out + (STEPS if argv[1] == "train" else [])


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
  """The user's directory after the walkthrough, and what each command printed."""
  home = tmp_path_factory.mktemp("walkthrough")
  os.symlink(os.path.join(ROOT, "distillax"), home / "distillax")
  for name, layers, seed in (("teacher", 6, 0), ("student", 2, 1)):
    ct.save_tokenizer(home / "models" / name, ct.CHATML)
    _qwen2(home / "models" / name, layers, seed)
  (home / "data").mkdir()
  ct.write_jsonl(home / "data" / "chats.jsonl", [{"messages": m} for m in ct.conversations(80)])
  return home


def _run(home, argv, capsys) -> str:
  """Runs one command from `home`; its stdout."""
  cwd = os.getcwd()
  os.chdir(home)
  try:
    capsys.readouterr()
    code = main(_tiny(argv))
    out, err = capsys.readouterr()
  finally:
    os.chdir(cwd)
  assert code == 0, " ".join(argv) + "\n" + err[-3000:]
  return out


def test_the_walkthrough_distils_exports_and_chats(walked, capsys):
  home, steps = walked, _walkthrough()
  _run(home, steps["distil"], capsys)
  summary = json.loads((home / "runs" / "hf_kd" / "summary.json").read_text())
  assert summary["finished"] and summary["step"] == 3
  recorded = json.loads((home / "runs" / "hf_kd" / "config.json").read_text())
  assert recorded["teacher"]["hf_path"] == str(home / "models" / "teacher")
  assert recorded["model"]["num_layers"] == 3 and recorded["model"]["qkv_bias"]
  # eval gives the trainer's numbers for the held-out chats.
  evaluated = json.loads(_run(home, steps["eval"], capsys).strip().splitlines()[-1])
  for key in ("eval_loss", "eval_perplexity", "eval_tokens"):
    assert evaluated[key] == summary[key], key
  _run(home, steps["export"], capsys)
  export = home / "out" / "student_hf"
  assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(
      os.listdir(export))
  said = _run(home, steps["generate"], capsys)
  # transformers loads the export as it is and chats with it: the same greedy answer.
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(export))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
  messages = json.loads(steps["generate"][steps["generate"].index("--messages") + 1])
  prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")
  with torch.no_grad():
    answer = hf_model.generate(**prompt, max_new_tokens=128, do_sample=False)
  ids = prompt["input_ids"].shape[1]
  assert said == hf_tok.decode(answer[0, ids:], skip_special_tokens=True) + "\n"
  # Its logits on the prompt and its answer are distillax's, from the run's checkpoint.
  model = load_trained_model(str(home / "runs" / "hf_kd"), pt.create_mesh(None),
                             pt.rules_from_config({"strategy": "fsdp"}))
  with torch.no_grad():
    theirs = hf_model(answer).logits.numpy()
  ours = np.asarray(forward(model, jnp.asarray(answer.numpy(), jnp.int32)).logits_BxLxV)
  assert np.max(np.abs(theirs - ours)) <= 1e-4


def test_the_walkthrough_starts_a_student_from_a_pretrained_checkpoint(walked, monkeypatch):
  """Its other student: the command resolves to models/student's shape (training such a
  student is tests/trainers/test_students.py's)."""
  monkeypatch.chdir(walked)
  argv = _tiny(_walkthrough()["distil_small"])
  config, _ = _parse("train", argv)
  config = recipe_for(resolve_job_config(config, "train")).config  # the recipe resolves it
  assert config.student.hf_path == str(walked / "models" / "student")
  assert config.data.tokenizer == f"hf:{walked / 'models' / 'teacher'}"
  assert (config.model.num_layers, config.model.embed_dim, config.model.mlp_dim) == (2, 48, 100)


def test_a_student_of_another_tokenizer_is_one_line_exit_2(walked, capsys, tmp_path,
                                                            monkeypatch):
  """Same vocabulary size, other tokens: the student would read the teacher's ids as other
  text."""
  home = walked
  other = tmp_path / "other"
  ct.save_tokenizer(other, ct.CHATML)
  vocab = json.loads((other / "tokenizer.json").read_text())
  tokens = vocab["model"]["vocab"]
  first, second = sorted(tokens, key=tokens.get)[300:302]
  tokens[first], tokens[second] = tokens[second], tokens[first]
  (other / "tokenizer.json").write_text(json.dumps(vocab))
  _qwen2(other, 2, 2)
  argv = _tiny(_walkthrough()["distil_small"])
  argv = [a.replace("models/student", str(other)) for a in argv]
  argv[argv.index("runs/hf_kd_small")] = "runs/refused"
  monkeypatch.chdir(home)
  capsys.readouterr()
  assert main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "different tokenizers" in err[0], err
  assert not (home / "runs" / "refused").exists()
