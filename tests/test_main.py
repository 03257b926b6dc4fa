"""The CLI as a user meets it: every config runs (tiny), and malformed input fails cleanly."""

import glob
import json
import os

import numpy as np
import pytest

from distillax.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Job configs are the files with a get_config (common.py and sections.py are their parts).
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "distillax", "configs", "*.py"))
                 if "def get_config(" in open(p).read())
DEMO = os.path.join(ROOT, "distillax", "configs", "demo.py")
JOBS = [p for p in CONFIGS if p != DEMO]
LM = os.path.join(ROOT, "distillax", "configs", "lm.py")


def test_every_config_has_its_launch_command_in_the_docstring():
  for path in CONFIGS:
    source = open(path).read()
    name = os.path.relpath(path, ROOT)
    assert f"--config {name}" in source, f"{name}: docstring lacks its launch command"


@pytest.mark.parametrize("config", JOBS, ids=os.path.basename)
def test_every_config_trains_on_tiny_overrides(config, tmp_path):
  workdir = tmp_path / "run"
  code = main(["distillax", "train", "--config", f"{config}:tiny", "--workdir", str(workdir),
               "--config.train.steps=3", "--config.train.eval_every=3"])
  assert code == 0
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("loss" in r for r in rows) and any("eval_loss" in r for r in rows)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["step"] == 3 and summary["finished"]
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 3


def test_demo_tiny_runs_every_stage_reports_and_reuses_finished_stages(tmp_path, capsys):
  workdir = tmp_path / "demo"
  argv = ["distillax", "demo", "--config", f"{DEMO}:tiny", "--workdir", str(workdir)]
  assert main(argv) == 0
  report = json.loads((workdir / "report.json").read_text())
  for stage in ("teacher", "student_scratch", "student_kd", "student_kd_fp",
                "student_ptq_int4", "student_qat_int4"):
    assert np.isfinite(report[stage]["val_loss"]), stage
    assert (workdir / stage / "summary.json").exists() or stage == "student_ptq_int4"
  assert report["teacher"]["top1_agreement"] == 1.0
  # int4 export is much smaller than the fp32 one and reloads to the fake-quant forward.
  # (the tied embedding stays fp32 by the demo rules, a large share of this tiny model)
  assert report["student_qat_int4"]["bytes_on_disk"] < 0.7 * report["student_kd"]["bytes_on_disk"]
  assert report["checks"]["int4_export_max_abs_ce_sum_diff"] < 1e-3
  assert (workdir / "report.md").read_text().count("|") > 30
  assert (workdir / "loss_curves.png").stat().st_size > 10_000
  capsys.readouterr()
  assert main(argv) == 0
  assert capsys.readouterr().out.count("finished earlier, reusing") == 5


