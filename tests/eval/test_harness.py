"""The lm-eval adapter against lm-eval's own Hugging Face backend (HFLM) on one tiny random Llama
saved by transformers: the same per-request log-likelihoods (within 1e-4), rolling
log-likelihoods across several windows, greedy generations, and task metrics through
`distillax eval --tasks` on the shipped local tasks; one line for each misuse."""

import json
import os

import numpy as np
import pytest
import torch
import transformers
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from distillax.eval.generate import greedy_completions
from distillax.eval.harness import DistillaxLM
from distillax.eval.lm_tasks import LOCAL_TASKS
from distillax.generate import load_model_dir
from distillax.main import main
from tests.data import chat_testing as ct

MAX_LEN = 64  # the model's max_position_embeddings: documents longer than it roll over windows
DATA = os.path.join(LOCAL_TASKS, "distillax_code", "code_completion.jsonl")


def _save_tokenizer(folder):
  """A byte-level BPE trained on the corpus whose encoding starts with BOS (as Llama's does), so
  both backends put BOS first by default."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(ct.training_lines(), trainers.BpeTrainer(
      vocab_size=384, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                     special_tokens=[("<s>", 1)])
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>").save_pretrained(str(folder))


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
  """(model dir, distillax's adapter, lm-eval's HFLM) over the same weights."""
  folder = tmp_path_factory.mktemp("eval_harness") / "llama"
  _save_tokenizer(folder)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
  transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
  hflm = HFLM(pretrained=str(folder), device="cpu", batch_size=4, dtype="float32")
  return str(folder), DistillaxLM(load_model_dir(str(folder))), hflm


def _snippets(count):
  with open(DATA, encoding="utf-8") as f:
    return [json.loads(line) for line in f][:count]


def test_loglikelihoods_equal_hflm(backends):
  _, ours, hflm = backends
  pairs = [(d["context"], c) for d in _snippets(4) for c in d["choices"]]
  pairs += [("", "import os"), ("def add(a, b):\n    return a ", "+ b")]  # empty context, space
  requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
  got, want = ours.loglikelihood(requests), hflm.loglikelihood(requests)
  delta = max(abs(g[0] - w[0]) for g, w in zip(got, want))
  assert delta <= 1e-4, delta
  assert [g[1] for g in got] == [w[1] for w in want]
  assert ours.scorer.compiled_shapes == {(8, 32)}  # one length bucket, one batch size


def test_rolling_loglikelihoods_equal_hflm_across_windows(backends):
  _, ours, hflm = backends
  docs = ["\n".join(ct.training_lines()[:12]), "def add(a, b):\n    return a + b\n"]
  assert len(ours.tok_encode(docs[0])) > 3 * MAX_LEN  # four windows
  requests = [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(docs)]
  # HFLM sums each window in float32: a total near -2,500 is only resolved to ~2.4e-4 there.
  np.testing.assert_allclose(ours.loglikelihood_rolling(requests),
                             hflm.loglikelihood_rolling(requests), rtol=1e-7, atol=1e-4)


def test_greedy_generations_equal_hflm(backends):
  _, ours, hflm = backends
  until = {"until": ["\n"], "do_sample": False, "max_gen_toks": 8}
  requests = [Instance("generate_until", {}, (d["context"], until), i)
              for i, d in enumerate(_snippets(4))]
  got = ours.generate_until(requests)
  assert got == hflm.generate_until(requests)
  assert any(got)


def test_generate_scores_greedy_completions_as_hflm_decodes_them(backends, tmp_path, capsys):
  """`eval --generate`'s completions (to EOS, no stop string) are HFLM's, scored as given."""
  folder, ours, hflm = backends
  docs = _snippets(4)
  prompts = [d["context"] for d in docs]
  want = hflm.generate_until([Instance("generate_until", {}, (p, {
      "until": [], "do_sample": False, "max_gen_toks": 8}), i) for i, p in enumerate(prompts)])
  assert greedy_completions(ours, prompts, 8) == want
  data = tmp_path / "pairs.jsonl"
  data.write_text('{"prompt": "x"}\n')
  line = _error_line(capsys, ["--model", folder, "--generate", str(data)])
  assert 'line 1 needs string "prompt" and "completion" fields' in line
  line = _error_line(capsys, ["--model", folder, "--generate", str(data), "--tasks", "x"])
  assert "--tasks and --generate are separate evaluations; run one at a time" in line


def test_eval_tasks_print_hflms_task_metrics(backends, tmp_path, capsys, monkeypatch):
  folder, _, hflm = backends
  output = tmp_path / "results.json"
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", folder, "--tasks",
               "distillax_code_mc,distillax_code_ppl", "--limit", "3", "--output",
               str(output)]) == 0
  got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert json.loads(output.read_text()) == got
  # The same tasks through lm-eval's own route: its TaskManager reads the YAMLs as they are,
  # from their folder (lm-eval reads data_files from the current directory).
  from lm_eval.tasks import TaskManager
  monkeypatch.chdir(os.path.dirname(DATA))
  want = simple_evaluate(model=hflm, tasks=["distillax_code_mc", "distillax_code_ppl"],
                         task_manager=TaskManager(include_path=LOCAL_TASKS,
                                                  include_defaults=False),
                         limit=3, bootstrap_iters=0)["results"]
  assert got["distillax_code_mc"]["acc"] == want["distillax_code_mc"]["acc,none"]
  assert got["distillax_code_mc"]["acc_norm"] == want["distillax_code_mc"]["acc_norm,none"]
  np.testing.assert_allclose(got["distillax_code_ppl"]["bits_per_byte"],
                             want["distillax_code_ppl"]["bits_per_byte,none"], rtol=1e-6)


def _error_line(capsys, argv) -> str:
  capsys.readouterr()
  assert main(["distillax", "eval"] + argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  return err[-1]


def test_eval_tasks_errors_are_one_line_and_write_nothing(backends, tmp_path, capsys,
                                                          monkeypatch):
  folder, _, _ = backends
  output = tmp_path / "out.json"
  line = _error_line(capsys, ["--model", folder, "--tasks", str(tmp_path / "nosuch.yaml")])
  assert "nosuch.yaml: no such file" in line
  # A task whose data is not on this machine (offline, nothing to download from).
  task = tmp_path / "gone.yaml"
  task.write_text(open(os.path.join(LOCAL_TASKS, "distillax_code", "distillax_code_mc.yaml"))
                  .read().replace("task: distillax_code_mc", "task: gone")
                  .replace("code_completion.jsonl", "missing.jsonl"))
  line = _error_line(capsys, ["--model", folder, "--tasks", str(task), "--output", str(output)])
  assert "a task's data could not be loaded" in line and "local JSON file" in line, line
  assert not output.exists()
  # An unknown name, judged against the local tasks only (indexing lm-eval's ~15k built-in
  # tasks takes 20-40 s here; the message is the same).
  import lm_eval.tasks
  index = lm_eval.tasks.TaskManager.__init__
  monkeypatch.setattr(lm_eval.tasks.TaskManager, "__init__",
                      lambda self, **kw: index(self, **dict(kw, include_defaults=False)))
  line = _error_line(capsys, ["--model", folder, "--tasks", "distillax_code_mc,nosuch",
                              "--output", str(output)])
  assert line.startswith("distillax eval: error: --tasks=nosuch: no such lm-eval task; the "
                         "local ones are distillax_code_gen, distillax_code_mc"), line
  assert not output.exists()
  monkeypatch.undo()
  line = _error_line(capsys, ["--model", folder, "--limit", "3"])
  assert "--limit sets how --tasks run; add --tasks" in line
  monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # the eval extra missing
  line = _error_line(capsys, ["--model", folder, "--tasks", "distillax_code_mc"])
  assert "--tasks needs the eval extra (lm-eval): pip install 'distillax[eval]'" in line


def test_eval_tasks_outside_a_git_repository_print_no_git_error(backends, tmp_path, capfd,
                                                               monkeypatch):
  """lm-eval runs `git describe` for its results' git hash, whose "fatal: not a git
  repository" went to the terminal from any directory outside a repository."""
  import subprocess
  folder, _, _ = backends
  monkeypatch.chdir(tmp_path)
  assert subprocess.run(["git", "rev-parse"], capture_output=True).returncode != 0
  capfd.readouterr()
  assert main(["distillax", "eval", "--model", folder, "--tasks", "distillax_code_mc",
               "--limit", "1"]) == 0
  captured = capfd.readouterr()
  assert '"distillax_code_mc"' in captured.out
  assert "fatal" not in captured.err and "not a git repository" not in captured.err, captured.err


