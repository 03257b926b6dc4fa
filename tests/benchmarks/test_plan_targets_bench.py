"""benchmarks/plan_targets.py --quick: the tiny lm step compiled by libtpu for tpu:v5e-4 and by
XLA:CPU over 4 simulated devices, each in its own process, side by side in the JSON."""

import json
from pathlib import Path

from tests.support.bench import run_script_here

ROOT = Path(__file__).resolve().parents[2]


def test_quick_row_compares_the_tpu_compiler_with_the_cpu_plan(tmp_path):
  """The script's parent runs in this process (--devices 8: the suite's; it uses none, each side
  compiles in a child process of its own as in a user's run), which saves an interpreter and
  its imports; the variables it sets for its children (libtpu's) are taken back after it."""
  status, printed = run_script_here(ROOT / "benchmarks" / "plan_targets.py",
                                    ["--quick", "--out", tmp_path, "--devices", "8"])
  assert status == 0, printed[-3000:]
  written = json.loads((tmp_path / "plan_targets_quick.json").read_text())
  assert written["provenance"]["script"] == "benchmarks/plan_targets.py"
  (row,) = written["rows"]
  tpu, cpu = row["on_target"], row["on_cpu"]
  assert tpu["devices"] == cpu["devices"] == 4 and tpu["mesh"] == cpu["mesh"] == "4x1"
  assert tpu["peak_bytes"] > 0 and cpu["peak_bytes"] > 0
  assert any(k.startswith("mosaic:splash_mqa_fwd") for k in tpu["kernels"]), tpu["kernels"]
  assert tpu["by_layer"] == {"layers 0-1 of 2": {"attention": "splash"}}, tpu["by_layer"]
  # train.loss_impl='auto': the lm job's CE over vocabulary slices (framework/vocab_slices.py).
  assert [k.split(" (")[0] for k in tpu["loss"]] == ["sliced"], tpu["loss"]
  # The same program, with the same model: the analytic FLOPs agree; XLA:CPU forms no
  # reduce-scatter where the TPU compiler's FSDP gradient reduction is one.
  assert tpu["model_flops_per_step"] == cpu["model_flops_per_step"]
  assert cpu["collectives"]["reduce-scatter"]["count"] == 0
  assert tpu["collectives"]["reduce-scatter"]["count"] > 0
  # Both compilers' matmuls agree with the analytic model (splash's attention left out).
  assert tpu["flops_check"]["within"] and cpu["flops_check"]["within"]
  assert "tiny-v5e4" in printed  # the table


def test_rows_a_partial_rerun_keeps_are_marked_stale_when_an_older_script_measured_them():
  from benchmarks import plan_targets
  from benchmarks.lib import common
  rows = [{"id": "a", "x": 1}, {"id": "b", "x": 2}]
  now = {"script": "benchmarks/plan_targets.py",
         "script_sha256": common.script_sha256(plan_targets.SCRIPT)}
  assert plan_targets.kept_rows({"rows": rows, "provenance": now}, {"a"}) == [rows[1]]
  for older in ({"rows": rows}, {"rows": rows, "provenance": {**now, "script_sha256": "0"}}):
    assert plan_targets.kept_rows(older, {"a"}) == [{"id": "b", "x": 2, "stale": True}]