def _bad(tmp_path):
  """(name, argv tail, expected fragment of the one-line error)."""
  wd = str(tmp_path / "wd")
  cfg = f"{LM}:tiny"
  return [
      ("unknown command", ["trian"], "unknown command 'trian'"),
      ("missing config", ["train", "--workdir", wd], "--config is required"),
      ("missing config file", ["train", "--config", "/nope/cfg.py", "--workdir", wd], "nope"),
      ("bad config arg", ["train", "--config", f"{LM}:huge", "--workdir", wd], "huge"),
      ("unknown key", ["train", "--config", cfg, "--workdir", wd, "--config.train.stepz=3"],
       "stepz"),
      ("wrong type", ["train", "--config", cfg, "--workdir", wd, "--config.train.steps=abc"],
       "abc"),
      ("unknown flag", ["train", "--config", cfg, "--workdir", wd, "--stepz=3"], "stepz"),
      ("missing workdir", ["train", "--config", cfg], "--workdir is required"),
      ("mesh mismatch", ["train", "--config", cfg, "--workdir", wd, "--config.mesh.data=3"],
       "devices"),
      ("mesh too large", ["train", "--config", cfg, "--workdir", wd, "--config.mesh.data=16"],
       "needs 16 devices but 8 are available"),
      ("two auto axes", ["train", "--config", cfg, "--workdir", wd, "--config.mesh.model=-1"],
       "at most one axis may be -1"),
      ("missing data path", ["train", "--config", cfg, "--workdir", wd,
                             "--config.data.source=/nope/corpus/*.txt"], "/nope/corpus"),
      ("vocab mismatch", ["train", "--config", cfg, "--workdir", wd,
                          "--config.model.vocab_size=100"], "vocab"),
      ("unwritable workdir", ["train", "--config", cfg, "--workdir", "/proc/distillax_wd"],
       "not writable"),
      ("unknown strategy", ["train", "--config", cfg, "--workdir", wd,
                            "--config.partitioning.strategy=zero3"], "zero3"),
      ("unknown backend", ["train", "--config", cfg, "--workdir", wd, "--config.backend=xla"],
       "backend='xla'"),
      ("indivisible batch", ["train", "--config", cfg, "--workdir", wd,
                             "--config.train.batch_size=6"], "multiple of 8"),
      ("pmap with tp", ["train", "--config", cfg, "--workdir", wd, "--config.backend=pmap",
                        "--config.partitioning.strategy=tp", "--config.mesh.model=2"],
       "data parallel only"),
      ("sequence too long", ["train", "--config", cfg, "--workdir", wd,
                             "--config.train.seq_len=4096"], "max_seq_len"),
      ("unknown trainer", ["train", "--config", cfg, "--workdir", wd,
                           "--config.trainer=rlhf"], "rlhf"),
      ("bad tokenizer", ["train", "--config", cfg, "--workdir", wd,
                         "--config.data.tokenizer=spm:/nope/tok.model"], "/nope/tok.model"),
      ("bad schedule", ["train", "--config", cfg, "--workdir", wd,
                        "--config.optimizer.schedule=exp"], "exp"),
      ("bad remat", ["train", "--config", cfg, "--workdir", wd, "--config.model.remat=most"],
       "remat"),
      ("bad heads", ["train", "--config", cfg, "--workdir", wd, "--config.model.num_kv_heads=3"],
       "num_kv_heads"),
      ("bad rule axis", ["train", "--config", cfg, "--workdir", wd,
                         "--config.partitioning.rules=(('mlp','fsdp'),)"], "'fsdp'"),
      ("bad checkpoint period", ["train", "--config", cfg, "--workdir", wd,
                                 "--config.checkpoint.every_steps=-1"], "every_steps"),
      ("demo config under train", ["train", "--config", f"{DEMO}:tiny", "--workdir", wd],
       "distillax demo"),
      ("job config under demo", ["demo", "--config", cfg, "--workdir", wd], "demo.py"),
      ("unknown qat rule field", ["train", "--config", cfg, "--workdir", wd,
                                  "--config.qat.rules=({'module_path': '.*', 'bits': 4},)"],
       "unknown field(s) ['bits']"),
      ("per-step reduction under fsdp", ["train", "--config", cfg, "--workdir", wd,
                                         "--config.partitioning.gradient_reduction=per_step"],
       "use strategy dp or tp"),
  ]


def test_malformed_invocations_fail_with_one_line_and_status_2(tmp_path, capsys):
  existing = tmp_path / "wd"
  existing.mkdir()
  (existing / "config.json").write_text('{"keep": true}')
  (existing / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  before = {p.name: p.read_bytes() for p in existing.iterdir()}
  cases = _bad(tmp_path)
  assert len(cases) >= 20
  for name, argv, fragment in cases:
    code = main(["distillax"] + argv)
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith(("WARNING: Logging before", "W1", "I1"))]
    assert code == 2, f"{name}: exit {code}, stderr {err}"
    assert len(err) == 1 and err[0].startswith("distillax"), f"{name}: {err}"
    assert "Traceback" not in err[0]
    assert fragment.lower() in err[0].lower(), f"{name}: {err[0]!r} lacks {fragment!r}"
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before, name


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