def test_a_hub_task_offline_and_uncached_is_one_line_before_lm_eval_starts(backends, tmp_path,
                                                                           capsys, monkeypatch):
  """The Hub client retried each request for ~25 s before lm-eval's error; the data set is
  now looked for first: HF_HUB_OFFLINE, or a Hub that refuses the connection (a closed local
  port as HF_ENDPOINT), is one line naming the task and its data set, lm-eval never called."""
  import lm_eval

  def never(**_):
    raise AssertionError("lm-eval started on data that cannot be loaded")

  folder, _, _ = backends
  monkeypatch.setattr(lm_eval, "simple_evaluate", never)
  task = tmp_path / "hub_task.yaml"
  task.write_text(open(os.path.join(LOCAL_TASKS, "distillax_code", "distillax_code_mc.yaml"))
                  .read().replace("task: distillax_code_mc", "task: hub_task")
                  .replace("dataset_path: json", "dataset_path: nosuch-org/nosuch-set"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  line = _error_line(capsys, ["--model", folder, "--tasks", str(task)])
  assert ("the Hugging Face data set nosuch-org/nosuch-set (task hub_task) is not in this "
          "machine's cache, and HF_HUB_OFFLINE=1 keeps the Hub client offline") in line, line
  assert "task YAML over a local JSON file" in line
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy",
              "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
  line = _error_line(capsys, ["--model", folder, "--tasks", str(task)])
  assert "and the Hub (http://127.0.0.1:1) cannot be reached from here" in line, line
