"""Smoke test of benchmarks/peft.py --quick (a one-layer tiny model): full fine-tuning, LoRA and
QLoRA run through the trainer's set-up on one device, and the figures agree with hand arithmetic
on the model's shapes (parameters, adapters, optimizer state, batch bytes) and with what the
adapters must do to the loss and to the compiled memory."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import FAST_COMPILE, matmul_weights, total_params

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("peft_bench")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peft.py"), "--quick",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=900, env=os.environ | FAST_COMPILE)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "vs full" in proc.stdout  # the table was printed
  res = json.loads((out / "peft_tiny.json").read_text(),
                   parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
  res["by_name"] = {r["variant"]: r for r in res["rows"]}
  return res


def test_every_variant_timed_against_full_fine_tuning(result):
  rows = result["by_name"]
  assert list(rows) == ["full", "lora", "qlora"]
  assert result["machine"]["device_count"] == 1
  assert rows["full"]["ratio_to_full"] == pytest.approx(1.0)
  for r in rows.values():
    assert len(r["step_s_all"]) == result["settings"]["reps"]
    per_round = [a / b for a, b in zip(r["step_s_all"], rows["full"]["step_s_all"])]
    assert min(per_round) - 1e-12 <= r["ratio_to_full"] <= max(per_round) + 1e-12
  assert result["checks_total"] >= 10 and result["checks_passed"] == result["checks_total"]
  assert {(t["variant"], t["figure"]) for t in result["targets"]} == {
      ("lora", "ratio_to_full"), ("lora", "temp_ratio_to_full"), ("qlora", "ratio_to_full"),
      ("lora", "memory_ratio_to_full")}
  assert all(len(v) == 3 for v in result["load_average"].values())


def test_parameters_and_optimizer_state(result):
  m, rows = result["model"], result["by_name"]
  p = total_params(m)
  assert all(r["model_params"] == p for r in rows.values())
  assert rows["full"]["trainable_params"] == p
  rank = rows["lora"]["lora"]["rank"]
  adapters = m["num_layers"] * rank * sum(math.prod(c) + math.prod(o)
                                          for c, o in matmul_weights(m).values())
  assert rows["lora"]["trainable_params"] == rows["qlora"]["trainable_params"] == adapters
  for r in rows.values():
    # AdamW: two fp32 moments per trainable parameter, plus two int32 step counts.
    assert r["opt_state_bytes"] == 2 * 4 * r["trainable_params"] + 2 * 4
  assert rows["lora"]["lora"]["dropout"] == 0.0  # lora.py as shipped: no adapter dropout


def test_compiled_memory(result):
  settings, rows = result["settings"], result["by_name"]
  # inputs, targets, segments, positions (int32) and the loss mask (fp32), on one device
  batch_bytes = 5 * 4 * settings["batch"] * settings["seq_len"]
  for r in rows.values():
    assert r["batch_bytes_per_device"] == batch_bytes
    assert r["argument_bytes"] == r["state_bytes_per_device"] + batch_bytes
    assert r["alias_bytes"] == r["state_bytes_per_device"]  # the state is donated
    assert r["compiled_total_bytes"] == (r["argument_bytes"] + r["output_bytes"]
                                         + r["temp_bytes"] - r["alias_bytes"])
  full = rows["full"]
  # No moments for a frozen base; nf4 codes smaller still.
  assert rows["qlora"]["argument_bytes"] < rows["lora"]["argument_bytes"] < full["argument_bytes"]
  # The adapter path keeps less for the backward than full fine-tuning computes for it.
  for name in ("lora", "qlora"):
    assert rows[name]["temp_bytes"] < full["temp_bytes"]
    assert rows[name]["temp_ratio_to_full"] == pytest.approx(rows[name]["temp_bytes"]
                                                             / full["temp_bytes"])
    assert rows[name]["compiled_total_bytes"] < full["compiled_total_bytes"]


def test_losses(result):
  rows = result["by_name"]
  full = rows["full"]["first_loss"]
  # B starts at zero: the LoRA model's first forward is the base model's; QLoRA's is rounded.
  assert abs(rows["lora"]["first_loss"] - full) / full <= 1e-5
  assert 0 < abs(rows["qlora"]["first_loss"] - full) / full < 0.1
  for r in rows.values():
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["final_loss"] < r["first_loss"]
