"""benchmarks/accelerator.py on this CPU: every row's candidates are compiled, run and the
fastest kept, with FLOPs worked out by hand; --expect-gpu refuses a CPU fallback in one line
(through scripts/accelerator_run.sh, as a user runs it), and a backend that cannot start fails in
one line too."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import accelerator
from distillax.models.presets import get_preset
from tests.support.bench import matmul_params

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "accelerator.py"


def run(args, env=None):
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=900, env=env)


def test_quick_rows_on_cpu(tmp_path):
  """The train and KD rows at quick sizes: each candidate ran, the best is the fastest, and its
  model FLOPs are 6N + 6 L H Q T per token for the student (half of each T x T product: the
  causal convention) plus 2N + 2 L H Q T for the frozen teacher's forward."""
  path = tmp_path / "acc.json"
  proc = run(["--quick", "--rows", "train,kd", "--json", str(path), "--threads", "2"])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  res = json.loads(path.read_text())
  probe = res["probe"]
  assert probe["backend"] == "cpu" and probe["versions"]["jax"] == probe["jax"]
  assert probe["matmul"]["best_flops_per_s"] >= probe["matmul"]["median_flops_per_s"] > 0
  rows = {r["name"]: r for r in res["rows"]}
  assert sorted(rows) == ["kd", "train"]
  tiny = get_preset("tiny")
  teacher = get_preset("tiny", num_layers=4, embed_dim=96, num_heads=6, num_kv_heads=2,
                       mlp_dim=192)
  for name, row in rows.items():
    ran = [c for c in row["candidates"] if c["status"] == "ok"]
    assert ran and row["best"] == max(ran, key=lambda c: c["tokens_per_s"])
    best = row["best"]
    tokens, T = best["batch"] * best["seq_len"], best["seq_len"]
    per_token = 6 * matmul_params(tiny) + 6 * tiny.num_layers * tiny.num_heads * tiny.head_dim * T
    if name == "kd":
      per_token += 2 * matmul_params(teacher) + (
          2 * teacher.num_layers * teacher.num_heads * teacher.head_dim * T)
    assert best["model_flops"] == pytest.approx(tokens * per_token)
    assert best["tokens_per_s"] == pytest.approx(tokens / best["step_s"])
    assert best["mfu_causal"] == pytest.approx(
        best["model_flops"] / best["step_s"] / probe["peak_flops"])
    assert best["final_loss"] < best["first_loss"]  # it trains
  assert "Each row at its fastest candidate" in proc.stdout and "kd (real)" in proc.stdout


def test_every_row_names_candidates_of_its_own_pair():
  for row in accelerator.ROWS:
    assert row.pair in accelerator.tpu_levers.lever_grid.PAIRS, row.name
    for c in row.candidates:
      v = accelerator.tpu_levers.lever_grid.Variant.parse(
          accelerator.variant_of(row, c, quick=False), 2048)
      assert v.option("pair") == row.pair and v.kind in ("train", "kd", "on_policy")


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
  """A plugin that fails at start-up (here: a platform JAX does not know) stops the run before
  any row, as a CPU fallback does."""
  path = tmp_path / "acc.json"
  proc = run(["--quick", "--json", str(path)],
             env={**os.environ, "JAX_PLATFORMS": "no_such_platform"})
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
  (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("accelerator.py:")]
  assert line.startswith("accelerator.py: FAIL: JAX could not start a backend: ")
  assert json.loads(path.read_text())["rows"] == []
