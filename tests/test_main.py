"""The CLI as a user meets it: every config runs (tiny), and malformed input fails cleanly."""

import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from distillax.demo.report import build_report
from distillax.demo.stages import TRAINED_STAGES, stage_config, stage_finished
from distillax.main import main
from tests.data import chat_testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "distillax", "configs", "demo.py")
LM = os.path.join(ROOT, "distillax", "configs", "lm.py")
DISTILL_HF = os.path.join(ROOT, "distillax", "configs", "distill_hf.py")


def strict_json(text: str):
  """json.loads that refuses NaN / Infinity, as every JSON reader but Python's does."""
  def refuse(name):
    raise ValueError(f"{name} is not JSON")
  return json.loads(text, parse_constant=refuse)


def test_demo_tiny_runs_every_stage_reports_and_reuses_finished_stages(tmp_path, capsys,
                                                                       monkeypatch):
  workdir = tmp_path / "demo"
  argv = ["distillax", "demo", "--config", f"{DEMO}:tiny", "--workdir", str(workdir)]
  built = []
  monkeypatch.setattr("distillax.demo.pipeline.build_report",
                      lambda pipeline: built.append(build_report(pipeline)) or built[-1])
  assert main(argv) == 0
  assert len(built) == 1
  # Strict JSON although PTQ has no training speed (null): any JSON reader can read the report.
  report = strict_json((workdir / "report.json").read_text())
  assert report["student_ptq_int4"]["tokens_per_s"] is None
  for metrics in workdir.glob("*/metrics.jsonl"):
    assert all(strict_json(line) for line in metrics.read_text().splitlines())
  markdown = (workdir / "report.md").read_text()
  assert "nan" not in markdown.lower()
  recovery = report["checks"]["qat_recovery_of_ptq_degradation"]
  ptq_gap = report["student_ptq_int4"]["val_loss"] - report["student_kd_fp"]["val_loss"]
  if ptq_gap > 0:
    assert recovery is not None and f"QAT recovers {recovery:.0%}" in markdown
  else:  # PTQ is not worse than full precision: no degradation, no ratio to report
    assert recovery is None and "nothing for QAT to recover" in markdown
  for stage in ("teacher", "student_scratch", "student_kd", "student_kd_fp",
                "student_ptq_int4", "student_qat_int4", "student_onpolicy", "student_qad_q4_0"):
    assert np.isfinite(report[stage]["val_loss"]), stage
    assert (workdir / stage / "summary.json").exists() or stage == "student_ptq_int4"
  assert report["teacher"]["top1_agreement"] == 1.0
  scratch, kd, teacher = (report[s]["val_loss"] for s in ("student_scratch", "student_kd",
                                                            "teacher"))
  share = report["checks"]["kd_share_of_gap_closed"]
  assert share == pytest.approx((scratch - kd) / (scratch - teacher)) if scratch > teacher \
      else share is None
  # The q4_0 export is much smaller than the fp32 one (the tied embedding stays fp32 by the
  # demo rules, a large share of this tiny model), and llama.cpp running it gives the fake-quant
  # forward's validation loss and greedy tokens. Per sequence, a q8_0 activation block that
  # rounds the other way in llama.cpp's integer dot products moves one token's CE by ~1e-3.
  assert report["student_qat_int4"]["bytes_on_disk"] < 0.7 * report["student_kd"]["bytes_on_disk"]
  checks = report["checks"]
  assert checks["llama_cpp_q4_0_qat_val_loss_diff"] < 1e-4 and checks["greedy_agrees"]
  assert checks["llama_cpp_f32_val_loss_diff"] < 1e-5
  assert checks["q4_0_gguf_max_abs_ce_sum_diff"] < 0.05
  assert (workdir / "report.md").read_text().count("|") > 30
  # Progressive against direct QAT: the direct row is the table's QAT row; both are q4_0
  # students measured against the same fp twin (a share, a KL, a ratio near 1 on these steps).
  progressive = report["progressive_qat"]
  assert progressive["student_qat_int4"]["val_loss"] == report["student_qat_int4"]["val_loss"]
  for row in progressive.values():
    assert 0 <= row["kl_mean"] <= row["kl_p99"] <= row["kl_max"] and 0 < row["same_top1"] <= 1
    assert row["tokens"] == report["setup"]["val_tokens"] and 0.5 < row["perplexity_ratio"] < 2
  assert (workdir / "loss_curves.png").stat().st_size > 10_000
  # The draft stage: the EAGLE-3 head and the distilled student as drafts for the teacher,
  # each acceptance length within [1, k + 1] tokens per teacher forward, and the verdict said.
  drafts = report["draft"]
  assert set(drafts["rows"]) == {"draft_head", "student_kd"}
  for row in drafts["rows"].values():
    assert len(row["acceptance"]) == drafts["k"] and row["params"] > 0
    assert all(1.0 <= a <= j + 1 for j, a in enumerate(row["acceptance"], 1))
  assert drafts["check"]["flops_ratio"] == pytest.approx(
      drafts["rows"]["draft_head"]["flops_per_token"]
      / drafts["rows"]["student_kd"]["flops_per_token"])
  assert "Speculative-decoding drafts for the teacher" in markdown
  assert ("The head beats" in markdown) != ("falls short" in markdown)
  # One evaluation route: each trained stage's row holds what `distillax eval --model <stage>`
  # prints and what its trainer's last eval wrote to summary.json, to the last digit; the
  # table's numbers are the same route over the report's larger validation set.
  # Three stages stand for the seven: a distilled student, a QAT one (its fake-quant form) and
  # the on-policy QAD one; the route is one function whatever the stage.
  assert {"student_kd", "student_qat_int4", "student_qad_q4_0"} <= set(TRAINED_STAGES)
  for stage in ("student_kd", "student_qat_int4", "student_qad_q4_0"):
    capsys.readouterr()
    assert main(["distillax", "eval", "--model", str(workdir / stage)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((workdir / stage / "summary.json").read_text())
    assert report[stage]["eval"] == printed == {k: summary[k] for k in printed}, stage
    assert report[stage]["val_tokens"] == report["setup"]["val_tokens"] > printed["eval_tokens"]
    # Next-token CE, whatever the stage's objective: the report's val loss on a superset of
    # its tokens.
    assert abs(report[stage]["val_loss"] - printed["eval_loss"]) < 0.5, stage
  # The rerun trains nothing and hands the reused stages to the report again. The report is
  # the same function over the same stage directories as above (its numbers are asserted
  # there), so here it is recorded, not measured twice: that half of the report took a third
  # of this test's time.
  reported = []
  monkeypatch.setattr("distillax.demo.pipeline.build_report",
                      lambda pipeline: reported.append(pipeline) or built[0])
  capsys.readouterr()
  assert main(argv) == 0
  assert capsys.readouterr().out.count("finished earlier, reusing") == len(TRAINED_STAGES) + 1
  assert len(reported) == 1 and reported[0].workdir == str(workdir)
  assert all(stage_finished(s, reported[0].stage_dir(s), stage_config(reported[0].config, s,
                                                                      str(workdir)))
             for s in TRAINED_STAGES)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  """A finished lm.py:tiny run and its Hugging Face export: what the malformed invocations that
  need an earlier run (init_from, export) point at."""
  root = tmp_path_factory.mktemp("lm_run")
  run, hf_dir = root / "run", root / "hf"
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(run),
               "--config.train.steps=3", "--config.train.eval_every=3"]) == 0
  assert main(["distillax", "export", "--config", f"{LM}:tiny", "--workdir", str(run),
               "--output", str(hf_dir)]) == 0
  return run, hf_dir


