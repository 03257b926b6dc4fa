"""benchmarks/accelerator.py on this CPU: the JSON is rewritten after every row, a row past its
limit is killed and recorded without stopping the run, --expect-gpu refuses a CPU fallback in
one line, and the quick rows' FLOPs agree with 6N + 12 L H Q T worked out by hand."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import accelerator
from benchmarks.lib import accelerator_table
from distillax.models.presets import get_preset
from tests.support.bench import matmul_params

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"


def test_json_holds_every_finished_row_before_the_next_starts(tmp_path):
  path = tmp_path / "acc.json"
  results = accelerator.Results(path, {"rows": [], "status": "running"})
  specs = [{"name": f"row{i}", "kind": "train"} for i in range(3)]
  on_disk_at_launch = []

  def launch(spec, limit_s):
    on_disk_at_launch.append([r["name"] for r in json.loads(path.read_text())["rows"]])
    return {"name": spec["name"], "status": "ok", "limit_s": limit_s}

  accelerator.run_all(specs, results, launch, budget_s=1e6, row_limit_s=77.0, start=0.0)
  assert on_disk_at_launch == [[], ["row0"], ["row0", "row1"]]
  rows = json.loads(path.read_text())["rows"]
  assert [r["name"] for r in rows] == ["row0", "row1", "row2"]
  assert all(r["limit_s"] == 77.0 for r in rows)


def test_rows_past_the_budget_are_recorded_as_skipped(tmp_path):
  results = accelerator.Results(tmp_path / "acc.json", {"rows": []})
  launched = []
  accelerator.run_all([{"name": "a", "kind": "train"}], results,
                      lambda spec, limit: launched.append(spec), budget_s=0.0,
                      row_limit_s=100.0, start=0.0)
  assert launched == []
  (row,) = json.loads((tmp_path / "acc.json").read_text())["rows"]
  assert row["status"] == "skipped" and "budget" in row["error"]
  assert accelerator_table.all_ran({"probe": {"status": "ok"}, "rows": [row]})


def test_a_row_past_its_limit_is_killed_and_keeps_what_it_wrote(tmp_path):
  out = tmp_path / "row.json"
  # The row records that it compiled, then hangs (a stand-in for a step that never finishes).
  hang = (f"import json, time; open({str(out)!r}, 'w').write(json.dumps("
          "{'name': 'r', 'status': 'compiled', 'compile_s': 12.5})); time.sleep(120)")
  row = accelerator.run_row([sys.executable, "-c", hang], out, 2.0, dict(os.environ))
  assert row["status"] == "timeout" and row["exit_code"] is None
  assert row["compile_s"] == 12.5
  assert "2s limit while running the compiled step" in row["error"]
  assert row["wall_s"] < 60  # killed, not waited for


def test_a_crashed_row_is_recorded_with_its_exit_status(tmp_path):
  row = accelerator.run_row([sys.executable, "-c", "import sys; sys.exit(7)"],
                            tmp_path / "none.json", 60.0, dict(os.environ))
  assert row["status"] == "crashed" and row["exit_code"] == 7
  assert not accelerator_table.all_ran({"probe": {"status": "ok"}, "rows": [row]})


def run(args, tmp_path, env=None):
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=900, env=env)


def test_quick_rows_on_cpu(tmp_path):
  path = tmp_path / "acc.json"
  proc = run(["--quick", "--json", str(path)], tmp_path)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads(path.read_text())
  probe = res["probe"]
  assert probe["status"] == "ok" and probe["backend"] == "cpu"
  assert probe["versions"]["jax"] == probe["jax_version"]
  assert probe["matmul"]["best_flops_per_s"] >= probe["matmul"]["median_flops_per_s"] > 0
  rows = {r["name"]: r for r in res["rows"]}
  assert set(rows) == {"train/reference/none/4x32", "train/blockwise/none/4x32",
                       "distill/auto/none/4x32"}
  assert all(r["status"] == "ok" for r in rows.values())
  tiny = get_preset("tiny")
  distill = rows["distill/auto/none/4x32"]
  teacher_layers = distill["teacher"]["num_layers"]
  for name, r in rows.items():
    tokens, T = r["tokens_per_step"], r["seq_len"]
    assert tokens == r["batch"] * T
    attn = tiny.num_layers * tiny.num_heads * tiny.head_dim * T  # L H Q T
    palm = tokens * (6 * matmul_params(tiny) + 12 * attn)
    causal = tokens * (6 * matmul_params(tiny) + 6 * attn)  # half of each T x T product
    if name.startswith("distill"):  # the frozen teacher's forward: 2N + 4 L H Q T per token
      t_attn = teacher_layers * tiny.num_heads * tiny.head_dim * T
      palm += tokens * (2 * matmul_params(tiny, teacher_layers) + 4 * t_attn)
      causal += tokens * (2 * matmul_params(tiny, teacher_layers) + 2 * t_attn)
    assert r["flops_palm"] == pytest.approx(palm)
    assert r["flops_causal"] == pytest.approx(causal)
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
    assert r["mfu_palm"] / r["mfu_causal"] == pytest.approx(palm / causal)
    assert r["mfu_causal"] == pytest.approx(causal / r["step_s"] / r["peak_flops_per_device"])
    assert r["final_loss"] < r["losses"][0]  # it trains
  # The same weights, data and steps: the blockwise attention trains to the reference's losses.
  ref, blockwise = rows["train/reference/none/4x32"], rows["train/blockwise/none/4x32"]
  assert (ref["attention_ran"], blockwise["attention_ran"]) == ("reference", "blockwise")
  np.testing.assert_allclose(blockwise["losses"], ref["losses"], rtol=1e-5)
  assert distill["attention_ran"] == "blockwise"  # auto on CPU: no fused kernel here
  assert 1.8 <= distill["teacher_params"] / ref["params"] <= 2.2
  printed = proc.stdout
  assert "MFU causal" in printed and "train/reference/none/4x32" in printed


def test_an_outer_sigterm_kills_the_running_row_and_records_it(tmp_path):
  """What `timeout` around scripts/accelerator_run.sh does: the row (in its own process
  group) must not outlive the run, and the JSON must say which row was cut short."""
  out = tmp_path / "row.json"
  hang = ("import json, os, sys, time; open(sys.argv[1], 'w').write(json.dumps({'name': 'r', "
          "'status': 'compiled', 'pid': os.getpid()})); time.sleep(120)")
  driver = ("import json, os, signal, sys; from pathlib import Path; "
            "from benchmarks import accelerator as a; signal.signal(signal.SIGTERM, a._stop); "
            f"row = a.run_row([sys.executable, '-c', {hang!r}, sys.argv[1]], Path(sys.argv[1]), "
            "300, dict(os.environ)); print(json.dumps(row))")
  proc = subprocess.Popen([sys.executable, "-c", driver, str(out)], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
  for _ in range(600):  # until the row has started (at most 60 s)
    if out.exists() and out.stat().st_size:
      break
    time.sleep(0.1)
  proc.send_signal(15)
  row = json.loads(proc.communicate(timeout=60)[0])
  assert row["status"] == "stopped" and row["stopped"] == "SIGTERM"
  assert "running the compiled step" in row["error"]
  with pytest.raises(ProcessLookupError):
    os.kill(row["pid"], 0)  # the hanging row is gone


def test_run_script_with_expect_gpu_on_cpu_refuses_and_leaves_its_files_in_out(tmp_path):
  """--expect-gpu on this CPU, through the run script (which runs accelerator.py as a user
  does): one line, exit 3, no row run, and the script's files in $OUT."""
  out, wheels = tmp_path / "out", tmp_path / "no_wheels"
  env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "ACCEL_WHEELS": str(wheels),
         "ACCEL_TIMEOUT_S": "300"}
  proc = subprocess.run([str(ROOT / "scripts" / "accelerator_run.sh"), "--quick",
                         "--expect-gpu"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert sorted(p.name for p in out.iterdir()) == [
      "accelerator.json", "accelerator.log", "accelerator_deps.txt"]
  log = (out / "accelerator.log").read_text()
  (line,) = [ln for ln in log.splitlines() if ln.startswith("accelerator.py:")]
  assert line.startswith("accelerator.py: FAIL: --expect-gpu, but JAX ")
  assert "runs on 'cpu'" in line and "fell back to CPU" in line
  res = json.loads((out / "accelerator.json").read_text())
  assert res["status"] == "refused" and res["rows"] == []
  assert res["probe"]["backend"] == "cpu"
  # This venv holds every dependency inside pyproject's ranges: nothing to install.
  deps = (out / "accelerator_deps.txt").read_text().splitlines()
  assert deps[-1] == "nothing to install"
  assert any(line.startswith("keep    jax: image ") for line in deps)


def test_a_backend_that_cannot_start_fails_in_one_line(tmp_path):
  """A plugin that fails at start-up (here: a platform JAX does not know) stops the run at the
  probe, as a CPU fallback does, instead of running rows that would all fail."""
  path = tmp_path / "acc.json"
  proc = run(["--quick", "--json", str(path)], tmp_path,
             env={**os.environ, "JAX_PLATFORMS": "no_such_platform"})
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
  (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("accelerator.py:")]
  assert line.startswith("accelerator.py: FAIL: JAX could not start a backend: ")
  assert json.loads(path.read_text())["rows"] == []