def test_init_from_a_run_may_change_how_the_forward_computes(lm_run, tmp_path, capsys):
  """A run started from an earlier one may pick another attention_impl (how attention is
  computed, not what is stored): the same weights give the earlier run's eval loss. A stored
  shape field that differs is still refused in one line."""
  run, _ = lm_run
  earlier = json.loads((run / "summary.json").read_text())
  base = ["distillax", "train", "--config", f"{LM}:tiny", f"--config.train.init_from={run}",
          "--config.train.steps=3", "--config.train.eval_every=3"]
  later = tmp_path / "reference"
  assert main([*base, "--workdir", str(later), "--config.model.attention_impl=reference",
               "--config.optimizer.learning_rate=1e-12"]) == 0
  assert json.loads((later / "config.json").read_text())["model"]["attention_impl"] == "reference"
  first = json.loads((later / "summary.json").read_text())
  assert abs(first["eval_loss"] - earlier["eval_loss"]) < 1e-5
  capsys.readouterr()
  refused = tmp_path / "heads"
  assert main([*base, "--workdir", str(refused), "--config.model.num_layers=3"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "train.init_from" in err[0] and "num_layers" in err[0], err
  assert not refused.exists()


def test_export_without_config_reads_the_runs_own(lm_run, tmp_path):
  """`export` needs no --config: the run's config.json gives its mesh, rules and model, and the
  files written are the ones an export with the run's --config writes, byte for byte."""
  run, hf_dir = lm_run
  out = tmp_path / "hf"
  assert main(["distillax", "export", "--workdir", str(run), "--output", str(out)]) == 0
  assert sorted(os.listdir(out)) == sorted(os.listdir(hf_dir))
  for name in os.listdir(hf_dir):
    assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name


def _bad(tmp_path, run, hf_dir):
  """(name, argv tail, fragments of the one-line error: the field or flag at fault, the fix)."""
  wd = str(tmp_path / "wd")
  cfg = f"{LM}:tiny"
  train = ["train", "--config", cfg, "--workdir", wd]
  plan = ["plan", "--config", cfg]
  layers = json.loads((run / "config.json").read_text())["model"]["num_layers"]
  unfinished = tmp_path / "unfinished"  # a distillax config.json but no checkpoints yet
  unfinished.mkdir()
  (unfinished / "config.json").write_bytes((run / "config.json").read_bytes())
  raising = tmp_path / "raising.py"
  raising.write_text("def get_config(arg=None):\n  raise RuntimeError('boom from the file')\n")
  export = ["export", "--config", cfg, "--workdir", str(run), "--output",
            str(tmp_path / "out")]
  return _bad_hf_job(tmp_path, run, hf_dir) + [
      ("unknown command", ["trian"], ["unknown command 'trian'", "use one of"]),
      ("missing config", ["train", "--workdir", wd], ["--config is required",
                                                      "--config distillax/configs"]),
      ("missing config file", ["train", "--config", "/nope/cfg.py", "--workdir", wd],
       ["/nope/cfg.py", "no such file"]),
      ("bad config arg", ["train", "--config", f"{LM}:huge", "--workdir", wd],
       ["'huge'", ":tiny"]),
      ("config arg of another config", ["train", "--config", f"{LM}:small", "--workdir", wd],
       ["unknown config argument 'small'", "this config takes :tiny"]),
      ("config file raises", ["train", "--config", str(raising), "--workdir", wd],
       ["RuntimeError", "boom from the file", "check the --config file"]),
      ("unknown key", train + ["--config.train.stepz=3"], ["train.stepz", "train.steps"]),
      ("unknown key, near miss", train + ["--config.train.step=10"],
       ["--config.train.step:", "no field 'step'", "did you mean train.steps",
        "--config.train.steps=10"]),
      ("unknown key, no near miss", train + ["--config.train.zzzz=1"],
       ["no field 'zzzz'", "batch_size", "fix the name"]),
      ("unknown section", train + ["--config.trian.steps=10"],
       ["'trian'", "--config.train.steps=10"]),
      ("wrong type", train + ["--config.train.steps=abc"],
       ["--config.train.steps=abc", "a whole number", "--config.train.steps=6"]),
      ("wrong type, float", train + ["--config.optimizer.learning_rate=fast"],
       ["optimizer.learning_rate=fast", "a number"]),
      ("wrong type, bool", train + ["--config.train.progress=maybe"],
       ["train.progress=maybe", "true or false"]),
      ("wrong type, placeholder", train + ["--config.model.sliding_window=wide"],
       ["model.sliding_window=wide", "a whole number"]),
      ("value for a section", train + ["--config.train=3"],
       ["--config.train is a section", "--config.train."]),
      ("override without value", train + ["--config.train.steps"],
       ["--config.train.steps", "distillax train --help"]),
      ("unknown flag", train + ["--stepz=3"], ["--stepz", "--workdir", "distillax train --help"]),
      ("flag typo", train + ["--workdri=x"], ["--workdri", "did you mean --workdir"]),
      ("config field as a flag", train + ["--steps=3"], ["--steps", "--config.train.steps"]),
      ("flag of another command", plan + ["--output", wd], ["--output", "distillax plan"]),
      ("missing workdir", ["train", "--config", cfg], ["--workdir is required",
                                                       "--workdir runs/"]),
      ("devices zero", train + ["--devices", "0"], ["--devices=0", "e.g. --devices 8"]),
      ("devices negative", train + ["--devices=-2"], ["--devices=-2", "positive whole number"]),
      ("devices not a number", train + ["--devices", "eight"],
       ["--devices=eight", "e.g. --devices 8"]),
      ("plan devices zero", plan + ["--devices", "0"], ["--devices=0", "e.g. --devices 8"]),
      ("plan memory negative", plan + ["--memory_gb", "-3"], ["--memory_gb=-3", "positive",
                                                              "e.g. --memory_gb 16"]),
      ("plan memory zero", plan + ["--memory_gb=0"], ["--memory_gb=0", "e.g. --memory_gb"]),
      ("mesh mismatch", train + ["--config.mesh.data=3"], ["mesh", "devices"]),
      ("mesh too large", train + ["--config.mesh.data=16"],
       ["needs 16 devices but 8 are available"]),
      ("two auto axes", train + ["--config.mesh.model=-1"], ["at most one axis may be -1"]),
      ("missing data path", train + ["--config.data.source=/nope/corpus/*.txt"],
       ["/nope/corpus"]),
      ("vocab mismatch", train + ["--config.model.vocab_size=100"], ["vocab"]),
      ("unwritable workdir", ["train", "--config", cfg, "--workdir", "/proc/distillax_wd"],
       ["/proc/distillax_wd", "not writable"]),
      ("unknown strategy", train + ["--config.partitioning.strategy=zero3"], ["zero3"]),
      ("unknown backend", train + ["--config.backend=xla"], ["backend='xla'"]),
      ("negative batch", train + ["--config.train.batch_size=-8"],
       ["train.batch_size=-8", "--config.train.batch_size="]),
      ("indivisible batch", train + ["--config.train.batch_size=6"], ["multiple of 8"]),
      ("negative steps", train + ["--config.train.steps=-5"],
       ["train.steps=-5", "1 or more", "--config.train.steps="]),
      ("zero steps", train + ["--config.train.steps=0"], ["train.steps=0", "1 or more"]),
      ("zero seq_len", train + ["--config.train.seq_len=0"], ["train.seq_len=0", "1 or more"]),
      ("zero accumulation", train + ["--config.train.accum_steps=0"],
       ["train.accum_steps=0", "--config.train.accum_steps="]),
      ("zero log period", train + ["--config.train.log_every=0"],
       ["train.log_every=0", "--config.train.log_every="]),
      ("negative eval period", train + ["--config.train.eval_every=-1"],
       ["train.eval_every=-1", "0 or more"]),
      ("zero eval batches", train + ["--config.train.eval_batches=0"],
       ["train.eval_batches=0", "--config.train.eval_batches="]),
      ("negative rollback threshold", train + ["--config.train.rollback_threshold=-0.1"],
       ["train.rollback_threshold=-0.1", "0 or more"]),
      ("zero rollback factor", train + ["--config.train.rollback_lr_factor=0.0"],
       ["train.rollback_lr_factor=0.0", "(0, 1]"]),
      ("growing rollback factor", train + ["--config.train.rollback_lr_factor=1.5"],
       ["train.rollback_lr_factor=1.5", "--config.train.rollback_lr_factor="]),
      ("negative max rollbacks", train + ["--config.train.max_rollbacks=-1"],
       ["train.max_rollbacks=-1", "0 or more"]),
      ("rollback metric the eval lacks", train + ["--config.train.rollback_metric=eval_acc"],
       ["train.rollback_metric='eval_acc'", "eval_perplexity, eval_loss, eval_objective",
        "--config.train.rollback_metric=eval_perplexity"]),
      ("negative learning rate", train + ["--config.optimizer.learning_rate=-1e-3"],
       ["optimizer.learning_rate=-0.001", "positive", "--config.optimizer.learning_rate="]),
      ("zero learning rate", train + ["--config.optimizer.learning_rate=0.0"],
       ["optimizer.learning_rate=0.0", "positive"]),
      ("nan learning rate", train + ["--config.optimizer.learning_rate=nan"],
       ["optimizer.learning_rate=nan", "positive"]),
      ("infinite learning rate", train + ["--config.optimizer.learning_rate=inf"],
       ["optimizer.learning_rate=inf", "--config.optimizer.learning_rate="]),
      ("negative warmup", train + ["--config.optimizer.warmup_steps=-1"],
       ["optimizer.warmup_steps=-1", "0 or more"]),
      ("warmup past the run", train + ["--config.optimizer.warmup_steps=10"],
       ["optimizer.warmup_steps=10", "train.steps"]),
      ("negative weight decay", train + ["--config.optimizer.weight_decay=-0.1"],
       ["optimizer.weight_decay=-0.1", "--config.optimizer.weight_decay="]),
      ("adam beta of one", train + ["--config.optimizer.b2=1.0"],
       ["optimizer.b2=1.0", "[0, 1)"]),
      ("negative adam epsilon", train + ["--config.optimizer.eps=-1e-08"],
       ["optimizer.eps=-1e-08", "0 or more"]),
      ("pmap with tp", train + ["--config.backend=pmap", "--config.partitioning.strategy=tp",
                                "--config.mesh.model=2"], ["data parallel only"]),
      ("sequence too long", train + ["--config.train.seq_len=4096"],
       ["train.seq_len=4096", "max_seq_len"]),
      ("unknown trainer", train + ["--config.trainer=rlhf"], ["rlhf", "use one of"]),
      ("bad tokenizer", train + ["--config.data.tokenizer=spm:/nope/tok.model"],
       ["/nope/tok.model"]),
      ("bad schedule", train + ["--config.optimizer.schedule=exp"], ["exp", "warmup_cosine"]),
      ("bad remat", train + ["--config.model.remat=most"], ["remat"]),
      ("bad heads", train + ["--config.model.num_kv_heads=3"], ["num_kv_heads"]),
      ("bad rule axis", train + ["--config.partitioning.rules=(('mlp','fsdp'),)"], ["'fsdp'"]),
      ("bad checkpoint period", train + ["--config.checkpoint.every_steps=-1"],
       ["every_steps"]),
      ("init_from a Hugging Face dir of another shape",
       train + [f"--config.train.init_from={hf_dir}", f"--config.model.num_layers={layers + 2}"],
       [f"--config.model.num_layers={layers + 2}", "train.init_from", f"num_layers={layers}",
        "drop the override"]),
      ("init_from nowhere", train + ["--config.train.init_from=/nope/run"],
       ["train.init_from=/nope/run", "not a distillax run", "--workdir"]),
      ("init_from an untrained run", train + [f"--config.train.init_from={unfinished}"],
       ["train.init_from", "no checkpoints/", "train that run first"]),
      ("init_from another shape", train + [f"--config.train.init_from={run}",
                                           f"--config.model.num_layers={layers + 2}"],
       [f"--config.model.num_layers={layers + 2} disagrees with train.init_from={run}",
        f"num_layers={layers}", "drop the override"]),
      ("demo config under train", ["train", "--config", f"{DEMO}:tiny", "--workdir", wd],
       ["distillax demo"]),
      ("job config under demo", ["demo", "--config", cfg, "--workdir", wd], ["demo.py"]),
      ("demo devices zero", ["demo", "--config", f"{DEMO}:tiny", "--workdir", wd,
                             "--devices", "0"], ["--devices=0"]),
      ("unknown qat rule field", train + ["--config.qat.rules=({'module_path': '.*', "
                                          "'bits': 4},)"], ["unknown field(s) ['bits']"]),
      ("per-step reduction under fsdp", train + [
          "--config.partitioning.gradient_reduction=per_step"], ["use strategy dp or tp"]),
      ("processes without coordinator", train + ["--num_processes=2"],
       ["num_processes=2", "--coordinator_address"]),
      ("coordinator without processes", train + ["--coordinator_address=127.0.0.1:1"],
       ["--num_processes", "--process_id"]),
      ("export without workdir", ["export", "--config", cfg, "--output", wd],
       ["--workdir is required"]),
      ("export without output", ["export", "--config", cfg, "--workdir", str(run)],
       ["--output is required"]),
      ("export unknown format", export + ["--format", "onnx"], ["--format='onnx'", "quantized"]),
      ("export into a full directory", ["export", "--config", cfg, "--workdir", str(run),
                                        "--output", wd], ["--output", "not empty"]),
      ("export of no run", ["export", "--config", cfg, "--workdir", wd, "--output",
                            str(tmp_path / "out")], ["--workdir", "not written by distillax"]),
      ("export of a Hugging Face dir", ["export", "--config", cfg, "--workdir", str(hf_dir),
                                        "--output", str(tmp_path / "out")],
       ["--workdir", "Hugging Face checkpoint"]),
      ("export with a distill config", ["export", "--config", f"{ROOT}/distillax/configs/"
                                        "distill.py:tiny", "--workdir", str(run), "--output",
                                        str(tmp_path / "out")],
       ["trainer 'distill'", "'lm'", "--config"]),
      ("export with the full-size config", ["export", "--config", LM, "--workdir", str(run),
                                            "--output", str(tmp_path / "out")],
       ["another job", "model.", "config.json"]),
      ("export with another model override", export + ["--config.model.num_layers=9"],
       ["model.num_layers 9", f"the run's {layers}"]),
      ("cache-teacher of an lm config", ["cache-teacher", "--config", cfg, "--workdir", wd],
       ["distillation config", "distill_cached.py"]),
  ]


def _bad_hf_job(tmp_path, run, hf_dir):
  """The mistakes of the README's walkthrough "Distil your own Hugging Face model" (issue 27):
  chat data that is not UTF-8, a role no template knows, chats with nothing to train, a block
  copied twice, a teacher folder without its tokenizer, relative paths from another directory,
  an export onto a file. The data ones use the byte tokenizer with a ChatML template file, so
  they run the train command as far as a real run goes before it compiles. The commands run
  from tmp_path/elsewhere (see the test); the teacher is in tmp_path/home/models/teacher."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "chatml.jinja").write_text(chat_testing.CHATML)
  chats = [{"messages": m} for m in chat_testing.conversations(6)]
  chat_testing.write_jsonl(data / "chats.jsonl", chats)
  lines = (data / "chats.jsonl").read_bytes().splitlines(keepends=True)
  latin1 = b'{"text": "caf\xe9"}\n'  # line 3 of that file: not UTF-8
  (data / "latin1.jsonl").write_bytes(b"".join(lines[:2] + [latin1] + lines[3:]))
  bot = [dict(c) for c in chats]
  bot[1] = {"messages": [dict(m, role="bot" if m["role"] == "assistant" else m["role"])
                         for m in chats[1]["messages"]]}
  chat_testing.write_jsonl(data / "bot.jsonl", bot)
  chat_testing.write_jsonl(data / "questions.jsonl", [
      {"messages": [m for m in c["messages"] if m["role"] != "assistant"]} for c in chats])
  teacher = tmp_path / "home" / "models" / "teacher"
  shutil.copytree(hf_dir, teacher)
  (teacher / "tokenizer.json").unlink()  # saved without its tokenizer
  (tmp_path / "a_file").write_text("not a directory")
  out = str(tmp_path / "out")  # never written: the test checks it stays absent
  chat_train = lambda name: [
      "train", "--config", f"{LM}:tiny", "--workdir", out, f"--config.data.source={data / name}",
      f"--config.data.eval_source={data / name}",
      f"--config.data.chat_template={data / 'chatml.jinja'}"]
  hf_train = ["train", "--config", DISTILL_HF + ":tiny", "--workdir", out]
  return [
      ("chat data not UTF-8", chat_train("latin1.jsonl"),
       [f"{data / 'latin1.jsonl'}: line 3 is not UTF-8", "b'\\xe9'", "re-encode the file"]),
      ("unknown chat role", chat_train("bot.jsonl"),
       ["bot.jsonl: line 2: message", "has role 'bot'", "system, developer, user, assistant",
        "rename it to 'assistant'"]),
      ("no chat has an answer", chat_train("questions.jsonl"),
       ["train records of data source", "questions.jsonl", "no token to train",
        "assistant turn", "--config.data.loss_on=all"]),
      ("a teacher block copied twice", ["train", "--config", f"{ROOT}/distillax/configs/"
                                        "distill.py:tiny", "--workdir", out,
                                        "--config.student.from_teacher.layers=(1, 1)"],
       ["student.from_teacher.layers=(1, 1)", "block(s) [1] more than once", "e.g. (1,)"]),
      # Issue 48: a Gemma 3 student of blocks (0, 2, 5) slides layers 0 and 1 of 3, which
      # llama.cpp's gemma3 cannot say: refused before training when the job says it will need
      # a GGUF (and where QAT rules train for q4_0/q8_0), not at export.
      ("a GGUF layout the student will need", [
          "train", "--config", f"{ROOT}/distillax/configs/distill.py:tiny", "--workdir", out,
          "--config.teacher.preset=tiny_gemma3", "--config.student.from_teacher.layers=(0, 2, 5)",
          "--config.train.export_format=gguf"],
       ["train.export_format='gguf'", "cannot be exported as GGUF", "five layers in six",
        "sliding layers are [0, 1]", "--format hf"]),
      ("teacher folder without tokenizer.json",
       hf_train + [f"--config.teacher.hf_path={teacher}", f"--config.data.tokenizer=hf:{teacher}",
                   "--config.student.from_teacher.layers=(0,)"],
       [f"data.tokenizer='hf:{teacher}'", "has no tokenizer.json", "save_pretrained"]),
      ("relative paths from another directory",
       hf_train + ["--config.teacher.hf_path=models/teacher",
                   "--config.data.tokenizer=hf:models/teacher",
                   "--config.student.from_teacher.layers=(0,)"],
       ["teacher.hf_path='models/teacher' is relative", f"{tmp_path / 'elsewhere'},",
        f"to {tmp_path / 'elsewhere' / 'models' / 'teacher'}, which does not exist",
        "give an absolute path"]),
      ("export onto a file", ["export", "--workdir", str(run), "--output",
                              str(tmp_path / "a_file")],
       ["--output", "a_file is a file", "choose a new directory path"]),
      ("export below a file", ["export", "--workdir", str(run), "--output",
                               str(tmp_path / "a_file" / "hf")],
       ["is below the file", "a_file", "choose a new directory path"]),
  ]


def _files(root) -> dict:
  """Every file under `root` (recursively) by relative path, with its bytes."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
          if p.is_file()}


# Found only once the step is compiled, so one distillax INFO line ("compiled jit step ...")
# comes before the error. None since the unwritable workdir is found before the compile.
AFTER_COMPILE = set()


def test_malformed_invocations_fail_with_one_line_and_status_2(tmp_path, capsys, lm_run,
                                                              monkeypatch):
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")  # not where the relative paths of a case lead
  existing = tmp_path / "wd"
  (existing / "checkpoints").mkdir(parents=True)
  (existing / "config.json").write_text('{"keep": true}')
  (existing / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  (existing / "checkpoints" / "note.txt").write_text("not a checkpoint")
  run, hf_dir = lm_run
  watched = [existing, run, hf_dir]
  before = [_files(d) for d in watched]
  cases = _bad(tmp_path, run, hf_dir)
  assert len(cases) >= 60
  for name, argv, fragments in cases:
    code = main(["distillax"] + argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    if name in AFTER_COMPILE:
      err = [line for line in err if not re.match(r"I\d{4} [\d:.]+ backends\.py:\d+\] ", line)]
    assert code == 2, f"{name}: exit {code}, stderr {err}"
    assert len(err) == 1 and err[0].startswith("distillax"), f"{name}: {err}"
    assert "Traceback" not in captured.err and captured.out == "", name
    for fragment in fragments:
      assert fragment.lower() in err[0].lower(), f"{name}: {err[0]!r} lacks {fragment!r}"
    assert [_files(d) for d in watched] == before, f"{name} changed a directory"
    assert not (tmp_path / "out").exists(), name


def test_a_file_where_some_chats_lack_an_answer_trains_and_counts_them_once(tmp_path, capsys,
                                                                            lm_run):
  """The near cousin of "no chat has an answer": the chats with an answer train, and one line
  says how many records were skipped (lm_run: the same step shapes, compiled once)."""
  chats = [{"messages": m} for m in chat_testing.conversations(10, seed=3)]
  for i in (2, 5, 8):
    chats[i]["messages"] = [m for m in chats[i]["messages"] if m["role"] != "assistant"]
  source = chat_testing.write_jsonl(tmp_path / "chats.jsonl", chats)
  (tmp_path / "chatml.jinja").write_text(chat_testing.CHATML)
  capsys.readouterr()
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(tmp_path / "run"),
               f"--config.data.source={source}", f"--config.data.eval_source={source}",
               f"--config.data.chat_template={tmp_path / 'chatml.jinja'}",
               "--config.train.steps=3", "--config.train.eval_every=3"]) == 0
  err = capsys.readouterr().err.splitlines()
  skipped = [line for line in err if "nothing to train" in line]
  assert len(skipped) == 1, err
  assert "3 of the 10 train records, 3 of the 10 eval records" in skipped[0]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["finished"] and summary["tokens"] > 0 and summary["eval_tokens"] > 0


def test_help_and_version_print_and_exit_0(capsys):
  version = importlib.metadata.version("distillax")
  for argv in (["--version"], ["train", "--version"], ["export", "--config", "x", "--version"]):
    assert main(["distillax"] + argv) == 0, argv
    assert capsys.readouterr().out == f"distillax {version}\n"
  assert main(["distillax", "--help"]) == 0
  overview = capsys.readouterr().out
  assert all(f"  {c} " in overview for c in ("train", "plan", "export", "cache-teacher", "demo"))
  # The flags a user needs for each command (README); plan writes nothing, so no --workdir.
  needs = {"train": ["--workdir", "--devices", "--num_processes", "--coordinator_address"],
           "plan": ["--devices", "--memory_gb"], "export": ["--workdir", "--output", "--format"],
           "cache-teacher": ["--workdir"], "demo": ["--workdir", "--devices"]}
  for command, flags in needs.items():
    for form in ("--help", "-h"):
      assert main(["distillax", command, form]) == 0
      captured = capsys.readouterr()
      # export reads the run's own config.json without one: its --config is shown optional
      config = "[--config" if command == "export" else "--config"
      assert captured.out.startswith(f"usage: distillax {command} {config}") and not captured.err
      for flag in flags + ["--config.KEY=VALUE", "--verbose", "--version"]:
        assert flag in captured.out, (command, flag)
  assert main(["distillax", "plan", "--help"]) == 0
  assert "--workdir" not in capsys.readouterr().out
  # The console entry point, in a fresh interpreter: no JAX start-up, nothing on stderr.
  out = subprocess.run([sys.executable, "-m", "distillax", "--version"], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert (out.returncode, out.stdout, out.stderr) == (0, f"distillax {version}\n", "")


LOG_LINE = re.compile(r"^(\[process \d+/\d+\] )?[IWEF]\d{4} [\d:.]+ ([\w.]+):\d+\] ")


def test_logs_are_distillax_lines_unless_verbose(tmp_path, capsys):
  """The console shows distillax's own INFO lines (one per checkpoint save) and no library INFO
  lines unless --verbose; never absl's "Logging before flag parsing" warning."""
  argv = ["distillax", "train", "--config", f"{LM}:tiny", "--config.train.steps=3",
          "--config.train.eval_every=3", "--config.checkpoint.every_steps=3"]
  own = {os.path.basename(p) for p in glob.glob(f"{ROOT}/distillax/**/*.py", recursive=True)}
  assert main(argv + ["--workdir", str(tmp_path / "quiet")]) == 0
  captured = capsys.readouterr()
  quiet = captured.err.splitlines()
  # One eval (step 3) and one line that reports it, on either stream.
  assert sum("perplexity" in line for line in quiet + captured.out.splitlines()) == 1, captured
  assert main(argv + ["--workdir", str(tmp_path / "verbose"), "--verbose"]) == 0
  verbose = capsys.readouterr().err.splitlines()
  assert not any("Logging before flag parsing" in line for line in quiet + verbose)
  quiet_logs = [LOG_LINE.match(line) for line in quiet]
  assert quiet_logs and all(quiet_logs), [l for l, m in zip(quiet, quiet_logs) if not m]
  assert {m.group(2) for m in quiet_logs} <= own
  assert not any("orbax" in line.lower() for line in quiet)
  assert sum("checkpoint: saving step 3" in line for line in quiet) == 1
  verbose_files = {m.group(2) for m in map(LOG_LINE.match, verbose) if m}
  assert verbose_files - own, "--verbose shows no library line"
  assert len(verbose) > 2 * len(quiet)


def test_every_log_line_names_its_process_when_there_are_several(tmp_path, lm_run):
  """Two real processes export one run: each log line starts with `[process i/2]`, and the
  checkpoint restore, which every process joins, is one line (process 0's)."""
  from distillax.launch_local import launch
  run, _ = lm_run
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  status = launch([sys.executable, "-m", "distillax", "export", "--config", f"{LM}:tiny",
                   "--workdir", str(run), "--output", str(tmp_path / "hf")],
                  num_processes=2, devices_per_process=4, timeout_s=600, env=env,
                  log_dir=str(tmp_path / "logs"))
  logs = [(tmp_path / "logs" / f"process_{i}.log").read_text().splitlines() for i in (0, 1)]
  assert status == 0, "\n".join(logs[0] + logs[1])
  assert (tmp_path / "hf" / "config.json").exists()
  for i, lines in enumerate(logs):
    ours = [m for m in map(LOG_LINE.match, lines) if m]
    assert ours and all(m.group(1) == f"[process {i}/2] " for m in ours), lines
  restores = [sum("checkpoint: restored step" in line for line in lines) for lines in logs]
  assert restores == [1, 0]


def test_a_run_from_init_from_exports_after_that_run_is_gone(tmp_path, lm_run):
  """train.init_from is checked when a run starts, not when it is loaded later: its weights
  are in its own checkpoints by then."""
  import shutil
  base, run, out = tmp_path / "base", tmp_path / "continued", tmp_path / "hf"
  shutil.copytree(lm_run[0], base)
  assert main(["distillax", "train", "--config", f"{LM}:tiny", "--workdir", str(run),
               f"--config.train.init_from={base}", "--config.train.steps=3",
               "--config.train.eval_every=3"]) == 0
  shutil.rmtree(base)
  assert main(["distillax", "export", "--config", f"{LM}:tiny", "--workdir", str(run),
               "--output", str(out)]) == 0
  assert (out / "config.json").exists()


def test_qat_rules_by_name_train_and_export(tmp_path):
  """`qat.rules` as named fields: the run trains with them, and the quantized export (which
  reads the same rules) writes int8 weights for the matmuls and keeps the embedding full."""
  qat = os.path.join(ROOT, "distillax", "configs", "qat.py") + ":tiny"
  rules = ("--config.qat.rules=({'module_path': '', 'weight_qtype': None}, "
           "{'module_path': '.*', 'weight_qtype': 'int8', 'act_qtype': 'int8'})")
  run, out = tmp_path / "run", tmp_path / "int8"
  assert main(["distillax", "train", "--config", qat, "--workdir", str(run), rules,
               "--config.train.steps=3", "--config.train.eval_every=3"]) == 0
  saved = json.loads((run / "config.json").read_text())["qat"]["rules"]
  assert saved[1] == {"module_path": ".*", "weight_qtype": "int8", "act_qtype": "int8"}
  assert main(["distillax", "export", "--config", qat, "--workdir", str(run), "--output",
               str(out), "--format", "quantized", rules]) == 0
  exported = json.loads((out / "quant_config.json").read_text())
  qtypes = {r["module_path"]: r["weight_qtype"] for r in exported["quant_config"]["rules"]}
  assert qtypes == {"": None, ".*": "int8"}
  assert {w["qtype"] for w in exported["quantized"].values()} == {"int8"}
  assert "embedder/embedding" not in exported["quantized"]
